// Weights to and from PyTorch: load a state dict that torch wrote (as
// safetensors; docs/interop.md has the Python side) into a kiln Module of the
// same architecture, and export a Module so that torch's
// load_state_dict(strict=True) takes it.
//
// kiln's state_dict names are torch's for the same architecture (DESIGN.md §5),
// so by default nothing is renamed; what this layer adds is what differs
// between a file and Module::load_state_dict:
//  - tied weights (GPT's lm_head.weight is transformer.wte.weight): torch's
//    state_dict lists both names; files that kept one (safetensors' save_model,
//    Hugging Face) load too, the other name filled from it, and a file whose
//    copies differ is an error rather than a silent last-one-wins;
//  - BatchNorm's int64 num_batches_tracked: absent in a file, it is set to 0,
//    as torch does for state dicts without version metadata;
//  - torch-only keys to skip (patterns), wrapper prefixes ("module." from DDP,
//    "_orig_mod." from torch.compile), key renames for models whose names differ;
//  - dtype conversion (a bfloat16 or float64 file into a float32 model), only
//    when asked.
// Every problem — missing and unexpected keys, shape and dtype mismatches,
// differing tied copies — is reported together, by name, in one ValueError
// before the module is touched.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kiln/io/state_dict.h"
#include "kiln/nn/module.h"

namespace kiln::nn {

struct PyTorchLoadOptions {
  /// As torch's strict: false reports missing and unexpected keys in the result
  /// instead of raising. Shape and dtype mismatches raise either way.
  bool strict = true;
  /// Cast each tensor to the dtype of the module tensor it lands in when both are
  /// floating-point or both integer (never between the two); false: a dtype
  /// difference is a mismatch.
  bool convert_dtype = false;
  /// Prefixes removed from the file's keys where present, before renames.
  std::vector<std::string> strip_prefixes = {"module.", "_orig_mod."};
  /// File key -> module key edits, applied after strip_prefixes.
  std::vector<io::KeyRename> renames = {};
  /// fnmatch(3) patterns of file keys (after renames) to skip, e.g. "*.attn.bias"
  /// for nanoGPT's causal-mask buffer, which kiln does not keep.
  std::vector<std::string> ignore = {};
};

/// What the load did besides copying (names are the module's).
struct PyTorchLoadResult {
  std::vector<std::string> missing_keys;     // only when !strict
  std::vector<std::string> unexpected_keys;  // only when !strict
  std::vector<std::string> ignored_keys;     // the file's keys matched by `ignore`
  /// "lm_head.weight <- transformer.wte.weight": absent, taken from a tied name.
  std::vector<std::string> tied_filled;
  /// num_batches_tracked entries absent from the file, set to 0.
  std::vector<std::string> defaulted;
  /// "fc.weight: bfloat16 -> float32".
  std::vector<std::string> converted;
};

/// Loads `dict` (torch's names) into `module`; all or nothing (see the top of this file).
PyTorchLoadResult load_pytorch_state_dict(Module& module, const NamedTensors& dict, const PyTorchLoadOptions& o = {});
/// The same from a safetensors file; IOError / FormatError when it cannot be read.
PyTorchLoadResult load_pytorch_weights(Module& module, const std::string& path, const PyTorchLoadOptions& o = {});

struct PyTorchExportOptions {
  /// Cast floating-point tensors (a smaller bfloat16/float16 file); torch's
  /// load_state_dict casts back into its parameters.
  std::optional<DType> dtype = std::nullopt;
  /// Module key -> file key edits (io::inverse of the load renames).
  std::vector<io::KeyRename> renames = {};
  /// Extra metadata; "format" is "pt" and "kiln.module" the module's type name unless given.
  io::Metadata metadata = {};
};

/// The state dict as torch's twin would list it: every name (both of a tied
/// pair), parameters and persistent buffers, module order, detached.
NamedTensors pytorch_state_dict(const Module& module, const PyTorchExportOptions& o = {});
/// Writes pytorch_state_dict(module, o) to `path` (atomically, io::write_state_dict).
void save_pytorch_weights(const Module& module, const std::string& path, const PyTorchExportOptions& o = {});

}  // namespace kiln::nn
