#pragma once
// `kiln train` and `kiln resume`: the training loop with its run directory
// (config.toml, metrics.jsonl, checkpoints/, summary.json, report.html),
// progress display, periodic evaluation and checkpoints, and the graceful stop
// on SIGINT/SIGTERM.
#include <filesystem>

#include "cli/config.h"

namespace kiln::cli {

/// Trains `config` into `run_dir` (which must not already hold a run). Returns the exit code.
int train(const Config& config, const std::filesystem::path& run_dir, const std::string& config_path);

/// Continues the run in `run_dir` from its latest checkpoint with the same
/// future it would have had uninterrupted. `sets` are --set overrides (e.g.
/// train.max_steps); train.max_steps is cleared unless set again. Returns the exit code.
int resume(const std::filesystem::path& run_dir, const std::vector<std::string>& sets);

}  // namespace kiln::cli
