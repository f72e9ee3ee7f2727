// StepSkew (cli/step_skew.h).
#include "cli/step_skew.h"

#include <algorithm>

#include "kiln/core/guards.h"
#include "kiln/kiln.h"

namespace kiln::cli {

nlohmann::json StepSkew::window(int64_t steps, double window_s, double data_wait_s) {
  const double per = steps > 0 ? 1e3 / static_cast<double>(steps) : 0;
  const int n = group_->size();
  Tensor mine = tensor<float>(
      {static_cast<float>(window_s * per), static_cast<float>(wait_s_ * per), static_cast<float>(data_wait_s * per)});
  Tensor all = zeros({static_cast<int64_t>(n) * 3});
  {
    dist::CollectiveLabel label("kiln train: per-rank step times");
    group_->allgather_into_tensor(all, mine)->wait();
  }
  wait_s_ = 0;
  const float* a = all.data_ptr<float>();
  nlohmann::json step = nlohmann::json::array(), busy = nlohmann::json::array(), wait = nlohmann::json::array(),
                 data = nlohmann::json::array();
  for (int r = 0; r < n; ++r) {
    const double s = a[3 * r], w = a[3 * r + 1], d = a[3 * r + 2];
    step.push_back(s);
    wait.push_back(w);
    data.push_back(d);
    busy.push_back(std::max(0.0, s - w));
  }
  return {{"step_ms", step}, {"busy_ms", busy}, {"wait_ms", wait}, {"data_ms", data}};
}

}  // namespace kiln::cli
