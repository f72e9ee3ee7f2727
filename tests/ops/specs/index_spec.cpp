// Registry entries (tests/ops/specs/op_spec.h) for the index family:
// index_select, gather, scatter(_add)(_), masked_fill(_), where, cat, stack,
// repeat, embedding, one_hot. The ops live in gather_scatter.cpp, where.cpp,
// join.cpp and repeat.cpp.
#include <algorithm>

#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

using Inputs = std::vector<Tensor>;

template <typename F>
OpSample one(std::string label, Inputs inputs, F f, std::string torch) {
  return {std::move(label), std::move(inputs), [f](const Inputs& x) { return std::vector<Tensor>{f(x)}; },
          std::move(torch), {}};
}

OpErrorCase err(std::string label, std::function<void()> run, std::string type, std::string contains) {
  return {std::move(label), std::move(run), std::move(type), std::move(contains)};
}

const std::vector<DType> kAll = {kFloat32, kFloat64, kBFloat16, kInt64, kBool};

Tensor idx(std::vector<int64_t> v, std::vector<int64_t> shape = {}) { return tensor<int64_t>(v, shape); }

// Valid random indices in [0, hi).
Tensor rand_index(int64_t hi, IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randint(0, hi, shape, kInt64, &g);
}

// A copy of `t` (2-D) living in a transposed buffer, for in-place ops on non-contiguous self.
Tensor transposed_copy(const Tensor& t) {
  Tensor buf = empty({t.sizes()[1], t.sizes()[0]}, t.dtype()).t();
  buf.copy_(t);
  return buf;
}

Tensor x34() { return arange(12, kFloat32).view({3, 4}); }

// Every op here is differentiable in its floating inputs (one_hot has none):
// floating samples check backward on those, except large samples (any input
// over 200 elements), which the numerical check would make slow.
std::function<std::vector<OpSample>(DType)> with_grad(std::function<std::vector<OpSample>(DType)> samples) {
  return [samples = std::move(samples)](DType dt) {
    std::vector<OpSample> v = samples(dt);
    if (!is_floating_point(dt)) return v;
    for (OpSample& s : v) {
      if (!s.grad_inputs.empty()) continue;  // chosen by the sample (self_grad_only)
      bool small = true;
      for (const Tensor& t : s.inputs) small &= t.numel() <= 200;
      if (!small) continue;
      for (size_t i = 0; i < s.inputs.size(); ++i) {
        if (s.inputs[i].is_floating_point()) s.grad_inputs.push_back(static_cast<int>(i));
      }
    }
    return v;
  };
}

// Samples whose src gradient is not checked: scatter with duplicate indices
// ("last write wins" has no useful derivative in src; torch's formula,
// gather, assumes distinct indices) and src larger than index (torch raises).
// Only self's gradient is checked; floating samples only.
OpSample self_grad_only(OpSample s, DType dt) {
  if (is_floating_point(dt)) s.grad_inputs = {0};
  return s;
}

void reg(std::vector<OpSpec>& r, std::string name, std::vector<DType> dtypes,
         std::function<std::vector<OpSample>(DType)> samples, std::function<std::vector<OpErrorCase>()> errors) {
  OpSpec s;
  s.name = std::move(name);
  s.dtypes = std::move(dtypes);
  s.samples = with_grad(std::move(samples));
  // Differentiable wherever the op takes floating tensors (not one_hot, not where over Scalars).
  s.differentiable = std::any_of(s.dtypes.begin(), s.dtypes.end(), [](DType d) { return is_floating_point(d); });
  s.errors = std::move(errors);
  r.push_back(std::move(s));
}

