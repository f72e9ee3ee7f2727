// State dicts on disk: name-keyed tensor maps (as torch's state_dict()) kept
// in safetensors files, and the key and dtype edits that moving them between
// frameworks needs. This layer knows tensors, names, dtypes and metadata only;
// matching a state dict against a module is nn's job (kiln/nn/pytorch_weights.h).
//
// Files written here load in PyTorch with the json+numpy reader of
// docs/interop.md (or the safetensors package's safe_open); files written by
// that doc's Python writer, by safetensors.torch.save_file or by Hugging Face
// tools load here.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/io/safetensors.h"

namespace kiln::io {

/// One key edit: `from` and `to` are whole dotted segments ("module", "_orig_mod",
/// "blocks" -> "h", "attn.qkv" -> "attn.c_attn"); `to` may be empty to drop
/// segments. A rule matches at any segment boundary, so "blocks" renames
/// "blocks.0.w" and "enc.blocks.1.w" but not "myblocks.0.w".
struct KeyRename {
  std::string from;
  std::string to;
};

/// `key` with each rule applied in order (every occurrence of each).
std::string rename_key(std::string_view key, const std::vector<KeyRename>& rules);
/// The rules that undo `rules` (reversed order, from and to swapped).
std::vector<KeyRename> inverse(const std::vector<KeyRename>& rules);
/// Every key renamed by `rules`, order kept. ValueError naming both original keys
/// when two of them would end up under one name.
NamedTensors rename_keys(const NamedTensors& dict, const std::vector<KeyRename>& rules);

/// As torch.nn.modules.utils.consume_prefix_in_state_dict_if_present: strips
/// `prefix` ("module." from DDP, "_orig_mod." from torch.compile) from every key
/// that starts with it. Returns how many keys changed.
size_t consume_prefix_in_state_dict_if_present(NamedTensors& dict, std::string_view prefix);

/// Floating-point tensors cast to `dtype` (integer and bool tensors, such as
/// BatchNorm's num_batches_tracked, unchanged); tensors that share memory
/// stay shared.
NamedTensors cast_floating(const NamedTensors& dict, DType dtype);

/// Names whose tensors are the same memory (same storage, offset, sizes, strides
/// and dtype): tied weights such as GPT's transformer.wte.weight and
/// lm_head.weight. Only groups of two or more, each in `dict`'s order.
std::vector<std::vector<std::string>> shared_groups(const NamedTensors& dict);

/// Same dtype, same shape and the same bytes.
bool equal_bytes(const Tensor& a, const Tensor& b);

struct WriteStateDictOptions {
  /// Cast floating-point tensors to this on the way out (a bfloat16 or float16
  /// file for a float32 model); unset: as they are.
  std::optional<DType> dtype = std::nullopt;
  /// Extra "__metadata__" strings; "format" defaults to "pt", as the files of
  /// safetensors.torch.save_file and Hugging Face say.
  Metadata metadata = {};
};

/// Writes `dict` in its order, each name with its own bytes (tied names are
/// written twice, as torch's state_dict() lists them; a reader needs nothing
/// special), atomically as save_safetensors.
void write_state_dict(const std::string& path, const NamedTensors& dict, const WriteStateDictOptions& o = {});

struct ReadStateDictOptions {
  /// Cast floating-point tensors to this after reading; unset: the file's dtypes.
  std::optional<DType> dtype = std::nullopt;
  /// Applied to the keys after reading (see rename_keys).
  std::vector<KeyRename> renames = {};
};

/// Reads a state dict: tensors in the file's byte order (the writer's order for
/// kiln's and the doc's Python writer) and its metadata. IOError / FormatError
/// as load_safetensors.
SafetensorsFile read_state_dict(const std::string& path, const ReadStateDictOptions& o = {});

}  // namespace kiln::io
