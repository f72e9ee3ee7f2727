// Sharded checkpoints (dist::save_sharded_checkpoint, dist::ShardedCheckpoint):
// ShardedCheckpointMpi cases save collectively over the MPI world (ctest
// dist_2, dist_4, dist_2_debug) into one directory all ranks share, and read
// it back at the saving split, at other world sizes, in full and at ranges
// that cross slice boundaries, bitwise. ShardedCheckpoint cases are
// single-process (a one-rank fake group); they run on every rank at once, each
// in its own temporary directory: hostile index and shard files, input errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dist/fake_group.h"
#include "kiln/core/half.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/sharded_checkpoint.h"
#include "kiln/ops/factory.h"
#include "dist/sharded_checkpoint_format.h"
#include "support/record_collector.h"
#include "support/test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using dist::ShardedCheckpoint;
using dist::ShardSlice;
using test::error_message;

// The logical tensors of the cases: several dtypes, a scalar, an empty one,
// sizes that split unevenly. Values are exact in every dtype (bfloat16 included).
struct Spec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
const std::vector<Spec> kSpecs = {
    {"model.fc.weight", kFloat32, {7, 5}},    {"model.fc.bias", kBFloat16, {9}},
    {"optim.fc.weight.exp_avg", kFloat32, {3, 4, 2}}, {"optim.step", kInt64, {}},
    {"data.order", kInt64, {23}},             {"model.empty", kFloat32, {0, 3}},
};

Tensor logical(const Spec& s, int salt = 0) {
  Tensor t = empty(s.shape, TensorOptions().dtype(s.dtype));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double v = ((i * 7 + salt * 13) % 97) * 0.5 - 20;
    switch (s.dtype) {
      case kFloat32: t.data_ptr<float>()[i] = static_cast<float>(v); break;
      case kBFloat16: t.data_ptr<BFloat16>()[i] = BFloat16(static_cast<float>(v)); break;
      case kInt64: t.data_ptr<int64_t>()[i] = i * 1000000007LL + salt; break;
      default: ADD_FAILURE() << "no values for " << dtype_name(s.dtype);
    }
  }
  return t;
}

// Elements [b, b + n) of t, flattened.
Tensor part(const Tensor& t, int64_t b, int64_t n) {
  if (n == 0) return empty({0}, TensorOptions().dtype(t.dtype()));
  return t.reshape({t.numel()}).narrow(0, b, n).clone();
}

struct Piece {
  int64_t begin, length;
  int owner;
};

// An uneven split of `numel` elements into 2n + 1 pieces (some empty) dealt to
// n ranks out of order, so ranks hold several pieces of a tensor or none.
std::vector<Piece> split(int64_t numel, int n, int salt) {
  const int64_t k = 2 * n + 1;
  std::vector<Piece> out;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t b = numel * i * i / (k * k), e = numel * (i + 1) * (i + 1) / (k * k);
    out.push_back(Piece{b, e - b, static_cast<int>((i * 3 + salt) % n)});
  }
  return out;
}

// Rank r's slices of every spec under split(., n, .); the bias goes wholly to the last rank.
std::vector<ShardSlice> slices_of(int r, int n, int salt = 0) {
  std::vector<ShardSlice> out;
  for (size_t i = 0; i < kSpecs.size(); ++i) {
    const Spec& s = kSpecs[i];
    const Tensor t = logical(s, salt);
    if (s.name == "model.fc.bias") {
      if (r == n - 1) out.push_back(ShardSlice{s.name, s.shape, 0, part(t, 0, t.numel())});
      continue;
    }
    for (const Piece& p : split(t.numel(), n, static_cast<int>(i))) {
      if (p.owner == r) out.push_back(ShardSlice{s.name, s.shape, p.begin, part(t, p.begin, p.length)});
    }
  }
  return out;
}

// Reads every spec back, in full and at ranges crossing slice boundaries.
void expect_contents(const ShardedCheckpoint& ck, int salt = 0) {
  for (const Spec& s : kSpecs) {
    SCOPED_TRACE(s.name);
    const Tensor want = logical(s, salt);
    ASSERT_TRUE(ck.contains(s.name));
    EXPECT_EQ(ck.dtype(s.name), s.dtype);
    EXPECT_EQ(ck.shape(s.name), s.shape);
    EXPECT_TRUE(test::bitwise_equal(ck.read_full(s.name), want));
    const int64_t m = want.numel();
    for (int64_t b : {int64_t{0}, int64_t{1}, m / 3, m / 2, m - 1}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, m / 2, m}) {
        if (b < 0 || n < 0 || b + n > m) continue;
        EXPECT_TRUE(test::bitwise_equal(ck.read(s.name, b, n), part(want, b, n))) << "range " << b << " + " << n;
      }
    }
  }
}

