#pragma once
// report.html's "Profile" section, for a run trained with --profile
// (cli/profile_run.h): the op table (the top ops by self time) and the
// per-step breakdown as stacked bars, drawn as the report's other charts are
// (same frame, ticks and legend; cli/report_chart.h).
#include <filesystem>
#include <ostream>
#include <vector>

#include "cli/profile_files.h"

namespace kiln::cli::report_detail {

/// Rows of the op table in the report.
inline constexpr size_t kProfileTopOps = 15;

/// The colour of each breakdown category in the stacked bars, in stacking
/// order from the bottom: data, forward, backward, optimizer, exposed
/// communication, other.
inline constexpr int kStepCategories = 6;
const char* step_category_name(int i);
const char* step_category_colour(int i);

/// The per-step breakdown as an <svg> of stacked bars, one bar per step.
std::string render_step_bars(const std::vector<StepRow>& steps);

/// The section (an <h2> and its content) when run_dir/profile/ holds a
/// profile; nothing otherwise.
void render_profile_section(std::ostream& o, const std::filesystem::path& run_dir);

}  // namespace kiln::cli::report_detail
