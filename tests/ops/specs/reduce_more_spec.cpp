// Registry entries for the reduction family, part 2: max min amax amin argmax
// argmin logsumexp norm softmax log_softmax all any (part 1: reduce_spec.cpp).
//
// Integer samples hold many equal values (drawn from [-5, 5)), so max/min and
// argmax/argmin also check PyTorch's first-index rule for ties.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>

#include "kiln/ops/factory.h"
#include "ops/specs/op_spec.h"
#include "kiln/ops/reduce.h"
#include "ops/specs/reduce_spec_util.h"

namespace kiln::ops {

namespace {

using namespace reduce_spec;
// torch 1.13 has no Half softmax on CPU.
const std::vector<DType> kFloatsNoHalf = {kFloat32, kFloat64, kBFloat16};

// max and min: over everything, and (values, indices) along a dim.
OpSpec max_min_spec(bool is_max) {
  const std::string t = is_max ? "torch.max" : "torch.min";
  return OpSpec{
      is_max ? "max" : "min",
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kBool},
      [is_max, t](DType dt) {
        auto all = [is_max](const Tensor& x) { return is_max ? x.max() : x.min(); };
        auto along = [is_max](const Tensor& x, int64_t d, bool k) { return is_max ? x.max(d, k) : x.min(d, k); };
        return differentiable({
            sample("all", sample_tensor({3, 4}, dt, 51), unary(all), t + "(x0)"),
            sample("dim=1 keepdim", sample_tensor({3, 4}, dt, 52),
                   unary([along](const Tensor& x) { return along(x, 1, true); }),
                   "tuple(" + t + "(x0, 1, keepdim=True))"),
            sample("dim=-2", sample_tensor({3, 4}, dt, 53),
                   unary([along](const Tensor& x) { return along(x, -2, false); }), "tuple(" + t + "(x0, -2))"),
            sample("middle dim", sample_tensor({2, 5, 3}, dt, 54),
                   unary([along](const Tensor& x) { return along(x, 1, false); }), "tuple(" + t + "(x0, 1))"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 55),
                   unary([along](const Tensor& x) { return along(x, 1, false); }), "tuple(" + t + "(x0, 1))"),
            sample("0-dim", sample_tensor({}, dt, 56), unary([along](const Tensor& x) { return along(x, 0, false); }),
                   "tuple(" + t + "(x0, 0))"),
            sample("large rows", sample_tensor({64, 1000}, dt, 57),
                   unary([along](const Tensor& x) { return along(x, 1, false); }), "tuple(" + t + "(x0, 1))"),
            sample("large columns", sample_tensor({64, 1000}, dt, 58),
                   unary([along](const Tensor& x) { return along(x, 0, false); }), "tuple(" + t + "(x0, 0))"),
        }, dt);
      },
      nullptr,
      [is_max] {
        return std::vector<OpErrorCase>{
            error("empty input", [is_max] { Tensor x = zeros({0, 3}); return is_max ? x.max() : x.min(); },
                  "IndexError", "no identity"),
            error("empty dim", [is_max] { Tensor x = zeros({0, 3}); return std::get<0>(is_max ? x.max(0) : x.min(0)); },
                  "IndexError", "non-zero size"),
            error("dim out of range", [is_max] { Tensor x = zeros({2, 3}); return std::get<0>(is_max ? x.max(2) : x.min(2)); },
                  "IndexError", "out of range"),
        };
      }};
}

OpSpec amax_amin_spec(bool is_max) {
  const std::string t = is_max ? "torch.amax" : "torch.amin";
  auto f = [is_max](const Tensor& x, IntArrayRef dims, bool k) { return is_max ? x.amax(dims, k) : x.amin(dims, k); };
  return OpSpec{
      is_max ? "amax" : "amin",
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kBool},
      [f, t](DType dt) {
        return differentiable({
            sample("dims=[0,-1]", sample_tensor({2, 3, 4}, dt, 61),
                   unary([f](const Tensor& x) { return f(x, {0, -1}, false); }), t + "(x0, [0, -1])"),
            sample("dims=[1] keepdim", sample_tensor({2, 3, 4}, dt, 62),
                   unary([f](const Tensor& x) { return f(x, {1}, true); }), t + "(x0, [1], keepdim=True)"),
            sample("dims=[] is all", sample_tensor({3, 4}, dt, 63),
                   unary([f](const Tensor& x) { return f(x, {}, false); }), t + "(x0, [])"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 64),
                   unary([f](const Tensor& x) { return f(x, {0}, false); }), t + "(x0, [0])"),
            sample("large columns", sample_tensor({64, 1000}, dt, 65),
                   unary([f](const Tensor& x) { return f(x, {0}, false); }), t + "(x0, [0])"),
        }, dt);
      },
      nullptr,
      [f] {
        return std::vector<OpErrorCase>{
            error("repeated dim", [f] { return f(zeros({2, 3}), {1, -1}, false); }, "ValueError",
                  "appears multiple times"),
            error("empty dim", [f] { return f(zeros({0, 3}), {0}, false); }, "IndexError", "non-zero size"),
        };
      }};
}

