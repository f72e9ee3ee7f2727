#pragma once
// Reading back what `kiln train --profile` wrote into RUN_DIR/profile/
// (cli/profile_run.h): `kiln profile RUN_DIR` prints the op table and the
// per-step breakdown again, sorted as asked, and report.html's "Profile"
// section shows them. No re-run: only the files are read.
#include <cstddef>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kiln::cli {

/// One row of ops.json, with the fields the table shows (absent ones 0 or "").
struct OpRow {
  std::string name, kind, input_shapes;
  int64_t calls = 0;
  double self_us = 0, total_us = 0, flops = 0, gflops_per_s = 0;
  int64_t bytes = 0, alloc_bytes = 0;
};

/// One entry of steps.json (ms).
struct StepRow {
  int64_t step = 0;
  double total_ms = 0, data_ms = 0, forward_ms = 0, backward_ms = 0, optimizer_ms = 0, comm_exposed_ms = 0,
         other_ms = 0;
};

struct ProfileFiles {
  std::filesystem::path dir;  // RUN_DIR/profile
  std::vector<OpRow> ops;
  std::vector<StepRow> steps;
  int world_size = 1;
  std::optional<nlohmann::json> memory;  // memory.json, when present and readable
  std::vector<std::string> problems;     // files missing or malformed (what is there is still shown)
};

/// RUN_DIR/profile's files, or nullopt when the run has no profile (no
/// profile/ops.json). Unreadable or malformed files are named in `problems`.
std::optional<ProfileFiles> read_profile(const std::filesystem::path& run_dir);

/// The sort keys `kiln profile --sort` takes.
inline constexpr const char* kProfileSortKeys = "self, total, calls or flops";

/// Rows in descending order of `key` (self, total, calls, flops); a ConfigError names the keys otherwise.
void sort_ops(std::vector<OpRow>& rows, const std::string& key);

/// The op table as text: the first `top` rows (0: all), their share of the summed self time, and a total line.
std::string format_ops(const std::vector<OpRow>& rows, size_t top);

/// The per-step breakdown as text: one line per step and their mean.
std::string format_steps(const std::vector<StepRow>& steps);

/// `kiln profile RUN_DIR [--sort KEY] [--top N]`: exit status 0; a run without a profile is a ConfigError.
int profile_command(const std::filesystem::path& run_dir, const std::string& sort, int64_t top);

}  // namespace kiln::cli
