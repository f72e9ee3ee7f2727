#include "kiln/ops/gradcheck.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kiln/autograd/engine.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"

namespace kiln::autograd {

namespace {

// Address of element `flat` (row-major order) of a float64 view.
double* element_ptr(const Tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t s = t.sizes()[d];
    off += (flat % s) * t.strides()[d];
    flat /= s;
  }
  return static_cast<double*>(t.data_ptr()) + off;
}

// Flattened float64 copy of the outputs, concatenated.
std::vector<double> flatten_outputs(const TensorList& outs) {
  std::vector<double> v;
  for (const Tensor& o : outs) {
    if (!o.defined()) continue;
    Tensor c = o.detach().to(kFloat64).contiguous();
    const double* p = c.data_ptr<double>();
    v.insert(v.end(), p, p + c.numel());
  }
  return v;
}

// Row-major float64 values of any tensor (for dot products in fast mode).
std::vector<double> values(const Tensor& t) {
  Tensor c = t.detach().to(kFloat64).contiguous();
  const double* p = c.data_ptr<double>();
  return std::vector<double>(p, p + c.numel());
}

// A random unit vector of n entries, uniform in [0, 1) before normalising (torch's choice).
std::vector<double> unit_vector(int64_t n, Generator& gen) {
  std::vector<double> v;
  if (n == 0) return v;
  Tensor r = rand({n}, kFloat64, &gen);
  v = values(r);
  double norm = 0;
  for (double x : v) norm += x * x;
  norm = std::sqrt(norm);
  if (norm > 0) {
    for (double& x : v) x /= norm;
  }
  return v;
}

// A tensor shaped and typed like `like` holding `vals` (row-major).
Tensor tensor_like(const std::vector<double>& vals, const Tensor& like) {
  Tensor t = empty(like.sizes(), kFloat64);
  std::copy(vals.begin(), vals.end(), t.data_ptr<double>());
  return like.dtype() == kFloat64 ? t : t.to(like.dtype());
}

double dot(const std::vector<double>& a, const double* b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

double sum_of(const std::vector<double>& a) {
  double s = 0;
  for (double x : a) s += x;
  return s;
}

// Fast mode: u_j^T J_jk v_k for every (output j, input k) pair.
bool fast_gradcheck(const DifferentiableFn& fn, const TensorList& inputs, const std::vector<size_t>& diff,
                    const GradcheckOptions& opts) {
  Generator gen(opts.seed);
  std::vector<std::vector<double>> v(diff.size());
  for (size_t k = 0; k < diff.size(); ++k) v[k] = unit_vector(inputs[diff[k]].numel(), gen);

  TensorList outs = fn(inputs);
  std::vector<std::vector<double>> u(outs.size());
  std::vector<size_t> out_offset(outs.size() + 1, 0);  // where output j starts in flatten_outputs
  for (size_t j = 0; j < outs.size(); ++j) {
    const int64_t n = outs[j].defined() ? outs[j].numel() : 0;
    u[j] = unit_vector(n, gen);
    out_offset[j + 1] = out_offset[j] + static_cast<size_t>(n);
  }

  // Numerical: J_k v_k for each input k, by central differences along v_k.
  std::vector<std::vector<double>> jv(diff.size());
  for (size_t k = 0; k < diff.size(); ++k) {
    const Tensor& x = inputs[diff[k]];
    const int64_t n = x.numel();
    std::vector<double*> ptrs(static_cast<size_t>(n));
    std::vector<double> orig(static_cast<size_t>(n));
    for (int64_t e = 0; e < n; ++e) {
      ptrs[e] = element_ptr(x, e);
      orig[e] = *ptrs[e];
    }
    for (int64_t e = 0; e < n; ++e) *ptrs[e] = orig[e] + opts.eps * v[k][e];
    const auto plus = flatten_outputs(fn(inputs));
    for (int64_t e = 0; e < n; ++e) *ptrs[e] = orig[e] - opts.eps * v[k][e];
    const auto minus = flatten_outputs(fn(inputs));
    for (int64_t e = 0; e < n; ++e) *ptrs[e] = orig[e];
    KILN_CHECK(plus.size() == out_offset.back() && minus.size() == plus.size(), ValueError,
               "gradcheck: the function returned outputs of different sizes for perturbed inputs");
    jv[k].resize(plus.size());
    for (size_t o = 0; o < plus.size(); ++o) jv[k][o] = (plus[o] - minus[o]) / (2 * opts.eps);
  }

  // Analytical: J_j^T u_j for each output j, one backward each, dotted with v_k.
  TensorList diff_inputs;
  for (size_t i : diff) diff_inputs.push_back(inputs[i]);
  double worst = 0;
  std::string worst_msg;
  for (size_t j = 0; j < outs.size(); ++j) {
    const Tensor& o = outs[j];
    if (!o.defined() || o.numel() == 0) continue;
    TensorList g(diff.size());
    if (o.requires_grad()) {
      Tensor uj = tensor_like(u[j], o);
      g = grad({o}, diff_inputs, {uj}, /*retain_graph=*/true, false, /*allow_unused=*/true);
    }
    for (size_t k = 0; k < diff.size(); ++k) {
      if (v[k].empty()) continue;
      double a = 0;
      if (g[k].defined()) {
        const auto gk = values(g[k]);
        a = dot(v[k], gk.data(), gk.size());
      }
      const double n = dot(u[j], jv[k].data() + out_offset[j], u[j].size());
      const double atol = opts.atol * sum_of(u[j]) * sum_of(v[k]);
      const double err = std::fabs(a - n);
      const double allowed = atol + opts.rtol * std::fabs(n);
      if (err > allowed && err - allowed > worst) {
        worst = err - allowed;
        std::ostringstream os;
        os << "gradcheck (fast mode): mismatch for output " << j << " w.r.t. input " << diff[k]
           << ": analytical u^T J v " << a << ", numerical " << n << " (|diff| " << err << " > atol " << atol
           << " + rtol " << opts.rtol << " * |numerical|)"
           << (o.requires_grad() ? "" : "; the output does not require grad, but its numerical derivative is nonzero")
           << ". Rerun with fast_mode=false to see which Jacobian entries differ";
        worst_msg = os.str();
      }
    }
  }
  if (worst > 0) {
    KILN_CHECK(!opts.raise, ValueError, worst_msg);
    return false;
  }
  return true;
}

// gradcheck of the first-order function checks only its derivatives: a
// create_graph backward that returns a wrong (say undefined, read as absent)
// gradient at every point passes it. So the create_graph gradients must also
// equal the plain backward's, defined wherever those are.
bool first_order_agrees(const DifferentiableFn& fn, const TensorList& inputs, const TensorList& vs,
                        const std::vector<size_t>& diff, const TensorList& graph, const GradcheckOptions& opts) {
  const TensorList outs = fn(inputs);
  TensorList used_out, used_v, diff_inputs;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (outs[k].defined() && outs[k].requires_grad()) {
      used_out.push_back(outs[k]);
      used_v.push_back(vs[k].detach());
    }
  }
  for (size_t i : diff) diff_inputs.push_back(inputs[i]);
  const TensorList plain = grad(used_out, diff_inputs, used_v, /*retain_graph=*/false, false, /*allow_unused=*/true);
  for (size_t k = 0; k < diff.size(); ++k) {
    std::ostringstream os;
    if (plain[k].defined() && !graph[k].defined()) {
      os << "gradgradcheck: the create_graph=true gradient w.r.t. input " << diff[k]
         << " is undefined, but the plain backward gives one; a backward's create_graph branch lost the input "
            "(a tensor saved without history?)";
    } else if (plain[k].defined()) {
      const std::vector<double> a = values(graph[k]), b = values(plain[k]);
      for (size_t e = 0; e < a.size() && os.tellp() == 0; ++e) {
        if (std::fabs(a[e] - b[e]) > opts.atol + opts.rtol * std::fabs(b[e])) {
          os << "gradgradcheck: the create_graph=true gradient w.r.t. input " << diff[k] << " element " << e << " is "
             << a[e] << ", the plain backward's " << b[e];
        }
      }
    }
    if (os.tellp() == 0) continue;
    KILN_CHECK(!opts.raise, ValueError, os.str());
    return false;
  }
  return true;
}

}  // namespace

