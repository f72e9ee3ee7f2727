// nn::lora: low-rank adapters (LoRA, Hu et al. 2021) on a model's Linear modules.
//
// A frozen Linear W (out × in) learns a low-rank update ΔW = (α / r) · B · A with
// A: r × in and B: out × r, r much smaller than in and out. Fine-tuning changes of
// a pretrained model have low "intrinsic rank", so r = 4..16 recovers most of what
// updating W would, with r (in + out) trainable numbers instead of in · out.
//
//   auto lora = nn::lora::apply(model, {.targets = {"attn.c_attn", "attn.c_proj", "mlp.*"},
//                                       .rank = 8, .alpha = 16, .dropout = 0.05});
//   optim::AdamW opt(lora.trainable_parameters(), {...});  // state only for A and B
//   ... train ...
//   lora.merge();    // W += (α/r) B A: inference at the base model's cost
//   lora.unmerge();  // W -= (α/r) B A: back to training the adapter
//
// Targets are patterns on module paths (named_modules' dotted names): a pattern
// matches a path when its dot-separated components equal the path's last ones,
// '*' and '?' matching within one component ("c_attn" matches
// "transformer.h.0.attn.c_attn"; "mlp.*" matches "...mlp.c_fc" and
// "...mlp.c_proj"), so a plain name behaves as a Hugging Face PEFT
// target_modules entry. Only nn::Linear modules (and subclasses, such as
// quant's NF4 Linear) are wrapped; a pattern that matches none is an error.
//
// The adapters are registered inside each wrapped Linear as PEFT lays them out,
// so named_parameters() shows "<path>.lora_A.<adapter>.weight" and
// "<path>.lora_B.<adapter>.weight" (both bias-free Linear modules) and the base
// keeps "<path>.weight". The wrapped Linear's forward is unchanged; a forward
// hook adds B(A(dropout(x))) · α / r to its output, so any model whose parents
// call their Linear children (GPT, ViT, Sequential, ...) takes adapters without
// being rewritten. A starts Kaiming-uniform (a = √5, nn::Linear's default, as
// PEFT) and B at zeros: a fresh adapter leaves the model's outputs exactly as
// they were.
//
// apply() freezes every parameter of the model (requires_grad = false) and makes
// only the active adapter's A and B trainable (and the biases its Options::bias names). Several named adapters may live
// side by side (add_adapter); set_adapter chooses which one runs and trains.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/nn/layers.h"
#include "kiln/nn/module.h"

namespace kiln::nn::lora {

struct Options {
  /// Module-path patterns (see above); at least one.
  std::vector<std::string> targets;
  int64_t rank = 8;
  /// The update is scaled by alpha / rank, so changing the rank does not change
  /// the scale of the initial updates (the LoRA paper's choice).
  double alpha = 16;
  /// Dropout on the adapter's input (training mode only); 0: none.
  double dropout = 0.0;
  /// The adapter's name ("default", as PEFT's first adapter).
  std::string name = "default";
  /// Which biases train with the adapter, as PEFT's LoraConfig.bias: "none";
  /// "all", every parameter of the model whose last name component is "bias"
  /// (LayerNorms' included); "lora_only", the wrapped Linears' biases. They
  /// count as the adapter's trainable parameters and are saved and loaded with
  /// it. Unlike A and B they are the base model's own tensors: disabling or
  /// switching the adapter does not undo what they learned (as in PEFT).
  std::string bias = "none";
};

/// Whether module path `path` matches target `pattern` (see the header comment).
bool matches(std::string_view pattern, std::string_view path);

/// The model's parameters that require grad, by name: what to build an
/// optimizer over after freezing, so that frozen weights get no state.
NamedTensors trainable_parameters(const Module& model);

class Lora;
/// Wraps the Linear modules of `model` that `options.targets` match with an
/// adapter called options.name, freezes everything else and returns the handle
/// through which the adapters are merged, switched, saved and loaded. ValueError
/// when a target matches no Linear, when an exact (glob-free) target names a
/// module that is not a Linear, or when the model already carries adapters of
/// another apply() (add them through that handle).
Lora apply(Module& model, const Options& options);

/// The adapters of one model (a handle: copies share the same adapters).
class Lora {
 public:
  /// Adds another named adapter (its own targets, rank, alpha, dropout). The
  /// active adapter is unchanged; the new one is frozen until set_adapter.
  void add_adapter(const Options& options);
  /// Makes `name` the adapter that runs in forward and the only one that trains.
  /// Refused while merged (unmerge first), and for an unknown name.
  void set_adapter(const std::string& name);
  const std::string& active_adapter() const;
  std::vector<std::string> adapter_names() const;
  const Options& options(const std::string& name) const;

  /// Folds the active adapter into each wrapped base weight (W += α/r · B·A,
  /// without gradient); forward then skips the adapter. Refused for a layer whose
  /// base weight is tied to another module's (it would change both) or that has
  /// no float weight (a quantized base).
  void merge();
  /// Takes the merged adapter out again (W -= α/r · B·A); W comes back within
  /// float32 rounding of its value before merge().
  void unmerge();
  bool merged() const;
  /// While disabled, forward skips every adapter: the base model's outputs.
  void set_enabled(bool on);

  /// The wrapped modules' paths, in model order.
  std::vector<std::string> target_paths() const;
  /// The active adapter's parameters (A and B of every layer that has it, then
  /// the biases its Options::bias trains), with their names in the model: the
  /// optimizer's parameters.
  NamedTensors trainable_parameters() const;
  /// Elements of adapter `name`'s A, B and trained biases (the active one when empty).
  int64_t num_parameters(const std::string& name = {}) const;

  /// Adapter `name` (active when empty) under PEFT's file names:
  /// "base_model.model.<path>.lora_A.weight", "...lora_B.weight", and for its
  /// trained biases "base_model.model.<parameter name>" (detached aliases).
  NamedTensors adapter_state_dict(const std::string& name = {}) const;
  /// Copies tensors named as adapter_state_dict into adapter `name`. Every
  /// missing, unexpected or wrongly shaped tensor is named in one ValueError
  /// before anything is copied.
  void load_adapter_state_dict(const NamedTensors& tensors, const std::string& name = {});

  /// Writes adapter `name` (active when empty) to directory `dir` as Hugging
  /// Face PEFT does: adapter_model.safetensors and adapter_config.json
  /// (peft_type "LORA", r, lora_alpha, lora_dropout, target_modules as the
  /// wrapped modules' full paths, which PEFT's suffix matching reads exactly).
  void save(const std::string& dir, const std::string& name = {}) const;
  /// Reads a PEFT LoRA adapter directory into a new adapter `name` (the file's
  /// own config gives rank, alpha, dropout and targets) and makes it active.
  /// Every target the model lacks and every tensor whose shape differs from
  /// the model's module is named in one ValueError; nothing is added then.
  void load(const std::string& dir, const std::string& name);

  struct Impl;

 private:
  friend Lora apply(Module& model, const Options& options);
  explicit Lora(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace kiln::nn::lora
