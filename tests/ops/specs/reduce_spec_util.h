// Helpers shared by the reduction family's registry files (reduce_spec.cpp,
// reduce_more_spec.cpp): sample constructors and the backward-sample rule.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops/specs/op_spec.h"

namespace kiln::ops::reduce_spec {

using Inputs = std::vector<Tensor>;
using Run = std::function<std::vector<Tensor>(const Inputs&)>;

// Wraps f(x0) returning a Tensor or a (values, indices) tuple.
template <typename F>
Run unary(F f) {
  return [f](const Inputs& x) -> std::vector<Tensor> {
    auto r = f(x[0]);
    if constexpr (std::is_same_v<decltype(r), Tensor>) return {r};
    else return {std::get<0>(r), std::get<1>(r)};
  };
}

inline OpSample sample(std::string label, Tensor x, Run run, std::string torch) {
  return OpSample{std::move(label), {std::move(x)}, std::move(run), std::move(torch), {}};
}

// Marks the samples of a floating dtype as backward samples (grad_inputs = {0})
// when their input is small enough for a numerical gradcheck (<= 200 elements:
// the [64, 1000] samples stay forward-only), except the labels in `skip`.
inline std::vector<OpSample> differentiable(std::vector<OpSample> s, DType dt, std::vector<std::string> skip = {}) {
  if (!is_floating_point(dt)) return s;
  for (OpSample& x : s) {
    if (x.inputs[0].numel() > 200 || std::find(skip.begin(), skip.end(), x.label) != skip.end()) continue;
    x.grad_inputs = {0};
  }
  return s;
}

template <typename F>
OpErrorCase error(std::string label, F f, std::string type, std::string contains) {
  return OpErrorCase{std::move(label), [f] { (void)f(); }, std::move(type), std::move(contains)};
}

inline const std::vector<DType> kFloats = {kFloat32, kFloat64, kBFloat16, kFloat16};

}  // namespace kiln::ops::reduce_spec
