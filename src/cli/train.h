#pragma once
// `kiln train` and `kiln resume`: the training loop with its run directory
// (config.toml, metrics.jsonl, checkpoints/, summary.json, report.html),
// progress display, periodic evaluation and checkpoints, and the graceful stop
// on SIGINT/SIGTERM.
#include <filesystem>
#include <string>
#include <vector>

#include "cli/config.h"
#include "kiln/dist/process_group.h"

namespace kiln::cli {

/// Trains `config` into `run_dir` (which must not already hold a run). Returns
/// the exit code. With a `group` (an MPI launch, dist::world()) every rank of
/// it calls this: data-parallel training, rank 0 writing the run directory
/// (Note [Data-parallel runs] in train.cpp, docs/distributed.md).
int train(const Config& config, const std::filesystem::path& run_dir, const std::string& config_path,
          dist::ProcessGroupPtr group = nullptr);

struct ResumeOptions {
  /// --set overrides; each takes effect or is refused (Config::on_resume,
  /// docs/config.md). train.max_steps is cleared unless set again.
  std::vector<std::string> sets;
  /// Continue although the process count differs from the one the checkpoint
  /// was trained with: the future then differs from the uninterrupted run's,
  /// and a warning says so. (A different thread count is only noted.)
  bool allow_world_size_change = false;
};

/// Continues the run in `run_dir` from its latest checkpoint with the same
/// future it would have had uninterrupted (unless a --set changes it on
/// purpose). Returns the exit code. With a `group`, every rank loads the
/// checkpoint rank 0 chose.
int resume(const std::filesystem::path& run_dir, const ResumeOptions& options, dist::ProcessGroupPtr group = nullptr);

}  // namespace kiln::cli