bool gradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts) {
  std::vector<size_t> diff;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !inputs[i].requires_grad()) continue;
    KILN_CHECK(inputs[i].dtype() == kFloat64, DTypeError, "gradcheck: input ", i, " requires grad but is ",
               dtype_name(inputs[i].dtype()), "; finite differences need float64 inputs (convert with .to(kFloat64))");
    diff.push_back(i);
  }
  KILN_CHECK(!diff.empty(), ValueError, "gradcheck: no input requires grad");
  if (opts.fast_mode) return fast_gradcheck(fn, inputs, diff, opts);

  // Numerical Jacobian: column per input element, by central differences.
  // Grad mode stays on: gradgradcheck's function itself calls grad().
  // Perturbing through the raw pointer leaves version counters untouched.
  std::vector<std::vector<std::vector<double>>> numerical(diff.size());  // [input][elem][out]
  {
    for (size_t k = 0; k < diff.size(); ++k) {
      const Tensor& x = inputs[diff[k]];
      numerical[k].resize(x.numel());
      for (int64_t e = 0; e < x.numel(); ++e) {
        double* p = element_ptr(x, e);
        const double orig = *p;
        *p = orig + opts.eps;
        const auto plus = flatten_outputs(fn(inputs));
        *p = orig - opts.eps;
        const auto minus = flatten_outputs(fn(inputs));
        *p = orig;
        auto& col = numerical[k][e];
        col.resize(plus.size());
        for (size_t o = 0; o < plus.size(); ++o) col[o] = (plus[o] - minus[o]) / (2 * opts.eps);
      }
    }
  }

  // Analytical Jacobian: one vector-Jacobian product per output element.
  TensorList outs = fn(inputs);
  TensorList diff_inputs;
  for (size_t i : diff) diff_inputs.push_back(inputs[i]);
  size_t out_flat = 0;
  double worst = 0;
  std::string worst_msg;
  for (size_t oi = 0; oi < outs.size(); ++oi) {
    const Tensor& o = outs[oi];
    if (!o.defined()) continue;
    for (int64_t m = 0; m < o.numel(); ++m, ++out_flat) {
      std::vector<double> rows;
      if (o.requires_grad()) {
        TensorList grad_outputs;
        TensorList used_outputs;
        Tensor onehot = zeros(o.sizes(), o.dtype());
        {
          NoGradGuard ng;
          Tensor flat = onehot.view({-1});
          flat.select(0, m).fill_(1);
        }
        TensorList g = grad({o}, diff_inputs, {onehot}, /*retain_graph=*/true, false, /*allow_unused=*/true);
        for (size_t k = 0; k < diff.size(); ++k) {
          Tensor gk = g[k].defined() ? g[k].to(kFloat64).contiguous() : zeros(diff_inputs[k].sizes(), kFloat64);
          for (int64_t e = 0; e < gk.numel(); ++e) {
            const double a = gk.data_ptr<double>()[e];
            const double n = numerical[k][e][out_flat];
            const double err = std::fabs(a - n);
            const double allowed = opts.atol + opts.rtol * std::fabs(n);
            if (err > allowed && err - allowed > worst) {
              worst = err - allowed;
              std::ostringstream os;
              os << "gradcheck: Jacobian mismatch for output " << oi << " element " << m << " w.r.t. input " << diff[k]
                 << " element " << e << ": analytical " << a << ", numerical " << n << " (|diff| " << err << " > atol "
                 << opts.atol << " + rtol " << opts.rtol << " * |numerical|)";
              worst_msg = os.str();
            }
          }
        }
      } else {
        for (size_t k = 0; k < diff.size(); ++k) {
          for (int64_t e = 0; e < diff_inputs[k].numel(); ++e) {
            const double n = numerical[k][e][out_flat];
            if (std::fabs(n) > opts.atol && std::fabs(n) - opts.atol > worst) {
              worst = std::fabs(n) - opts.atol;
              worst_msg = "gradcheck: output " + std::to_string(oi) +
                          " does not require grad, but its numerical derivative is nonzero (" + std::to_string(n) + ")";
            }
          }
        }
      }
    }
  }
  if (worst > 0) {
    KILN_CHECK(!opts.raise, ValueError, worst_msg);
    return false;
  }
  return true;
}