OpSpec argmax_argmin_spec(bool is_max) {
  const std::string t = is_max ? "torch.argmax" : "torch.argmin";
  auto f = [is_max](const Tensor& x, std::optional<int64_t> d, bool k) {
    return is_max ? x.argmax(d, k) : x.argmin(d, k);
  };
  return OpSpec{
      is_max ? "argmax" : "argmin",
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64},
      [f, t](DType dt) {
        return std::vector<OpSample>{
            sample("flattened", sample_tensor({3, 4}, dt, 71),
                   unary([f](const Tensor& x) { return f(x, std::nullopt, false); }), t + "(x0)"),
            sample("flattened keepdim", sample_noncontig({3, 4}, dt, 72),
                   unary([f](const Tensor& x) { return f(x, std::nullopt, true); }), t + "(x0, keepdim=True)"),
            sample("dim=1", sample_tensor({3, 4}, dt, 73), unary([f](const Tensor& x) { return f(x, 1, false); }),
                   t + "(x0, 1)"),
            sample("dim=0 keepdim", sample_tensor({3, 4}, dt, 74),
                   unary([f](const Tensor& x) { return f(x, 0, true); }), t + "(x0, 0, keepdim=True)"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 75),
                   unary([f](const Tensor& x) { return f(x, -1, false); }), t + "(x0, -1)"),
            sample("large rows", sample_tensor({64, 1000}, dt, 76),
                   unary([f](const Tensor& x) { return f(x, 1, false); }), t + "(x0, 1)"),
        };
      },
      nullptr,
      [f] {
        return std::vector<OpErrorCase>{
            error("empty input", [f] { return f(zeros({0}), std::nullopt, false); }, "IndexError", "no identity"),
            error("dim out of range", [f] { return f(zeros({2, 3}), -3, false); }, "IndexError", "out of range"),
        };
      }};
}

OpSpec logsumexp_spec() {
  return OpSpec{
      "logsumexp",
      {kFloat32, kFloat64, kBFloat16, kInt64},
      [](DType dt) {
        return differentiable({
            sample("dims=[1]", sample_tensor({3, 4}, dt, 81), unary([](const Tensor& x) { return x.logsumexp({1}); }),
                   "torch.logsumexp(x0, [1])"),
            sample("dims=[0,1] keepdim", sample_tensor({3, 4}, dt, 82),
                   unary([](const Tensor& x) { return x.logsumexp({0, 1}, true); }),
                   "torch.logsumexp(x0, [0, 1], keepdim=True)"),
            sample("dims=[-1] 3-d", sample_tensor({2, 3, 4}, dt, 83),
                   unary([](const Tensor& x) { return x.logsumexp({-1}); }), "torch.logsumexp(x0, [-1])"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 84),
                   unary([](const Tensor& x) { return x.logsumexp({0}); }), "torch.logsumexp(x0, [0])"),
            sample("large rows", sample_tensor({64, 1000}, dt, 85),
                   unary([](const Tensor& x) { return x.logsumexp({1}); }), "torch.logsumexp(x0, [1])"),
            sample("large columns", sample_tensor({64, 1000}, dt, 86),
                   unary([](const Tensor& x) { return x.logsumexp({0}); }), "torch.logsumexp(x0, [0])"),
        }, dt);
      },
      nullptr,  // int64 inputs give float32 results: the default follows the result's dtype
      [] {
        return std::vector<OpErrorCase>{
            error("dim out of range", [] { return zeros({2, 3}).logsumexp({2}); }, "IndexError", "out of range"),
        };
      }};
}

// torch 1.13 accumulates 16-bit norms over long or outer dims in 16-bit
// precision (a float16 2-norm of 1000 values is off by 0.5%); kiln accumulates
// in float and rounds once. The reference for those is torch's float result
// rounded to the input dtype: what an accurate 16-bit norm returns.
std::string in_float(DType dt, const std::string& call) {
  if (dt == kBFloat16 || dt == kFloat16) return "x0.float()." + call + ".to(x0.dtype)";
  return "x0." + call;
}