void register_select_gather(std::vector<OpSpec>& r) {
  reg(
      r, "index_select", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 0 repeated", {sample_tensor({5, 3}, dt, 101), idx({4, 0, 4, 2})},
                [](const Inputs& x) { return x[0].index_select(0, x[1]); }, "torch.index_select(x0, 0, x1)"),
            one("dim 1 int32 index", {sample_tensor({3, 5}, dt, 102), idx({4, 1}).to(kInt32)},
                [](const Inputs& x) { return index_select(x[0], 1, x[1]); }, "torch.index_select(x0, 1, x1)"),
            one("noncontig self and index", {sample_noncontig({4, 5}, dt, 103), idx({0, 9, 2, 9, 4}).slice(0, 0, std::nullopt, 2)},
                [](const Inputs& x) { return x[0].index_select(1, x[1]); }, "torch.index_select(x0, 1, x1)"),
            one("0-dim index", {sample_tensor({2, 3, 4}, dt, 104), scalar_tensor(2, kInt64)},
                [](const Inputs& x) { return x[0].index_select(-1, x[1]); }, "torch.index_select(x0, -1, x1)"),
            one("empty index", {sample_tensor({3, 4}, dt, 105), empty({0}, kInt64)},
                [](const Inputs& x) { return x[0].index_select(0, x[1]); }, "torch.index_select(x0, 0, x1)"),
            one("large rows", {sample_tensor({300, 130}, dt, 106), rand_index(300, {280}, 107)},
                [](const Inputs& x) { return x[0].index_select(0, x[1]); }, "torch.index_select(x0, 0, x1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("index too large", [] { x34().index_select(1, idx({0, 4})); }, "IndexError",
                "index 4 is out of bounds for dimension 1 with size 4"),
            err("negative index", [] { x34().index_select(0, idx({-1})); }, "IndexError", "index -1 is out of bounds"),
            err("float index", [] { x34().index_select(0, tensor<float>({0.f})); }, "DTypeError",
                "Expected dtype int32 or int64 for index"),
            err("2-d index", [] { x34().index_select(0, idx({0}, {1, 1})); }, "IndexError", "supposed to be a vector"),
        };
      });

  reg(
      r, "gather", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 1", {sample_tensor({3, 5}, dt, 111), rand_index(5, {3, 4}, 112)},
                [](const Inputs& x) { return x[0].gather(1, x[1]); }, "torch.gather(x0, 1, x1)"),
            one("dim 0 index longer than self", {sample_tensor({3, 5}, dt, 113), rand_index(3, {6, 5}, 114)},
                [](const Inputs& x) { return gather(x[0], 0, x[1]); }, "torch.gather(x0, 0, x1)"),
            one("noncontig", {sample_noncontig({4, 3}, dt, 115), rand_index(4, {3, 2}, 116).t()},
                [](const Inputs& x) { return x[0].gather(0, x[1]); }, "torch.gather(x0, 0, x1)"),
            one("3-d negative dim", {sample_tensor({2, 3, 4}, dt, 117), rand_index(4, {2, 3, 6}, 118)},
                [](const Inputs& x) { return x[0].gather(-1, x[1]); }, "torch.gather(x0, -1, x1)"),
            one("0-dim self", {sample_tensor({}, dt, 119), idx({0, 0})},
                [](const Inputs& x) { return x[0].gather(0, x[1]); }, "torch.gather(x0, 0, x1)"),
            one("large", {sample_tensor({200, 180}, dt, 120), rand_index(180, {200, 180}, 121)},
                [](const Inputs& x) { return x[0].gather(1, x[1]); }, "torch.gather(x0, 1, x1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("int32 index", [] { x34().gather(0, idx({0}, {1, 1}).to(kInt32)); }, "DTypeError",
                "gather(): Expected dtype int64 for index"),
            err("index out of range", [] { x34().gather(0, idx({0, 1, 3}, {1, 3})); }, "IndexError",
                "index 3 is out of bounds for dimension 0 with size 3"),
            err("dims differ", [] { x34().gather(0, idx({0, 1})); }, "ShapeError", "same number of dimensions"),
            err("index too large", [] { x34().gather(0, zeros({1, 5}, kInt64)); }, "ShapeError",
                "expected index [1, 5] to be no larger than self [3, 4] apart from dimension 0"),
        };
      });
}

