// HealthLog (cli/health_log.h).
#include "cli/health_log.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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

// Note [Subnormal optimizer state]
// A parameter whose gradient stays zero (a ReLU unit that died, an embedding
// row no batch uses any more) keeps its momentum or Adam moments decaying by
// beta each step, into the subnormals, and there they stay: k * 2^-149 times
// 0.9 rounds back to itself for k <= 4 (times 0.999, for k < 500). x86
// takes a microcode assist for every subnormal input or result: AdamW's step
// over such moments ran 21x slower (bench/micro BM_OptimStepSubnormal), and
// examples/scenarios/subnormal_slowdown.toml, whose units all die, runs 20 %
// fewer samples a second once 64 % of its momentum is subnormal. The run
// slows down for no visible reason, and torch says nothing. The health line
// counts them (a pass over the state every log_every steps, a bit test per
// value), and `kiln doctor` names the tensors and the cure,
// flush_denormal = true.
namespace {
template <typename Bits>
int64_t count_subnormal(const void* data, int64_t n, Bits exponent, Bits mantissa) {
  int64_t count = 0;
  const auto* p = static_cast<const unsigned char*>(data);
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * static_cast<int64_t>(sizeof(Bits)), sizeof b);
    count += (b & exponent) == 0 && (b & mantissa) != 0;
  }
  return count;
}
}  // namespace

SubnormalState subnormal_state(const optim::Optimizer& optimizer) {
  SubnormalState out;
  for (const auto& [param, st] : optimizer.state()) {
    for (const auto& [key, t] : st.tensors) {
      if (!t.defined() || !t.is_contiguous() || t.numel() == 0) continue;
      int64_t sub = 0;
      if (t.dtype() == kFloat32)
        sub = count_subnormal<uint32_t>(t.data_ptr(), t.numel(), 0x7f800000u, 0x007fffffu);
      else if (t.dtype() == kFloat64)
        sub = count_subnormal<uint64_t>(t.data_ptr(), t.numel(), 0x7ff0000000000000ull, 0x000fffffffffffffull);
      else
        continue;
      out.subnormal += sub;
      out.values += t.numel();
      if (sub > 0) out.worst.push_back({param, key, sub, t.numel()});
    }
  }
  std::stable_sort(out.worst.begin(), out.worst.end(),
                   [](const auto& a, const auto& b) { return a.subnormal > b.subnormal; });
  if (out.worst.size() > 3) out.worst.resize(3);
  return out;
}

void HealthLog::begin(int64_t step) {
  const auto t = Clock::now();
  monitor_.begin_step(step);
  begin_ms_ = ms_since(t);
}

void HealthLog::end(std::ostream& metrics, const optim::Optimizer* optimizer) {
  const auto t = Clock::now();
  const std::optional<train::HealthRecord> r = monitor_.end_step();
  if (!r) return;
  json j = health_json(*r);
  if (optimizer) {
    const SubnormalState s = subnormal_state(*optimizer);
    json worst = json::array();
    for (const auto& w : s.worst)
      worst.push_back({{"param", w.param}, {"state", w.state}, {"subnormal", w.subnormal}, {"values", w.values}});
    j["subnormal_state"] = {{"subnormal", s.subnormal}, {"values", s.values}, {"worst", worst}};
  }
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