// Reads every spec as `n` ranks of an FSDP-like even split (the last shard shorter) would.
void expect_resharded(const ShardedCheckpoint& ck, int n, int salt = 0) {
  for (const Spec& s : kSpecs) {
    const Tensor want = logical(s, salt);
    const int64_t m = want.numel(), chunk = (m + n - 1) / n;
    for (int r = 0; r < n; ++r) {
      const int64_t b = std::min(m, r * chunk), len = std::min(chunk, m - b);
      EXPECT_TRUE(test::bitwise_equal(ck.read(s.name, b, len), part(want, b, len)))
          << s.name << " as rank " << r << " of " << n;
    }
  }
}

template <typename E, typename F>
void expect_error(F&& f, const std::string& want) {
  const std::string msg = error_message<E>(std::forward<F>(f));
  EXPECT_NE(msg.find(want), std::string::npos) << "expected a message containing: " << want << "\ngot: " << msg;
}

// ---------------------------------------------------------------------------
// Over the MPI world, in a directory every rank shares.

class ShardedCheckpointMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(dist::is_initialized()) << "test_dist's ShardedCheckpointMpi cases run under mpirun: ctest -R dist_";
    pg = dist::world();
    rank = pg->rank(), n = pg->size();
    Tensor pid = full({1}, static_cast<double>(::getpid()), TensorOptions().dtype(kInt64));
    pg->broadcast(pid, 0)->wait();
    base = fs::temp_directory_path() /
           ("kiln-sharded-" + std::to_string(pid.data_ptr<int64_t>()[0]) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    if (rank == 0) fs::create_directories(base);
    pg->barrier()->wait();
  }
  void TearDown() override {
    if (!pg) return;
    pg->barrier()->wait();
    std::error_code ec;
    if (rank == 0) fs::remove_all(base, ec);
  }
  void save(const fs::path& dir, int salt = 0, const dist::ShardedMetadata& md = {{"step", "7"}}) {
    dist::save_sharded_checkpoint(dir, slices_of(rank, n, salt), md, *pg);
  }
  dist::ProcessGroupPtr pg;
  int rank = 0, n = 1;
  fs::path base;
};

// A profile sees each rank's save as one Checkpoint scope with its own shard file's size.
TEST_F(ShardedCheckpointMpi, SaveIsRecordedWithThisRanksShardBytes) {
  const fs::path dir = base / "ckpt";
  std::vector<test::RecordedEvent> saves;
  {
    test::RecordCollector rec;
    save(dir);
    saves = rec.events(record::Kind::Checkpoint, "checkpoint.save");
  }
  ASSERT_EQ(saves.size(), 1u);
  EXPECT_EQ(saves[0].detail, "sharded");
  EXPECT_EQ(saves[0].bytes, static_cast<int64_t>(fs::file_size(dir / dist::shard_format::shard_file_name(rank, n))));
}

