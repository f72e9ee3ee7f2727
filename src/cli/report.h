// The run report: one self-contained report.html per run directory, with the
// charts a person looks at after training (loss, learning rate, throughput,
// data wait, memory by category) drawn as inline SVG, the final metrics and
// the resolved config. No JavaScript, no network: it opens anywhere, offline.
#pragma once

#include <filesystem>

namespace kiln::cli {

/// Reads run_dir/config.toml (shown as text), run_dir/metrics.jsonl and
/// run_dir/summary.json, and writes run_dir/report.html atomically (a temporary
/// file renamed over it). Missing files or fields, a partial last line (a run
/// killed mid-write) or malformed lines still give a report, which says what
/// was missing or skipped; throws kiln::IOError only when run_dir does not
/// exist or the report cannot be written.
void write_report(const std::filesystem::path& run_dir);

}  // namespace kiln::cli
