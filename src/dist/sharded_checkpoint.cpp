// save_sharded_checkpoint (include/kiln/dist/sharded_checkpoint.h): four
// steps, each ending in an exchange through which every rank learns every
// rank's outcome, so that one rank's error is raised on all of them and no
// rank is left waiting in a collective the others skipped:
//   1. describe: each rank's slices (name, dtype, shape, range) go to every
//      rank, which all run the same validation (coverage, agreement) on the
//      same descriptions, so a bad set of slices fails everywhere before any
//      byte is written;
//   2. prepare (rank 0): remove a leftover <dir>.partial, create it afresh;
//   3. write: each rank writes its shard file (atomic, fsynced) and the
//      checksum of each slice;
//   4. commit (rank 0): index.json into <dir>.partial, then <dir>.partial
//      takes the place of <dir> (see commit()).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kiln/core/error.h"
#include "kiln/core/record.h"
#include "kiln/io/safetensors.h"
#include "kiln/ops/factory.h"
#include "sharded_checkpoint_format.h"
#include "sharded_checkpoint_fs.h"

namespace kiln::dist {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::concat;
using namespace shard_format;

namespace {

// Every rank's string, on every rank: the lengths, then the bytes packed in
// int64 words (the dtypes collectives carry), one collective each.
std::vector<std::string> exchange(ProcessGroup& g, const std::string& mine, const char* step) {
  CollectiveLabel label(concat("sharded checkpoint save: ", step));
  const int n = g.size();
  const auto i64 = TensorOptions().dtype(kInt64);
  Tensor len = full({1}, static_cast<double>(mine.size()), i64);
  std::vector<Tensor> lens;
  for (int r = 0; r < n; ++r) lens.push_back(zeros({1}, i64));
  g.allgather(lens, len)->wait();
  auto words = [](int64_t bytes) { return std::max<int64_t>(1, (bytes + 7) / 8); };
  Tensor in = zeros({words(static_cast<int64_t>(mine.size()))}, i64);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  std::vector<Tensor> outs;
  for (int r = 0; r < n; ++r) outs.push_back(zeros({words(lens[r].data_ptr<int64_t>()[0])}, i64));
  g.allgather(outs, in)->wait();
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r)
    all.emplace_back(static_cast<const char*>(outs[r].data_ptr()), static_cast<size_t>(lens[r].data_ptr<int64_t>()[0]));
  return all;
}

// Runs `step` and returns "" or its error as "<kind letter>:<message>", so it can travel to every rank.
template <typename F>
std::string capture(F&& step) {
  try {
    step();
    return {};
  } catch (const ValueError& e) {
    return concat("V:", e.what());
  } catch (const std::exception& e) {
    return concat("I:", e.what());
  }
}

// Raises on this rank the errors every rank reported (the kind of the first), if any.
void raise_any(const std::vector<std::string>& errors, const std::string& where) {
  std::string msg;
  bool value = false;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    if (msg.empty()) value = errors[r][0] == 'V';
    msg += concat(msg.empty() ? "" : "; ", errors.size() > 1 ? concat("rank ", r, ": ") : "", errors[r].substr(2));
  }
  if (msg.empty()) return;
  if (value) throw ValueError(concat(where, ": ", msg));
  throw IOError(concat(where, ": ", msg));
}

// One non-empty slice of this rank, flattened and contiguous.
struct Piece {
  std::string name;
  std::vector<int64_t> shape;
  int64_t begin;
  Tensor flat;
};

