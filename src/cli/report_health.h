#pragma once
// report.html's charts of the health lines (cli/health_log.h): one chart per
// family, one line per module, layer or block.
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/report_chart.h"

namespace kiln::cli::report_detail {

/// Gradient norm and update-to-weight ratio by module, dead units by layer,
/// activation and gradient RMS by block, parameters without a gradient. A
/// family the records do not have is left out; with many modules, at most ten
/// evenly spread ones are drawn (first and last among them). Ratios and RMS
/// span decades: they are drawn as log10.
std::vector<Chart> health_charts(const std::vector<nlohmann::json>& health);

/// A data-parallel run's per-rank step times (train lines' "ranks", cli/step_skew.h): each rank's own
/// work per step (busy_ms), one line per rank (at most ten); none without such lines.
std::vector<Chart> rank_charts(const std::vector<nlohmann::json>& train);

}  // namespace kiln::cli::report_detail
