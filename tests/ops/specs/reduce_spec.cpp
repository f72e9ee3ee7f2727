// Registry entries for the reduction family (tests/ops/specs/op_spec.h):
// sum mean prod var std max min amax amin argmax argmin logsumexp norm
// softmax log_softmax all any.
//
// Every op gets, per dtype: a full reduction, dim lists with and without
// keepdim (negative dims included), a non-contiguous input, a 0-dim or empty
// input where torch defines the result, and a [64, 1000] input that takes the
// parallel and vectorised row and column paths. Large sums use positive
// inputs so that a sum is never close to zero, where float32 rounding of two
// different (both correct) summation orders would exceed a relative tolerance.
// Every floating sample of a differentiable op with at most 200 elements is
// also a backward sample (grad_inputs); the [64, 1000] ones are forward-only.
#include <algorithm>
#include <optional>
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

Tensor positive(IntArrayRef sizes, DType dt, uint64_t seed) { return sample_positive(sizes, dt, seed, 0.5, 2.0); }

void add_sum_mean_prod(std::vector<OpSpec>& r) {
  r.push_back(OpSpec{
      "sum",
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kBool},
      [](DType dt) {
        std::vector<OpSample> s = {
            sample("all", sample_tensor({3, 4}, dt, 1), unary([](const Tensor& x) { return x.sum(); }),
                   "torch.sum(x0)"),
            sample("dims=[0] keepdim", sample_tensor({3, 4}, dt, 2),
                   unary([](const Tensor& x) { return x.sum({0}, true); }), "torch.sum(x0, [0], keepdim=True)"),
            sample("dim=-1", sample_tensor({3, 4}, dt, 3), unary([](const Tensor& x) { return x.sum({-1}); }),
                   "torch.sum(x0, -1)"),
            sample("dims=[0,2] 3-d", sample_tensor({2, 3, 4}, dt, 4),
                   unary([](const Tensor& x) { return x.sum({0, 2}); }), "torch.sum(x0, [0, 2])"),
            sample("dims=[] is all", sample_tensor({2, 3}, dt, 5),
                   unary([](const Tensor& x) { return x.sum(IntArrayRef{}, true); }),
                   "torch.sum(x0, [], keepdim=True)"),
            sample("noncontig dim=1", sample_noncontig({5, 6}, dt, 6),
                   unary([](const Tensor& x) { return x.sum({1}); }), "torch.sum(x0, 1)"),
            sample("noncontig dim=0", sample_noncontig({5, 6}, dt, 7),
                   unary([](const Tensor& x) { return x.sum({0}); }), "torch.sum(x0, 0)"),
            sample("0-dim", sample_tensor({}, dt, 8), unary([](const Tensor& x) { return x.sum({0}); }),
                   "torch.sum(x0, 0)"),
            sample("empty dim", sample_tensor({0, 3}, dt, 9), unary([](const Tensor& x) { return x.sum({0}); }),
                   "torch.sum(x0, 0)"),
            sample("large rows", positive({64, 1000}, dt, 10), unary([](const Tensor& x) { return x.sum({1}); }),
                   "torch.sum(x0, 1)"),
            sample("large columns", positive({64, 1000}, dt, 11), unary([](const Tensor& x) { return x.sum({0}); }),
                   "torch.sum(x0, 0)"),
        };
        if (dt == kFloat32) {
          s.push_back(sample("dtype=float64", sample_tensor({3, 4}, dt, 12),
                             unary([](const Tensor& x) { return x.sum({1}, false, kFloat64); }),
                             "torch.sum(x0, 1, dtype=torch.float64)"));
        }
        if (dt == kInt64) {
          s.push_back(sample("dtype=float32", sample_tensor({3, 4}, dt, 13),
                             unary([](const Tensor& x) { return x.sum(kFloat32); }),
                             "torch.sum(x0, dtype=torch.float32)"));
        }
        return differentiable(std::move(s), dt);
      },
      nullptr,
      [] {
        return std::vector<OpErrorCase>{
            error("dim out of range", [] { return sample_tensor({2, 3}, kFloat32, 1).sum({2}); }, "IndexError",
                  "out of range"),
            error("repeated dim", [] { return sample_tensor({2, 3}, kFloat32, 1).sum({0, -2}); }, "ValueError",
                  "appears multiple times"),
        };
      }});

  r.push_back(OpSpec{
      "mean",
      kFloats,
      [](DType dt) {
        return differentiable({
            sample("all", sample_tensor({3, 4}, dt, 21), unary([](const Tensor& x) { return x.mean(); }),
                   "torch.mean(x0)"),
            sample("dims=[0] keepdim", sample_tensor({3, 4}, dt, 22),
                   unary([](const Tensor& x) { return x.mean({0}, true); }), "torch.mean(x0, [0], keepdim=True)"),
            sample("dims=[-1,0] 3-d", sample_tensor({2, 3, 4}, dt, 23),
                   unary([](const Tensor& x) { return x.mean({-1, 0}); }), "torch.mean(x0, [-1, 0])"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 24), unary([](const Tensor& x) { return x.mean({1}); }),
                   "torch.mean(x0, 1)"),
            sample("large rows", positive({64, 1000}, dt, 25), unary([](const Tensor& x) { return x.mean({1}); }),
                   "torch.mean(x0, 1)"),
            sample("large columns", positive({64, 1000}, dt, 26),
                   unary([](const Tensor& x) { return x.mean({0}); }), "torch.mean(x0, 0)"),
        }, dt);
      },
      nullptr,
      [] {
        return std::vector<OpErrorCase>{
            error("int64 input", [] { return sample_tensor({2, 3}, kInt64, 1).mean(); }, "DTypeError",
                  "could not infer output dtype"),
            error("dim out of range", [] { return sample_tensor({2, 3}, kFloat32, 1).mean({-3}); }, "IndexError",
                  "out of range"),
        };
      }});

  r.push_back(OpSpec{
      "prod",
      {kFloat32, kFloat64, kInt64, kBool},
      [](DType dt) {
        return differentiable({
            sample("all", sample_tensor({3, 4}, dt, 31), unary([](const Tensor& x) { return x.prod(); }),
                   "torch.prod(x0)"),
            sample("dim=1 keepdim", sample_tensor({3, 4}, dt, 32),
                   unary([](const Tensor& x) { return x.prod(1, true); }), "torch.prod(x0, 1, keepdim=True)"),
            sample("dim=-2", sample_tensor({3, 4}, dt, 33), unary([](const Tensor& x) { return x.prod(-2); }),
                   "torch.prod(x0, -2)"),
            sample("noncontig", sample_noncontig({4, 5}, dt, 34), unary([](const Tensor& x) { return x.prod(0); }),
                   "torch.prod(x0, 0)"),
            sample("empty dim", sample_tensor({0, 3}, dt, 35), unary([](const Tensor& x) { return x.prod(0); }),
                   "torch.prod(x0, 0)"),
            sample("large", sample_positive({64, 1000}, dt, 36, 0.999, 1.001),
                   unary([](const Tensor& x) { return x.prod(1); }), "torch.prod(x0, 1)"),
            // One, two and no zeros per row; one zero in all (the gradient there is the others' product).
            sample("zeros dim=1", tensor<double>({2, 0, 3, 0, 0, 1, 1, 2, 3}, {3, 3}).to(dt),
                   unary([](const Tensor& x) { return x.prod(1); }), "torch.prod(x0, 1)"),
            sample("one zero all", tensor<double>({2, 0, 3, 1.5, -1, 0.5}, {2, 3}).to(dt),
                   unary([](const Tensor& x) { return x.prod(); }), "torch.prod(x0)"),
        }, dt);
      },
      nullptr,
      [] {
        return std::vector<OpErrorCase>{
            error("dim out of range", [] { return sample_tensor({2, 3}, kFloat32, 1).prod(2); }, "IndexError",
                  "out of range"),
        };
      }});
}