// This rank's slices as JSON (and `pieces`), or the first problem that is visible on this rank alone.
std::string describe(const std::vector<ShardSlice>& mine, const ShardedMetadata& metadata, std::vector<Piece>& pieces,
                     std::string& problem) {
  json d = json::object();
  json slices = json::array();
  problem = capture([&] {
    for (size_t i = 0; i < mine.size(); ++i) {
      const ShardSlice& s = mine[i];
      KILN_CHECK(!s.name.empty(), ValueError, "slice ", i, ": expected a tensor name, got an empty one");
      KILN_CHECK(s.data.defined(), ValueError, "slice ", i, " of '", s.name, "': the data tensor is undefined");
      KILN_CHECK(s.shape.size() <= kMaxDims, ValueError, "slice ", i, " of '", s.name, "': expected at most ", kMaxDims,
                 " dimensions, got ", s.shape.size());
      const auto numel = checked_numel(s.shape, element_size(s.data.dtype()));
      KILN_CHECK(numel.has_value(), ValueError, "slice ", i, " of '", s.name,
                 "': expected a shape of non-negative sizes whose byte count fits int64");
      const int64_t len = s.data.numel();
      KILN_CHECK(s.begin >= 0 && s.begin <= *numel - len, ValueError, "slice ", i, " of '", s.name, "': elements [",
                 s.begin, ", ", s.begin + len, ") lie outside the tensor's ", *numel, " elements");
      // An empty slice holds no data but still names its tensor: a tensor of zero elements has no other.
      slices.push_back({s.name, std::string(dtype_name(s.data.dtype())), s.shape, s.begin, len});
      if (len > 0) pieces.push_back(Piece{s.name, s.shape, s.begin, s.data.reshape({-1}).contiguous()});
    }
  });
  d["slices"] = std::move(slices);
  d["metadata"] = metadata;
  std::string text;
  try {
    text = d.dump();
  } catch (const json::exception& e) {
    if (problem.empty()) problem = concat("V:", "expected tensor names and metadata in valid UTF-8 (", e.what(), ")");
    d["metadata"] = json::object();
    d["slices"] = json::array();
    text = d.dump();
  }
  return text;
}

// What every rank told: the same validation on every rank, from the same
// descriptions, so that all raise the same error or none does.
Index validate(const std::vector<std::string>& descs, const std::vector<std::string>& local_problems,
               const std::string& where) {
  std::vector<std::string> errors = local_problems;
  Index index;
  index.world_size = static_cast<int64_t>(descs.size());
  std::map<std::string, int64_t> first_rank;  // who first described each tensor
  std::map<std::string, std::vector<Range>> ranges;
  std::vector<json> parsed;
  for (const std::string& d : descs) parsed.push_back(json::parse(d));
  index.metadata = parsed[0]["metadata"].get<ShardedMetadata>();
  auto add = [&](size_t r, const std::string& msg) {
    if (errors[r].empty()) errors[r] = concat("V:", msg);
  };
  for (size_t r = 0; r < parsed.size(); ++r) {
    if (parsed[r]["metadata"] != parsed[0]["metadata"])
      add(r, "its metadata differs from rank 0's (expected the same metadata on every rank)");
    for (const json& s : parsed[r]["slices"]) {
      const std::string name = s[0].get<std::string>();
      const DType dtype = *dtype_from_name(s[1].get<std::string>());
      const auto shape = s[2].get<std::vector<int64_t>>();
      const int64_t begin = s[3].get<int64_t>(), length = s[4].get<int64_t>();
      auto [it, fresh] = index.tensors.try_emplace(name);
      IndexTensor& t = it->second;
      if (fresh) {
        t.dtype = dtype, t.shape = shape, t.numel = *checked_numel(shape, element_size(dtype));
        first_rank[name] = static_cast<int64_t>(r);
      } else if (t.dtype != dtype || t.shape != shape) {
        add(r,
            concat("tensor '", name, "': expected the ", dtype_name(t.dtype), " shape ", json(t.shape).dump(),
                   " that rank ", first_rank[name], " gives, got ", dtype_name(dtype), " shape ", json(shape).dump()));
        continue;
      }
      if (length == 0) continue;
      t.slices.push_back(IndexSlice{static_cast<int64_t>(r), slice_key(name, begin), begin, length, 0});
      ranges[name].push_back(Range{begin, length, concat("rank ", r)});
    }
  }
  std::string coverage;
  for (const auto& [name, t] : index.tensors) {
    const std::string p = coverage_problem(name, t.numel, ranges[name]);
    if (!p.empty()) coverage += concat(coverage.empty() ? "" : "; ", p);
  }
  raise_any(errors, where);  // first: a slice left out by its rank's own error also leaves a gap
  if (!coverage.empty()) throw ValueError(concat(where, ": ", coverage));
  for (auto& [name, t] : index.tensors)
    std::sort(t.slices.begin(), t.slices.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  return index;
}

// Rank 0's commit: index.json into `partial`, then `partial` becomes `dir`.
void commit(const fs::path& dir, const fs::path& partial, const Index& index) {
  write_file_synced(partial / kIndexName, write_index(index));
  sync_directory(partial);
  replace_directory(partial, dir);
}

}  // namespace