TEST_F(ShardedCheckpointMpi, RoundTripAtTheSavingWorldSize) {
  const fs::path dir = base / "ckpt";
  save(dir, 0, {{"step", "7"}, {"config", "lr = 0.1\n"}});
  EXPECT_TRUE(dist::is_sharded_checkpoint(dir));
  EXPECT_FALSE(fs::exists(base / "ckpt.partial"));
  for (int r = 0; r < n; ++r) EXPECT_TRUE(fs::exists(dir / ("shard-" + std::to_string(r) + "-of-" + std::to_string(n) + ".safetensors")));
  ShardedCheckpoint ck(dir);
  EXPECT_EQ(ck.world_size(), n);
  EXPECT_EQ(ck.metadata(), (dist::ShardedMetadata{{"step", "7"}, {"config", "lr = 0.1\n"}}));
  std::vector<std::string> names;
  for (const Spec& s : kSpecs) names.push_back(s.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(ck.names(), names);
  expect_contents(ck);
  // Each rank gets back exactly its own slices.
  for (const ShardSlice& s : slices_of(rank, n))
    EXPECT_TRUE(test::bitwise_equal(ck.read(s.name, s.begin, s.data.numel()), s.data)) << s.name;
}

TEST_F(ShardedCheckpointMpi, ResumesAtOtherWorldSizes) {
  const fs::path dir = base / "ckpt";
  save(dir, 3);
  ShardedCheckpoint ck(dir);
  for (int m : {1, 2, 3, 5, 8}) expect_resharded(ck, m, 3);
}

TEST_F(ShardedCheckpointMpi, SingleProcessCheckpointResumesOnEveryRank) {
  const fs::path one = base / "one", three = base / "three";
  if (rank == 0) {  // one process saves alone (a group of one), then three threads as a world of three
    auto world1 = std::make_shared<test::FakeWorld>(1);
    test::FakeGroup g(world1, 0);
    dist::save_sharded_checkpoint(one, slices_of(0, 1, 5), {{"step", "1"}}, g);
    auto world3 = std::make_shared<test::FakeWorld>(3);
    world3->run([&](int r) {
      test::FakeGroup g3(world3, r);
      dist::save_sharded_checkpoint(three, slices_of(r, 3, 6), {{"step", "3"}}, g3);
    });
  }
  pg->barrier()->wait();
  ShardedCheckpoint ck1(one), ck3(three);
  EXPECT_EQ(ck1.world_size(), 1);
  EXPECT_EQ(ck3.world_size(), 3);
  expect_resharded(ck1, n, 5);
  expect_resharded(ck3, n, 6);
  expect_contents(ck3, 6);
}

TEST_F(ShardedCheckpointMpi, LeftoverPartialIsNeitherReadNorInTheWay) {
  const fs::path dir = base / "ckpt", partial = base / "ckpt.partial";
  if (rank == 0) {  // what a save killed before its commit leaves
    fs::create_directories(partial);
    std::ofstream(partial / "shard-0-of-9.safetensors") << "half a file";
    std::ofstream(partial / "index.json.tmp.12345") << "{";
  }
  pg->barrier()->wait();
  EXPECT_FALSE(dist::is_sharded_checkpoint(dir));
  expect_error<IOError>([&] { ShardedCheckpoint ck(dir); }, "never read");
  pg->barrier()->wait();
  save(dir);
  EXPECT_FALSE(fs::exists(partial));
  expect_contents(ShardedCheckpoint(dir));
}

TEST_F(ShardedCheckpointMpi, FailedSaveLeavesThePreviousCheckpoint) {
  const fs::path dir = base / "ckpt";
  save(dir, 1, {{"step", "1"}});
  // Every rank also claims element 0 of data.order: an overlap, refused on every rank before any write.
  std::vector<ShardSlice> bad = slices_of(rank, n, 2);
  bad.push_back(ShardSlice{"data.order", {23}, 0, part(logical(kSpecs[4], 2), 0, 1)});
  expect_error<ValueError>([&] { dist::save_sharded_checkpoint(dir, bad, {{"step", "2"}}, *pg); },
                           "tensor 'data.order' (23 elements): elements [0, 1) are held twice, by rank ");
  ShardedCheckpoint ck(dir);
  EXPECT_EQ(ck.metadata().at("step"), "1");
  expect_contents(ck, 1);
  pg->barrier()->wait();  // everyone has read the old one before it is replaced
  save(dir, 2, {{"step", "2"}});
  EXPECT_FALSE(fs::exists(base / "ckpt.partial"));
  EXPECT_FALSE(fs::exists(base / "ckpt.old"));
  ShardedCheckpoint ck2(dir);
  EXPECT_EQ(ck2.metadata().at("step"), "2");
  expect_contents(ck2, 2);
}

TEST_F(ShardedCheckpointMpi, BadSlicesAreRefusedOnEveryRank) {
  const fs::path dir = base / "ckpt";
  auto save_with = [&](std::vector<ShardSlice> mine, dist::ShardedMetadata md = {}) {
    dist::save_sharded_checkpoint(dir, mine, md, *pg);
  };
  const Tensor order = logical(kSpecs[4]);
  {  // a gap: rank 0 holds the first 10 elements, no rank the rest
    std::vector<ShardSlice> mine;
    if (rank == 0) mine.push_back({"data.order", {23}, 0, part(order, 0, 10)});
    expect_error<ValueError>([&] { save_with(mine); },
                             "tensor 'data.order' (23 elements): elements [10, 23) are held by no one");
  }
  {  // dtypes that disagree
    std::vector<ShardSlice> mine = {{"w", {n}, rank, full({1}, 1.0, TensorOptions().dtype(rank ? kFloat32 : kInt64))}};
    if (n == 1) mine.push_back({"w", {n}, 0, full({0}, 1.0)});
    expect_error<ValueError>([&] { save_with(mine); }, "tensor 'w': expected the int64 shape [" + std::to_string(n) + "] that rank 0 gives, got float32");
  }
  if (n > 1) {  // metadata that disagrees
    std::vector<ShardSlice> mine = {{"w", {n}, rank, full({1}, 1.0)}};
    expect_error<ValueError>([&] { save_with(mine, {{"step", std::to_string(rank)}}); },
                             "rank 1: its metadata differs from rank 0's");
  }
  {  // a slice outside its tensor on the last rank only: raised on every rank, naming it
    std::vector<ShardSlice> mine = {{"w", {n}, rank, full({1}, 1.0)}};
    if (rank == n - 1) mine[0].begin = n;
    expect_error<ValueError>([&] { save_with(mine); }, "lie outside the tensor's " + std::to_string(n) + " elements");
    if (n > 1) expect_error<ValueError>([&] { save_with(mine); }, "rank " + std::to_string(n - 1) + ": slice 0 of 'w'");
  }
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(fs::exists(base / "ckpt.partial"));
}

// ---------------------------------------------------------------------------
// One process (a group of one), in this rank's own directory.

class ShardedCheckpoint1 : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = tmp.path() / "ckpt";
    // Two slices per tensor, so that the index holds boundaries to damage.
    for (const Spec& s : kSpecs) {
      const Tensor t = logical(s);
      const int64_t m = t.numel(), h = m / 2;
      if (h > 0) mine.push_back({s.name, s.shape, 0, part(t, 0, h)});
      mine.push_back({s.name, s.shape, h, part(t, h, m - h)});
    }
    save(dir);
  }
  void save(const fs::path& d, const dist::ShardedMetadata& md = {{"step", "4"}}) {
    test::FakeGroup g(world, 0);
    dist::save_sharded_checkpoint(d, mine, md, g);
  }
  nlohmann::json index() const { return nlohmann::json::parse(test::read_file((dir / "index.json").string())); }
  void write_index(const nlohmann::json& j) const { std::ofstream(dir / "index.json", std::ios::trunc) << j.dump(1); }
  void write_index(const std::string& text) const { std::ofstream(dir / "index.json", std::ios::trunc) << text; }
  // Opens and reads everything: where a damaged checkpoint must fail.
  void open_and_read() const {
    ShardedCheckpoint ck(dir);
    for (const std::string& name : ck.names()) ck.read_full(name);
  }

  test::TempDir tmp;
  fs::path dir;
  std::shared_ptr<test::FakeWorld> world = std::make_shared<test::FakeWorld>(1);
  std::vector<ShardSlice> mine;
};
using ShardedCheckpoint1Hostile = ShardedCheckpoint1;