// var and std share samples; `name` is "var" or "std".
OpSpec var_std_spec(const std::string& name) {
  const bool is_std = name == "std";
  auto f = [is_std](const Tensor& x, IntArrayRef dims, int64_t correction, bool keepdim) {
    return is_std ? x.std(dims, correction, keepdim) : x.var(dims, correction, keepdim);
  };
  return OpSpec{
      name,
      kFloats,
      [f, name](DType dt) {
        const std::string t = "torch." + name;
        return differentiable({
            sample("all", sample_tensor({3, 4}, dt, 41), unary([f](const Tensor& x) { return f(x, {}, 1, false); }),
                   t + "(x0)"),
            sample("dims=[1] correction=0", sample_tensor({3, 4}, dt, 42),
                   unary([f](const Tensor& x) { return f(x, {1}, 0, false); }),
                   t + "(x0, dim=[1], correction=0)"),
            sample("dims=[0] keepdim", sample_tensor({3, 4}, dt, 43),
                   unary([f](const Tensor& x) { return f(x, {0}, 1, true); }),
                   t + "(x0, dim=[0], correction=1, keepdim=True)"),
            sample("dims=[0,-1] 3-d", sample_tensor({2, 3, 4}, dt, 44),
                   unary([f](const Tensor& x) { return f(x, {0, -1}, 1, false); }),
                   t + "(x0, dim=[0, -1])"),
            sample("noncontig", sample_noncontig({5, 6}, dt, 45),
                   unary([f](const Tensor& x) { return f(x, {1}, 1, false); }), t + "(x0, dim=[1])"),
            sample("large rows", sample_tensor({64, 1000}, dt, 46),
                   unary([f](const Tensor& x) { return f(x, {1}, 0, false); }),
                   t + "(x0, dim=[1], correction=0)"),
            sample("large columns", sample_tensor({64, 1000}, dt, 47),
                   unary([f](const Tensor& x) { return f(x, {0}, 1, false); }), t + "(x0, dim=[0])"),
        }, dt);
      },
      nullptr,
      [f] {
        return std::vector<OpErrorCase>{
            error("int64 input", [f] { return f(sample_tensor({2, 3}, kInt64, 1), IntArrayRef{}, 1, false); },
                  "DTypeError", "only support floating point"),
        };
      }};
}

}  // namespace

void register_reduction_stats_ops(std::vector<OpSpec>& r);  // reduce_more_spec.cpp

void register_reduction_ops(std::vector<OpSpec>& r) {
  const size_t first = r.size();
  add_sum_mean_prod(r);
  r.push_back(var_std_spec("var"));
  r.push_back(var_std_spec("std"));
  register_reduction_stats_ops(r);
  // Every op of the family has a backward but those with integer or bool results.
  for (size_t i = first; i < r.size(); ++i) {
    const std::string& n = r[i].name;
    r[i].differentiable = n != "argmax" && n != "argmin" && n != "all" && n != "any";
  }
}

}  // namespace kiln::ops
