#pragma once
// `kiln scenario list|run NAME`: the anomaly gallery. Each scenario reproduces
// one classic training failure in seconds and shows what kiln says about it:
// config scenarios (examples/scenarios/NAME.toml) train with `kiln train` and
// are read by `kiln doctor`; program scenarios (cli/scenario_programs.cpp)
// make the mistake in a few lines of C++ against the library and show its
// error, warning or doctor finding. docs/diagnostics.md is the catalogue.
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"

namespace kiln::cli {

struct Scenario {
  std::string name;
  std::string kind;     // "config" or "program"
  std::string symptom;  // what the user sees
  /// What kiln's diagnosis must contain for it to name the cause: doctor finding codes
  /// ("[divergence]") or a phrase of the error or warning; any one suffices.
  std::vector<std::string> expect;
  std::filesystem::path config;  // config scenarios
  /// Program scenarios: makes the mistake in `work_dir`; returns what kiln said.
  std::function<std::string(const std::filesystem::path& work_dir)> program;
};

/// The program scenarios, in gallery order.
std::vector<Scenario> program_scenarios();

/// Every scenario: those of `dir` (examples/scenarios/*.toml, their header says
/// symptom and expect) and the program scenarios, by name.
std::vector<Scenario> all_scenarios(const std::filesystem::path& dir);

/// The examples/scenarios directory: `dir` when given, else ./examples/scenarios, else the
/// source tree's next to the executable (build/<preset>/bin/kiln).
std::filesystem::path scenarios_dir(const std::filesystem::path& dir);

/// `kiln scenario rank NAME` under `kiln launch -n 2`: one rank of a data-parallel
/// scenario (the scenario itself launches the job and shows what it printed).
int scenario_rank(const std::string& name, dist::ProcessGroupPtr group);

/// `kiln scenario list` / `kiln scenario run NAME`: exit 0 when kiln's diagnosis
/// names the cause, 1 when it does not (the gallery's own test), 2 for an unknown name.
int scenario_command(const std::string& action, const std::string& name, const std::filesystem::path& dir,
                     const std::filesystem::path& out);

}  // namespace kiln::cli
