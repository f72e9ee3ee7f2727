// Private to src/dist: the index of a sharded checkpoint (index.json), shared
// by the writer (sharded_checkpoint.cpp) and the reader
// (sharded_checkpoint_read.cpp). docs/checkpoints.md describes the format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/dist/sharded_checkpoint.h"

namespace kiln::dist::shard_format {

inline constexpr const char* kFormat = "kiln.sharded_checkpoint";
inline constexpr int64_t kVersion = 1;
inline constexpr const char* kIndexName = "index.json";
/// Refused before parsing: a DOM costs ~16x its text, and no real index is near this.
inline constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;
inline constexpr int64_t kMaxWorldSize = 1 << 20;
inline constexpr size_t kMaxDims = 64;

/// FNV-1a 64 over `n` bytes, continuing from `h`.
inline constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
uint64_t fnv1a64(const void* p, size_t n, uint64_t h = kFnvOffset);
std::string hex16(uint64_t v);

/// "shard-<r>-of-<n>.safetensors".
std::string shard_file_name(int64_t r, int64_t n);
/// The key of a slice in its shard file: "<name>@<begin>" (unique within the file, since slices do not overlap).
std::string slice_key(const std::string& name, int64_t begin);
/// dtype_name() backwards; nullopt for a name kiln does not have.
std::optional<DType> dtype_from_name(std::string_view name);
/// The product of `shape`, or nullopt when a dimension is negative or the byte count of a
/// tensor of that shape and `itemsize` would overflow int64.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape, int64_t itemsize);

struct IndexSlice {
  int64_t file = 0;  // the rank whose shard file holds it
  std::string key;
  int64_t begin = 0;
  int64_t length = 0;
  uint64_t checksum = 0;  // fnv1a64 of the slice's bytes
};

struct IndexTensor {
  DType dtype = kFloat32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  std::vector<IndexSlice> slices;  // sorted by begin, covering [0, numel) exactly
};

struct Index {
  int64_t world_size = 0;
  ShardedMetadata metadata;
  std::map<std::string, IndexTensor> tensors;
};

/// The JSON text of `index`, with its checksum.
std::string write_index(const Index& index);
/// Parses and validates index.json text (`source` names it in messages):
/// FormatError for anything but an index write_index could have written for
/// some consistent set of slices (checksum included).
Index parse_index(std::string_view text, const std::string& source);

/// One holder's range of a tensor's flattened elements, for coverage_problem.
struct Range {
  int64_t begin = 0;
  int64_t length = 0;
  std::string owner;  // "rank 1", "shard-1-of-2.safetensors": how messages name who holds it
};
/// Whether `ranges` cover [0, numel) exactly: empty if so, else the first gap
/// or overlap, naming tensor `name`, the element ranges and their owners.
std::string coverage_problem(const std::string& name, int64_t numel, std::vector<Range> ranges);

}  // namespace kiln::dist::shard_format
