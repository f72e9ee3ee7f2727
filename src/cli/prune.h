// `kiln prune RUN_DIR --sparsity S | --channels C`: magnitude pruning of a
// run's image model (quant/prune.h), a short fine-tune on the training split
// with the pruned weights held at zero, test accuracy before and after, and
// the pruned model written beside the run as a checkpoint `kiln eval` reads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace CLI {
class App;
}

namespace kiln::cli {

struct PruneOptions {
  std::filesystem::path target;
  std::string checkpoint;
  double sparsity = -1;     // unstructured: the share of each layer's weights set to zero (-1: not asked)
  double channels = -1;     // structured: the share of channels taken out (-1: not asked)
  bool global = false;      // unstructured: one magnitude threshold over all layers
  int64_t bn_batches = 50;  // BatchNorm statistics re-estimated after pruning (models with BatchNorm)
  int64_t finetune_steps = 300;
  double lr = 0;             // 0: a tenth of the run's optim.lr
  std::string out;           // default: RUN_DIR/model.pruned.safetensors
  int64_t eval_batches = 0;  // 0: the whole test split
  int64_t bench_batch = 64;
  int64_t bench_iters = 30;
};

/// Registers the subcommand and its options on `app`.
CLI::App* add_prune_command(CLI::App& app, PruneOptions& o);
int prune_command(const PruneOptions& o);

}  // namespace kiln::cli