TEST_F(ShardedCheckpoint1, RoundTripWithEveryDType) {
  expect_contents(ShardedCheckpoint(dir));
  const fs::path d2 = tmp.path() / "dtypes/";  // a trailing slash names the same directory
  std::vector<ShardSlice> all;
  for (int i = 0; i < kNumDTypes; ++i) {
    const DType dt = static_cast<DType>(i);
    Tensor t = full({2, 3}, dt == kBool ? 1.0 : i + 0.5, TensorOptions().dtype(dt));
    all.push_back({std::string(dtype_name(dt)), {2, 3}, 0, t.transpose(0, 1)});  // not contiguous: read flattened
  }
  test::FakeGroup g(world, 0);
  dist::save_sharded_checkpoint(d2, all, {}, g);
  ShardedCheckpoint ck(tmp.path() / "dtypes");
  for (const ShardSlice& s : all)
    EXPECT_TRUE(test::bitwise_equal(ck.read(s.name, 0, 6), s.data.reshape({-1}).contiguous())) << s.name;
}

TEST_F(ShardedCheckpoint1, ReaderErrors) {
  ShardedCheckpoint ck(dir);
  expect_error<ValueError>([&] { ck.shape("model.nope"); }, "no tensor named 'model.nope'; it holds 6 tensors");
  expect_error<IndexError>([&] { ck.read("data.order", 20, 4); }, "expected a range within [0, 23), got begin 20, length 4");
  expect_error<IndexError>([&] { ck.read("data.order", -1, 1); }, "got begin -1");
  expect_error<IndexError>([&] { ck.read("data.order", 1, INT64_MAX); }, "length 9223372036854775807");
}

