// LoRA adapter directories in Hugging Face PEFT's layout (DESIGN.md §7):
//
//   DIR/adapter_model.safetensors  only the adapter tensors, named
//                                  "base_model.model.<module path>.lora_A.weight" [r, in]
//                                  "base_model.model.<module path>.lora_B.weight" [out, r]
//   DIR/adapter_config.json        {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
//                                   "lora_dropout": 0.05, "target_modules": [...],
//                                   "bias": "none", "fan_in_fan_out": false, ...}
//                                  plus, when "bias" is "all" or "lora_only", the trained
//                                  biases as "base_model.model.<parameter name>" (1-D)
//
// so that the files are recognisable to that ecosystem (PEFT's
// PeftModel.from_pretrained reads them). The format lives in io because it is
// a file format; nn::lora::Lora::save/load map it onto a model.
//
// Readers treat both files as hostile: the JSON must parse and hold the keys
// with the right types and ranges, every tensor name must have PEFT's form,
// every tensor must be a 2-D float tensor whose rank dimension equals r, and
// every module must have both its A and its B; each problem is a FormatError
// naming the file and the entry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/io/safetensors.h"

namespace kiln::io {

/// The adapter_config.json fields kiln reads and writes (PEFT's LoraConfig names).
struct PeftLoraConfig {
  int64_t r = 8;
  double lora_alpha = 16;
  double lora_dropout = 0.0;
  /// PEFT matches each entry against module paths by equality or as a dotted suffix.
  std::vector<std::string> target_modules;
  /// Where the base model came from (informational; PEFT's field).
  std::string base_model_name_or_path;
  /// Which biases the adapter trained and carries: "none", "all" or "lora_only"
  /// (PEFT's meaning); with "all" or "lora_only" the file also holds tensors
  /// "base_model.model.<parameter name ending in .bias>", 1-D.
  std::string bias = "none";
};

/// One adapter: its config and tensors (PEFT's names, in file order).
struct PeftAdapter {
  PeftLoraConfig config;
  NamedTensors tensors;
};

/// "base_model.model." + path + ".lora_A.weight" (which = "A") or ".lora_B.weight" ("B").
std::string peft_lora_key(const std::string& module_path, char which);
/// The module path of a PEFT LoRA tensor name, or "" when `key` does not have that form;
/// `which` receives 'A' or 'B'.
std::string peft_lora_module(const std::string& key, char* which = nullptr);
/// The parameter name of a PEFT bias tensor name ("base_model.model.<name>" with
/// <name> ending in ".bias" and not an adapter tensor), or "" when `key` is not one.
std::string peft_bias_parameter(const std::string& key);

/// Writes DIR/adapter_model.safetensors and DIR/adapter_config.json (creating
/// DIR), each atomically. ValueError for a tensor name not of PEFT's form.
void save_peft_adapter(const std::string& dir, const PeftAdapter& adapter);
/// Reads and validates both files (see the header comment). IOError when a
/// file cannot be read, FormatError when its contents are not a LoRA adapter.
PeftAdapter load_peft_adapter(const std::string& dir);
/// The config part of load_peft_adapter, from JSON text (`source` names it in errors).
PeftLoraConfig parse_peft_lora_config(const std::string& json_text, const std::string& source);

}  // namespace kiln::io
