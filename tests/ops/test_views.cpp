// Direct tests of view semantics (src/ops/view.cpp): views share storage and
// the version counter with their base, writes through a view reach the base,
// contiguity flags, reshape copies only when it must, expand has stride 0
// while repeat copies, as_strided's bounds check, 0-dim and empty tensors.
// Sizes, strides and offsets were checked against PyTorch 1.13.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kiln/kiln.h"

using namespace kiln;

namespace {

void expect_layout(const Tensor& t, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset) {
  EXPECT_EQ(t.sizes(), IntArrayRef(sizes)) << "sizes " << t.sizes();
  EXPECT_EQ(t.strides(), IntArrayRef(strides)) << "strides " << t.strides();
  EXPECT_EQ(t.storage_offset(), offset);
}

std::vector<double> values(const Tensor& t) {
  Tensor c = t.to(kFloat64, /*copy=*/true);
  const double* p = c.data_ptr<double>();
  return {p, p + c.numel()};
}

template <typename E, typename F>
void expect_error(F&& f, const std::string& substr) {
  try {
    f();
    ADD_FAILURE() << "expected an exception containing '" << substr << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(substr), std::string::npos) << e.what();
  }
}

Tensor a23() { return arange(6, kFloat32).view({2, 3}); }

}  // namespace

TEST(Views, ShareStorageAndVersionCounter) {
  Tensor base = a23();
  const std::vector<Tensor> views = {base.view({3, 2}),      base.reshape({6}),        base.t(),
                                     base.transpose(0, 1),   base.permute({1, 0}),     base.unsqueeze(0),
                                     base.unsqueeze(0).squeeze(), base.expand({4, 2, 3}), base.narrow(1, 1, 2),
                                     base.slice(1, 0, 3, 2), base.select(0, 1),        base.flatten(),
                                     base.unflatten(1, {3, 1}), base.as_strided({2}, {2}, 1), base.diagonal(),
                                     base.split(1)[1],       base.chunk(2, 1)[0],      base.unbind(1)[2]};
  for (const Tensor& v : views) {
    EXPECT_TRUE(v.is_alias_of(base));
    EXPECT_EQ(v.version(), base.version());
  }
  const uint32_t v0 = base.version();
  Tensor through = views[2];
  through.fill_(1.0);  // through a view
  EXPECT_EQ(base.version(), v0 + 1);
  for (const Tensor& v : views) EXPECT_EQ(v.version(), v0 + 1);
}

TEST(Views, WritesThroughViewsReachTheBase) {
  Tensor base = a23();
  Tensor col = base.t().select(0, 2);
  col.fill_(-1.0);
  EXPECT_EQ(values(base), (std::vector<double>{0, 1, -1, 3, 4, -1}));
  base.slice(1, 0, 2, 1).narrow(0, 1, 1).fill_(9.0);
  EXPECT_EQ(values(base), (std::vector<double>{0, 1, -1, 9, 9, -1}));
  base.diagonal().copy_(tensor<float>({7.f, 8.f}));
  EXPECT_EQ(values(base), (std::vector<double>{7, 1, -1, 9, 8, -1}));
  base.view({6}).slice(0, 1, std::nullopt, 4).fill_(0.0);  // elements 1 and 5
  EXPECT_EQ(values(base), (std::vector<double>{7, 0, -1, 9, 8, 0}));
  for (Tensor& piece : base.split(1, 1)) piece.fill_(piece.storage_offset());
  EXPECT_EQ(values(base), (std::vector<double>{0, 1, 2, 0, 1, 2}));
}