TEST_F(ShardedCheckpoint1, BadInputIsAValueError) {
  test::FakeGroup g(world, 0);
  const fs::path d = tmp.path() / "bad";
  expect_error<ValueError>([&] { dist::save_sharded_checkpoint(d, {{"", {1}, 0, full({1}, 1.0)}}, {}, g); },
                           "expected a tensor name, got an empty one");
  expect_error<ValueError>([&] { dist::save_sharded_checkpoint(d, {{"w", {1}, 0, Tensor()}}, {}, g); },
                           "'w': the data tensor is undefined");
  expect_error<ValueError>([&] { dist::save_sharded_checkpoint(d, {{"w", {-1}, 0, full({0}, 1.0)}}, {}, g); },
                           "expected a shape of non-negative sizes");
  expect_error<ValueError>(
      [&] { dist::save_sharded_checkpoint(d, {{"w", {INT64_MAX / 2, 4}, 0, full({1}, 1.0)}}, {}, g); },
      "whose byte count fits int64");
  expect_error<ValueError>([&] { dist::save_sharded_checkpoint(d, {{"w", {4}, 0, full({2}, 1.0)}}, {{"k", "\xff"}}, g); },
                           "valid UTF-8");
  std::ofstream(tmp.path() / "notes.txt") << "mine";
  fs::create_directories(tmp.path() / "user");
  std::ofstream(tmp.path() / "user" / "notes.txt") << "mine";
  expect_error<ValueError>([&] { save(tmp.path() / "user"); }, "refusing to replace");
  fs::create_directories(tmp.path() / "x.partial");
  std::ofstream(tmp.path() / "x.partial" / "notes.txt") << "mine";
  expect_error<ValueError>([&] { save(tmp.path() / "x"); }, "holds files a save does not write: 'notes.txt'");
  EXPECT_TRUE(fs::exists(tmp.path() / "x.partial" / "notes.txt"));
  EXPECT_TRUE(fs::exists(tmp.path() / "user" / "notes.txt"));
  EXPECT_FALSE(fs::exists(d));
}

TEST_F(ShardedCheckpoint1Hostile, DamagedShardFiles) {
  const fs::path shard = dir / "shard-0-of-1.safetensors";
  const auto size = fs::file_size(shard);
  {  // a flipped byte in the data: the header is fine, the checksum is not
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 3));
    f.put('\x5a');
  }
  ShardedCheckpoint ck(dir);
  expect_error<FormatError>([&] { for (const Spec& s : kSpecs) ck.read_full(s.name); }, "checksum mismatch");
  expect_error<FormatError>([&] { for (const Spec& s : kSpecs) ck.read_full(s.name); }, "shard-0-of-1.safetensors");
  fs::resize_file(shard, size / 2);  // truncated: caught on open (the header promises more bytes)
  expect_error<FormatError>([&] { open_and_read(); }, "shard-0-of-1.safetensors");
  fs::resize_file(shard, 5);
  expect_error<FormatError>([&] { open_and_read(); }, "shard-0-of-1.safetensors");
  fs::remove(shard);  // the index names a file that is not there
  expect_error<IOError>([&] { open_and_read(); }, "shard-0-of-1.safetensors");
  save(dir);  // a good one again; then a shard of another save's numbering under this name
  std::vector<ShardSlice> other = {{"x", {1}, 0, full({1}, 1.0)}};
  test::FakeGroup g(world, 0);
  dist::save_sharded_checkpoint(tmp.path() / "other", other, {}, g);
  fs::copy_file(tmp.path() / "other" / "shard-0-of-1.safetensors", shard, fs::copy_options::overwrite_existing);
  expect_error<FormatError>([&] { open_and_read(); }, "expected a tensor 'data.order@0' (named by the index)");
}

