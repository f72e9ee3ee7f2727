// amp::GradScaler: torch 1.13's torch/cuda/amp/grad_scaler.py state machine
// (per-optimizer stages READY -> UNSCALED -> STEPPED, reset by update()) and
// its _amp_update_scale_ rule, plus the telemetry of kiln/amp/grad_scaler.h.
#include "kiln/amp/grad_scaler.h"

#include <cmath>
#include <iostream>
#include <sstream>
#include <type_traits>
#include <variant>

#include "kiln/autograd/anomaly.h"
#include "kiln/core/autocast.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/core/record.h"
#include "kiln/ops/factory.h"

namespace kiln::amp {

namespace {

std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), enabled_(options.enabled), scale_(static_cast<float>(options.init_scale)) {
  KILN_CHECK(std::isfinite(options.init_scale) && options.init_scale > 0, ValueError,
             "GradScaler: expected a finite init_scale > 0, got ", options.init_scale);
  KILN_CHECK(options.growth_factor > 1.0, ValueError, "GradScaler: expected growth_factor > 1, got ",
             options.growth_factor);
  KILN_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0, ValueError,
             "GradScaler: expected backoff_factor in (0, 1), got ", options.backoff_factor);
  KILN_CHECK(options.growth_interval > 0, ValueError, "GradScaler: expected growth_interval > 0, got ",
             options.growth_interval);
}

void GradScaler::emit(std::string message) {
  if (options_.print_messages) std::cerr << "kiln warning: " << message << "\n";
  messages_.push_back(std::move(message));
}

Tensor GradScaler::scale(const Tensor& loss) {
  KILN_CHECK(loss.defined(), ValueError, "GradScaler::scale: expected a loss tensor, got an undefined one");
  if (!enabled_) return loss;
  const std::optional<DType> amp_dtype = autocast_enabled() ? autocast_dtype() : autocast_last_dtype();
  if (!warned_bf16_ && amp_dtype == kBFloat16) {
    warned_bf16_ = true;
    emit(
        "GradScaler: autocast runs in bfloat16, which has float32's exponent range, so gradients do not "
        "underflow and loss scaling is unnecessary (harmless: it only costs a pass over the gradients). "
        "Drop the scaler or construct it with enabled = false.");
  }
  if (!overflow_scope_.open) {
    // A new iteration: a record left from an unscaled backward is not ours.
    autograd::clear_overflow_record();
    autograd::begin_expected_overflow();
    overflow_scope_.open = true;
  }
  // The scale changes between steps (update()), so kiln::compile records its
  // write as a closure that a replay runs with the scale of that moment; the
  // scaler must outlive the compiled function, as its optimizer does.
  Tensor factor = empty({}, TensorOptions(kFloat32));
  capture::host_write("GradScaler.scale", [p = factor.data_ptr<float>(), this]() { *p = scale_; });
  return loss * factor;
}

void GradScaler::unscale_(optim::Optimizer& opt) {
  if (!enabled_) return;
  // torch's _amp_foreach_non_finite_check_and_unscale_: the check and the scaling of every gradient.
  const record::Scope rs(record::Kind::Op, "GradScaler.unscale_");
  PerOptimizer& st = per_optimizer_[&opt];
  KILN_CHECK(st.stage != Stage::Unscaled, ValueError,
             "GradScaler::unscale_: unscale_() has already been called on this optimizer since the last update() "
             "(call it at most once per step, before clipping)");
  KILN_CHECK(st.stage != Stage::Stepped, ValueError,
             "GradScaler::unscale_: called after step() (unscale_ must come before step(); update() starts the "
             "next iteration)");
  // torch: inv_scale = scale.double().reciprocal().float().
  const double inv_scale = static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale_)));
  const NoGradGuard no_grad;
  bool found = false;
  for (optim::ParamGroup& group : opt.param_groups()) {
    for (auto& [name, p] : group.params) {
      Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      KILN_CHECK(g.dtype() != kFloat16, DTypeError, "GradScaler::unscale_: parameter '", name,
                 "' has a float16 gradient; keep parameters float32 (master weights) and autocast the ops");
      int64_t nan = 0, inf = 0;
      autograd::count_nonfinite(g, nan, inf);
      if ((nan || inf) && pending_param_.empty()) {
        pending_param_ = name;
        pending_nan_ = nan;
        pending_inf_ = inf;
      }
      found = found || nan || inf;
      g.mul_(inv_scale);
    }
  }
  // The record belongs to the backward, not to one optimizer: the first
  // optimizer that finds a non-finite gradient takes it.
  if (found && !pending_overflow_) pending_overflow_ = autograd::take_overflow_record();
  st.found_inf = found;
  st.checked = true;
  st.stage = Stage::Unscaled;
}

