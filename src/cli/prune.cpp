// `kiln prune` (src/cli/prune.h).
#include "cli/prune.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "cli/commands.h"
#include "cli/quantize.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/threads.h"
#include "kiln/data/loader.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/norm.h"
#include "kiln/quant/prune.h"

namespace kiln::cli {
namespace fs = std::filesystem;

CLI::App* add_prune_command(CLI::App& app, PruneOptions& o) {
  auto* p = app.add_subcommand("prune",
                               "Prune a run's image model (zero the smallest weights, or take out whole channels), "
                               "fine-tune it briefly and print test accuracy before and after");
  p->add_option("target", o.target, "Run directory or checkpoint file")->required();
  p->add_option("--checkpoint", o.checkpoint, "Of a run directory: latest (default), best or a step");
  p->add_option("--sparsity", o.sparsity,
                "Unstructured: the fraction of every Conv2d/Linear weight set to zero (smallest |w| first)");
  p->add_option("--channels", o.channels,
                "Structured: the fraction of channels taken out (lowest L1 norm) of cnn's conv1, conv2, fc1 or of "
                "each resnet block's inner channels; the layers shrink");
  p->add_flag("--global", o.global, "With --sparsity: one magnitude threshold over all layers together");
  p->add_option("--finetune-steps", o.finetune_steps, "Training steps after pruning (0: none)")->capture_default_str();
  p->add_option("--lr", o.lr, "Fine-tuning learning rate (default: a tenth of the run's optim.lr)");
  p->add_option("--bn-batches", o.bn_batches,
                "Training batches that re-estimate BatchNorm's running statistics after pruning (0: keep them)")
      ->capture_default_str();
  p->add_option("--out", o.out, "Where the pruned model goes (default: RUN_DIR/model.pruned.safetensors)");
  p->add_option("--eval-batches", o.eval_batches, "Test batches to evaluate (0: all)")->capture_default_str();
  p->add_option("--bench-batch", o.bench_batch, "Batch size of the timed inference")->capture_default_str();
  p->add_option("--bench-iters", o.bench_iters, "Timed forward passes")->capture_default_str();
  return p;
}

namespace {

void fine_tune(Task& task, const Config& config, int64_t steps, double lr) {
  Config c = config;
  char assignment[64];
  std::snprintf(assignment, sizeof assignment, "optim.lr=%.9g", lr);
  c.set(assignment);
  auto optimizer = make_optimizer(c, *task.model);
  data::DataLoader<> loader(task.train_set,
                            {.batch_size = config.integer("data.batch_size"), .shuffle = true, .seed = 1});
  task.model->train();
  int64_t step = 0;
  double loss_sum = 0;
  while (step < steps) {
    for (auto& batch : loader) {
      if (step >= steps) break;
      optimizer->zero_grad();
      Tensor loss = batch_loss(task, batch);
      loss.backward();
      optimizer->step();
      loss_sum += loss.item<double>();
      if (++step % 100 == 0 || step == steps) {
        std::printf("  fine-tune step %lld/%lld  loss %.4f\n", static_cast<long long>(step),
                    static_cast<long long>(steps), loss_sum / static_cast<double>(step % 100 ? step % 100 : 100));
        loss_sum = 0;
      }
    }
  }
  task.model->eval();
}

// Pruning changes what every BatchNorm after a pruned layer sees, and its
// running statistics still describe the dense model (a 25 % channel cut of the
// resnet read 17.6 % test accuracy with them, before any fine-tuning). They are
// re-estimated from `batches` training batches in training mode (momentum 0.1
// leaves 0.9^batches of the old value), without gradients: no weight moves.
bool recalibrate_batchnorm(Task& task, const Config& config, int64_t batches) {
  bool any = false;
  for (auto& [path, m] : task.model->named_modules()) any |= dynamic_cast<nn::BatchNorm*>(m) != nullptr;
  if (!any || batches == 0) return false;
  data::DataLoader<> loader(task.train_set,
                            {.batch_size = config.integer("data.batch_size"), .shuffle = true, .seed = 2});
  const NoGradGuard no_grad;
  task.model->train();
  int64_t n = 0;
  while (n < batches)
    for (auto& batch : loader) {
      if (n++ >= batches) break;
      (*task.model)(batch.data);
    }
  task.model->eval();
  return true;
}

void print_sparsity(nn::Module& model) {
  int64_t zeros = 0, n = 0;
  std::printf("%-24s %12s %10s\n", "layer", "weights", "sparsity");
  for (const auto& l : quant::weight_sparsity(model)) {
    std::printf("%-24s %12lld %9.2f%%\n", l.layer.c_str(), static_cast<long long>(l.numel), 100 * l.fraction());
    zeros += l.zeros;
    n += l.numel;
  }
  std::printf("%-24s %12lld %9.2f%%\n", "all", static_cast<long long>(n),
              n ? 100.0 * static_cast<double>(zeros) / static_cast<double>(n) : 0.0);
}

}  // namespace

int prune_command(const PruneOptions& o) {
  const bool unstructured = o.sparsity >= 0, structured = o.channels >= 0;
  if (unstructured == structured)
    throw ConfigError("kiln prune expects one of --sparsity S (unstructured) or --channels C (structured)");
  if (unstructured && !(o.sparsity <= 1.0))
    throw ConfigError("--sparsity expects a fraction in [0, 1], got " + std::to_string(o.sparsity));
  if (structured && !(o.channels < 1.0))
    throw ConfigError("--channels expects a fraction in [0, 1), got " + std::to_string(o.channels));
  if (o.global && !unstructured) throw ConfigError("--global goes with --sparsity");
  if (o.bn_batches < 0) throw ConfigError("--bn-batches expects 0 or more");
  if (o.finetune_steps < 0) throw ConfigError("--finetune-steps expects 0 or more");
  if (o.lr < 0 || !std::isfinite(o.lr)) throw ConfigError("--lr expects a positive learning rate");
  if (o.bench_batch < 1 || o.bench_iters < 1) throw ConfigError("--bench-batch and --bench-iters expect at least 1");
  const fs::path ckpt = checkpoint_of(o.target, o.checkpoint);
  auto [config, task] = load_for_eval(ckpt);
  if (task.gpt)
    throw ConfigError(ckpt.string() +
                      ": kiln prune covers image models (Conv2d and Linear layers); the language "
                      "model is not covered yet");
  if (structured) {
    try {
      quant::channel_counts(*task.model);
    } catch (const ValueError& e) {
      throw ConfigError(std::string("--channels: ") + e.what() + " (--sparsity works on any model's layers)");
    }
  }
  auto [config_d, task_d] = load_for_eval(ckpt);  // the dense model, kept for the timing

  const EvalResult dense = evaluate(task, config, "test", o.eval_batches);
  std::printf("dense:      test accuracy %.2f%% (loss %.4f, %lld samples), %lld parameters\n", 100 * dense.accuracy,
              dense.loss, static_cast<long long>(dense.samples), static_cast<long long>(task.model->num_parameters()));

  std::string what;
  char buf[96];
  if (unstructured) {
    std::vector<std::pair<nn::Module*, std::string>> params;
    for (auto& [path, m] : quant::prunable_layers(*task.model)) params.emplace_back(m, "weight");
    if (o.global) {
      quant::global_unstructured(params, o.sparsity);
    } else {
      for (auto& [m, name] : params) quant::l1_unstructured(*m, name, o.sparsity);
    }
    std::snprintf(buf, sizeof buf, "unstructured L1, %s, sparsity %g", o.global ? "global" : "per layer", o.sparsity);
  } else {
    const auto before = quant::channel_counts(*task.model);
    const auto after = quant::prune_channels(*task.model, o.channels);
    std::printf("channels (of %g taken out):", o.channels);
    for (const auto& [unit, n] : after)
      std::printf(" %s %lld->%lld", unit.c_str(), static_cast<long long>(before.at(unit)), static_cast<long long>(n));
    std::printf("\n");
    std::snprintf(buf, sizeof buf, "channels L1, fraction %g", o.channels);
  }
  what = buf;
  if (recalibrate_batchnorm(task, config, o.bn_batches))
    std::printf("BatchNorm running statistics re-estimated over %lld training batches\n",
                static_cast<long long>(o.bn_batches));
  const EvalResult pruned = evaluate(task, config, "test", o.eval_batches);
  std::printf("pruned:     test accuracy %.2f%% (loss %.4f), %+.2f points, %lld parameters (%s)\n",
              100 * pruned.accuracy, pruned.loss, 100 * (pruned.accuracy - dense.accuracy),
              static_cast<long long>(task.model->num_parameters()), what.c_str());

  EvalResult tuned = pruned;
  if (o.finetune_steps > 0) {
    const double lr = o.lr > 0 ? o.lr : config.number("optim.lr") / 10;
    std::printf("fine-tuning %lld steps on the training split, %s lr %g:\n", static_cast<long long>(o.finetune_steps),
                config.string("optim.name").c_str(), lr);
    fine_tune(task, config, o.finetune_steps, lr);
    tuned = evaluate(task, config, "test", o.eval_batches);
    std::printf("fine-tuned: test accuracy %.2f%% (loss %.4f), %+.2f points from dense\n", 100 * tuned.accuracy,
                tuned.loss, 100 * (tuned.accuracy - dense.accuracy));
  }
  quant::remove_all(*task.model);  // the zeros become the weights; masks and hooks go
  print_sparsity(*task.model);

  if (structured) {
    data::DataLoader<> loader(task.eval_set, {.batch_size = o.bench_batch, .seed = 0});
    const Tensor x = (*loader.begin()).data.contiguous();
    const auto [td, tp] = time_forward(*task_d.model, *task.model, x, o.bench_iters);
    std::printf(
        "inference at 1 thread, batch %lld, %lld runs: median dense %.3f ms, pruned %.3f ms, %.2fx; "
        "best dense %.3f ms, pruned %.3f ms, %.2fx\n",
        static_cast<long long>(x.size(0)), static_cast<long long>(o.bench_iters), td.median_ms, tp.median_ms,
        td.median_ms / tp.median_ms, td.best_ms, tp.best_ms, td.best_ms / tp.best_ms);
  }

  const fs::path out = o.out.empty() ? (fs::is_directory(o.target) ? o.target / "model.pruned.safetensors"
                                                                   : ckpt.parent_path() / "model.pruned.safetensors")
                                     : fs::path(o.out);
  const auto header = io::read_safetensors_header(ckpt.string());
  io::Metadata md{{"config", header.metadata.at("config")},
                  {"kiln.pruned", what},
                  {"source", ckpt.string()},
                  {"finetune_steps", std::to_string(o.finetune_steps)}};
  if (header.metadata.count("step")) md["step"] = header.metadata.at("step");
  if (structured) md[quant::kPrunedChannelsKey] = quant::channel_counts_json(quant::channel_counts(*task.model));
  io::NamedTensors tensors;
  for (auto& [name, t] : task.model->state_dict()) tensors.emplace_back("model." + name, t.contiguous());
  io::save_safetensors(out.string(), tensors, md);
  std::printf("wrote %s\n", out.string().c_str());

  // Read back as `kiln eval` reads it: the same accuracy and loss, or the file is wrong.
  auto [config_r, task_r] = load_for_eval(out);
  const EvalResult reloaded = evaluate(task_r, config_r, "test", o.eval_batches);
  const bool same = reloaded.accuracy == tuned.accuracy && reloaded.loss == tuned.loss;
  std::printf("reloaded %s: test accuracy %.2f%% (loss %.4f)%s\n", out.filename().string().c_str(),
              100 * reloaded.accuracy, reloaded.loss, same ? ", as the pruned model" : ", DIFFERENT");
  if (!same) throw ValueError("kiln prune: " + out.string() + " does not reload into the model that wrote it");
  return 0;
}

}  // namespace kiln::cli
