#include "kiln/autograd/anomaly.h"
#include "kiln/autograd/grad_math.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string_view>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"

namespace kiln::autograd {

namespace {

bool env_default() {
  const char* s = std::getenv("KILN_DETECT_ANOMALY");
  return s && *s && std::string(s) != "0";
}

// Process-wide, like torch.autograd.set_detect_anomaly, so worker threads see it.
std::atomic<bool>& flag() {
  static std::atomic<bool> f{env_default()};
  return f;
}

struct Stats {
  double min = std::numeric_limits<double>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  int64_t nan = 0, inf = 0, n = 0;
};

Stats compute(const Tensor& t) {
  Stats s;
  if (!t.defined() || !t.is_floating_point()) return s;
  Tensor c = grad_math().contiguous(t);
  s.n = c.numel();
  visit_dtype<kFloatingTypes>(c.dtype(), "anomaly check", [&]<typename T>() {
    const T* p = static_cast<const T*>(c.data_ptr());
    for (int64_t i = 0; i < s.n; ++i) {
      const double v = static_cast<double>(static_cast<compute_t<T>>(p[i]));
      if (std::isnan(v)) {
        ++s.nan;
      } else {
        if (std::isinf(v)) ++s.inf;
        s.min = std::min(s.min, v);
        s.max = std::max(s.max, v);
      }
    }
  });
  return s;
}

std::string format(const Stats& s) {
  std::ostringstream os;
  if (s.n == 0) return "no elements";
  if (s.nan == s.n) {
    os << "all " << s.n << " elements NaN";
    return os.str();
  }
  os << "min " << s.min << ", max " << s.max << ", " << s.nan << " NaN, " << s.inf << " Inf of " << s.n << " elements";
  return os.str();
}

// Per thread: a scaler's iteration (scale .. update) runs on one thread, and
// two threads training two models must not see each other's overflow.
thread_local int t_expected_depth = 0;
thread_local std::optional<OverflowRecord> t_record;

}  // namespace

bool overflow_expected() { return t_expected_depth > 0; }
void begin_expected_overflow() { ++t_expected_depth; }
// Tolerates an unmatched end (a scaler destroyed on another thread than the
// one that scaled): throwing from a destructor would terminate the program.
void end_expected_overflow() {
  if (t_expected_depth > 0) --t_expected_depth;
}

std::optional<OverflowRecord> take_overflow_record() {
  std::optional<OverflowRecord> r = std::move(t_record);
  t_record.reset();
  return r;
}
void clear_overflow_record() { t_record.reset(); }

std::string OverflowRecord::str() const {
  std::ostringstream os;
  os << node;
  if (site.known()) os << " (forward at " << site.str() << ")";
  os << " returned " << nan << " NaN and " << inf << " Inf in the float16 gradient for its input " << input_index << " "
     << shape;
  if (!input_node.empty()) {
    os << ", the gradient of the output of " << input_node;
    if (input_site.known()) os << " (forward at " << input_site.str() << ")";
    os << ",";
  }
  os << " from finite incoming gradients (" << incoming << ")";
  return os.str();
}

bool anomaly_mode_enabled() { return flag().load(std::memory_order_relaxed); }
void set_anomaly_mode_enabled(bool enabled) { flag().store(enabled, std::memory_order_relaxed); }

std::string tensor_stats(const Tensor& t) { return format(compute(t)); }

void count_nonfinite(const Tensor& t, int64_t& nan_count, int64_t& inf_count) {
  // The counts steer host code (GradScaler skips the step on them). The
  // anomaly checks above read values too, but only to raise: a replay skips them.
  capture::graph_break_if_recording(
      "counting non-finite values (GradScaler's inf check, count_nonfinite) reads a tensor's values on the host");
  const Stats s = compute(t);
  nan_count = s.nan;
  inf_count = s.inf;
}

void check_forward_outputs(const Node& node, const Tensor* const* outputs, size_t n_out,
                           const std::vector<Tensor>& inputs) {
  for (size_t i = 0; i < n_out; ++i) {
    const Stats s = compute(*outputs[i]);
    if (s.nan == 0 && s.inf == 0) continue;
    // Non-finite outputs from non-finite inputs are not where the trouble started.
    bool inputs_finite = true;
    for (const Tensor& in : inputs) {
      const Stats si = compute(in);
      if (si.nan || si.inf) inputs_finite = false;
    }
    if (!inputs_finite) continue;
    std::ostringstream os;
    os << "anomaly mode: the forward of " << node.name() << " produced " << s.nan << " NaN and " << s.inf
       << " Inf values in output " << i << " " << shape_str(outputs[i]->sizes());
    if (node.site().known()) os << " at " << node.site().str();
    os << " from finite inputs:";
    for (size_t k = 0; k < inputs.size(); ++k) {
      if (inputs[k].defined())
        os << "\n  input " << k << " " << shape_str(inputs[k].sizes()) << ": " << tensor_stats(inputs[k]);
    }
    os << "\nhint: check the op's domain (log/sqrt of values <= 0, division by zero, exp overflow)";
    throw AnomalyError(os.str());
  }
}

void check_backward_outputs(const Node& node, const TensorList& grads_in, const TensorList& grads_out) {
  for (size_t i = 0; i < grads_out.size(); ++i) {
    const Stats s = compute(grads_out[i]);
    if (s.nan == 0 && s.inf == 0) continue;
    bool in_finite = true;
    for (const Tensor& g : grads_in) {
      const Stats si = compute(g);
      if (si.nan || si.inf) in_finite = false;
    }
    if (!in_finite) continue;
    // float16 overflow under a loss scaler is the scaler's business (it skips
    // the step and backs off); keep where it happened for its message.
    if (overflow_expected() && grads_out[i].dtype() == kFloat16) {
      if (!t_record) {
        OverflowRecord r;
        r.node = node.name();
        r.site = node.site();
        r.input_index = i;
        r.shape = shape_str(grads_out[i].sizes());
        r.nan = s.nan;
        r.inf = s.inf;
        if (i < node.next_edges().size() && node.next_edges()[i].is_valid()) {
          const Node& producer = *node.next_edges()[i].function;
          if (std::string_view(producer.name()) != "AccumulateGrad") {
            r.input_node = producer.name();
            r.input_site = producer.site();
          }
        }
        for (size_t k = 0; k < grads_in.size(); ++k) {
          if (!grads_in[k].defined()) continue;
          if (!r.incoming.empty()) r.incoming += "; ";
          r.incoming += "grad of output " + std::to_string(k) + ": " + tensor_stats(grads_in[k]);
        }
        t_record = std::move(r);
      }
      continue;
    }
    std::ostringstream os;
    os << "anomaly mode: the backward of " << node.name() << " returned " << s.nan << " NaN and " << s.inf
       << " Inf values in the gradient for its input " << i << " " << shape_str(grads_out[i].sizes());
    if (node.site().known()) os << " (forward at " << node.site().str() << ")";
    os << " from finite incoming gradients:";
    for (size_t k = 0; k < grads_in.size(); ++k) {
      if (grads_in[k].defined()) os << "\n  grad of output " << k << ": " << tensor_stats(grads_in[k]);
    }
    if (grads_out[i].dtype() == kFloat16)
      os << "\nhint: float16 overflows above 65504; scale the loss with amp::GradScaler, which expects such "
            "overflow in backward, skips the step and backs off (anomaly mode then records it instead of "
            "throwing)";
    os << "\nhint: the derivative is not finite at the forward's input values (sqrt or pow at 0, log at 0, "
          "division by a tiny number)";
    throw AnomalyError(os.str());
  }
}

}  // namespace kiln::autograd