TEST(Views, LayoutsMatchTorch) {
  Tensor x = a23();
  expect_layout(x.t(), {3, 2}, {1, 3}, 0);
  expect_layout(x.t().reshape({3, 2}), {3, 2}, {1, 3}, 0);  // viewable, no copy
  expect_layout(x.unflatten(-1, {-1, 1}), {2, 3, 1}, {3, 1, 1}, 0);
  expect_layout(x.t().unflatten(0, {3, 1}), {3, 1, 2}, {1, 6, 3}, 0);
  expect_layout(x.t().unflatten(1, {2, 1}), {3, 2, 1}, {1, 3, 3}, 0);
  expect_layout(x.unsqueeze(-1), {2, 3, 1}, {3, 1, 1}, 0);
  expect_layout(x.narrow(1, -2, 2), {2, 2}, {3, 1}, 1);
  expect_layout(x.select(1, -1), {2}, {3}, 2);
  expect_layout(x.view({2, -1, 3}), {2, 1, 3}, {3, 3, 1}, 0);
  Tensor r = arange(6, kFloat32).view({1, 2, 1, 3});
  expect_layout(r.squeeze(), {2, 3}, {3, 1}, 0);
  expect_layout(r.squeeze(-2), {1, 2, 3}, {6, 3, 1}, 0);
  expect_layout(r.squeeze(1), {1, 2, 1, 3}, {6, 3, 3, 1}, 0);  // size != 1: unchanged
  Tensor v = arange(10, kFloat32);
  expect_layout(v.slice(0, 1, 9, 3), {3}, {3}, 1);
  expect_layout(v.slice(0, -3), {3}, {1}, 7);
  expect_layout(v.slice(0, 7, 2), {0}, {1}, 7);
  Tensor y = arange(24, kFloat32).view({2, 3, 4});
  expect_layout(y.diagonal(1, 0, 2), {3, 2}, {4, 13}, 1);
  expect_layout(y.diagonal(-1, 2, 1), {2, 3}, {12, 5}, 1);
  expect_layout(y.diagonal(5, 1, 2), {2, 0}, {12, 5}, 0);
  expect_layout(y.diagonal(-5, 1, 2), {2, 0}, {12, 5}, 0);
  expect_layout(y.slice(1, 1).view({2, 8}), {2, 8}, {12, 1}, 4);
  expect_layout(y.permute({2, -3, 1}), {4, 2, 3}, {1, 12, 4}, 0);
  expect_layout(arange(6, kFloat32).expand({2, -1}), {2, 6}, {0, 1}, 0);
  expect_layout(arange(6, kFloat32).as_strided({2, 2}, {1, 3}, 1), {2, 2}, {1, 3}, 1);
  expect_layout(arange(6, kFloat32).slice(0, 1).as_strided({2}, {1}), {2}, {1}, 1);  // keeps self's offset
}

TEST(Views, ContiguityFlags) {
  Tensor x = a23();
  EXPECT_TRUE(x.is_contiguous());
  EXPECT_FALSE(x.t().is_contiguous());
  EXPECT_TRUE(x.t().t().is_contiguous());
  EXPECT_TRUE(x.select(0, 1).is_contiguous());
  EXPECT_FALSE(x.select(1, 1).is_contiguous());
  EXPECT_TRUE(x.narrow(0, 1, 1).is_contiguous());
  EXPECT_FALSE(x.narrow(1, 1, 1).squeeze(1).is_contiguous());
  EXPECT_FALSE(x.expand({2, 2, 3}).is_contiguous());
  EXPECT_TRUE(x.unsqueeze(1).is_contiguous());
  Tensor c = x.t().contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_FALSE(c.is_alias_of(x));
  EXPECT_TRUE(x.contiguous().is_same(x));  // already contiguous: no copy
  Tensor k = x.clone();
  EXPECT_FALSE(k.is_alias_of(x));
  EXPECT_EQ(values(k), values(x));
}