TEST_F(ShardedCheckpoint1Hostile, DamagedIndex) {
  const nlohmann::json good = index();
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    write_index(j);
  };
  ASSERT_EQ(good["tensors"]["data.order"]["slices"].size(), 2u);
  // Slice k of data.order: 0 holds elements [0, 11), 1 holds [11, 23).
  auto slice = [](nlohmann::json& j, int k) -> nlohmann::json& { return j["tensors"]["data.order"]["slices"][k]; };

  write_index(std::string("not json{"));
  expect_error<FormatError>([&] { open_and_read(); }, "index.json: not a valid sharded checkpoint index: expected JSON");
  EXPECT_FALSE(dist::is_sharded_checkpoint(dir));
  write_index(std::string(""));
  expect_error<FormatError>([&] { open_and_read(); }, "expected JSON");
  write_index(std::string(100, '[') + std::string(100, ']'));
  expect_error<FormatError>([&] { open_and_read(); }, "nests deeper");
  write_index(std::string("{\"format\": \"kiln.sharded_checkpoint\", \"format\": \"x\"}"));
  expect_error<FormatError>([&] { open_and_read(); }, "key 'format' appears twice");
  with([](auto& j) { j["version"] = 2; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected format version 1, got 2");
  with([](auto& j) { j["world_size"] = 0; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected 'world_size' in [1, ");
  with([](auto& j) { j["world_size"] = "1"; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected 'world_size' to be an integer");
  with([](auto& j) { j.erase("tensors"); });
  expect_error<FormatError>([&] { open_and_read(); }, "expected a field 'tensors'");
  with([&](auto& j) { slice(j, 0)["length"] = slice(j, 0)["length"].template get<int64_t>() - 1; });
  expect_error<FormatError>([&] { open_and_read(); }, "are held by no one");
  with([&](auto& j) { slice(j, 0)["length"] = slice(j, 0)["length"].template get<int64_t>() + 1; });
  expect_error<FormatError>([&] { open_and_read(); }, "are held twice");
  with([&](auto& j) { slice(j, 0)["begin"] = -5; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected 0 <= begin, 0 < length and begin + length <= 23");
  with([&](auto& j) { slice(j, 1)["length"] = INT64_MAX; });
  expect_error<FormatError>([&] { open_and_read(); }, "length 9223372036854775807");
  with([&](auto& j) { slice(j, 1)["length"] = UINT64_MAX; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected 'length' to be an integer that fits int64");
  with([&](auto& j) { slice(j, 1)["length"] = 0; });
  expect_error<FormatError>([&] { open_and_read(); }, "0 < length");
  with([](auto& j) { j["tensors"]["data.order"]["shape"] = {4294967296LL, 4294967296LL, 4}; });
  expect_error<FormatError>([&] { open_and_read(); }, "holds more bytes than int64 can count");
  with([](auto& j) { j["tensors"]["data.order"]["shape"] = {-23}; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected non-negative integer sizes");
  with([](auto& j) { j["tensors"]["data.order"]["dtype"] = "float128"; });
  expect_error<FormatError>([&] { open_and_read(); }, "got 'float128'");
  with([&](auto& j) { slice(j, 1)["file"] = "../../etc/passwd"; });
  expect_error<FormatError>([&] { open_and_read(); }, "expected 'file' to be shard-<r>-of-1.safetensors, got '../../etc/passwd'");
  with([&](auto& j) { slice(j, 1)["file"] = "shard-1-of-1.safetensors"; });
  expect_error<FormatError>([&] { open_and_read(); }, "got 'shard-1-of-1.safetensors'");
  with([&](auto& j) { slice(j, 1)["key"] = slice(j, 0)["key"]; });
  expect_error<FormatError>([&] { open_and_read(); }, "is used by another slice too");
  with([&](auto& j) { slice(j, 1)["key"] = "nope"; j["checksum"] = "0000000000000000"; });
  expect_error<FormatError>([&] { open_and_read(); }, "checksum mismatch: the index says 0000000000000000");
  with([](auto& j) { j["metadata"]["step"] = "5"; });  // still parses: only the checksum tells
  expect_error<FormatError>([&] { open_and_read(); }, "checksum mismatch");
  with([](auto& j) { j["metadata"]["step"] = 5; });
  expect_error<FormatError>([&] { open_and_read(); }, "metadata 'step': expected a string, got 5");
  std::ofstream(dir / "index.json", std::ios::trunc) << good.dump(1);
  EXPECT_TRUE(dist::is_sharded_checkpoint(dir));
  expect_contents(ShardedCheckpoint(dir));
  fs::remove(dir / "index.json");
  expect_error<IOError>([&] { open_and_read(); }, "cannot open");
  EXPECT_FALSE(dist::is_sharded_checkpoint(tmp.path() / "nowhere"));
}

}  // namespace
}  // namespace kiln
