// HealthLog (cli/health_log.h).
#include "cli/health_log.h"

#include <algorithm>
#include <cmath>

namespace kiln::cli {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
}  // namespace

json health_json(const train::HealthRecord& r) {
  json modules = json::array(), dead = json::array(), blocks = json::array(), no_grad = json::array();
  for (const auto& m : r.modules)
    modules.push_back({{"name", m.name},
                       {"type", m.type},
                       {"grad_norm", m.grad_norm},
                       {"weight_norm", m.weight_norm},
                       {"update_ratio", m.update_ratio}});
  for (const auto& a : r.activations)
    dead.push_back({{"name", a.name}, {"type", a.type}, {"fraction", a.dead_fraction}, {"units", a.units}});
  for (const auto& b : r.blocks)
    blocks.push_back({{"name", b.name}, {"act_rms", b.activation_rms}, {"grad_rms", b.grad_rms}});
  // A model whose every parameter lost its gradient would otherwise write them all.
  for (size_t i = 0; i < std::min<size_t>(r.no_grad.size(), 20); ++i) no_grad.push_back(r.no_grad[i]);
  json j = {{"kind", "health"},   {"step", r.step},           {"grad_norm", r.grad_norm},
            {"modules", modules}, {"no_grad", no_grad},       {"no_grad_count", r.no_grad.size()},
            {"frozen", r.frozen}, {"trainable", r.trainable}, {"dead", dead},
            {"blocks", blocks}};
  // Absent for an input that is not floating point (token ids): JSON has no NaN.
  if (std::isfinite(r.input_mean)) j["input"] = {{"mean", r.input_mean}, {"std", r.input_std}};
  return j;
}

void HealthLog::begin(int64_t step) {
  const auto t = Clock::now();
  monitor_.begin_step(step);
  begin_ms_ = ms_since(t);
}

void HealthLog::end(std::ostream& metrics) {
  const auto t = Clock::now();
  const std::optional<train::HealthRecord> r = monitor_.end_step();
  if (!r) return;
  json j = health_json(*r);
  j["cost_ms"] = begin_ms_ + ms_since(t);
  metrics << j.dump() << "\n" << std::flush;
}

bool log_eval_check(train::EvalCheck& check, int64_t step, std::ostream& metrics) {
  const std::optional<train::EvalModeReport> r = check.finish();
  if (!r) return false;
  json modules = json::array();
  for (const auto& m : r->modules) {
    json j = {{"name", m.name}, {"type", m.type}, {"forwards", m.forwards}};
    if (m.p > 0) {  // a Dropout; a BatchNorm has no p
      j["p"] = m.p;
    } else {
      j["batches_before"] = m.batches_before;
      j["batches_after"] = m.batches_after;
      j["running_mean_moved"] = m.running_mean_moved;
    }
    modules.push_back(std::move(j));
  }
  metrics << json{{"kind", "warning"},
                  {"step", step},
                  {"what", "eval_train_mode"},
                  {"message", r->message},
                  {"modules", modules}}
                 .dump()
          << "\n"
          << std::flush;
  return true;
}

}  // namespace kiln::cli
