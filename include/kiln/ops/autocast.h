// The autocast op policy (torch.autocast's CPU op lists, adapted to kiln's ops):
// one table, kAutocastPolicy, says for every op that autocast touches whether it
// runs in the lower-precision dtype, in float32, or at the widest input type.
// docs/amp.md prints this table and tests/amp checks the two agree.
//
// An op consults it with one line at its entry, before any other work:
//
//   if (autocast_enabled())
//     return ops::autocast_call(AutocastOp::linear, [&](const Tensor& x, const Tensor& w, const Tensor& b) {
//       return linear(x, w, b, loc); }, input, weight, bias);
//
// autocast_call casts the tensor arguments as the policy says and runs the
// body with autocast suspended, so the op's internal calls (softmax inside
// attention, matmul inside a loss) are not cast again. The casts are ordinary
// differentiable Tensor::to calls: gradients flow back in the source dtype.
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/core/autocast.h"
#include "kiln/core/tensor.h"

namespace kiln {

/// What autocast does with an op's floating tensor arguments.
enum class AutocastPolicy {
  /// float32 arguments are cast to the autocast dtype (bf16/fp16); float64 is left alone.
  LowerPrecision,
  /// bf16/fp16 arguments are cast to float32: range-hungry math (exp, sums of
  /// squares, normalisation statistics, losses).
  Float32,
  /// Mixed floating arguments are cast to the widest among them.
  Promote,
};

/// Every op with an autocast hook. The order is the table's order.
enum class AutocastOp {
  mm,
  bmm,
  matmul,
  linear,
  conv2d,
  scaled_dot_product_attention,
  softmax,
  log_softmax,
  logsumexp,
  norm,
  exp,
  log,
  layer_norm,
  batch_norm,
  rms_norm,
  group_norm,
  cross_entropy,
  nll_loss,
  mse_loss,
  l1_loss,
  smooth_l1_loss,
  binary_cross_entropy_with_logits,
  kl_div,
  cat,
  stack,
  count_
};

struct AutocastRule {
  AutocastOp op;
  std::string_view name;  // the kiln (= torch) function name
  AutocastPolicy policy;
  std::string_view why;
};

inline constexpr int kAutocastOpCount = static_cast<int>(AutocastOp::count_);

// The policy. Note [Autocast policy]: matrix products and convolutions are
// where bf16 pays (oneDNN AVX512_BF16, half the bytes) and their float32
// accumulation inside oneDNN keeps them accurate; everything that exponentiates,
// accumulates squares or reduces to a loss stays float32, where bf16's 8-bit
// mantissa would lose the answer; joins of mixed tensors promote so no value
// is silently narrowed.
inline constexpr std::array<AutocastRule, kAutocastOpCount> kAutocastPolicy{{
    {AutocastOp::mm, "mm", AutocastPolicy::LowerPrecision, "matrix product (oneDNN bf16)"},
    {AutocastOp::bmm, "bmm", AutocastPolicy::LowerPrecision, "batched matrix product"},
    {AutocastOp::matmul, "matmul", AutocastPolicy::LowerPrecision, "matrix product"},
    {AutocastOp::linear, "linear", AutocastPolicy::LowerPrecision, "matrix product + bias"},
    {AutocastOp::conv2d, "conv2d", AutocastPolicy::LowerPrecision, "convolution (oneDNN bf16)"},
    {AutocastOp::scaled_dot_product_attention, "scaled_dot_product_attention", AutocastPolicy::LowerPrecision,
     "two matrix products around a softmax"},
    {AutocastOp::softmax, "softmax", AutocastPolicy::Float32, "exp and a normalising sum"},
    {AutocastOp::log_softmax, "log_softmax", AutocastPolicy::Float32, "exp, sum and log"},
    {AutocastOp::logsumexp, "logsumexp", AutocastPolicy::Float32, "exp, sum and log"},
    {AutocastOp::norm, "norm", AutocastPolicy::Float32, "sum of powers (range)"},
    {AutocastOp::exp, "exp", AutocastPolicy::Float32, "overflows bf16/fp16 range quickly"},
    {AutocastOp::log, "log", AutocastPolicy::Float32, "loses precision near 1"},
    {AutocastOp::layer_norm, "layer_norm", AutocastPolicy::Float32, "mean/variance statistics"},
    {AutocastOp::batch_norm, "batch_norm", AutocastPolicy::Float32,
     "statistics; channels-last bf16 in training: bf16 activations, float32 statistics"},
    {AutocastOp::rms_norm, "rms_norm", AutocastPolicy::Float32, "mean of squares"},
    {AutocastOp::group_norm, "group_norm", AutocastPolicy::Float32, "mean/variance statistics"},
    {AutocastOp::cross_entropy, "cross_entropy", AutocastPolicy::Float32, "loss: log_softmax and a mean"},
    {AutocastOp::nll_loss, "nll_loss", AutocastPolicy::Float32, "loss: a mean over the batch"},
    {AutocastOp::mse_loss, "mse_loss", AutocastPolicy::Float32, "loss: mean of squares"},
    {AutocastOp::l1_loss, "l1_loss", AutocastPolicy::Float32, "loss: a mean over the batch"},
    {AutocastOp::smooth_l1_loss, "smooth_l1_loss", AutocastPolicy::Float32, "loss: squares and a mean"},
    {AutocastOp::binary_cross_entropy_with_logits, "binary_cross_entropy_with_logits", AutocastPolicy::Float32,
     "loss: log1p(exp) and a mean"},
    {AutocastOp::kl_div, "kl_div", AutocastPolicy::Float32, "loss: exp/log and a sum"},
    {AutocastOp::cat, "cat", AutocastPolicy::Promote, "join: widest input type"},
    {AutocastOp::stack, "stack", AutocastPolicy::Promote, "join: widest input type"},
}};

constexpr const AutocastRule& autocast_rule(AutocastOp op) { return kAutocastPolicy[static_cast<int>(op)]; }
std::string_view autocast_policy_name(AutocastPolicy p);

/// How this CPU computes bf16 autocast's matrix products and convolutions, so
/// that a run can say why bf16 is or is not faster than float32 here (docs/amp.md,
/// "bf16 against float32"). They run on oneDNN's bf16 kernels where the CPU's
/// bf16 dot product pays: with AMX, or where vdpbf16ps does at least
/// native_from of float32 FMA's flops per second (timed once per process).
/// Elsewhere each is widened to float32 and rounded once: the values are
/// bf16's, and bf16 then saves activation memory, not product time.
/// KILN_ONEDNN_BF16=1 or 0 forces either path.
struct Bf16ProductPath {
  bool native = false;  // oneDNN's bf16 kernels; false: through float32
  bool forced = false;  // KILN_ONEDNN_BF16 chose the path
  bool amx = false;     // oneDNN may use AMX here
  // vdpbf16ps / vfmadd231ps flops per second that the path was chosen on (0: none oneDNN may use)
  double dot_vs_fma = 0;
  double native_from = 0;  // the rate from which the bf16 kernels are used
  /// One sentence for a user: which path, and why.
  std::string describe() const;
};
Bf16ProductPath bf16_product_path();

namespace ops {

/// Finds the dtype an op's floating arguments are cast to under the current
/// autocast state: fixed for LowerPrecision/Float32, the widest floating
/// argument for Promote (so it sees every argument first).
class AutocastTarget {
 public:
  explicit AutocastTarget(AutocastOp op) : policy_(autocast_rule(op).policy) {}
  void add(const Tensor& t);
  void add(const std::vector<Tensor>& ts) {
    for (const Tensor& t : ts) add(t);
  }
  template <typename T>
  void add(const T&) {}
  AutocastPolicy policy() const { return policy_; }
  DType dtype() const;

 private:
  AutocastPolicy policy_;
  bool any_floating_ = false;
  DType widest_ = DType::Float32;
};

/// One argument cast for autocast: undefined, non-floating, float64 (for the
/// lower-precision class) and already-matching tensors pass through; a
/// float32 leaf that requires grad (a parameter) is cast once per region.
Tensor autocast_arg(const Tensor& t, DType target, AutocastPolicy policy);
std::vector<Tensor> autocast_arg(const std::vector<Tensor>& ts, DType target, AutocastPolicy policy);
template <typename T>
const T& autocast_arg(const T& v, DType, AutocastPolicy) {
  return v;
}

/// Casts the Tensor (and tensor-list) arguments per `op`'s policy, other
/// arguments pass through, and runs `body` on them with autocast suspended.
template <typename Body, typename... Args>
decltype(auto) autocast_call(AutocastOp op, Body&& body, const Args&... args) {
  AutocastTarget target(op);
  (target.add(args), ...);
  const DType dt = target.dtype();
  const autocast_detail::SuspendGuard suspend;
  return body(autocast_arg(args, dt, target.policy())...);
}

}  // namespace ops
}  // namespace kiln