OpSpec norm_spec() {
  return OpSpec{
      "norm",
      kFloats,
      [](DType dt) {
        return differentiable({
            sample("p=2 all", sample_tensor({3, 4}, dt, 91), unary([](const Tensor& x) { return x.norm(); }),
                   "x0.norm()"),
            sample("p=1 dim=1", sample_tensor({3, 4}, dt, 92), unary([](const Tensor& x) { return x.norm(1.0, {1}); }),
                   "x0.norm(1, [1])"),
            sample("p=inf dim=0 keepdim", sample_tensor({3, 4}, dt, 93),
                   unary([](const Tensor& x) { return x.norm(INFINITY, {0}, true); }),
                   "x0.norm(float('inf'), [0], keepdim=True)"),
            sample("p=3 dims=[0,-1]", sample_tensor({2, 3, 4}, dt, 94),
                   unary([](const Tensor& x) { return x.norm(3.0, {0, -1}); }), "x0.norm(3, [0, -1])"),
            sample("p=0", sample_tensor({3, 4}, dt, 95), unary([](const Tensor& x) { return x.norm(0.0); }),
                   "x0.norm(0)"),
            sample("p=2 noncontig", sample_noncontig({5, 6}, dt, 96),
                   unary([](const Tensor& x) { return x.norm(2.0, {1}); }), "x0.norm(2, [1])"),
            sample("p=2 large rows", sample_tensor({64, 1000}, dt, 97),
                   unary([](const Tensor& x) { return x.norm(2.0, {1}); }), in_float(dt, "norm(2, [1])")),
            sample("p=1 large columns", sample_tensor({64, 1000}, dt, 98),
                   unary([](const Tensor& x) { return x.norm(1.0, {0}); }), in_float(dt, "norm(1, [0])")),
        }, dt, {"p=0"});  // torch gives p = 0 no gradient at all
      },
      nullptr,
      [] {
        return std::vector<OpErrorCase>{
            error("int64 input", [] { return arange(6).norm(); }, "DTypeError", "floating point"),
        };
      }};
}

OpSpec softmax_spec(bool log) {
  const std::string t = log ? "torch.log_softmax" : "torch.softmax";
  auto f = [log](const Tensor& x, int64_t d) { return log ? x.log_softmax(d) : x.softmax(d); };
  return OpSpec{
      log ? "log_softmax" : "softmax",
      kFloatsNoHalf,
      [f, t](DType dt) {
        return differentiable({
            sample("dim=-1", sample_tensor({3, 5}, dt, 101), unary([f](const Tensor& x) { return f(x, -1); }),
                   t + "(x0, -1)"),
            sample("dim=0", sample_tensor({3, 5}, dt, 102), unary([f](const Tensor& x) { return f(x, 0); }),
                   t + "(x0, 0)"),
            sample("middle dim", sample_tensor({2, 3, 4}, dt, 103), unary([f](const Tensor& x) { return f(x, 1); }),
                   t + "(x0, 1)"),
            sample("noncontig", sample_noncontig({4, 6}, dt, 104), unary([f](const Tensor& x) { return f(x, 1); }),
                   t + "(x0, 1)"),
            sample("0-dim", sample_tensor({}, dt, 105), unary([f](const Tensor& x) { return f(x, 0); }),
                   t + "(x0, 0)"),
            sample("large rows", sample_tensor({64, 1000}, dt, 106), unary([f](const Tensor& x) { return f(x, -1); }),
                   t + "(x0, -1)"),
            sample("large columns", sample_tensor({64, 1000}, dt, 107),
                   unary([f](const Tensor& x) { return f(x, 0); }), t + "(x0, 0)"),
        }, dt);
      },
      nullptr,
      [f] {
        return std::vector<OpErrorCase>{
            error("int64 input", [f] { return f(arange(6), 0); }, "DTypeError", "floating-point"),
            error("dim out of range", [f] { return f(zeros({2, 3}), 2); }, "IndexError", "out of range"),
        };
      }};
}

OpSpec all_any_spec(bool is_all) {
  const std::string t = is_all ? "torch.all" : "torch.any";
  auto f = [is_all](const Tensor& x) { return is_all ? x.all() : x.any(); };
  return OpSpec{
      is_all ? "all" : "any",
      {kBool, kFloat32, kInt64, kUInt8},
      [f, t](DType dt) {
        return std::vector<OpSample>{
            sample("random", sample_tensor({3, 4}, dt, 111), unary(f), t + "(x0)"),
            sample("all nonzero", ones({2, 3}, dt), unary(f), t + "(x0)"),
            sample("all zero", zeros({2, 3}, dt), unary(f), t + "(x0)"),
            sample("noncontig", sample_noncontig({4, 6}, dt, 112), unary(f), t + "(x0)"),
            sample("empty", zeros({0, 3}, dt), unary(f), t + "(x0)"),
            sample("large", sample_tensor({64, 1000}, dt, 113), unary(f), t + "(x0)"),
        };
      },
      nullptr,
      nullptr};
}

}  // namespace

void register_reduction_stats_ops(std::vector<OpSpec>& r) {
  r.push_back(max_min_spec(true));
  r.push_back(max_min_spec(false));
  r.push_back(amax_amin_spec(true));
  r.push_back(amax_amin_spec(false));
  r.push_back(argmax_argmin_spec(true));
  r.push_back(argmax_argmin_spec(false));
  r.push_back(logsumexp_spec());
  r.push_back(norm_spec());
  r.push_back(softmax_spec(false));
  r.push_back(softmax_spec(true));
  r.push_back(all_any_spec(true));
  r.push_back(all_any_spec(false));
}

}  // namespace kiln::ops