bool GradScaler::step(optim::Optimizer& opt) {
  const record::Scope rs(record::Kind::Op, "GradScaler.step");
  if (!enabled_) {
    opt.step();
    return true;
  }
  {
    const PerOptimizer& st = per_optimizer_[&opt];
    KILN_CHECK(st.stage != Stage::Stepped, ValueError,
               "GradScaler::step: already called on this optimizer since the last update()");
    if (st.stage == Stage::Ready) unscale_(opt);
  }
  PerOptimizer& st = per_optimizer_[&opt];
  KILN_ASSERT(st.checked, "GradScaler::step: no inf check was recorded for this optimizer");
  const bool stepped = !st.found_inf;
  if (stepped) opt.step();
  st.stage = Stage::Stepped;
  return stepped;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  const record::Scope rs(record::Kind::Op, "GradScaler.update");
  bool found_inf = false;
  if (new_scale) {
    KILN_CHECK(std::isfinite(*new_scale) && *new_scale > 0, ValueError,
               "GradScaler::update: expected a finite new_scale > 0, got ", *new_scale);
    scale_ = static_cast<float>(*new_scale);
  } else {
    bool any_checked = false;
    for (const auto& [opt, st] : per_optimizer_) {
      any_checked = any_checked || st.checked;
      found_inf = found_inf || st.found_inf;
    }
    KILN_CHECK(any_checked, ValueError,
               "GradScaler::update: no inf checks were recorded before update() (call step() or unscale_() "
               "on an optimizer first)");
    // torch's _amp_update_scale_: the products are formed in double and stored in the float32 scale.
    if (found_inf) {
      scale_ = static_cast<float>(static_cast<double>(scale_) * options_.backoff_factor);
      growth_tracker_ = 0;
    } else if (growth_tracker_ + 1 == options_.growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(scale_) * options_.growth_factor);
      if (std::isfinite(grown)) scale_ = grown;
      growth_tracker_ = 0;
    } else {
      ++growth_tracker_;
    }
    ++stats_.steps;
    stats_.last_step_skipped = found_inf;
    if (found_inf) {
      ++stats_.skipped_steps;
      ++stats_.consecutive_skips;
      stats_.first_nonfinite_param = pending_param_;
      stats_.first_nonfinite_nan = pending_nan_;
      stats_.first_nonfinite_inf = pending_inf_;
      stats_.first_overflow = pending_overflow_;
      note_streak();
    } else {
      stats_.consecutive_skips = 0;
      warned_streak_ = false;
    }
  }
  if (scale_ >= options_.collapse_threshold) warned_collapse_ = false;
  close_iteration();
}

void GradScaler::close_iteration() {
  per_optimizer_.clear();
  pending_param_.clear();
  pending_nan_ = pending_inf_ = 0;
  pending_overflow_.reset();
  autograd::clear_overflow_record();
  overflow_scope_.close();
}

void GradScaler::note_streak() {
  const std::string who = stats_.first_nonfinite_param.empty()
                              ? std::string("(no parameter named)")
                              : "'" + stats_.first_nonfinite_param + "' (" +
                                    std::to_string(stats_.first_nonfinite_nan) + " NaN, " +
                                    std::to_string(stats_.first_nonfinite_inf) + " Inf)";
  const std::string anomaly =
      stats_.first_overflow
          ? " Anomaly mode found where float16 first overflowed in backward: " + stats_.first_overflow->str() + "."
      : autograd::anomaly_mode_enabled()
          ? " Anomaly mode is on and recorded no float16 overflow in backward, so the values entered from "
            "non-finite inputs or from work outside the graph (data, an in-place update under no_grad)."
          : " Rerun with anomaly mode (KILN_DETECT_ANOMALY=1 or autograd::AnomalyModeGuard) to name the op "
            "that produced it (float16 overflow in backward is recorded, not thrown, while a scaler is active).";
  if (!warned_streak_ && stats_.consecutive_skips >= options_.warn_after_skips) {
    warned_streak_ = true;
    emit("GradScaler: " + std::to_string(stats_.consecutive_skips) +
         " consecutive steps skipped for non-finite gradients (scale now " + num(scale_) +
         "); the first non-finite gradient is " + who + "." + anomaly);
  }
  if (!warned_collapse_ && scale_ < options_.collapse_threshold) {
    warned_collapse_ = true;
    emit("GradScaler: the loss scale collapsed to " + num(scale_) + " (below " + num(options_.collapse_threshold) +
         ") after " + std::to_string(stats_.consecutive_skips) +
         " consecutive skipped steps: the gradients are non-finite even barely scaled, so this is likely a real "
         "divergence (NaN/Inf in the model's forward or backward), not float16 overflow. First non-finite "
         "gradient: " +
         who + "." + anomaly);
  }
}

