#pragma once
// `kiln doctor RUN_DIR`: reads what a run left behind (config.toml,
// metrics.jsonl with its train, eval, health and warning lines, summary.json,
// checkpoints/) and says what went wrong or is going wrong, for the failures
// that raise no error as much as for those that stopped the run. Each finding
// has a severity, its evidence (steps, values, module names) and the fix that
// usually works. docs/diagnostics.md lists every finding.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kiln::cli {

enum class Severity { Info = 0, Warning = 1, Error = 2 };

const char* severity_name(Severity s);

struct Finding {
  Severity severity = Severity::Info;
  std::string code;      // stable identifier: "nan", "divergence", "no_grad", ... (docs/diagnostics.md)
  std::string title;     // one line: what is wrong
  std::string evidence;  // the numbers it rests on
  std::string fix;       // what usually cures it
  int64_t step = -1;     // the first step it concerns (-1: the whole run)
};

/// Every finding about the run in `run_dir`, most severe first (then by step).
/// Throws ConfigError when `run_dir` holds no run (no metrics.jsonl).
std::vector<Finding> diagnose(const std::filesystem::path& run_dir);

/// The findings as `kiln doctor` prints them, one block each (severity, code, title, evidence, fix).
std::string format_findings(const std::vector<Finding>& findings);

/// Prints diagnose()'s findings (as JSON with `json`); exit code 0, or 1 when
/// a finding is an error (so a script can gate on it).
int doctor_command(const std::filesystem::path& run_dir, bool json);

}  // namespace kiln::cli