std::vector<OpErrorCase> scatter_errors(bool add_mode) {
  const char* op = add_mode ? "scatter_add" : "scatter";
  auto run = [add_mode](const Tensor& self, int64_t dim, const Tensor& index, const Tensor& src) {
    return add_mode ? self.scatter_add(dim, index, src) : self.scatter(dim, index, src);
  };
  return {
      err("int32 index", [run] { run(x34(), 0, idx({0}, {1, 1}).to(kInt32), ones({1, 1})); }, "DTypeError",
          std::string(op) + ": Expected dtype int64 for index"),
      err("src dtype", [run] { run(x34(), 0, zeros({1, 1}, kInt64), ones({1, 1}, kFloat64)); }, "DTypeError",
          "Expected self.dtype to be equal to src.dtype"),
      err("index out of range", [run] { run(x34(), 1, idx({0, 4}, {1, 2}), ones({1, 2})); }, "IndexError",
          "index 4 is out of bounds for dimension 1 with size 4"),
      err("index larger than src", [run] { run(x34(), 0, zeros({1, 3}, kInt64), ones({1, 2})); }, "ShapeError",
          "expected index [1, 3] to be no larger than self [3, 4] apart from dimension 0 and no larger than src [1, 2]"),
      err("dims differ", [run] { run(x34(), 0, zeros({3}, kInt64), ones({3})); }, "ShapeError",
          "same number of dimensions"),
      err("in place into an expanded tensor",
          [add_mode] {
            Tensor e = zeros({3}).expand({2, 3});
            if (add_mode) e.scatter_add_(0, zeros({1, 3}, kInt64), ones({1, 3}));
            else e.scatter_(0, zeros({1, 3}, kInt64), ones({1, 3}));
          },
          "ValueError", "single memory location"),
  };
}

void register_scatter(std::vector<OpSpec>& r) {
  reg(
      r, "scatter", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            self_grad_only(one("dim 0 duplicates", {sample_tensor({3, 4}, dt, 131), rand_index(3, {2, 4}, 132),
                                                     sample_tensor({2, 4}, dt, 133)},
                               [](const Inputs& x) { return x[0].scatter(0, x[1], x[2]); },
                               "torch.scatter(x0, 0, x1, x2)"),
                           dt),
            // torch 1.13 cannot differentiate src when it is larger than index
            // (tests/ops/test_index_grad.cpp checks kiln's zero-padded gradient).
            self_grad_only(one("dim 1 src larger", {sample_tensor({3, 5}, dt, 134), idx({4, 0, 2, 1, 3, 0}, {2, 3}),
                                                     sample_tensor({3, 4}, dt, 135)},
                               [](const Inputs& x) { return scatter(x[0], 1, x[1], x[2]); },
                               "torch.scatter(x0, 1, x1, x2)"),
                           dt),
            one("noncontig", {sample_noncontig({4, 3}, dt, 136), idx({3, 0, 1, 2, 0, 3}, {3, 2}).t(), sample_noncontig({2, 3}, dt, 137)},
                [](const Inputs& x) { return x[0].scatter(0, x[1], x[2]); }, "torch.scatter(x0, 0, x1, x2)"),
            self_grad_only(one("0-dim self", {sample_tensor({}, dt, 138), idx({0, 0}), sample_tensor({2}, dt, 139)},
                               [](const Inputs& x) { return x[0].scatter(0, x[1], x[2]); },
                               "torch.scatter(x0, 0, x1, x2)"),
                           dt),
        };
      },
      [] { return scatter_errors(false); });

  reg(
      r, "scatter value", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 1", {sample_tensor({3, 4}, dt, 141), idx({0, 3, 1}, {3, 1})},
                [](const Inputs& x) { return x[0].scatter(1, x[1], 2.5); }, "torch.scatter(x0, 1, x1, 2.5)"),
            one("noncontig", {sample_noncontig({4, 3}, dt, 142), idx({3, 0, 1, 1, 2, 0}, {3, 2}).t()},
                [](const Inputs& x) { return scatter(x[0], 0, x[1], -1); }, "torch.scatter(x0, 0, x1, -1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("index out of range", [] { x34().scatter(0, idx({3}, {1, 1}), 1.0); }, "IndexError",
                "index 3 is out of bounds for dimension 0 with size 3"),
        };
      });

  reg(
      r, "scatter_", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("into a transposed view", {sample_tensor({4, 3}, dt, 143), idx({0, 1, 2, 3, 2, 1}, {2, 3}), sample_tensor({2, 3}, dt, 144)},
                [](const Inputs& x) {
                  Tensor s = transposed_copy(x[0]);
                  s.scatter_(0, x[1], x[2]);
                  return s;
                },
                "x0.clone().scatter_(0, x1, x2)"),
            one("value", {sample_tensor({3, 4}, dt, 145), idx({1, 1, 0}, {3, 1})},
                [](const Inputs& x) {
                  Tensor s = x[0].clone();
                  s.scatter_(1, x[1], 1);
                  return s;
                },
                "x0.clone().scatter_(1, x1, 1)"),
        };
      },
      [] { return std::vector<OpErrorCase>{}; });

  reg(
      r, "scatter_add", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("duplicates", {sample_tensor({3, 4}, dt, 151), rand_index(3, {6, 4}, 152), sample_tensor({6, 4}, dt, 153)},
                [](const Inputs& x) { return x[0].scatter_add(0, x[1], x[2]); }, "torch.scatter_add(x0, 0, x1, x2)"),
            one("dim 1 noncontig", {sample_noncontig({3, 4}, dt, 154), rand_index(4, {3, 7}, 155), sample_noncontig({3, 7}, dt, 156)},
                [](const Inputs& x) { return scatter_add(x[0], 1, x[1], x[2]); }, "torch.scatter_add(x0, 1, x1, x2)"),
            one("many duplicates large", {sample_tensor({4, 300}, dt, 157), rand_index(4, {200, 300}, 158), sample_tensor({200, 300}, dt, 159)},
                [](const Inputs& x) { return x[0].scatter_add(0, x[1], x[2]); }, "torch.scatter_add(x0, 0, x1, x2)"),
        };
      },
      [] { return scatter_errors(true); });

  reg(
      r, "scatter_add_", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("into a transposed view", {sample_tensor({4, 3}, dt, 161), rand_index(4, {5, 3}, 162), sample_tensor({5, 3}, dt, 163)},
                [](const Inputs& x) {
                  Tensor s = transposed_copy(x[0]);
                  s.scatter_add_(0, x[1], x[2]);
                  return s;
                },
                "x0.clone().scatter_add_(0, x1, x2)"),
        };
      },
      [] { return std::vector<OpErrorCase>{}; });
}

