// safetensors files: the on-disk format for tensors (DESIGN.md §7), shared
// with PyTorch and Hugging Face.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//    "__metadata__": {"key": "value"}}
// then the byte buffer, offsets relative to its start, no holes, no overlap.
//
// Readers treat every file as hostile: each malformed header, offset, size or
// value raises kiln::FormatError naming the file, the tensor and the problem,
// and nothing is allocated beyond what the file's size can hold. Writers are
// atomic: a failed save never replaces a good file.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln::io {

/// Tensors in order (the order written, the order of the file's byte buffer when read).
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using Metadata = std::map<std::string, std::string>;

/// What a safetensors file holds. Tensors are in the order of their bytes in
/// the file, which for files kiln writes is the order they were given.
struct SafetensorsFile {
  NamedTensors tensors;
  Metadata metadata;

  bool contains(std::string_view name) const;
  /// The tensor called `name`; ValueError listing the names present otherwise.
  const Tensor& at(std::string_view name) const;
  size_t size() const { return tensors.size(); }
};

/// One header entry, without its data: enough to inspect a file cheaply.
struct TensorInfo {
  std::string name;
  DType dtype = kFloat32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // relative to the byte buffer
  uint64_t data_end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // in byte-buffer order
  Metadata metadata;
  uint64_t data_start = 0;  // file offset of the byte buffer (8 + N)
  uint64_t data_size = 0;   // bytes in the byte buffer
};

/// Writes `tensors` (any strides; written contiguous) and `metadata` to `path`
/// atomically: to "<path>.tmp.<pid>", fsync, rename over `path`, fsync the
/// directory. On failure the previous file is untouched and no temporary
/// file is left. Raises ValueError for bad input (duplicate or reserved names,
/// undefined tensors, invalid UTF-8) and IOError when the system refuses.
void save_safetensors(const std::string& path, const NamedTensors& tensors, const Metadata& metadata = {});
/// Any map of name -> Tensor (std::map writes in name order).
template <typename Map>
requires requires(const Map& m) {
  std::string(m.begin()->first);
  m.begin()->second.defined();
}
void save_safetensors(const std::string& path, const Map& tensors, const Metadata& metadata = {}) {
  save_safetensors(path, NamedTensors(tensors.begin(), tensors.end()), metadata);
}

/// Reads every tensor of `path` into fresh memory charged to MemoryCategory::Data.
/// IOError if the file cannot be read, FormatError if it is not valid safetensors.
SafetensorsFile load_safetensors(const std::string& path);

/// Reads and validates only the header (cheap for large files).
SafetensorsHeader read_safetensors_header(const std::string& path);

/// In-memory forms (tests, fuzzing, network transfer). `source` names the
/// bytes in error messages.
std::vector<uint8_t> serialize_safetensors(const NamedTensors& tensors, const Metadata& metadata = {});
SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes, std::string_view source = "<memory>");

}  // namespace kiln::io
