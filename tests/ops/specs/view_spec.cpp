// Registry entries (tests/ops/specs/op_spec.h) for the view ops of
// src/ops/view.cpp plus contiguous and clone. Results are compared by value
// with torch; that they are views (shared storage and version counter) is
// checked directly in tests/ops/test_views.cpp, their gradients (and the
// view + in-place errors) in tests/ops/test_views_grad.cpp.
#include "kiln/ops/factory.h"
#include "ops/specs/op_spec.h"

namespace kiln::ops {

namespace {

using Inputs = std::vector<Tensor>;

// A sample whose kiln side returns one tensor.
template <typename F>
OpSample one(std::string label, Inputs inputs, F f, std::string torch) {
  return {std::move(label), std::move(inputs), [f](const Inputs& x) { return std::vector<Tensor>{f(x)}; },
          std::move(torch), {}};
}
// A sample whose kiln side returns several tensors (torch: a tuple).
template <typename F>
OpSample many(std::string label, Inputs inputs, F f, std::string torch) {
  return {std::move(label), std::move(inputs), [f](const Inputs& x) { return std::vector<Tensor>(f(x)); },
          std::move(torch), {}};
}

OpErrorCase err(std::string label, std::function<void()> run, std::string type, std::string contains) {
  return {std::move(label), std::move(run), std::move(type), std::move(contains)};
}

const std::vector<DType> kAll = {kFloat32, kFloat64, kBFloat16, kInt64, kBool};

Tensor a23() { return arange(6, kFloat32).view({2, 3}); }

// Every op here is differentiable in its one input: floating samples check
// backward on x0 (all samples are small enough for the numerical check).
std::function<std::vector<OpSample>(DType)> with_grad(std::function<std::vector<OpSample>(DType)> samples) {
  return [samples = std::move(samples)](DType dt) {
    std::vector<OpSample> v = samples(dt);
    if (is_floating_point(dt)) {
      for (OpSample& s : v) s.grad_inputs = {0};
    }
    return v;
  };
}

void reg(std::vector<OpSpec>& r, std::string name, std::function<std::vector<OpSample>(DType)> samples,
         std::function<std::vector<OpErrorCase>()> errors = nullptr) {
  OpSpec s;
  s.name = std::move(name);
  s.dtypes = kAll;
  s.samples = with_grad(std::move(samples));
  s.differentiable = true;
  s.errors = errors ? std::move(errors) : [] { return std::vector<OpErrorCase>{}; };
  r.push_back(std::move(s));
}

}  // namespace

void register_view_ops(std::vector<OpSpec>& r) {
  reg(
      r, "view",
      [](DType dt) {
        return std::vector<OpSample>{
            one("infer", {sample_tensor({2, 3, 4}, dt, 1)}, [](const Inputs& x) { return x[0].view({4, -1}); },
                "x0.view(4, -1)"),
            // A transposed tensor can still split its (strided) leading dim.
            one("noncontig split dim", {sample_tensor({4, 6}, dt, 2).t()},
                [](const Inputs& x) { return x[0].view({2, 3, 4}); }, "x0.view(2, 3, 4)"),
            one("0-dim", {sample_tensor({}, dt, 3)}, [](const Inputs& x) { return x[0].view({1, 1}); },
                "x0.view(1, 1)"),
            one("empty", {sample_tensor({0, 3}, dt, 4)}, [](const Inputs& x) { return x[0].view({3, 0}); },
                "x0.view(3, 0)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("incompatible strides", [] { a23().t().view({6}); }, "ShapeError", "use .reshape"),
            err("bad numel", [] { a23().view({4, -1}); }, "ShapeError", "is invalid for input of shape [2, 3]"),
            err("two -1", [] { a23().view({-1, -1}); }, "ShapeError", "only one dimension can be inferred"),
        };
      });

  reg(
      r, "reshape",
      [](DType dt) {
        return std::vector<OpSample>{
            one("viewable", {sample_tensor({2, 3, 4}, dt, 5)}, [](const Inputs& x) { return x[0].reshape({-1, 2}); },
                "x0.reshape(-1, 2)"),
            one("noncontig copies", {sample_noncontig({3, 4}, dt, 6)},
                [](const Inputs& x) { return x[0].reshape({12}); }, "x0.reshape(12)"),
            one("noncontig 3-d", {sample_noncontig({2, 3, 4}, dt, 7)},
                [](const Inputs& x) { return x[0].reshape({6, 4}); }, "x0.reshape(6, 4)"),
            one("0-dim", {sample_tensor({}, dt, 8)}, [](const Inputs& x) { return x[0].reshape({-1}); },
                "x0.reshape(-1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("bad numel", [] { a23().reshape({5}); }, "ShapeError", "is invalid for input of shape [2, 3]"),
        };
      });

  reg(
      r, "transpose",
      [](DType dt) {
        return std::vector<OpSample>{
            one("dims 0 2", {sample_tensor({2, 3, 4}, dt, 9)}, [](const Inputs& x) { return x[0].transpose(0, 2); },
                "x0.transpose(0, 2)"),
            one("negative dims", {sample_tensor({2, 3, 4}, dt, 10)},
                [](const Inputs& x) { return x[0].transpose(-1, -2); }, "x0.transpose(-1, -2)"),
            one("noncontig", {sample_noncontig({3, 5}, dt, 11)}, [](const Inputs& x) { return x[0].transpose(0, 1); },
                "x0.transpose(0, 1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("dim out of range", [] { a23().transpose(0, 2); }, "IndexError", "dimension out of range"),
        };
      });

  reg(
      r, "permute",
      [](DType dt) {
        return std::vector<OpSample>{
            one("3-d", {sample_tensor({2, 3, 4}, dt, 12)}, [](const Inputs& x) { return x[0].permute({2, 0, 1}); },
                "x0.permute(2, 0, 1)"),
            one("negative dims noncontig", {sample_noncontig({2, 3, 4}, dt, 13)},
                [](const Inputs& x) { return x[0].permute({-1, 0, -2}); }, "x0.permute(-1, 0, -2)"),
            one("0-dim", {sample_tensor({}, dt, 14)}, [](const Inputs& x) { return x[0].permute({}); },
                "x0.permute([])"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("repeated dim", [] { a23().permute({1, 1}); }, "ShapeError", "appears more than once"),
            err("wrong count", [] { a23().permute({1}); }, "ShapeError", "does not match"),
        };
      });

  reg(
      r, "t",
      [](DType dt) {
        return std::vector<OpSample>{
            one("2-d", {sample_tensor({3, 5}, dt, 15)}, [](const Inputs& x) { return x[0].t(); }, "x0.t()"),
            one("1-d", {sample_tensor({4}, dt, 16)}, [](const Inputs& x) { return x[0].t(); }, "x0.t()"),
            one("noncontig", {sample_noncontig({4, 3}, dt, 17)}, [](const Inputs& x) { return x[0].t(); }, "x0.t()"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("3-d", [] { arange(24).view({2, 3, 4}).t(); }, "ShapeError", "<= 2 dimensions"),
        };
      });

  reg(r, "squeeze", [](DType dt) {
    return std::vector<OpSample>{
        one("all", {sample_tensor({1, 3, 1, 2}, dt, 18)}, [](const Inputs& x) { return x[0].squeeze(); },
            "x0.squeeze()"),
        one("one dim", {sample_tensor({1, 3, 1, 2}, dt, 19)}, [](const Inputs& x) { return x[0].squeeze(2); },
            "x0.squeeze(2)"),
        one("not size 1", {sample_tensor({1, 3, 1, 2}, dt, 20)}, [](const Inputs& x) { return x[0].squeeze(-1); },
            "x0.squeeze(-1)"),
        one("0-dim", {sample_tensor({}, dt, 21)}, [](const Inputs& x) { return x[0].squeeze(0); }, "x0.squeeze(0)"),
    };
  });

  reg(
      r, "unsqueeze",
      [](DType dt) {
        return std::vector<OpSample>{
            one("front", {sample_tensor({3, 2}, dt, 22)}, [](const Inputs& x) { return x[0].unsqueeze(0); },
                "x0.unsqueeze(0)"),
            one("back noncontig", {sample_noncontig({3, 2}, dt, 23)},
                [](const Inputs& x) { return x[0].unsqueeze(-1); }, "x0.unsqueeze(-1)"),
            one("0-dim", {sample_tensor({}, dt, 24)}, [](const Inputs& x) { return x[0].unsqueeze(0); },
                "x0.unsqueeze(0)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("dim out of range", [] { a23().unsqueeze(3); }, "IndexError", "dimension out of range"),
        };
      });

  reg(
      r, "expand",
      [](DType dt) {
        return std::vector<OpSample>{
            one("broadcast", {sample_tensor({3, 1}, dt, 25)}, [](const Inputs& x) { return x[0].expand({2, 3, 4}); },
                "x0.expand(2, 3, 4)"),
            one("-1 keeps", {sample_tensor({1, 4}, dt, 26)}, [](const Inputs& x) { return x[0].expand({3, -1}); },
                "x0.expand(3, -1)"),
            one("0-dim", {sample_tensor({}, dt, 27)}, [](const Inputs& x) { return x[0].expand({2, 2}); },
                "x0.expand(2, 2)"),
            one("noncontig", {sample_noncontig({1, 3}, dt, 28)}, [](const Inputs& x) { return x[0].expand({2, 3}); },
                "x0.expand(2, 3)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("bad size", [] { arange(3).expand({2, 4}); }, "ShapeError", "must match the existing size (3)"),
            err("fewer dims", [] { a23().expand({3}); }, "ShapeError", "fewer dims"),
            err("leading -1", [] { arange(3).expand({-1, 3}); }, "ShapeError", "not allowed in a new leading dim"),
        };
      });

  reg(
      r, "narrow",
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 1", {sample_tensor({3, 5}, dt, 29)}, [](const Inputs& x) { return x[0].narrow(1, 1, 3); },
                "x0.narrow(1, 1, 3)"),
            one("negative start noncontig", {sample_noncontig({4, 3}, dt, 30)},
                [](const Inputs& x) { return x[0].narrow(0, -3, 2); }, "x0.narrow(0, -3, 2)"),
            one("empty", {sample_tensor({3, 5}, dt, 31)}, [](const Inputs& x) { return x[0].narrow(1, 5, 0); },
                "x0.narrow(1, 5, 0)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("too long", [] { a23().narrow(1, 2, 2); }, "IndexError", "exceeds dimension 1 of size 3"),
        };
      });

  reg(
      r, "slice",
      [](DType dt) {
        return std::vector<OpSample>{
            one("step 2", {sample_tensor({4, 7}, dt, 32)}, [](const Inputs& x) { return x[0].slice(1, 1, std::nullopt, 2); },
                "x0[:, 1::2]"),
            one("step 3 clamped end", {sample_tensor({10}, dt, 33)},
                [](const Inputs& x) { return x[0].slice(0, 1, 100, 3); }, "x0[1:100:3]"),
            one("negative start", {sample_noncontig({5, 3}, dt, 34)},
                [](const Inputs& x) { return x[0].slice(0, -3); }, "x0[-3:]"),
            one("empty", {sample_tensor({10}, dt, 35)}, [](const Inputs& x) { return x[0].slice(0, 7, 2); },
                "x0[7:2]"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("zero step", [] { a23().slice(0, 0, 2, 0); }, "ValueError", "step must be positive"),
        };
      });

  reg(
      r, "select",
      [](DType dt) {
        return std::vector<OpSample>{
            one("dim 1", {sample_tensor({3, 4, 2}, dt, 36)}, [](const Inputs& x) { return x[0].select(1, 2); },
                "x0.select(1, 2)"),
            one("negative index", {sample_noncontig({3, 4}, dt, 37)}, [](const Inputs& x) { return x[0].select(0, -1); },
                "x0.select(0, -1)"),
            one("to 0-dim", {sample_tensor({5}, dt, 38)}, [](const Inputs& x) { return x[0].select(0, 3); },
                "x0.select(0, 3)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("out of range", [] { a23().select(1, 3); }, "IndexError",
                "index 3 is out of bounds for dimension 1 with size 3"),
            err("negative out of range", [] { a23().select(0, -3); }, "IndexError", "index -3 is out of bounds"),
            err("0-dim", [] { arange(1).view({}).select(0, 0); }, "IndexError", "0-dim"),
        };
      });

  reg(
      r, "flatten",
      [](DType dt) {
        return std::vector<OpSample>{
            one("middle dims", {sample_tensor({2, 3, 4, 2}, dt, 39)},
                [](const Inputs& x) { return x[0].flatten(1, 2); }, "x0.flatten(1, 2)"),
            one("all noncontig", {sample_noncontig({3, 4}, dt, 40)}, [](const Inputs& x) { return x[0].flatten(); },
                "x0.flatten()"),
            one("0-dim", {sample_tensor({}, dt, 41)}, [](const Inputs& x) { return x[0].flatten(); }, "x0.flatten()"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("start after end", [] { a23().flatten(1, 0); }, "ValueError", "must not come after"),
        };
      });

  reg(
      r, "unflatten",
      [](DType dt) {
        return std::vector<OpSample>{
            one("infer", {sample_tensor({2, 6}, dt, 42)}, [](const Inputs& x) { return x[0].unflatten(1, {2, -1}); },
                "x0.unflatten(1, (2, -1))"),
            one("noncontig", {sample_noncontig({6, 2}, dt, 43)},
                [](const Inputs& x) { return x[0].unflatten(0, {3, 2}); }, "x0.unflatten(0, (3, 2))"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("bad sizes", [] { a23().unflatten(1, {2, 2}); }, "ShapeError", "is invalid"),
        };
      });

  reg(r, "split", [](DType dt) {
    return std::vector<OpSample>{
        many("uneven", {sample_tensor({3, 5}, dt, 44)}, [](const Inputs& x) { return x[0].split(2, 1); },
             "x0.split(2, 1)"),
        many("noncontig", {sample_noncontig({4, 3}, dt, 45)}, [](const Inputs& x) { return x[0].split(3); },
             "x0.split(3)"),
    };
  });

  reg(
      r, "split_with_sizes",
      [](DType dt) {
        return std::vector<OpSample>{
            many("sizes", {sample_tensor({3, 5}, dt, 46)},
                 [](const Inputs& x) { return x[0].split_with_sizes({1, 0, 4}, -1); }, "x0.split([1, 0, 4], -1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("bad sum", [] { a23().split_with_sizes({1, 1}, 1); }, "ShapeError", "sum to 2 but dimension 1"),
        };
      });

  reg(
      r, "chunk",
      [](DType dt) {
        return std::vector<OpSample>{
            many("uneven", {sample_tensor({5, 2}, dt, 47)}, [](const Inputs& x) { return x[0].chunk(3); },
                 "x0.chunk(3)"),
            many("more chunks than size", {sample_noncontig({2, 3}, dt, 48)},
                 [](const Inputs& x) { return x[0].chunk(4, 1); }, "x0.chunk(4, 1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("zero chunks", [] { a23().chunk(0); }, "ValueError", "must be positive"),
        };
      });

  reg(r, "unbind", [](DType dt) {
    return std::vector<OpSample>{
        many("dim 1", {sample_tensor({2, 3}, dt, 49)}, [](const Inputs& x) { return x[0].unbind(1); },
             "x0.unbind(1)"),
        many("noncontig", {sample_noncontig({3, 2}, dt, 50)}, [](const Inputs& x) { return x[0].unbind(0); },
             "x0.unbind(0)"),
    };
  });

  reg(
      r, "as_strided",
      [](DType dt) {
        return std::vector<OpSample>{
            one("overlapping windows", {sample_tensor({12}, dt, 51)},
                [](const Inputs& x) { return x[0].as_strided({3, 4}, {2, 1}, 1); },
                "torch.as_strided(x0, (3, 4), (2, 1), 1)"),
            one("transpose-like", {sample_tensor({3, 4}, dt, 52)},
                [](const Inputs& x) { return x[0].as_strided({4, 3}, {1, 4}); }, "torch.as_strided(x0, (4, 3), (1, 4))"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("beyond storage", [] { arange(6).as_strided({2, 2}, {1, 3}, 2); }, "IndexError",
                "beyond the storage's 6 elements"),
            err("negative stride", [] { arange(6).as_strided({2}, {-1}); }, "ShapeError", "negative"),
        };
      });

  reg(
      r, "diagonal",
      [](DType dt) {
        return std::vector<OpSample>{
            one("main", {sample_tensor({3, 4}, dt, 53)}, [](const Inputs& x) { return x[0].diagonal(); },
                "x0.diagonal()"),
            one("offset +1 dims 0 2", {sample_tensor({3, 4, 5}, dt, 54)},
                [](const Inputs& x) { return x[0].diagonal(1, 0, 2); }, "x0.diagonal(1, 0, 2)"),
            one("offset -1 dims 2 1", {sample_tensor({3, 4, 5}, dt, 55)},
                [](const Inputs& x) { return x[0].diagonal(-1, 2, 1); }, "x0.diagonal(-1, 2, 1)"),
            one("offset past the end", {sample_tensor({3, 4}, dt, 56)},
                [](const Inputs& x) { return x[0].diagonal(5); }, "x0.diagonal(5)"),
            one("noncontig", {sample_noncontig({4, 3}, dt, 57)}, [](const Inputs& x) { return x[0].diagonal(-1); },
                "x0.diagonal(-1)"),
        };
      },
      [] {
        return std::vector<OpErrorCase>{
            err("same dims", [] { a23().diagonal(0, 1, -1); }, "ValueError", "cannot be identical"),
            err("1-d", [] { arange(3).diagonal(); }, "ShapeError", "at least 2 dims"),
        };
      });

  reg(r, "contiguous", [](DType dt) {
    return std::vector<OpSample>{
        one("noncontig", {sample_noncontig({3, 4}, dt, 58)}, [](const Inputs& x) { return x[0].contiguous(); },
            "x0.contiguous()"),
        one("expanded", {sample_tensor({3, 1}, dt, 59)}, [](const Inputs& x) { return x[0].expand({3, 4}).contiguous(); },
            "x0.expand(3, 4).contiguous()"),
        one("contiguous", {sample_tensor({2, 3}, dt, 60)}, [](const Inputs& x) { return x[0].contiguous(); },
            "x0.contiguous()"),
    };
  });

  reg(r, "clone", [](DType dt) {
    return std::vector<OpSample>{
        one("noncontig", {sample_noncontig({2, 3, 4}, dt, 61)}, [](const Inputs& x) { return x[0].clone(); },
            "x0.clone()"),
        one("0-dim", {sample_tensor({}, dt, 62)}, [](const Inputs& x) { return x[0].clone(); }, "x0.clone()"),
        one("empty", {sample_tensor({0, 4}, dt, 63)}, [](const Inputs& x) { return x[0].clone(); }, "x0.clone()"),
    };
  });
}

}  // namespace kiln::ops