void register_masked_where(std::vector<OpSpec>& r) {
  reg(
      r, "masked_fill", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("broadcast mask", {sample_tensor({3, 4}, dt, 171), sample_tensor({4}, kBool, 172)},
                [](const Inputs& x) { return x[0].masked_fill(x[1], 1.5); }, "torch.masked_fill(x0, x1, 1.5)"),
            one("self broadcast up", {sample_tensor({4}, dt, 173), sample_tensor({3, 1}, kBool, 174)},
                [](const Inputs& x) { return masked_fill(x[0], x[1], -2); }, "torch.masked_fill(x0, x1, -2)"),
            one("noncontig", {sample_noncontig({3, 4}, dt, 175), sample_noncontig({3, 4}, kBool, 176)},
                [](const Inputs& x) { return x[0].masked_fill(x[1], 0); }, "torch.masked_fill(x0, x1, 0)"),
            one("0-dim value tensor", {sample_tensor({2, 3}, dt, 177), sample_tensor({2, 3}, kBool, 178), scalar_tensor(3.0, kFloat64)},
                [](const Inputs& x) { return masked_fill(x[0], x[1], x[2]); }, "torch.masked_fill(x0, x1, x2)"),
            one("0-dim self", {sample_tensor({}, dt, 179), sample_tensor({}, kBool, 180)},
                [](const Inputs& x) { return x[0].masked_fill(x[1], 1); }, "torch.masked_fill(x0, x1, 1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("int mask", [] { x34().masked_fill(idx({1, 0, 1, 0}), 1.0); }, "DTypeError", "expected a bool mask"),
            err("mask shape", [] { x34().masked_fill(tensor<bool>({true, false}), 1.0); }, "ShapeError", "masked_fill"),
            err("value not 0-dim", [] { masked_fill(x34(), tensor<bool>({true}), tensor<float>({1.f})); }, "ShapeError",
                "0-dimensional value tensor"),
            err("value overflows uint8", [] { zeros({2}, kUInt8).masked_fill(tensor<bool>({true, false}), 300); },
                "ValueError", "cannot be converted to dtype uint8"),
        };
      });

  reg(
      r, "masked_fill_", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("into a transposed view, broadcast mask", {sample_tensor({4, 3}, dt, 181), sample_tensor({3}, kBool, 182)},
                [](const Inputs& x) {
                  Tensor s = transposed_copy(x[0]);
                  s.masked_fill_(x[1], 1);
                  return s;
                },
                "x0.clone().masked_fill_(x1, 1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("mask would grow self",
                [] {
                  Tensor x = x34();
                  x.masked_fill_(tensor<bool>({true}, {1, 1, 1}), 0.0);
                },
                "ShapeError", "does not broadcast to self's shape [3, 4]"),
        };
      });

  reg(
      r, "where", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("broadcast all three", {sample_tensor({3, 1}, kBool, 191), sample_tensor({4}, dt, 192), sample_tensor({2, 1, 1}, dt, 193)},
                [](const Inputs& x) { return where(x[0], x[1], x[2]); }, "torch.where(x0, x1, x2)"),
            one("noncontig", {sample_noncontig({3, 4}, kBool, 194), sample_noncontig({3, 4}, dt, 195), sample_tensor({3, 4}, dt, 196)},
                [](const Inputs& x) { return where(x[0], x[1], x[2]); }, "torch.where(x0, x1, x2)"),
            one("promote with float64", {sample_tensor({5}, kBool, 197), sample_tensor({5}, dt, 198), sample_tensor({5}, kFloat64, 199)},
                [](const Inputs& x) { return where(x[0], x[1], x[2]); }, "torch.where(x0, x1, x2)"),
            one("0-dim other ranks lower", {sample_tensor({2, 3}, kBool, 200), sample_tensor({2, 3}, dt, 201), scalar_tensor(2, kInt64)},
                [](const Inputs& x) { return where(x[0], x[1], x[2]); }, "torch.where(x0, x1, x2)"),
            one("scalar other", {sample_tensor({2, 3}, kBool, 202), sample_tensor({2, 3}, dt, 203)},
                [](const Inputs& x) { return where(x[0], x[1], 2.5); }, "torch.where(x0, x1, 2.5)"),
            one("scalar input", {sample_tensor({2, 3}, kBool, 204), sample_tensor({3}, dt, 205)},
                [](const Inputs& x) { return where(x[0], -1, x[1]); }, "torch.where(x0, -1, x1)"),
            one("0-dim cond", {sample_tensor({}, kBool, 206), sample_tensor({2}, dt, 207), sample_tensor({2}, dt, 208)},
                [](const Inputs& x) { return where(x[0], x[1], x[2]); }, "torch.where(x0, x1, x2)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("int cond", [] { where(idx({1, 0}), ones({2}), zeros({2})); }, "DTypeError",
                "where: expected condition to be a bool tensor, got a tensor of dtype int64"),
            err("shapes", [] { where(tensor<bool>({true, false, true}), ones({2, 3}), ones({2})); }, "ShapeError",
                "where"),
        };
      });

  reg(
      r, "where scalars", {kBool},
      [](DType) {
        return std::vector<OpSample>{
            one("int", {sample_tensor({2, 3}, kBool, 209)}, [](const Inputs& x) { return where(x[0], 1, 0); },
                "torch.where(x0, 1, 0)"),
            one("float and int", {sample_tensor({4}, kBool, 210)}, [](const Inputs& x) { return where(x[0], 1.5, 0); },
                "torch.where(x0, 1.5, 0)"),
        };
      },
      [] { return std::vector<OpErrorCase>{}; });
}