void save_sharded_checkpoint(const fs::path& dir_in, const std::vector<ShardSlice>& mine,
                             const ShardedMetadata& metadata, ProcessGroup& group) {
  const std::string where = concat("save_sharded_checkpoint('", dir_in.string(), "')");
  // In a profile: the whole save, collectives included, with this rank's shard file as its bytes.
  record::Scope scope(record::Kind::Checkpoint, "checkpoint.save");
  scope.set_detail("sharded");
  KILN_CHECK(group.is_member(), ValueError, where, ": this process is not a member of ", group.describe());
  KILN_CHECK(!dir_in.empty(), ValueError, where, ": expected a directory path, got an empty one");
  const fs::path dir = dir_in.has_filename() ? dir_in : dir_in.parent_path();  // "ckpt/" is "ckpt"
  const fs::path partial = partial_path(dir);
  const int rank = group.rank();
  const int64_t n = group.size();

  // 1. Describe and validate.
  std::vector<Piece> pieces;
  std::string problem;
  const std::string desc = describe(mine, metadata, pieces, problem);
  const std::vector<std::string> descs = exchange(group, desc, "describe");
  const std::vector<std::string> problems = exchange(group, problem, "validate");
  Index index = validate(descs, problems, where);

  // 2. Prepare the partial directory.
  std::string err;
  if (rank == 0) err = capture([&] { prepare_partial(dir, partial); });
  const std::vector<std::string> prepared = exchange(group, err, "prepare");
  raise_any({prepared[0]}, where);

  // 3. Every rank writes its file; the checksums go to rank 0 with the outcome.
  std::vector<uint64_t> sums;
  err = capture([&] {
    io::NamedTensors tensors;
    for (const Piece& p : pieces) {
      sums.push_back(fnv1a64(p.flat.data_ptr(), static_cast<size_t>(p.flat.nbytes())));
      tensors.emplace_back(slice_key(p.name, p.begin), p.flat);
    }
    const io::Metadata md = {{kFormat, std::to_string(kVersion)},
                             {"kiln.sharded_checkpoint.rank", std::to_string(rank)},
                             {"kiln.sharded_checkpoint.world_size", std::to_string(n)}};
    const fs::path file = partial / shard_file_name(rank, n);
    io::save_safetensors(file.string(), tensors, md);
    std::error_code ec;
    const auto bytes = fs::file_size(file, ec);
    if (!ec) scope.set_bytes(static_cast<int64_t>(bytes));
  });
  json report = {{"error", err}, {"sums", sums}};
  const std::vector<std::string> reports =
      exchange(group, report.dump(-1, ' ', false, json::error_handler_t::replace), "write shards");

  // 4. Commit on rank 0, which alone has every checksum.
  std::vector<std::string> written;
  for (const std::string& r : reports) written.push_back(json::parse(r)["error"].get<std::string>());
  err.clear();
  if (rank == 0) {
    err = capture([&] {
      raise_any(written, "writing the shard files");
      // Each report's checksums are in the order of that rank's description.
      std::map<std::pair<int64_t, std::string>, uint64_t> sum_of;
      for (int64_t r = 0; r < n; ++r) {
        const json d = json::parse(descs[static_cast<size_t>(r)]);
        const auto rs = json::parse(reports[static_cast<size_t>(r)])["sums"].get<std::vector<uint64_t>>();
        size_t k = 0;  // the pieces: the described slices that are not empty
        for (const json& s : d["slices"]) {
          if (s[4].get<int64_t>() > 0)
            sum_of[{r, slice_key(s[0].get<std::string>(), s[3].get<int64_t>())}] = rs.at(k++);
        }
      }
      for (auto& [name, t] : index.tensors) {
        for (IndexSlice& sl : t.slices) sl.checksum = sum_of.at({sl.file, sl.key});
      }
      commit(dir, partial, index);
    });
    if (!err.empty()) remove_ours(partial);
  }
  raise_any({exchange(group, err, "commit")[0]}, where);
}

}  // namespace kiln::dist
