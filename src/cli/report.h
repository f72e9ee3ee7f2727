// The run report: one self-contained report.html per run directory that tells
// the run's story: how it ended (completed, paused, interrupted, stopped on
// NaN, still running) and where it was resumed, a summary block, the charts a
// person looks at after training (loss with the eval points, test accuracy,
// learning rate, throughput, data wait, gradient norm, memory by category)
// drawn as inline SVG in a grid as wide as the page, the profile of a run
// trained with --profile (its op table and per-step breakdown), and the
// resolved config.
// No network: it opens anywhere, offline; its one small script only reloads
// the report of a run in progress.
#pragma once

#include <filesystem>

namespace kiln::cli {

/// Reads run_dir/config.toml (shown as text), run_dir/metrics.jsonl (train and
/// eval lines, and the start/resume/nonfinite/end records of Note [Run story]
/// in train.cpp) and run_dir/summary.json, and writes run_dir/report.html atomically (a temporary
/// file renamed over it). Missing files or fields, a partial last line (a run
/// killed mid-write) or malformed lines still give a report, which says what
/// was missing or skipped; throws kiln::IOError only when run_dir does not
/// exist or the report cannot be written.
void write_report(const std::filesystem::path& run_dir);

}  // namespace kiln::cli