TEST(Views, ReshapeCopiesOnlyWhenItMust) {
  Tensor x = a23();
  EXPECT_TRUE(x.reshape({3, 2}).is_alias_of(x));
  EXPECT_TRUE(x.t().reshape({3, 2}).is_alias_of(x));
  Tensor copied = x.t().reshape({6});
  EXPECT_FALSE(copied.is_alias_of(x));
  EXPECT_EQ(values(copied), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  EXPECT_TRUE(x.t().flatten().is_contiguous());
  Tensor y = arange(24, kFloat32).view({2, 3, 4});
  EXPECT_TRUE(y.slice(1, 1).reshape({2, 8}).is_alias_of(y));
  EXPECT_FALSE(y.slice(2, 1, 3).reshape({2, 6}).is_alias_of(y));
  expect_error<ShapeError>([&] { y.slice(2, 1, 3).view({2, 6}); }, "use .reshape");
  expect_error<ShapeError>([&] { x.t().view({6}); }, "use .reshape");
  expect_error<ShapeError>([&] { x.view({-1, -1}); }, "only one dimension can be inferred");
  expect_error<ShapeError>([&] { x.view({4, -1}); }, "is invalid for input of shape [2, 3]");
  expect_error<ShapeError>([&] { x.view({0, -1}); }, "is invalid");
}

TEST(Views, ExpandIsAViewWithStrideZeroRepeatCopies) {
  Tensor x = tensor<float>({1.f, 2.f, 3.f}, {3, 1});
  Tensor e = x.expand({2, 3, 4});
  expect_layout(e, {2, 3, 4}, {0, 1, 0}, 0);
  EXPECT_TRUE(e.is_alias_of(x));
  x.select(0, 1).fill_(5.0);
  EXPECT_EQ(values(e.select(0, 1).select(0, 1)), (std::vector<double>{5, 5, 5, 5}));
  Tensor r = x.repeat({2, 1, 4});
  EXPECT_FALSE(r.is_alias_of(x));
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.sizes(), IntArrayRef({2, 3, 4}));
  EXPECT_EQ(values(r), values(e));
  expect_error<ShapeError>([&] { x.expand({4, 5}); }, "must match the existing size (3)");
  expect_error<ShapeError>([&] { x.expand({4}); }, "fewer dims");
  expect_error<ShapeError>([&] { x.expand({-1, 3, 1}); }, "-1 is not allowed in a new leading dim");
}

TEST(Views, AsStridedBoundsCheck) {
  Tensor x = arange(6, kFloat32);
  EXPECT_EQ(values(x.as_strided({2, 2}, {1, 2}, 1)), (std::vector<double>{1, 3, 2, 4}));
  expect_error<IndexError>([&] { x.as_strided({2, 2}, {1, 3}, 2); }, "beyond the storage's 6 elements");
  expect_error<IndexError>([&] { x.as_strided({7}, {1}); }, "as_strided");
  expect_error<ShapeError>([&] { x.as_strided({2}, {1, 1}); }, "same length");
  expect_error<ShapeError>([&] { x.as_strided({2}, {-1}); }, "negative");
  EXPECT_EQ(x.as_strided({0, 5}, {100, 100}, 5).numel(), 0);  // empty: never reads
  // A view of a view still sees the whole storage.
  EXPECT_EQ(values(x.slice(0, 4).as_strided({3}, {1}, 0)), (std::vector<double>{0, 1, 2}));
}

TEST(Views, ZeroDimTensors) {
  Tensor s = scalar_tensor(3.0, kFloat32);
  expect_layout(s.squeeze(0), {}, {}, 0);
  expect_layout(s.unsqueeze(0), {1}, {1}, 0);
  expect_layout(s.flatten(), {1}, {1}, 0);
  expect_layout(s.t(), {}, {}, 0);
  expect_layout(s.permute({}), {}, {}, 0);
  expect_layout(s.expand({2, 3}), {2, 3}, {0, 0}, 0);
  expect_layout(s.view({1, 1}), {1, 1}, {1, 1}, 0);
  expect_layout(s.reshape({-1}), {1}, {1}, 0);
  expect_layout(s.transpose(0, -1), {}, {}, 0);
  EXPECT_TRUE(s.unsqueeze(0).squeeze().is_alias_of(s));
  expect_error<IndexError>([&] { s.select(0, 0); }, "0-dim");
  expect_error<ShapeError>([&] { s.narrow(0, 0, 1); }, "0-dim");
  expect_error<ShapeError>([&] { s.split(1); }, "0-dim");
  expect_error<ShapeError>([&] { s.split_with_sizes({1}); }, "0-dim");
  expect_error<ShapeError>([&] { s.chunk(2); }, "0-dim");
  expect_error<IndexError>([&] { s.unbind(0); }, "0-dim");
  expect_error<IndexError>([&] { s.unflatten(0, {1}); }, "0-dim");
  expect_error<ShapeError>([&] { s.diagonal(); }, "at least 2 dims");
}