void register_join(std::vector<OpSpec>& r) {
  reg(
      r, "cat", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 0 with legacy empty", {sample_tensor({2, 3}, dt, 211), sample_tensor({4, 3}, dt, 212), empty({0}, dt)},
                [](const Inputs& x) { return cat({x[0], x[1], x[2]}); }, "torch.cat([x0, x1, x2])"),
            one("dim -1 noncontig", {sample_noncontig({3, 2}, dt, 213), sample_tensor({3, 4}, dt, 214), sample_noncontig({3, 1}, dt, 215)},
                [](const Inputs& x) { return cat({x[0], x[1], x[2]}, -1); }, "torch.cat([x0, x1, x2], -1)"),
            one("promote with float32", {sample_tensor({2, 2}, dt, 216), sample_tensor({2, 3}, kFloat32, 217)},
                [](const Inputs& x) { return cat({x[0], x[1]}, 1); }, "torch.cat([x0, x1], 1)"),
            one("empty along dim", {sample_tensor({0, 3}, dt, 218), sample_tensor({2, 3}, dt, 219)},
                [](const Inputs& x) { return cat({x[0], x[1]}); }, "torch.cat([x0, x1])"),
            one("3-d middle dim", {sample_tensor({2, 1, 4}, dt, 220), sample_tensor({2, 3, 4}, dt, 221)},
                [](const Inputs& x) { return cat({x[0], x[1]}, 1); }, "torch.cat([x0, x1], 1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("size mismatch", [] { cat({x34(), x34().slice(1, 0, 2)}); }, "ShapeError",
                "sizes of tensors must match except in dimension 0: tensor 0 has shape [3, 4] but tensor 1 has shape "
                "[3, 2]"),
            err("dims differ", [] { cat({x34(), x34()[0]}); }, "ShapeError", "tensor 1 has shape [4] (1 dims)"),
            err("0-dim", [] { cat({scalar_tensor(1.0)}); }, "ShapeError", "zero-dimensional tensor (at position 0)"),
            err("empty list", [] { cat({}); }, "ValueError", "non-empty list"),
            err("dim out of range", [] { cat({x34()}, 2); }, "IndexError", "dimension out of range"),
        };
      });

  reg(
      r, "stack", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 1", {sample_tensor({2, 3}, dt, 231), sample_tensor({2, 3}, dt, 232)},
                [](const Inputs& x) { return stack({x[0], x[1]}, 1); }, "torch.stack([x0, x1], 1)"),
            one("dim -1 noncontig", {sample_noncontig({3, 2}, dt, 233), sample_tensor({3, 2}, dt, 234), sample_noncontig({3, 2}, dt, 235)},
                [](const Inputs& x) { return stack({x[0], x[1], x[2]}, -1); }, "torch.stack([x0, x1, x2], -1)"),
            one("0-dim", {sample_tensor({}, dt, 236), sample_tensor({}, dt, 237)},
                [](const Inputs& x) { return stack({x[0], x[1]}); }, "torch.stack([x0, x1])"),
            one("promote with float32", {sample_tensor({2}, dt, 238), sample_tensor({2}, kFloat32, 239)},
                [](const Inputs& x) { return stack({x[0], x[1]}); }, "torch.stack([x0, x1])"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("shapes differ", [] { stack({x34(), x34().slice(1, 0, 2)}); }, "ShapeError",
                "stack: expects each tensor to be equal size, but got [3, 4] at entry 0 and [3, 2] at entry 1"),
            err("dim out of range", [] { stack({x34()}, 3); }, "IndexError", "dimension out of range"),
        };
      });

  reg(
      r, "repeat", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("tile and lead", {sample_tensor({2, 3}, dt, 241)}, [](const Inputs& x) { return x[0].repeat({2, 1, 2}); },
                "x0.repeat(2, 1, 2)"),
            one("noncontig", {sample_noncontig({3, 2}, dt, 242)}, [](const Inputs& x) { return x[0].repeat({1, 3}); },
                "x0.repeat(1, 3)"),
            one("0-dim", {sample_tensor({}, dt, 243)}, [](const Inputs& x) { return x[0].repeat({3}); },
                "x0.repeat(3)"),
            one("zero repeats", {sample_tensor({2, 3}, dt, 244)}, [](const Inputs& x) { return x[0].repeat({0, 2}); },
                "x0.repeat(0, 2)"),
            one("expanded input", {sample_tensor({3, 1}, dt, 245)},
                [](const Inputs& x) { return x[0].expand({3, 2}).repeat({2, 2}); }, "x0.expand(3, 2).repeat(2, 2)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("too few repeats", [] { x34().repeat({2}); }, "ShapeError", "can not be smaller than the number of dims"),
            err("negative", [] { x34().repeat({-1, 2}); }, "ShapeError", "non-negative"),
        };
      });
}

