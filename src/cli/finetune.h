#pragma once
// Fine-tuning in `kiln train` (issue 23): a run that starts from weights
// someone trained (`init_from`), trains LoRA adapters instead of the whole model
// (a `[lora]` table), optionally over an NF4-quantized frozen base (QLoRA,
// lora.quantize = "nf4"), and accumulates gradients over micro-batches
// (train.grad_accum_steps). docs/config.md documents the keys.
//
// Why `kiln train` with a `[lora]` table rather than a `kiln finetune` command:
// fine-tuning is training from another starting point with fewer trainable
// parameters; the data, optimizer, schedule, checkpoints, resume, eval, sample
// and report are the same, and the resolved config rebuilds the adapters'
// structure, so `kiln resume`, `kiln eval` and `kiln sample` work on a LoRA
// run with no change. A second command would have to repeat all of that.
#include <cstdint>
#include <filesystem>
#include <string>

#include "cli/config.h"
#include "cli/task.h"
#include "kiln/data/dataset.h"
#include "kiln/nn/module.h"

namespace kiln::cli {

/// What prepare_model did, for the run's first lines.
struct FinetuneSummary {
  std::string init;       // "" or "init_from runs/x (ckpt-...): 51 tensors" plus any key report
  int64_t trainable = 0;  // parameters that train
  int64_t total = 0;      // all parameters, NF4 weights counted by their element count
  bool lora = false;
};

/// The model side of fine-tuning, applied right after the model is built:
/// with `load_init`, copies init_from's weights in (a run directory's latest
/// usable checkpoint, a kiln checkpoint file, or a safetensors state dict with
/// PyTorch's names; init_strict = false reports missing and unexpected keys
/// instead of refusing); then, with lora.rank > 0, stores the targets' base
/// weights as NF4 when lora.quantize = "nf4" and wraps them with LoRA adapters,
/// freezing everything else. Without load_init (eval, sample, a resume's
/// checkpoint will overwrite the weights) only the structure is built.
/// ConfigError for a bad init_from or target, naming the key's origin.
FinetuneSummary prepare_model(const Config& config, nn::Module& model, bool load_init);

/// The summary as the run's first lines say it ("" when there is nothing to say).
std::string finetune_note(const FinetuneSummary& s);

/// Settings that do not work together (lora with dist.strategy zero3, grad
/// accumulation with zero2, quantize without LoRA); ConfigError naming them.
void check_finetune_config(const Config& config, bool distributed);

/// Optimizer steps of a run of train.epochs epochs of `batches` batches each,
/// with train.grad_accum_steps batches per step (at least 1).
int64_t steps_for_epochs(const Config& config, int64_t batches);

/// Forward and backward of one of the k micro-batches of a step: the loss divided
/// by k when k > 1 (so the accumulated gradient is that of the mean over all k),
/// scaled by the task's GradScaler when it has one. Returns the loss before the
/// division. No data-parallel scope: the caller chooses.
Tensor micro_batch_backward(Task& task, const data::Example& batch, int64_t k);

/// One micro-batch of a step that accumulates k > 1 of them, not the last one:
/// forward, the loss divided by k (so the accumulated gradient is that of the
/// mean over all k micro-batches), backward without data-parallel
/// communication (DDP's and FSDP's no_sync: the last micro-batch's backward
/// reduces the sum once). Returns the micro-batch's loss before the division.
double accumulate_micro_batch(Task& task, const data::Example& batch, int64_t k);

/// A LoRA run's adapter as Hugging Face PEFT stores it (adapter_model.safetensors
/// and adapter_config.json) under `dir`, read from the model's own adapter
/// parameters; nothing for a run without lora.
void save_run_adapter(const Config& config, const nn::Module& model, const std::filesystem::path& dir);

}  // namespace kiln::cli
