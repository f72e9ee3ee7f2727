// In-place writes into views under autograd (CopySlices; docs/autograd.md,
// "Views"). A random sweep builds programs of views (narrow, select, step
// slices, diagonal, transpose, t, flat view, unsqueeze, permute, chains of
// them) and in-place ops (arithmetic with scalars and tensors, broadcast
// operands, copy_, fills, exp_/tanh_/sigmoid_/pow_/clamp_, masked_fill_,
// index_put_ with integer and bool indices, accumulating or not), with
// reads of the base and of sibling views before the writes and stale views
// read after them, starting from a tensor that requires grad or from a plain
// buffer (a KV cache). Each program runs in kiln and, as one expression, in
// torch; the outputs' values (rtol 1e-12) and the gradients of every input
// (rtol 1e-9, atol 1e-11) must agree in float64, and a subset is checked against central
// differences, first and second order. Then the fixed cases: what must still
// raise (and with which words), node names, and detach() aliases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/autograd/autograd_meta.h"
#include "kiln/autograd/engine.h"
#include "kiln/kiln.h"
#include "kiln/ops/gradcheck.h"
#include "support/compare.h"
#include "support/oracle.h"

using namespace kiln;

namespace {

enum class ViewKind { Narrow, Select, Step, Diagonal, Transpose, Flat, Unsqueeze, Permute, T };
struct ViewOp {
  ViewKind kind;
  int64_t a = 0, b = 0, c = 0;
};

Tensor apply_view(const Tensor& t, const ViewOp& v) {
  switch (v.kind) {
    case ViewKind::Narrow: return t.narrow(v.a, v.b, v.c);
    case ViewKind::Select: return t.select(v.a, v.b);
    case ViewKind::Step: return t.slice(v.a, v.b, std::nullopt, 2);
    case ViewKind::Diagonal: return t.diagonal(v.a, v.b, v.c);
    case ViewKind::Transpose: return t.transpose(v.a, v.b);
    case ViewKind::Flat: return t.view({-1});
    case ViewKind::Unsqueeze: return t.unsqueeze(v.a);
    case ViewKind::Permute: {
      std::vector<int64_t> dims(static_cast<size_t>(t.dim()));
      std::iota(dims.rbegin(), dims.rend(), 0);
      return t.permute(dims);
    }
    case ViewKind::T: return t.t();
  }
  return t;
}

std::string view_py(const ViewOp& v, int64_t ndim) {
  std::ostringstream os;
  switch (v.kind) {
    case ViewKind::Narrow: os << ".narrow(" << v.a << ", " << v.b << ", " << v.c << ")"; break;
    case ViewKind::Select: os << ".select(" << v.a << ", " << v.b << ")"; break;
    case ViewKind::Step: os << "[(slice(None),) * " << v.a << " + (slice(" << v.b << ", None, 2),)]"; break;
    case ViewKind::Diagonal: os << ".diagonal(" << v.a << ", " << v.b << ", " << v.c << ")"; break;
    case ViewKind::Transpose: os << ".transpose(" << v.a << ", " << v.b << ")"; break;
    case ViewKind::Flat: os << ".view(-1)"; break;
    case ViewKind::Unsqueeze: os << ".unsqueeze(" << v.a << ")"; break;
    case ViewKind::Permute: {
      os << ".permute(";
      for (int64_t d = ndim - 1; d >= 0; --d) os << d << (d ? ", " : "");
      os << (ndim == 1 ? ",)" : ")");
      break;
    }
    case ViewKind::T: os << ".t()"; break;
  }
  return os.str();
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using Rng = std::mt19937_64;
int64_t pick(Rng& r, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(r); }

// A random view op valid for a tensor of `sizes` (empty when none fits).
std::optional<ViewOp> random_view(Rng& r, const Tensor& t) {
  const int64_t nd = t.dim();
  for (int attempt = 0; attempt < 20; ++attempt) {
    const auto kind = static_cast<ViewKind>(pick(r, 0, 8));
    if (nd == 0) return std::nullopt;
    const int64_t d = pick(r, 0, nd - 1), n = t.sizes()[d];
    switch (kind) {
      case ViewKind::Narrow:
        if (n < 2) break;
        {
          const int64_t s = pick(r, 0, n - 2);
          return ViewOp{kind, d, s, pick(r, 1, n - s)};
        }
      case ViewKind::Select:
        if (nd < 2) break;  // keep at least one dim to write into
        return ViewOp{kind, d, pick(r, 0, n - 1)};
      case ViewKind::Step:
        if (n < 2) break;
        return ViewOp{kind, d, pick(r, 0, 1)};
      case ViewKind::Diagonal: {
        if (nd < 2) break;
        int64_t d2 = pick(r, 0, nd - 1);
        if (d2 == d) break;
        const int64_t off = pick(r, -1, 1);
        const int64_t len = off >= 0 ? std::min(t.sizes()[d], t.sizes()[d2] - off) : std::min(t.sizes()[d] + off, t.sizes()[d2]);
        if (len < 1) break;
        return ViewOp{kind, off, d, d2};
      }
      case ViewKind::Transpose: {
        if (nd < 2) break;
        const int64_t d2 = pick(r, 0, nd - 1);
        if (d2 == d) break;
        return ViewOp{kind, d, d2};
      }
      case ViewKind::Flat:
        if (nd < 2 || !t.is_contiguous()) break;
        return ViewOp{kind};
      case ViewKind::Unsqueeze:
        if (nd > 3) break;
        return ViewOp{kind, pick(r, 0, nd)};
      case ViewKind::Permute:
        if (nd < 2) break;
        return ViewOp{kind};
      case ViewKind::T:
        if (nd != 2) break;
        return ViewOp{kind};
    }
  }
  return std::nullopt;
}

enum class OpKind {
  MulT, MulS, AddT, AddBcast, DivT, CopyT, CopyBcast, Zero, Fill, Exp, Tanh, Sigmoid, Clamp, Pow2,
  MaskedFill, IndexPut, IndexPutAcc, IndexPutMask, kCount
};

// A program: inputs (leaves x0.., some constant), and the steps as closures over
// both kiln tensors and torch text, so that it can be replayed for gradcheck.
struct Program {
  std::vector<Tensor> inputs;   // values
  std::vector<int> grad_inputs; // which inputs are differentiated
  std::vector<std::string> py;  // statements, joined into one expression
  std::function<TensorList(const TensorList&)> run;  // the outputs that may require grad
  std::string out_py;
  std::string text;  // readable, for failure messages
};

struct Builder {
  Rng rng;
  std::vector<Tensor> inputs;
  std::vector<int> grad_inputs;
  std::vector<std::string> py;
  std::vector<std::function<void(std::vector<Tensor>& env, const TensorList& in)>> steps;
  int env_size = 0;
  std::vector<int> outputs;  // env slots returned
  std::vector<std::string> out_names;

  explicit Builder(uint64_t seed) : rng(seed) {}

  int add_input(Tensor t, bool grad) {
    inputs.push_back(std::move(t));
    if (grad) grad_inputs.push_back(static_cast<int>(inputs.size()) - 1);
    return static_cast<int>(inputs.size()) - 1;
  }
  Tensor randn_(IntArrayRef shape) {
    Generator g(rng());
    return randn(shape, kFloat64, &g);
  }
};

std::string shape_py(IntArrayRef s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << s[i] << (s.size() == 1 || i + 1 < s.size() ? "," : "");
  os << ")";
  return os.str();
}

// Builds random program `seed`. `shadow` runs alongside without grad to learn shapes.
Program make_program(uint64_t seed) {
  Builder b(seed);
  Rng& r = b.rng;
  std::ostringstream text;
  DimVector shape = pick(r, 0, 2) == 0 ? DimVector{pick(r, 2, 3), pick(r, 2, 3), pick(r, 2, 4)}
                                       : DimVector{pick(r, 2, 4), pick(r, 2, 5)};
  const bool from_buffer = pick(r, 0, 3) == 0;  // a KV-cache style plain buffer
  Tensor shadow;                                 // h's value, no grad: shapes and masks
  // env[0] = h
  if (from_buffer) {
    b.py.push_back("h := torch.zeros(" + shape_py(shape) + ", dtype=torch.float64)");
    b.steps.push_back([shape](std::vector<Tensor>& env, const TensorList&) { env[0] = zeros(shape, kFloat64); });
    shadow = zeros(shape, kFloat64);
    text << "h = zeros" << shape << "; ";
  } else {
    const int x0 = b.add_input(b.randn_(shape), true);
    b.py.push_back("h := x" + std::to_string(x0) + ".clone()");
    b.steps.push_back([x0](std::vector<Tensor>& env, const TensorList& in) { env[0] = in[x0].clone(); });
    shadow = b.inputs[x0].clone();
    text << "h = x0.clone() " << shape << "; ";
  }
  int slot = 1;
  const int nsteps = static_cast<int>(pick(r, 1, 3));
  for (int s = 0; s < nsteps; ++s) {
    // A read of h (through a view or not) before the write: its gradient must still reach h's old value.
    if (pick(r, 0, 2) == 0) {
      const auto v = random_view(r, shadow);
      const double c = 0.5 + pick(r, 0, 3) * 0.5;
      const int out = slot++;
      std::string name = "r" + std::to_string(out);
      std::string vpy = v ? view_py(*v, shadow.dim()) : "";
      b.py.push_back(name + " := h" + vpy + " * " + std::to_string(c));
      b.steps.push_back([out, v, c](std::vector<Tensor>& env, const TensorList&) {
        env[out] = (v ? apply_view(env[0], *v) : env[0]) * c;
      });
      b.outputs.push_back(out);
      b.out_names.push_back(name);
      text << name << " = h" << vpy << " * " << c << "; ";
    }
    // A sibling view made now and read after the write (its history goes stale).
    int sibling = -1;
    std::string sibling_name;
    std::optional<ViewOp> sv;
    if (pick(r, 0, 2) == 0 && (sv = random_view(r, shadow))) {
      sibling = slot++;
      sibling_name = "s" + std::to_string(sibling);
      b.py.push_back(sibling_name + " := h" + view_py(*sv, shadow.dim()));
      b.steps.push_back([sibling, sv](std::vector<Tensor>& env, const TensorList&) { env[sibling] = apply_view(env[0], *sv); });
      text << sibling_name << " = h" << view_py(*sv, shadow.dim()) << "; ";
    }
    // The view chain written into: one or two view ops.
    std::vector<ViewOp> chain;
    Tensor vshadow = shadow;
    std::string vpy = "h";
    const int depth = static_cast<int>(pick(r, 1, 2));
    for (int k = 0; k < depth; ++k) {
      auto v = random_view(r, vshadow);
      if (!v) break;
      vpy += view_py(*v, vshadow.dim());
      vshadow = apply_view(vshadow, *v);
      chain.push_back(*v);
    }
    if (chain.empty()) continue;
    const int vslot = slot++;
    const std::string vname = "v" + std::to_string(vslot);
    b.py.push_back(vname + " := " + vpy);
    b.steps.push_back([vslot, chain](std::vector<Tensor>& env, const TensorList&) {
      Tensor t = env[0];
      for (const ViewOp& v : chain) t = apply_view(t, v);
      env[vslot] = t;
    });
    text << vname << " = " << vpy << "; ";
    // The in-place op. A plain buffer's first write must carry a gradient.
    OpKind op;
    do {
      op = static_cast<OpKind>(pick(r, 0, static_cast<int64_t>(OpKind::kCount) - 1));
    } while (from_buffer && s == 0 &&
             !(op == OpKind::AddT || op == OpKind::CopyT || op == OpKind::CopyBcast || op == OpKind::IndexPut ||
               op == OpKind::IndexPutAcc || op == OpKind::AddBcast));
    const DimVector vs(vshadow.sizes());
    const bool has_dim = !vs.empty();
    if (!has_dim && (op == OpKind::AddBcast || op == OpKind::CopyBcast || op == OpKind::IndexPut ||
                     op == OpKind::IndexPutAcc || op == OpKind::IndexPutMask))
      op = OpKind::AddT;
    std::string stmt;
    std::function<void(std::vector<Tensor>&, const TensorList&)> fn;
    const std::string V = vname;
    switch (op) {
      case OpKind::MulT: case OpKind::AddT: case OpKind::DivT: case OpKind::CopyT: {
        Tensor val = b.randn_(vs);
        if (op == OpKind::DivT) val = val.abs() + 0.5;
        const int xi = b.add_input(val, true);
        const std::string X = "x" + std::to_string(xi);
        const char* m = op == OpKind::MulT ? "mul_" : op == OpKind::AddT ? "add_" : op == OpKind::DivT ? "div_" : "copy_";
        stmt = V + "." + m + "(" + X + ")";
        fn = [vslot, xi, op](std::vector<Tensor>& env, const TensorList& in) {
          Tensor& v = env[vslot];
          if (op == OpKind::MulT) v.mul_(in[xi]);
          else if (op == OpKind::AddT) v.add_(in[xi]);
          else if (op == OpKind::DivT) v.div_(in[xi]);
          else v.copy_(in[xi]);
        };
        break;
      }
      case OpKind::AddBcast: case OpKind::CopyBcast: {
        const int xi = b.add_input(b.randn_({vs[vs.size() - 1]}), true);
        const std::string X = "x" + std::to_string(xi);
        stmt = V + (op == OpKind::AddBcast ? ".add_(" + X + ", alpha=-1.5)" : ".copy_(" + X + ")");
        fn = [vslot, xi, op](std::vector<Tensor>& env, const TensorList& in) {
          if (op == OpKind::AddBcast) env[vslot].add_(in[xi], -1.5);
          else env[vslot].copy_(in[xi]);
        };
        break;
      }
      case OpKind::MulS:
        stmt = V + ".mul_(-1.25)";
        fn = [vslot](std::vector<Tensor>& env, const TensorList&) { env[vslot].mul_(-1.25); };
        break;
      case OpKind::Zero:
        stmt = V + ".zero_()";
        fn = [vslot](std::vector<Tensor>& env, const TensorList&) { env[vslot].zero_(); };
        break;
      case OpKind::Fill:
        stmt = V + ".fill_(0.75)";
        fn = [vslot](std::vector<Tensor>& env, const TensorList&) { env[vslot].fill_(0.75); };
        break;
      case OpKind::Exp: case OpKind::Tanh: case OpKind::Sigmoid: case OpKind::Pow2: {
        const char* m = op == OpKind::Exp ? "exp_()" : op == OpKind::Tanh ? "tanh_()" : op == OpKind::Sigmoid ? "sigmoid_()" : "pow_(2)";
        stmt = V + "." + m;
        fn = [vslot, op](std::vector<Tensor>& env, const TensorList&) {
          Tensor& v = env[vslot];
          if (op == OpKind::Exp) v.exp_();
          else if (op == OpKind::Tanh) v.tanh_();
          else if (op == OpKind::Sigmoid) v.sigmoid_();
          else v.pow_(2);
        };
        break;
      }
      case OpKind::Clamp:
        stmt = V + ".clamp_(-0.6, 0.8)";
        fn = [vslot](std::vector<Tensor>& env, const TensorList&) { env[vslot].clamp_(-0.6, 0.8); };
        break;
      case OpKind::MaskedFill: {
        Generator g(r());
        const int mi = b.add_input(rand(vs, TensorOptions(kFloat64), &g).gt(0.5), false);
        stmt = V + ".masked_fill_(x" + std::to_string(mi) + ", 0.3)";
        fn = [vslot, mi](std::vector<Tensor>& env, const TensorList& in) { env[vslot].masked_fill_(in[mi], 0.3); };
        break;
      }
      case OpKind::IndexPut: case OpKind::IndexPutAcc: {
        const int64_t n = vs[0];
        std::vector<int64_t> idx(static_cast<size_t>(n));
        std::iota(idx.begin(), idx.end(), 0);
        std::shuffle(idx.begin(), idx.end(), r);
        const int64_t m = pick(r, 1, n + (op == OpKind::IndexPutAcc ? 2 : 0));
        std::vector<int64_t> chosen;
        for (int64_t i = 0; i < m; ++i) chosen.push_back(op == OpKind::IndexPutAcc ? pick(r, -n, n - 1) : idx[i]);
        Tensor it = empty({m}, kInt64);
        std::copy(chosen.begin(), chosen.end(), it.data_ptr<int64_t>());
        const int ii = b.add_input(it, false);
        DimVector vals_shape = vs;
        vals_shape[0] = m;
        const int xi = b.add_input(b.randn_(vals_shape), true);
        const bool acc = op == OpKind::IndexPutAcc;
        stmt = V + ".index_put_((x" + std::to_string(ii) + ",), x" + std::to_string(xi) + (acc ? ", accumulate=True)" : ")");
        fn = [vslot, ii, xi, acc](std::vector<Tensor>& env, const TensorList& in) {
          env[vslot].index_put_({in[ii]}, in[xi], acc);
        };
        break;
      }
      case OpKind::IndexPutMask: {
        Generator g(r());
        Tensor mask = rand(vs, TensorOptions(kFloat64), &g).gt(0.4);
        const int64_t count = mask.sum().item<int64_t>();
        const int mi = b.add_input(mask, false);
        const int xi = b.add_input(b.randn_({count}), true);
        stmt = V + ".index_put_((x" + std::to_string(mi) + ",), x" + std::to_string(xi) + ")";
        fn = [vslot, mi, xi](std::vector<Tensor>& env, const TensorList& in) { env[vslot].index_put_({in[mi]}, in[xi]); };
        break;
      }
      case OpKind::kCount: break;
    }
    b.py.push_back(stmt);
    b.steps.push_back(fn);
    text << stmt << "; ";
    if (sibling >= 0) {
      const int out = slot++;
      const std::string name = "q" + std::to_string(out);
      b.py.push_back(name + " := " + sibling_name + " * 1.5");
      b.steps.push_back([out, sibling](std::vector<Tensor>& env, const TensorList&) { env[out] = env[sibling] * 1.5; });
      b.outputs.push_back(out);
      b.out_names.push_back(name);
      text << name << " = " << sibling_name << " * 1.5; ";
    }
  }
  b.outputs.insert(b.outputs.begin(), 0);
  b.out_names.insert(b.out_names.begin(), "h");
  Program p;
  p.inputs = b.inputs;
  p.grad_inputs = b.grad_inputs;
  p.py = b.py;
  std::string outs = "(";
  for (const auto& n : b.out_names) outs += n + ", ";
  p.out_py = outs + ")";
  p.text = text.str();
  const int nslots = slot;
  auto steps = b.steps;
  auto outputs = b.outputs;
  p.run = [steps, outputs, nslots](const TensorList& in) {
    std::vector<Tensor> env(static_cast<size_t>(nslots));
    for (const auto& s : steps) s(env, in);
    TensorList out;
    for (int o : outputs) out.push_back(env[o]);
    return out;
  };
  return p;
}

std::string expression(const Program& p) {
  std::string e = "(";
  for (const auto& s : p.py) e += s + ", ";
  return e + p.out_py + ")[-1]";
}

constexpr int kPrograms = 160;

TEST(InPlaceViews, RandomSweepMatchesTorch) {
  std::vector<Program> programs;
  std::vector<std::vector<Tensor>> grad_outs;
  test::OracleBatch batch;
  for (int i = 0; i < kPrograms; ++i) {
    programs.push_back(make_program(1000 + i));
    const Program& p = programs.back();
    // The outputs' shapes, from a run without grad.
    TensorList outs;
    {
      NoGradGuard ng;
      outs = p.run(p.inputs);
    }
    std::vector<Tensor> gos;
    Generator g(77 + i);
    for (const Tensor& o : outs) gos.push_back(randn(o.sizes(), kFloat64, &g));
    grad_outs.push_back(gos);
    batch.add_grad("inplace_view_" + std::to_string(i), expression(p), p.inputs, p.grad_inputs, gos);
  }
  // The forward values too (a separate case each: torch evaluates without grad bookkeeping).
  for (int i = 0; i < kPrograms; ++i) batch.add("inplace_view_values_" + std::to_string(i), expression(programs[i]), programs[i].inputs);
  batch.run();
  int compared = 0, refused = 0;
  for (int i = 0; i < kPrograms; ++i) {
    const Program& p = programs[i];
    const test::OracleOutcome& o = batch.outcome(i);
    SCOPED_TRACE("program " + std::to_string(i) + ": " + p.text + "\n  torch: " + expression(p));
    TensorList leaves;
    for (size_t k = 0; k < p.inputs.size(); ++k) {
      Tensor t = p.inputs[k].clone();
      if (std::find(p.grad_inputs.begin(), p.grad_inputs.end(), static_cast<int>(k)) != p.grad_inputs.end())
        t.requires_grad_();
      leaves.push_back(t);
    }
    TensorList outs, used, gos, wrt;
    if (!o.ok) {
      // torch refuses the program (a tensor saved for backward was overwritten
      // through a view): kiln must refuse it too, by the same reason.
      EXPECT_TRUE(has(o.error, "modified by an inplace operation")) << "unexpected torch error: " << o.error;
      std::string kiln_error = "(no error)";
      try {
        outs = p.run(leaves);
        for (const Tensor& t : outs)
          if (t.requires_grad()) used.push_back(t), gos.push_back(grad_outs[i][&t - outs.data()]);
        for (int k : p.grad_inputs) wrt.push_back(leaves[k]);
        autograd::grad(used, wrt, gos, std::nullopt, false, true);
      } catch (const std::exception& e) {
        kiln_error = e.what();
      }
      EXPECT_TRUE(has(kiln_error, "a tensor saved for backward was modified in place")) << kiln_error;
      ++refused;
      continue;
    }
    try {
      outs = p.run(leaves);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "kiln raised in forward: " << e.what();
      continue;
    }
    ASSERT_EQ(outs.size(), o.output_requires_grad.size());
    const test::OracleOutcome& values = batch.outcome(kPrograms + i);
    ASSERT_TRUE(values.ok) << values.error;
    ASSERT_EQ(values.outputs.size(), outs.size());
    for (size_t k = 0; k < outs.size(); ++k) {
      const auto c = test::compare_tensors(outs[k], values.outputs[k], 1e-12, 1e-14);
      EXPECT_TRUE(c.ok) << "value of output " << k << ": " << c.message;
    }
    for (size_t k = 0; k < outs.size(); ++k) {
      EXPECT_EQ(outs[k].requires_grad(), static_cast<bool>(o.output_requires_grad[k])) << "output " << k;
      if (outs[k].requires_grad()) {
        used.push_back(outs[k]);
        gos.push_back(grad_outs[i][k]);
      }
    }
    for (int k : p.grad_inputs) wrt.push_back(leaves[k]);
    if (used.empty()) continue;
    TensorList grads;
    try {
      grads = autograd::grad(used, wrt, gos, std::nullopt, false, /*allow_unused=*/true);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "kiln raised in backward: " << e.what();
      continue;
    }
    ASSERT_EQ(grads.size(), o.outputs.size());
    for (size_t k = 0; k < grads.size(); ++k) {
      const Tensor& got = grads[k];
      const Tensor& want = o.outputs[k];
      if (!got.defined() || !want.defined()) {
        const Tensor& d = got.defined() ? got : want;
        if (d.defined()) {
          EXPECT_TRUE(d.eq(0).all().item<bool>()) << "gradient " << k << " undefined on one side only";
        }
        continue;
      }
      const auto c = test::compare_tensors(got, want, 1e-9, 1e-11);
      EXPECT_TRUE(c.ok) << "gradient of input " << p.grad_inputs[k] << ": " << c.message;
    }
    ++compared;
  }
  // Most programs are valid; the rest must have been refused by both.
  EXPECT_GE(compared, kPrograms * 3 / 4) << refused << " refused";
  std::printf("[ sweep    ] %d programs compared with torch, %d refused by both\n", compared, refused);
}

// Central differences, first and second order, on every 8th program.
TEST(InPlaceViews, RandomSweepGradcheck) {
  for (int i = 0; i < kPrograms; i += 8) {
    const Program p = make_program(1000 + i);
    SCOPED_TRACE("program " + std::to_string(i) + ": " + p.text);
    TensorList wrt;
    for (int k : p.grad_inputs) wrt.push_back(p.inputs[k].clone().requires_grad_());
    if (wrt.empty()) continue;
    auto fn = [&](const TensorList& xs) {
      TensorList in = p.inputs;
      for (size_t k = 0; k < p.grad_inputs.size(); ++k) in[p.grad_inputs[k]] = xs[k];
      TensorList out;
      for (const Tensor& t : p.run(in))
        if (t.requires_grad()) out.push_back(t);
      return out;
    };
    try {
      EXPECT_TRUE(autograd::gradcheck(fn, wrt));
      EXPECT_TRUE(autograd::gradgradcheck(fn, wrt));
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

Tensor leaf(IntArrayRef shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, kFloat64, &g).requires_grad_();
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(InPlaceViews, KvCacheFilledInPlaceMatchesTorch) {
  // cache[t] = k_t for t in 0..3, then attention-like scores against q.
  const Tensor k0 = leaf({5}, 1), k1 = leaf({5}, 2), k2 = leaf({5}, 3), q = leaf({5}, 4);
  Tensor cache = zeros({4, 5}, kFloat64);
  cache[0].copy_(k0);
  cache[1].copy_(k1);
  cache.narrow(0, 2, 1).copy_(k2.unsqueeze(0));
  EXPECT_TRUE(cache.requires_grad());
  EXPECT_STREQ(cache.grad_fn()->name(), "CopySlices");
  Tensor scores = cache.matmul(q).softmax(0);
  const Tensor go = leaf({4}, 5).detach();
  const TensorList g = autograd::grad({scores}, {k0, k1, k2, q}, {go});
  test::OracleBatch batch;
  batch.add_grad("kv_cache",
                 "(c := torch.zeros(4, 5, dtype=torch.float64), c[0].copy_(x0), c[1].copy_(x1), "
                 "c[2:3].copy_(x2.unsqueeze(0)), torch.softmax(c @ x3, 0))[-1]",
                 {k0.detach(), k1.detach(), k2.detach(), q.detach()}, {0, 1, 2, 3}, {go});
  batch.run();
  ASSERT_TRUE(batch.outcome(0).ok) << batch.outcome(0).error;
  for (size_t i = 0; i < 4; ++i) {
    const auto c = test::compare_tensors(g[i], batch.outcome(0).outputs[i], 1e-10, 1e-12);
    EXPECT_TRUE(c.ok) << "input " << i << ": " << c.message;
  }
}

TEST(InPlaceViews, NodeNamesAreTorchs) {
  Tensor y = leaf({3, 4}, 11).clone();
  Tensor v = y.narrow(0, 1, 2);
  v.mul_(2.0);
  EXPECT_STREQ(y.grad_fn()->name(), "CopySlices");
  EXPECT_STREQ(v.grad_fn()->name(), "AsStridedBackward0");
  // A sibling made before the write is rebuilt from the base's new history.
  Tensor s = y.select(1, 0);
  y.select(0, 0).fill_(1.0);
  EXPECT_STREQ(s.grad_fn()->name(), "AsStridedBackward0");
  EXPECT_EQ(s.grad_fn()->next_edges()[0].function.get(), y.grad_fn());
}

TEST(InPlaceViews, WhatTorchRefusesStillRaises) {
  const Tensor x = leaf({4, 3}, 21);
  // A view of a leaf that requires grad.
  std::string m = error_of([&] { x.narrow(0, 0, 2).mul_(2.0); });
  EXPECT_TRUE(has(m, "mul_: ") && has(m, "is a view of a leaf tensor [4, 3] float64, a leaf that requires grad")) << m;
  EXPECT_TRUE(has(m, "test_inplace_views.cpp:")) << m;
  EXPECT_EQ(x.grad_fn(), nullptr);
  // One of several views returned by split / chunk / unbind.
  Tensor y = x.clone();
  for (auto& piece : {y.split(2)[0], y.chunk(2)[1], y.unbind(0)[2]}) {
    Tensor p = piece;
    m = error_of([&] { p.mul_(2.0); });
    EXPECT_TRUE(has(m, "is one of several views returned by one op (split, chunk or unbind)")) << m;
  }
  // Also when only the written value requires grad (torch refuses that too).
  Tensor buf = zeros({4, 3}, kFloat64);
  Tensor piece = buf.split(2)[0];
  m = error_of([&] { piece.copy_(x.narrow(0, 0, 2)); });
  EXPECT_TRUE(has(m, "is one of several views")) << m;
  // Such a view read after its base was written in place.
  Tensor a = y.split(2)[0];
  y.mul_(3.0);
  m = error_of([&] { (void)(a * 2.0); });
  EXPECT_TRUE(has(m, "its base or another view of its base was modified in place (by mul_ at")) << m;
  // A view made under NoGradGuard, written with grad mode on.
  Tensor z = x.clone();
  Tensor nv;
  {
    NoGradGuard ng;
    nv = z.narrow(0, 1, 2);
  }
  m = error_of([&] { nv.add_(1.0); });
  EXPECT_TRUE(has(m, "is a view made with grad mode off")) << m;
  Tensor nb;
  {
    NoGradGuard ng;
    nb = buf.narrow(1, 0, 1);
  }
  m = error_of([&] { nb.copy_(x.narrow(1, 0, 1)); });
  EXPECT_TRUE(has(m, "is a view made with grad mode off")) << m;
  // Under NoGradGuard everything is allowed (an optimizer's step), and not recorded.
  {
    NoGradGuard ng;
    nv.add_(1.0);
    x.narrow(0, 0, 1).zero_();
  }
  // A view made a leaf with requires_grad_().
  Tensor plain = zeros({3}, kFloat64);
  Tensor lv = plain.narrow(0, 0, 2);
  lv.requires_grad_();
  EXPECT_TRUE(lv.is_leaf());
  m = error_of([&] { lv.mul_(2.0); });
  EXPECT_TRUE(has(m, "a view that was made a leaf requiring grad")) << m;
  // A saved tensor overwritten through a view is still named at backward.
  Tensor w = leaf({3, 4}, 22).clone();
  Tensor s = w.sin();  // saves w
  w.narrow(1, 0, 2).mul_(2.0);
  m = error_of([&] { s.sum().backward(); });
  EXPECT_TRUE(has(m, "a tensor saved for backward was modified in place")) << m;
  EXPECT_TRUE(has(m, "saved by:    SinBackward0")) << m;
  EXPECT_TRUE(has(m, "modified by: mul_ at")) << m;
  // detach_() of a view.
  m = error_of([&] { w.narrow(0, 0, 1).detach_(); });
  EXPECT_TRUE(has(m, "views cannot be detached in place")) << m;
}

TEST(InPlaceViews, DetachAliasesWriteAsTorchAllows) {
  // Writing into a detach() alias changes values, not history: views of the
  // original keep differentiating through the original's history (torch's answer).
  const Tensor x = leaf({4}, 31);
  Tensor y = x * 2.0;
  Tensor v = y.narrow(0, 1, 2);
  y.detach().mul_(3.0);
  Tensor g = autograd::grad({(v * 1.0).sum()}, {x})[0];
  EXPECT_TRUE(g.equal(tensor<double>({0, 2, 2, 0})));
  // Writing a value that requires grad into a buffer that has a detach() alias.
  Tensor buf = zeros({3}, kFloat64);
  Tensor alias = buf.detach();
  const Tensor src = leaf({3}, 32);
  buf.copy_(src);
  EXPECT_STREQ(buf.grad_fn()->name(), "CopyBackwards");
  EXPECT_FALSE(alias.requires_grad());
  // And into a view of a detach() alias: the alias is the base that gets the history.
  Tensor buf2 = zeros({4}, kFloat64);
  Tensor d = buf2.detach();
  d.narrow(0, 0, 3).copy_(src);
  EXPECT_FALSE(buf2.requires_grad());
  EXPECT_STREQ(d.grad_fn()->name(), "CopySlices");
}

TEST(InPlaceViews, ExpandedViewsCannotBeWritten) {
  Tensor y = leaf({3}, 41).clone();
  const std::string m = error_of([&] { y.expand({2, 3}).mul_(2.0); });
  EXPECT_TRUE(has(m, "more than one element")) << m;
}

TEST(InPlaceViews, DoubleBackwardThroughCopySlices) {
  const Tensor x = leaf({3, 4}, 51), w = leaf({2, 4}, 52);
  auto f = [](const TensorList& in) {
    Tensor h = in[0] * 1.5;  // saves nothing that the writes below would overwrite
    h.narrow(0, 0, 2).mul_(in[1]);
    h.select(1, 2).exp_();
    return TensorList{h.pow(2), h.t().narrow(0, 1, 2).sin()};
  };
  EXPECT_TRUE(autograd::gradcheck(f, {x, w}));
  EXPECT_TRUE(autograd::gradgradcheck(f, {x, w}));
}

}  // namespace