io::ObjectState GradScaler::state_dict() const {
  if (!enabled_) return {};
  io::ObjectState s;
  s.tensors["scale"] = scalar_tensor(static_cast<double>(scale_), TensorOptions(kFloat32));
  s.tensors["_growth_tracker"] = scalar_tensor(growth_tracker_, TensorOptions(kInt64));
  s.values["growth_factor"] = options_.growth_factor;
  s.values["backoff_factor"] = options_.backoff_factor;
  s.values["growth_interval"] = options_.growth_interval;
  s.values["steps"] = stats_.steps;
  s.values["skipped_steps"] = stats_.skipped_steps;
  return s;
}

void GradScaler::load_state_dict(const io::ObjectState& s) {
  KILN_CHECK(enabled_, ValueError, "GradScaler::load_state_dict: this scaler is disabled (enabled = false)");
  KILN_CHECK(!s.tensors.empty() || !s.values.empty(), ValueError,
             "GradScaler::load_state_dict: the state is empty, possibly because it was saved from a disabled "
             "GradScaler");
  auto tensor_at = [&](const char* key, DType dt) -> const Tensor& {
    auto it = s.tensors.find(key);
    KILN_CHECK(it != s.tensors.end() && it->second.defined(), ValueError,
               "GradScaler::load_state_dict: missing tensor '", key, "'");
    KILN_CHECK(it->second.dtype() == dt && it->second.numel() == 1, ValueError, "GradScaler::load_state_dict: '", key,
               "' must be one ", dtype_name(dt), " value, got ", dtype_name(it->second.dtype()), " of shape ",
               it->second.shape_string());
    return it->second;
  };
  auto value_at = [&]<typename T>(const char* key, T*) -> T {
    auto it = s.values.find(key);
    KILN_CHECK(it != s.values.end(), ValueError, "GradScaler::load_state_dict: missing value '", key, "'");
    const T* v = std::get_if<T>(&it->second);
    KILN_CHECK(v != nullptr, ValueError, "GradScaler::load_state_dict: '", key, "' must be ",
               std::is_same_v<T, double> ? "a double" : "an int64");
    return *v;
  };
  const float scale = tensor_at("scale", kFloat32).item<float>();
  const int64_t tracker = tensor_at("_growth_tracker", kInt64).item<int64_t>();
  GradScalerOptions o = options_;
  o.growth_factor = value_at("growth_factor", static_cast<double*>(nullptr));
  o.backoff_factor = value_at("backoff_factor", static_cast<double*>(nullptr));
  o.growth_interval = value_at("growth_interval", static_cast<int64_t*>(nullptr));
  o.init_scale = scale;
  const GradScaler check(o);  // validates the hyperparameters with the constructor's messages
  KILN_CHECK(tracker >= 0 && tracker < o.growth_interval, ValueError,
             "GradScaler::load_state_dict: '_growth_tracker' must be in [0, growth_interval = ", o.growth_interval,
             "), got ", tracker);
  // The counters are telemetry: a state from torch (without them) starts them at 0.
  GradScalerStats stats;
  if (s.values.count("steps")) stats.steps = value_at("steps", static_cast<int64_t*>(nullptr));
  if (s.values.count("skipped_steps")) stats.skipped_steps = value_at("skipped_steps", static_cast<int64_t*>(nullptr));
  options_ = o;
  scale_ = scale;
  growth_tracker_ = tracker;
  stats_ = stats;
  per_optimizer_.clear();
}

GradScalerStats GradScaler::stats() const {
  GradScalerStats s = stats_;
  s.scale = get_scale();
  return s;
}

std::map<std::string, double> GradScaler::metrics() const {
  return {{"amp_scale", get_scale()},
          {"amp_skipped_steps", static_cast<double>(stats_.skipped_steps)},
          {"amp_step_skipped", stats_.last_step_skipped ? 1.0 : 0.0},
          {"amp_consecutive_skips", static_cast<double>(stats_.consecutive_skips)}};
}

}  // namespace kiln::amp
