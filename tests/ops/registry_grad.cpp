#include "ops/registry_grad.h"

#include <algorithm>
#include <set>

#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/compare.h"

namespace kiln::test {

using ops::OpSample;
using ops::OpSpec;
using ops::Tolerance;

namespace {

// FNV-1a: a seed that is the same on every platform for the same id.
uint64_t seed_of(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

// The sample's inputs with each grad input replaced by a leaf that requires
// grad. detach() gives a new TensorImpl over the same storage with the same
// sizes, strides and offset, so a non-contiguous or expanded layout is kept
// and the sample's own tensors (shared with other tests) gain no autograd state.
TensorList grad_leaves(const OpSample& s) {
  TensorList in = s.inputs;
  for (int i : s.grad_inputs) in[i] = s.inputs[i].detach().requires_grad_();
  return in;
}

bool all_zero(const Tensor& t) {
  Tensor c = t.detach().to(kFloat64).contiguous();
  const double* p = c.data_ptr<double>();
  return std::all_of(p, p + c.numel(), [](double v) { return v == 0; });
}

// A float64 copy of a floating tensor (never the tensor itself: gradcheck
// marks it requires_grad and perturbs it) with the same strides where that
// layout holds each element once; expanded (stride-0) inputs become
// contiguous, as perturbing one element of an expanded tensor would move all
// its copies.
Tensor to_float64_keep_layout(const Tensor& t) {
  if (!t.is_floating_point()) return t;
  bool overlapping = false;
  for (int64_t d = 0; d < t.dim(); ++d) overlapping |= t.strides()[d] == 0 && t.sizes()[d] > 1;
  if (t.is_contiguous() || overlapping) return t.to(kFloat64, /*copy=*/true).contiguous();
  Tensor out = empty_strided(t.sizes(), t.strides(), kFloat64);
  out.copy_(t);
  return out;
}

int64_t total_numel(const TensorList& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += t.defined() ? t.numel() : 0;
  return n;
}

}  // namespace

std::string describe_inputs(const std::vector<Tensor>& inputs) {
  std::string s;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& t = inputs[k];
    s += (k ? ", x" : "x") + std::to_string(k) + ": " +
         (t.defined() ? std::string(dtype_name(t.dtype())) + shape_str(t.sizes()) +
                            (t.is_contiguous() ? "" : " strides " + shape_str(t.strides()))
                      : "undefined");
  }
  return s.empty() ? "no inputs" : s;
}

std::vector<std::string> grad_inputs_problems(const OpSample& s) {
  std::vector<std::string> out;
  std::set<int> seen;
  for (int i : s.grad_inputs) {
    if (i < 0 || static_cast<size_t>(i) >= s.inputs.size()) {
      out.push_back("grad input " + std::to_string(i) + " is out of range (the sample has " +
                    std::to_string(s.inputs.size()) + " inputs)");
    } else if (!s.inputs[i].defined() || !s.inputs[i].is_floating_point()) {
      out.push_back("grad input x" + std::to_string(i) + " is " +
                    (s.inputs[i].defined() ? std::string(dtype_name(s.inputs[i].dtype())) : "undefined") +
                    "; only floating inputs have gradients");
    }
    if (!seen.insert(i).second) out.push_back("grad input " + std::to_string(i) + " is listed twice");
  }
  return out;
}

GradCase add_grad_case(OracleBatch& oracle, const std::string& id, const OpSample& s) {
  GradCase c;
  if (auto p = grad_inputs_problems(s); !p.empty()) {
    c.error = p.front();
    return c;
  }
  TensorList outs;
  try {
    outs = s.run(grad_leaves(s));
  } catch (const std::exception& e) {
    c.error = std::string("kiln threw: ") + e.what();
    return c;
  }
  for (size_t k = 0; k < outs.size(); ++k) {
    const Tensor& o = outs[k];
    if (!o.defined() || !o.is_floating_point()) {
      c.grad_outputs.emplace_back();
      continue;
    }
    Generator gen(seed_of(id + "/grad_output " + std::to_string(k)));
    c.grad_outputs.push_back(randn(o.sizes(), kFloat32, &gen).to(o.dtype()));
  }
  c.oracle_case = oracle.add_grad(id, s.torch, s.inputs, s.grad_inputs, c.grad_outputs);
  return c;
}

Tolerance grad_tolerance(const OpSpec& spec, DType dt) {
  if (spec.grad_tolerance) return spec.grad_tolerance(dt);
  Tolerance t = spec.tolerance ? spec.tolerance(dt) : ops::default_tolerance(dt);
  if (dt == kFloat32) {
    t.rtol = std::max(t.rtol, 1e-4);
    t.atol = std::max(t.atol, 1e-5);
  }
  return t;
}

std::vector<std::string> check_grad_against_torch(const std::string& op, const OpSample& s, const GradCase& c,
                                                  const OracleOutcome& want, Tolerance tol) {
  std::vector<std::string> fails;
  if (!c.error.empty()) return {c.error};
  if (!want.ok) return {"torch.autograd.grad raised: " + want.error};
  const TensorList leaves = grad_leaves(s);
  for (int i : s.grad_inputs) {
    if (leaves[i].strides() != s.inputs[i].strides() || leaves[i].storage_offset() != s.inputs[i].storage_offset()) {
      fails.push_back("the leaf made for x" + std::to_string(i) + " lost the sample's layout (strides " +
                      shape_str(leaves[i].strides()) + " vs " + shape_str(s.inputs[i].strides()) + ")");
    }
  }
  TensorList outs;
  try {
    outs = s.run(leaves);
  } catch (const std::exception& e) {
    return {std::string("kiln threw on inputs that require grad: ") + e.what()};
  }
  if (outs.size() != c.grad_outputs.size() || want.output_requires_grad.size() != outs.size()) {
    return {"kiln returned " + std::to_string(outs.size()) + " outputs, " + std::to_string(c.grad_outputs.size()) +
            " when the case was prepared and torch " + std::to_string(want.output_requires_grad.size())};
  }
  TensorList used, used_go, xs;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!c.grad_outputs[k].defined()) continue;
    const bool kiln_rg = outs[k].requires_grad(), torch_rg = want.output_requires_grad[k];
    if (!kiln_rg && torch_rg) {
      fails.push_back("op " + op + " has grad_inputs but its output " + std::to_string(k) +
                      " does not require grad: backward not implemented (no grad_fn was recorded; torch records "
                      "one for this output)");
    } else if (kiln_rg && !torch_rg) {
      fails.push_back("output " + std::to_string(k) + " requires grad in kiln (grad_fn " +
                      (outs[k].grad_fn() ? outs[k].grad_fn()->name() : "none") +
                      ") but not in torch, which treats it as not differentiable");
    } else if (kiln_rg) {
      used.push_back(outs[k]);
      used_go.push_back(c.grad_outputs[k]);
    }
  }
  if (!fails.empty()) return fails;
  for (int i : s.grad_inputs) xs.push_back(leaves[i]);
  TensorList got(xs.size());
  if (!used.empty()) {
    try {
      got = autograd::grad(used, xs, used_go, std::nullopt, false, /*allow_unused=*/true);
    } catch (const std::exception& e) {
      return {std::string("kiln's backward threw: ") + e.what()};
    }
  }
  if (want.outputs.size() != xs.size()) {
    return {"torch returned " + std::to_string(want.outputs.size()) + " gradients for " + std::to_string(xs.size()) +
            " grad inputs"};
  }
  for (size_t k = 0; k < xs.size(); ++k) {
    const std::string which = "gradient of x" + std::to_string(s.grad_inputs[k]);
    const Tensor& g = got[k];
    const Tensor& w = want.outputs[k];
    if (!g.defined() || !w.defined()) {
      // Undefined on one side equals all zeros on the other (torch: None when unused).
      if (g.defined() && !all_zero(g)) fails.push_back(which + ": torch returned None (unused), kiln nonzero values");
      if (w.defined() && !all_zero(w)) fails.push_back(which + ": kiln returned none (unused), torch nonzero values");
      continue;
    }
    const auto r = compare_tensors(g, w, tol.rtol, tol.atol);
    if (!r.ok) fails.push_back(which + ": " + r.message);
  }
  return fails;
}

std::vector<std::string> check_gradcheck(const std::string& op, const OpSample& s) {
  if (auto p = grad_inputs_problems(s); !p.empty()) return p;
  TensorList in;
  for (const Tensor& t : s.inputs) in.push_back(t.defined() ? to_float64_keep_layout(t) : t);
  TensorList xs;
  for (int i : s.grad_inputs) {
    in[i].requires_grad_();
    xs.push_back(in[i]);
  }
  autograd::GradcheckOptions opts;
  try {
    const int64_t out_numel = total_numel(s.run(in));
    opts.fast_mode = total_numel(xs) > kFastModeNumel || out_numel > kFastModeNumel;
    autograd::gradcheck([&s](const TensorList& x) { return s.run(x); }, in, opts);
  } catch (const std::exception& e) {
    return {std::string("float64 gradcheck") + (opts.fast_mode ? " (fast mode)" : "") + " of " + op +
            " failed: " + e.what()};
  }
  return {};
}

}  // namespace kiln::test