bool gradgradcheck(const DifferentiableFn& fn, const TensorList& inputs, const GradcheckOptions& opts, uint64_t seed) {
  TensorList outs = fn(inputs);
  Generator gen(seed);
  TensorList vs;
  for (const Tensor& o : outs) {
    vs.push_back(o.defined() && o.requires_grad() ? randn(o.sizes(), kFloat64, &gen).requires_grad_(true) : Tensor());
  }
  std::vector<size_t> diff;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) diff.push_back(i);
  }
  const size_t n_in = inputs.size();
  DifferentiableFn first_order = [&](const TensorList& all) {
    TensorList xs(all.begin(), all.begin() + n_in);
    TensorList out = fn(xs);
    TensorList used_out, used_v, diff_inputs;
    for (size_t k = 0; k < out.size(); ++k) {
      if (out[k].defined() && out[k].requires_grad()) {
        used_out.push_back(out[k]);
        used_v.push_back(all[n_in + k]);
      }
    }
    for (size_t i : diff) diff_inputs.push_back(xs[i]);
    return grad(used_out, diff_inputs, used_v, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
  };
  TensorList all = inputs;
  for (const Tensor& v : vs) all.push_back(v);
  if (!first_order_agrees(fn, inputs, vs, diff, first_order(all), opts)) return false;
  return gradcheck(first_order, all, opts);
}

}  // namespace kiln::autograd