void register_embedding_one_hot(std::vector<OpSpec>& r) {
  reg(
      r, "embedding", {kFloat32, kFloat64, kBFloat16, kInt64},
      [](DType dt) {
        return std::vector<OpSample>{
            one("2-d indices", {sample_tensor({6, 4}, dt, 251), rand_index(6, {2, 3}, 252)},
                [](const Inputs& x) { return embedding(x[0], x[1]); }, "F.embedding(x1, x0)"),
            one("int32 indices noncontig weight", {sample_noncontig({5, 3}, dt, 253), rand_index(5, {4}, 254).to(kInt32)},
                [](const Inputs& x) { return embedding(x[0], x[1]); }, "F.embedding(x1, x0)"),
            one("0-dim index", {sample_tensor({5, 3}, dt, 255), scalar_tensor(4, kInt64)},
                [](const Inputs& x) { return embedding(x[0], x[1]); }, "F.embedding(x1, x0)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("index out of range", [] { embedding(x34(), idx({1, 7})); }, "IndexError",
                "embedding: index 7 is out of range for an embedding table of 3 entries"),
            err("float indices", [] { embedding(x34(), tensor<float>({1.f})); }, "DTypeError", "int64 or int32"),
            err("1-d weight", [] { embedding(x34()[0], idx({1})); }, "ShapeError", "'weight' must be 2-D"),
        };
      });

  reg(
      r, "one_hot", {kInt64},
      [](DType) {
        return std::vector<OpSample>{
            one("inferred classes", {rand_index(5, {2, 3}, 261)}, [](const Inputs& x) { return one_hot(x[0]); },
                "F.one_hot(x0)"),
            one("num_classes", {rand_index(4, {5}, 262)}, [](const Inputs& x) { return one_hot(x[0], 6); },
                "F.one_hot(x0, 6)"),
            one("noncontig", {rand_index(3, {2, 4}, 263).t()}, [](const Inputs& x) { return one_hot(x[0], 3); },
                "F.one_hot(x0, 3)"),
            one("empty", {empty({0}, kInt64)}, [](const Inputs& x) { return one_hot(x[0], 2); }, "F.one_hot(x0, 2)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("negative", [] { one_hot(idx({0, -2, 1})); }, "ValueError", "class values must be non-negative"),
            err("too large", [] { one_hot(idx({0, 2}), 2); }, "ValueError", "smaller than num_classes (2)"),
            err("empty without num_classes", [] { one_hot(empty({0}, kInt64)); }, "ValueError", "can not infer"),
            err("int32", [] { one_hot(idx({0}).to(kInt32)); }, "DTypeError", "int64"),
        };
      });
}

// Advanced indexing with index tensors (index_put.cpp): x[i], x[i, j], x[mask],
// x[:, i], and x[i] = v / x[i] += v, out of place and into a view.
void register_advanced_index(std::vector<OpSpec>& r) {
  reg(
      r, "index", kAll,
      [](DType dt) {
        return std::vector<OpSample>{
            one("int index, 2-D, negative", {sample_tensor({4, 3}, dt, 401), idx({0, -1, 2, 0}, {2, 2})},
                [](const Inputs& x) { return x[0].index({x[1]}); }, "x0[x1]"),
            one("two int indices broadcast", {sample_tensor({3, 4, 2}, dt, 402), idx({2, 0}, {2, 1}), idx({1, 3, 3})},
                [](const Inputs& x) { return x[0].index({x[1], x[2]}); }, "x0[x1, x2]"),
            one("bool mask, all dims", {sample_tensor({3, 4}, dt, 403), sample_tensor({3, 4}, kBool, 404)},
                [](const Inputs& x) { return x[0].index({x[1]}); }, "x0[x1]"),
            one("bool mask, leading dim", {sample_noncontig({4, 3}, dt, 405), tensor<bool>({true, false, true, true})},
                [](const Inputs& x) { return x[0].index({x[1]}); }, "x0[x1]"),
            one("after a full slice", {sample_tensor({2, 5}, dt, 406), idx({4, 0, 4})},
                [](const Inputs& x) { return x[0].index({Tensor(), x[1]}); }, "x0[:, x1]"),
            one("0-dim index", {sample_tensor({4, 3}, dt, 407), scalar_tensor(2, kInt64)},
                [](const Inputs& x) { return x[0].index({x[1]}); }, "x0[x1]"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("out of range", [] { x34().index({idx({1, 3})}); }, "IndexError",
                "index 3 is out of bounds for dimension 0 with size 3"),
            err("float index", [] { x34().index({tensor<float>({1.f})}); }, "IndexError",
                "tensors used as indices must be int64, int32, bool or uint8, got float32"),
            err("mask shape", [] { x34().index({tensor<bool>({true, false})}); }, "IndexError",
                "the shape of the mask [2] at index 0 does not match the shape of the indexed tensor [3, 4] at dim 0"),
            err("too many", [] { x34().index({idx({0}), idx({0}), idx({0})}); }, "IndexError",
                "too many indices for a tensor of dimension 2"),
            err("not adjacent", [] { zeros({2, 3, 4}).index({idx({0}), Tensor(), idx({1})}); }, "IndexError",
                "must index adjacent dims"),
        };
      });

  reg(
      r, "index_put", kAll,
      [](DType dt) {
        std::vector<OpSample> v{
            one("int index, row values", {sample_tensor({4, 3}, dt, 411), idx({3, 0}), sample_tensor({2, 3}, dt, 412)},
                [](const Inputs& x) { return x[0].index_put({x[1]}, x[2]); }, "x0.index_put((x1,), x2)"),
            one("broadcast values", {sample_tensor({4, 3}, dt, 413), idx({-1, 1}), sample_tensor({3}, dt, 414)},
                [](const Inputs& x) { return x[0].index_put({x[1]}, x[2]); }, "x0.index_put((x1,), x2)"),
            one("bool mask, 0-dim value", {sample_tensor({3, 4}, dt, 415), sample_tensor({3, 4}, kBool, 416),
                                           sample_tensor({}, dt, 417)},
                [](const Inputs& x) { return x[0].index_put({x[1]}, x[2]); }, "x0.index_put((x1,), x2)"),
            one("two indices into a view", {sample_tensor({3, 4}, dt, 418), idx({0, 2}), idx({1, 1}),
                                            sample_tensor({2}, dt, 419)},
                [](const Inputs& x) {
                  Tensor s = x[0].clone();
                  s.t().index_put_({x[2], x[1]}, x[3]);
                  return s;
                },
                "(s := x0.clone(), s.t().index_put_((x2, x1), x3), s)[-1]"),
        };
        if (dt != kBool) {
          v.push_back(one("accumulate, repeated", {sample_tensor({4, 3}, dt, 420), idx({0, 2, 0, -4}),
                                                   sample_tensor({4, 3}, dt, 421)},
                          [](const Inputs& x) { return x[0].index_put({x[1]}, x[2], true); },
                          "x0.index_put((x1,), x2, accumulate=True)"));
        }
        return v;
      },
      [] {
        return std::vector<OpErrorCase>{
            err("values dtype", [] { x34().index_put({idx({0})}, zeros({4}, kFloat64)); }, "DTypeError",
                "the values' dtype must match self's"),
            err("values shape", [] { x34().index_put({idx({0, 1})}, zeros({3})); }, "ShapeError",
                "values of shape [3] cannot be broadcast to the indexed shape [2, 4]"),
            err("out of range leaves self", [] {
                  Tensor x = x34();
                  try {
                    x.index_put_({idx({0, 7})}, zeros({4}));
                  } catch (const IndexError&) {
                    KILN_CHECK(x.equal(x34()), ValueError, "index_put_ wrote before raising");
                    throw;
                  }
                }, "IndexError", "index 7 is out of bounds for dimension 0 with size 3"),
        };
      });
}

}  // namespace

void register_index_ops(std::vector<OpSpec>& r) {
  register_select_gather(r);
  register_scatter(r);
  register_masked_where(r);
  register_advanced_index(r);
  register_join(r);
  register_embedding_one_hot(r);
}

}  // namespace kiln::ops
