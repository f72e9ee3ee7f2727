// dist::DeviceMesh (issue 20): the row-major layout (last dimension fastest)
// against an independent computation from the world rank, the subgroup of
// every dimension (its members, this rank's place in it, its name in
// messages), an allreduce along each dimension against the sum over the
// members the layout says it has, groups of two dimensions used at once, and
// shapes refused. Every shape whose sizes multiply to the world size is tried,
// so at 4 ranks: 4, 2x2, 4x1, 1x4, 2x1x2 ...; at 2: 2, 2x1, 1x2; at 1: 1, 1x1
// (the degenerate meshes). Every rank builds the same meshes in the same
// order, as the API requires.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/dist/device_mesh.h"
#include "kiln/dist/dist.h"
#include "kiln/ops/factory.h"

using namespace kiln;
using dist::DeviceMesh;

namespace {

const char* const kNames[] = {"dp", "tp", "pp"};

// Every way to write n as an ordered product of `ndim` factors >= 1.
void factorizations(int n, int ndim, std::vector<int>& cur, std::vector<std::vector<int>>& out) {
  if (static_cast<int>(cur.size()) == ndim - 1) {
    cur.push_back(n);
    out.push_back(cur);
    cur.pop_back();
    return;
  }
  for (int f = 1; f <= n; ++f) {
    if (n % f != 0) continue;
    cur.push_back(f);
    factorizations(n / f, ndim, cur, out);
    cur.pop_back();
  }
}

std::vector<std::vector<int>> all_shapes(int n) {
  std::vector<std::vector<int>> out;
  for (int ndim = 1; ndim <= 3; ++ndim) {
    std::vector<int> cur;
    factorizations(n, ndim, cur, out);
  }
  return out;
}

std::vector<DeviceMesh::Dim> dims_of(const std::vector<int>& shape) {
  std::vector<DeviceMesh::Dim> dims;
  for (size_t i = 0; i < shape.size(); ++i) dims.push_back({kNames[i], shape[i]});
  return dims;
}

std::string text(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The coordinates of world rank r in `shape`, row-major with the last index
// fastest, computed here by peeling off the last dimension first (not as the
// mesh does, by strides).
std::vector<int> unravel(int r, const std::vector<int>& shape) {
  std::vector<int> c(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = r % shape[i];
    r /= shape[i];
  }
  return c;
}

// The world ranks whose coordinates equal `me`'s except along dimension d, by search.
std::vector<int> line_through(int me, size_t d, const std::vector<int>& shape, int world) {
  const auto mine = unravel(me, shape);
  std::vector<int> out;
  for (int r = 0; r < world; ++r) {
    auto c = unravel(r, shape);
    c[d] = mine[d];
    if (c == mine) out.push_back(r);
  }
  return out;
}

template <typename E, typename F>
void expect_error(F&& f, const std::string& want) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing: " << want;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

TEST(DeviceMesh, LayoutIsRowMajorWithTheLastDimensionFastest) {
  const int world = dist::world_size(), me = dist::rank();
  for (const auto& shape : all_shapes(world)) {
    SCOPED_TRACE("shape " + text(shape) + " on world rank " + std::to_string(me));
    DeviceMesh mesh(dims_of(shape));
    ASSERT_EQ(mesh.ndim(), static_cast<int>(shape.size()));
    EXPECT_EQ(mesh.size(), world);
    const auto want = unravel(me, shape);
    EXPECT_EQ(mesh.coordinates(), want);
    EXPECT_EQ(mesh.rank_at(want), me);
    for (size_t d = 0; d < shape.size(); ++d) {
      const std::string name = kNames[d];
      EXPECT_EQ(mesh.size(name), shape[d]);
      EXPECT_EQ(mesh.coordinate(name), want[d]);
      const auto line = line_through(me, d, shape, world);
      EXPECT_EQ(mesh.ranks_along(name), line) << name;
      const auto g = mesh.group(name);
      ASSERT_TRUE(g && g->is_member());
      EXPECT_EQ(g->size(), shape[d]);
      EXPECT_EQ(g->rank(), want[d]) << "a rank's group rank is its coordinate along " << name;
      EXPECT_EQ(g->ranks(), line);
      // Errors and the watchdog name the group by its dimension.
      EXPECT_EQ(g->describe(), name + " group " + text(line) + " (" + std::to_string(shape[d]) + " of " +
                                   std::to_string(world) + " ranks)");
    }
    // Every coordinate tuple names a distinct rank (the layout is a bijection).
    std::vector<int> seen(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) ++seen[static_cast<size_t>(mesh.rank_at(unravel(r, shape)))];
    EXPECT_EQ(seen, std::vector<int>(static_cast<size_t>(world), 1));
  }
}

TEST(DeviceMesh, TwoByTwoIsTorchsLayout) {
  if (dist::world_size() != 4) GTEST_SKIP() << "the 2x2 picture of the header needs exactly 4 ranks";
  DeviceMesh mesh({{"dp", 2}, {"tp", 2}});
  const int me = dist::rank();
  // torch.arange(4).view(2, 2): rows are dp, columns tp.
  const std::vector<std::vector<int>> tp_groups = {{0, 1}, {2, 3}}, dp_groups = {{0, 2}, {1, 3}};
  EXPECT_EQ(mesh.ranks_along("tp"), tp_groups[static_cast<size_t>(me / 2)]);
  EXPECT_EQ(mesh.ranks_along("dp"), dp_groups[static_cast<size_t>(me % 2)]);
  EXPECT_EQ(mesh.describe(), "mesh dp=2 x tp=2 (4 ranks); world rank " + std::to_string(me) +
                                 " at dp=" + std::to_string(me / 2) + ", tp=" + std::to_string(me % 2));
}

TEST(DeviceMesh, AllreduceAlongEachDimensionSumsItsLine) {
  const int world = dist::world_size(), me = dist::rank();
  constexpr int64_t kN = 7;
  for (const auto& shape : all_shapes(world)) {
    SCOPED_TRACE("shape " + text(shape) + " on world rank " + std::to_string(me));
    DeviceMesh mesh(dims_of(shape));
    for (size_t d = 0; d < shape.size(); ++d) {
      const std::string name = kNames[d];
      // World rank w contributes (w + 1) * 10 + i + d: each line's sum differs from every other line's.
      Tensor t = empty({kN}, TensorOptions().dtype(DType::Float32));
      for (int64_t i = 0; i < kN; ++i) t.data_ptr<float>()[i] = static_cast<float>((me + 1) * 10 + i + d);
      mesh.group(name)->allreduce(t)->wait();
      for (int64_t i = 0; i < kN; ++i) {
        float want = 0;
        for (int w : line_through(me, d, shape, world)) want += static_cast<float>((w + 1) * 10 + i + d);
        ASSERT_EQ(t.data_ptr<float>()[i], want) << "allreduce along " << name << ", element " << i;
      }
    }
  }
}

TEST(DeviceMesh, GroupsOfTwoDimensionsRunAtOnce) {
  // Both allreduces are in flight together (each group has its own
  // communication thread), as a tp all-reduce inside a dp gradient sync would be.
  const int world = dist::world_size(), me = dist::rank();
  const int a = world >= 4 ? 2 : 1;
  DeviceMesh mesh({{"dp", a}, {"tp", world / a}});
  Tensor x = full({5}, me + 1.0, TensorOptions().dtype(DType::Float32));
  Tensor y = full({5}, (me + 1.0) * 100, TensorOptions().dtype(DType::Float32));
  auto wx = mesh.group("tp")->allreduce(x);
  auto wy = mesh.group("dp")->allreduce(y);
  wy->wait();
  wx->wait();
  float sx = 0, sy = 0;
  for (int w : mesh.ranks_along("tp")) sx += w + 1.0f;
  for (int w : mesh.ranks_along("dp")) sy += (w + 1.0f) * 100;
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(x.data_ptr<float>()[i], sx);
    EXPECT_EQ(y.data_ptr<float>()[i], sy);
  }
}

TEST(DeviceMesh, BadShapesAreRefused) {
  const int world = dist::world_size();
  // Every rank throws the same error before any collective, so none is left waiting.
  expect_error<ValueError>([&] { DeviceMesh({{"dp", world + 1}}); },
                           "the dimensions dp=" + std::to_string(world + 1) + " hold " + std::to_string(world + 1) +
                               " ranks, but the world has " + std::to_string(world));
  expect_error<ValueError>([&] { DeviceMesh({{"dp", 2}, {"tp", world}}); },
                           "but the world has " + std::to_string(world) + "; the sizes must multiply");
  expect_error<ValueError>([] { DeviceMesh(std::vector<DeviceMesh::Dim>{}); }, "expected at least one dimension");
  expect_error<ValueError>([&] { DeviceMesh({{"dp", world}, {"tp", 0}}); }, "'tp' must have size >= 1, got 0");
  expect_error<ValueError>([&] { DeviceMesh({{"dp", world}, {"dp", 1}}); }, "'dp' is named twice");
  expect_error<ValueError>([&] { DeviceMesh({{"", world}}); }, "dimension 0 has an empty name");
  // A mesh that was made refuses names it does not have, and coordinates outside it.
  DeviceMesh mesh({{"dp", world}, {"tp", 1}});
  expect_error<ValueError>([&] { mesh.group("pp"); }, "no dimension 'pp' in the mesh dp=" + std::to_string(world) +
                                                          " x tp=1; its dimensions are dp, tp");
  expect_error<ValueError>([&] { mesh.rank_at({0}); }, "expected 2 coordinates (dp, tp), got 1");
  expect_error<ValueError>([&] { mesh.rank_at({world, 0}); }, "coordinate dp=" + std::to_string(world));
  // The world still works after the refusals: no rank was left inside a collective.
  Tensor t = full({1}, 1.0, TensorOptions().dtype(DType::Float32));
  mesh.group("dp")->allreduce(t)->wait();
  EXPECT_EQ(t.data_ptr<float>()[0], static_cast<float>(world));
}

}  // namespace