TEST(Views, EmptyTensors) {
  Tensor e = empty({0, 3});
  expect_layout(e.view({3, 0}), {3, 0}, {1, 1}, 0);
  expect_layout(e.view({-1, 3}), {0, 3}, {3, 1}, 0);
  expect_layout(e.t(), {3, 0}, {1, 3}, 0);
  EXPECT_EQ(e.reshape({0}).numel(), 0);
  EXPECT_EQ(empty({0}).chunk(3).size(), 3u);
  EXPECT_EQ(empty({2, 0}).chunk(3, 1).size(), 3u);
  EXPECT_EQ(empty({0}).split(2).size(), 1u);
  EXPECT_EQ(e.unbind(0).size(), 0u);
  EXPECT_EQ(e.unbind(1).size(), 3u);
  EXPECT_EQ(e.unbind(1)[2].sizes(), IntArrayRef({0}));
  expect_layout(e.expand({2, 0, 3}), {2, 0, 3}, {0, 3, 1}, 0);
}

TEST(Views, SplitChunkUnbind) {
  Tensor x = arange(10, kFloat32).view({2, 5});
  auto parts = x.split(2, 1);
  ASSERT_EQ(parts.size(), 3u);
  expect_layout(parts[2], {2, 1}, {5, 1}, 4);
  auto sized = x.split_with_sizes({1, 0, 4}, -1);
  ASSERT_EQ(sized.size(), 3u);
  expect_layout(sized[1], {2, 0}, {5, 1}, 1);
  expect_layout(sized[2], {2, 4}, {5, 1}, 1);
  auto chunks = x.chunk(4, 1);  // ceil(5/4) = 2 -> pieces of 2, 2, 1
  ASSERT_EQ(chunks.size(), 3u);
  expect_layout(chunks[2], {2, 1}, {5, 1}, 4);
  auto rows = x.unbind(0);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(values(rows[1]), (std::vector<double>{5, 6, 7, 8, 9}));
  expect_error<ShapeError>([&] { x.split_with_sizes({1, 1}, 1); }, "sum to 2 but dimension 1 has size 5");
  expect_error<ValueError>([&] { x.split_with_sizes({1, -1, 5}, 1); }, "non-negative");
  expect_error<ValueError>([&] { x.chunk(0); }, "must be positive");
  expect_error<ValueError>([&] { x.split(0); }, "must be positive");
}

TEST(Views, Errors) {
  Tensor x = a23();
  expect_error<IndexError>([&] { x.select(1, 3); }, "index 3 is out of bounds for dimension 1 with size 3");
  expect_error<IndexError>([&] { x.select(1, -4); }, "index -4");
  expect_error<ShapeError>([&] { x.permute({1, 1}); }, "appears more than once");
  expect_error<ShapeError>([&] { x.permute({1}); }, "does not match");
  expect_error<IndexError>([&] { x.transpose(0, 2); }, "dimension out of range");
  expect_error<IndexError>([&] { x.unsqueeze(3); }, "dimension out of range");
  expect_error<IndexError>([&] { x.narrow(1, 2, 2); }, "exceeds dimension 1 of size 3");
  expect_error<ValueError>([&] { x.flatten(1, 0); }, "must not come after");
  expect_error<ShapeError>([&] { arange(24).view({2, 3, 4}).t(); }, "<= 2 dimensions");
  expect_error<ValueError>([&] { x.diagonal(0, 1, -1); }, "cannot be identical");
  expect_error<ValueError>([&] { x.slice(0, 0, 2, 0); }, "step must be positive");
}
