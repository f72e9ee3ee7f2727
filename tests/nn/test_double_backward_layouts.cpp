// Second-order gradients through the fused ops and custom Functions with
// non-contiguous inputs (issue 15, item 1). A fused forward reads contiguous
// copies of its arguments; when it saved those copies (made under the
// Function's no-grad guard) rather than the arguments, its create_graph
// backward saw tensors without history and returned no gradient for them:
// LayerNorm with a transposed input or a step-2 sliced weight did. gradgradcheck
// over contiguous inputs cannot see it (the copy is the argument itself then).
//
// The sweep runs every fused op (and the products with transposed operands)
// with all its differentiable inputs laid out transposed (channels-last for
// 4-D, a matrix column for 1-D), sliced with step 2, expanded from size 1
// (stride 0), and as strided leaves, and checks against the same op on
// contiguous copies of the same values: outputs, plain and create_graph
// first-order gradients (defined for the same inputs, equal), and the
// gradient of <create_graph gradients, w> w.r.t. every input; then
// gradgradcheck (float64 central differences of the first-order gradients)
// over the leaves. Shapes are drawn from a fixed seed within small bounds.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/autograd/engine.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/norm.h"
#include "kiln/ops/batch_norm.h"
#include "kiln/ops/linalg.h"
#include "ops/dense_grad_util.h"
#include "support/compare.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

enum class Layout { Contiguous, Transposed, Sliced, Expanded, StridedLeaf };

const Layout kLayouts[] = {Layout::Contiguous, Layout::Transposed, Layout::Sliced, Layout::Expanded,
                           Layout::StridedLeaf};

std::string layout_name(Layout l) {
  switch (l) {
    case Layout::Contiguous: return "contiguous";
    case Layout::Transposed: return "transposed";
    case Layout::Sliced: return "sliced";
    case Layout::Expanded: return "expanded";
    case Layout::StridedLeaf: return "strided leaf";
  }
  return "?";
}

// The dim an expanded input is broadcast along: the first with more than one element.
int64_t expanded_dim(IntArrayRef shape) {
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] > 1) return static_cast<int64_t>(d);
  }
  return 0;
}

// The shape of the tensor whose view (view_of) has `shape` under layout `l`.
std::vector<int64_t> storage_shape(Layout l, std::vector<int64_t> shape) {
  const size_t d = shape.size();
  switch (l) {
    case Layout::Contiguous: return shape;
    case Layout::Transposed:
    case Layout::StridedLeaf:
      if (d == 1) return {shape[0], 2};
      if (d == 4) return {shape[0], shape[2], shape[3], shape[1]};
      std::swap(shape[d - 1], shape[d - 2]);
      return shape;
    case Layout::Sliced: shape.back() *= 2; return shape;
    case Layout::Expanded: shape[static_cast<size_t>(expanded_dim(shape))] = 1; return shape;
  }
  return shape;
}

// The argument of logical `shape` read from `t` (of storage_shape) under layout `l`.
Tensor view_of(Layout l, const Tensor& t, IntArrayRef shape) {
  switch (l) {
    case Layout::Contiguous: return t;
    case Layout::Transposed:
      if (t.dim() == 2 && shape.size() == 1) return t.select(1, 0);
      if (t.dim() == 4) return t.permute({0, 3, 1, 2});  // channels-last, as a conv's output
      return t.transpose(-1, -2);
    case Layout::Sliced: return t.slice(-1, 0, std::nullopt, 2);
    case Layout::Expanded: return t.expand(shape);
    case Layout::StridedLeaf: return t;  // the leaf is the strided tensor itself
  }
  return t;
}

struct OpCase {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;  // logical shapes of the differentiable inputs
  std::function<Tensor(const TensorList&)> fn;
};

// Tight float64 tolerances: the same values through another memory layout
// may only differ by the order of a reduction's additions.
constexpr double kRtol = 1e-10, kAtol = 1e-12;

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  const test::Comparison c = test::compare_tensors(got.detach(), want.detach(), kRtol, kAtol);
  EXPECT_TRUE(c.ok) << what << ": " << c.message;
}

// First- and second-order gradients through `c` with every input in layout
// `l`, against the same op on contiguous copies; then gradgradcheck.
void check_layout(const OpCase& c, Layout l, uint64_t seed) {
  SCOPED_TRACE(c.name + ", inputs " + layout_name(l));
  Generator gen(seed);
  const size_t n = c.shapes.size();
  TensorList leaves;
  for (const auto& s : c.shapes) {
    Tensor t = randn(storage_shape(l, s), kFloat64, &gen);
    if (l == Layout::StridedLeaf) t = view_of(Layout::Transposed, t, s).detach();
    leaves.push_back(t.requires_grad_());
  }
  const auto args_of = [&](const TensorList& ls) {
    TensorList a;
    for (size_t i = 0; i < n; ++i) a.push_back(view_of(l, ls[i], c.shapes[i]));
    return a;
  };
  const TensorList args = args_of(leaves);
  TensorList refs;
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(args[i].sizes().vec(), c.shapes[i]) << "input " << i;
    if (l != Layout::Contiguous) {
      ASSERT_FALSE(args[i].is_contiguous()) << "input " << i << " " << args[i].strides();
    }
    refs.push_back(args[i].detach().contiguous().clone().requires_grad_());
    ASSERT_TRUE(refs.back().is_contiguous());
  }

  const Tensor out = c.fn(args), out_ref = c.fn(refs);
  expect_same(out, out_ref, "output");
  const Tensor u = randn(out.sizes(), kFloat64, &gen);
  const auto grads = [&](const Tensor& o, const TensorList& in, bool create_graph) {
    return autograd::grad({o}, in, {u}, /*retain_graph=*/true, create_graph, /*allow_unused=*/true);
  };
  const TensorList plain = grads(out, args, false), plain_ref = grads(out_ref, refs, false);
  const TensorList graph = grads(out, args, true), graph_ref = grads(out_ref, refs, true);
  Tensor s, s_ref;  // <create_graph gradients, w>: its gradient is the second order
  for (size_t i = 0; i < n; ++i) {
    const std::string in = "input " + std::to_string(i);
    ASSERT_EQ(plain[i].defined(), plain_ref[i].defined()) << "plain gradient of " << in;
    ASSERT_EQ(graph[i].defined(), graph_ref[i].defined()) << "create_graph gradient of " << in;
    if (!graph_ref[i].defined()) continue;
    expect_same(plain[i], plain_ref[i], "plain gradient of " + in);
    expect_same(graph[i], graph_ref[i], "create_graph gradient of " + in);
    expect_same(graph[i], plain_ref[i], "create_graph against plain gradient of " + in);
    const Tensor w = randn(graph_ref[i].sizes(), kFloat64, &gen);
    const Tensor term = (graph[i] * w).sum(), term_ref = (graph_ref[i] * w).sum();
    s = s.defined() ? s + term : term;
    s_ref = s_ref.defined() ? s_ref + term_ref : term_ref;
  }
  // The second order, an undefined gradient read as zeros: a fused ReLU's
  // mask is a constant of the graph, where the separate relu's backward
  // keeps a (zero) dependence on its output, so only the values must agree.
  const auto second = [&](const Tensor& sum, const TensorList& in) {
    TensorList h(n);
    if (sum.defined() && sum.requires_grad()) {
      h = autograd::grad({sum}, in, {}, /*retain_graph=*/true, false, /*allow_unused=*/true);
    }
    for (size_t i = 0; i < n; ++i) {
      if (!h[i].defined()) h[i] = zeros(in[i].sizes(), TensorOptions(kFloat64));
    }
    return h;
  };
  const TensorList h = second(s, args), h_ref = second(s_ref, refs);
  for (size_t i = 0; i < n; ++i) expect_same(h[i], h_ref[i], "second-order gradient of input " + std::to_string(i));
  test::expect_gradgradcheck([&](const TensorList& ls) { return c.fn(args_of(ls)); }, leaves,
                             c.name + ", " + layout_name(l) + ": gradgradcheck");
}

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// The fused ops with randomly drawn (small) shapes. Values come later, per layout.
std::vector<OpCase> fused_cases(std::mt19937_64& rng) {
  std::vector<OpCase> cases;
  {
    const int64_t r = pick(rng, 2, 4), n = pick(rng, 3, 5);
    cases.push_back({"LayerNorm [" + std::to_string(r) + ", " + std::to_string(n) + "]", {{r, n}, {n}, {n}},
                     [n](const TensorList& t) {
                       nn::LayerNorm ln({.normalized_shape = {n}, .dtype = kFloat64});
                       ln.weight = t[1];
                       ln.bias = t[2];
                       return ln(t[0]);
                     }});
  }
  {
    const int64_t b = pick(rng, 2, 3), m = pick(rng, 2, 3), n = pick(rng, 2, 3);
    cases.push_back({"LayerNorm over two dims", {{b, m, n}, {m, n}, {m, n}}, [m, n](const TensorList& t) {
                       nn::LayerNorm ln({.normalized_shape = {m, n}, .dtype = kFloat64});
                       ln.weight = t[1];
                       ln.bias = t[2];
                       return ln(t[0]);
                     }});
  }
  {
    const int64_t b = pick(rng, 1, 2), l = pick(rng, 3, 5), s = pick(rng, 3, 4), e = pick(rng, 2, 3);
    const int64_t ev = pick(rng, 2, 3);
    for (bool causal : {false, true}) {
      // Blocks of 2 query rows: several blocks, the last one partial when L is odd.
      cases.push_back({std::string("sdpa_fused") + (causal ? " causal" : ""),
                       {{b, l, e}, {b, causal ? l : s, e}, {b, causal ? l : s, ev}},
                       [causal](const TensorList& t) { return F::detail::sdpa_fused(t[0], t[1], t[2], {}, causal, 2); }});
    }
    // [B, H, L, E], the heads path (its output is allocated [B, L, H, Ev]).
    cases.push_back({"sdpa_fused heads", {{1, 2, l, e}, {1, 2, s, e}, {1, 2, s, ev}},
                     [](const TensorList& t) { return F::detail::sdpa_fused(t[0], t[1], t[2], {}, false, 2); }});
  }
  {
    const int64_t rows = pick(rng, 3, 5), classes = pick(rng, 3, 5), d = pick(rng, 2, 3);
    Generator g(rng());
    const Tensor target = randint(0, classes, {rows}, TensorOptions(kInt64), &g);
    cases.push_back({"cross_entropy mean", {{rows, classes}},
                     [target](const TensorList& t) { return F::cross_entropy(t[0], target); }});
    Tensor ignoring = target.clone();
    ignoring.select(0, 0).fill_(-100);
    const Tensor weight = rand({classes}, TensorOptions(kFloat64), &g).add(0.5);
    cases.push_back({"cross_entropy sum, weight, label smoothing, an ignored row", {{rows, classes}},
                     [ignoring, weight](const TensorList& t) {
                       return F::cross_entropy(t[0], ignoring,
                                               {.weight = weight, .reduction = "sum", .label_smoothing = 0.1});
                     }});
    const Tensor target3 = randint(0, classes, {rows, d}, TensorOptions(kInt64), &g);
    cases.push_back({"cross_entropy [N, C, d], none", {{rows, classes, d}}, [target3](const TensorList& t) {
                       return F::cross_entropy(t[0], target3, {.reduction = "none"});
                     }});
  }
  {
    const int64_t b = pick(rng, 2, 3), ch = pick(rng, 2, 3), h = pick(rng, 2, 3), w = pick(rng, 2, 3);
    const std::vector<int64_t> x{b, ch, h, w};
    cases.push_back({"batch_norm_train", {x, {ch}, {ch}},
                     [](const TensorList& t) { return ops::batch_norm_train(t[0], t[1], t[2], 1e-5).output; }});
    // Channels-last x (the transposed layout and the strided leaf) takes the fused ReLU; the rest the two ops.
    cases.push_back({"batch_norm_relu_train", {x, {ch}, {ch}},
                     [](const TensorList& t) { return ops::batch_norm_relu_train(t[0], t[1], t[2], 1e-5).output; }});
    cases.push_back({"batch_norm_add_relu_train", {x, {ch}, {ch}, x}, [](const TensorList& t) {
                       return ops::batch_norm_add_relu_train(t[0], t[1], t[2], t[3], 1e-5).output;
                     }});
    cases.push_back({"batch_norm_train [N, C]", {{b + 3, ch}, {ch}, {ch}},
                     [](const TensorList& t) { return ops::batch_norm_train(t[0], t[1], t[2], 1e-5).output; }});
  }
  {
    const int64_t r = pick(rng, 2, 4), n = pick(rng, 3, 5);
    cases.push_back({"softmax(-1)", {{r, n}}, [](const TensorList& t) { return t[0].softmax(-1); }});
    cases.push_back({"softmax(0)", {{r, n}}, [](const TensorList& t) { return t[0].softmax(0); }});
    cases.push_back({"log_softmax(-1)", {{r, n}}, [](const TensorList& t) { return t[0].log_softmax(-1); }});
  }
  {
    const int64_t r = pick(rng, 2, 4), in = pick(rng, 2, 4), out = pick(rng, 2, 4), b = pick(rng, 2, 3);
    cases.push_back({"linear", {{r, in}, {out, in}, {out}},
                     [](const TensorList& t) { return linear(t[0], t[1], t[2]); }});
    cases.push_back({"linear_gelu tanh", {{r, in}, {out, in}, {out}},
                     [](const TensorList& t) { return linear_gelu(t[0], t[1], t[2], "tanh").pow(2); }});
    cases.push_back({"linear_add", {{r, in}, {out, in}, {out}, {r, out}},
                     [](const TensorList& t) { return linear_add(t[0], t[1], t[2], t[3]).pow(2); }});
    // Products read a transposed operand in place (MmBackward's col-major case); squared to have a second order.
    cases.push_back({"mm", {{r, in}, {in, out}}, [](const TensorList& t) { return mm(t[0], t[1]).pow(2); }});
    cases.push_back({"matmul batched", {{b, r, in}, {in, out}},
                     [](const TensorList& t) { return matmul(t[0], t[1]).pow(2); }});
    cases.push_back({"bmm", {{b, r, in}, {b, in, out}}, [](const TensorList& t) { return bmm(t[0], t[1]).pow(2); }});
  }
  return cases;
}

TEST(DoubleBackwardLayouts, FusedOpsOverNonContiguousInputs) {
  std::mt19937_64 rng(20250715);
  const std::vector<OpCase> cases = fused_cases(rng);
  uint64_t seed = 1500;
  for (const OpCase& c : cases) {
    for (Layout l : kLayouts) check_layout(c, l, seed++);
  }
}

// The report: a transposed input through nn::LayerNorm, and a step-2
// sliced weight, each alone and together.
TEST(DoubleBackwardLayouts, LayerNormTransposedInputAndSlicedWeightUnderCreateGraph) {
  for (const auto& [transpose_x, slice_w] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
    SCOPED_TRACE(std::string(transpose_x ? "x transposed" : "x contiguous") +
                 (slice_w ? ", weight sliced" : ", weight contiguous"));
    Generator gen(15);
    const Tensor x = transpose_x ? randn({3, 4}, kFloat64, &gen).t().requires_grad_()
                                 : randn({4, 3}, kFloat64, &gen).requires_grad_();
    const Tensor w_base = randn({slice_w ? 6 : 3}, kFloat64, &gen).add(1).requires_grad_();
    const Tensor b = randn({3}, kFloat64, &gen).requires_grad_();
    const auto weight_of = [slice = slice_w](const Tensor& base) {
      return slice ? base.slice(0, 0, std::nullopt, 2) : base;  // stride 2
    };
    const Tensor w = weight_of(w_base);
    nn::LayerNorm ln({.normalized_shape = {3}, .dtype = kFloat64});
    ln.weight = w;
    ln.bias = b;
    const Tensor y = ln(x).pow(2).sum();
    const TensorList plain = autograd::grad({y}, {x, w, b}, {}, /*retain_graph=*/true);
    const TensorList graph =
        autograd::grad({y}, {x, w, b}, {}, /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
    bool all_defined = true;
    for (size_t i = 0; i < 3; ++i) {
      if (!graph[i].defined()) {
        ADD_FAILURE() << "the create_graph gradient of input " << i << " is undefined";
        all_defined = false;
        continue;
      }
      EXPECT_TRUE(graph[i].requires_grad()) << "input " << i;
      expect_same(graph[i], plain[i], "input " + std::to_string(i));
    }
    if (!all_defined) continue;
    // The second order reaches the sliced weight's base through the slice.
    const TensorList h = autograd::grad({graph[0].sum() + graph[1].sum()}, {x, w_base});
    ASSERT_TRUE(h[0].defined() && h[1].defined());
    EXPECT_TRUE(autograd::gradgradcheck(
        [&](const TensorList& t) {
          nn::LayerNorm m({.normalized_shape = {3}, .dtype = kFloat64});
          m.weight = weight_of(t[1]);
          m.bias = t[2];
          return TensorList{m(t[0])};
        },
        {x, w_base, b}));
  }
}

// Self-attention passes one tensor as q, k and v: under create_graph each
// argument must get its own share of the gradient, as the plain backward
// gives, not the whole gradient once per argument.
TEST(DoubleBackwardLayouts, AttentionWithOneTensorAsQueryKeyAndValue) {
  Generator gen(16);
  const Tensor x = randn({2, 5, 3}, kFloat64, &gen).requires_grad_();
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const Tensor fused = F::detail::sdpa_fused(x, x, x, {}, causal, 2).pow(2).sum();
    const Tensor composite = F::detail::sdpa_composite(x, x, x, {}, 0.0, causal, false).pow(2).sum();
    const Tensor plain = autograd::grad({fused}, {x}, {}, /*retain_graph=*/true)[0];
    const Tensor graph = autograd::grad({fused}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    const Tensor want = autograd::grad({composite}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    expect_same(plain, want.detach(), "plain gradient");
    expect_same(graph, want, "create_graph gradient");
    expect_same(autograd::grad({graph.pow(2).sum()}, {x})[0], autograd::grad({want.pow(2).sum()}, {x})[0],
                "second order");
  }
  EXPECT_TRUE(autograd::gradgradcheck(
      [](const TensorList& t) { return TensorList{F::detail::sdpa_fused(t[0], t[0], t[0], {}, true, 2)}; }, {x}));
}

// Only some of q, k, v require grad (cross-attention to a frozen memory):
// the create_graph branch differentiates only those.
TEST(DoubleBackwardLayouts, AttentionWithConstantKeysAndValues) {
  Generator gen(17);
  const Tensor q = randn({2, 4, 3}, kFloat64, &gen).transpose(0, 2).requires_grad_();  // [3, 4, 2], strided
  const Tensor k = randn({3, 5, 2}, kFloat64, &gen), v = randn({3, 5, 2}, kFloat64, &gen);
  const Tensor y = F::detail::sdpa_fused(q, k, v, {}, false, 2).pow(2).sum();
  const Tensor plain = autograd::grad({y}, {q}, {}, /*retain_graph=*/true)[0];
  const Tensor graph = autograd::grad({y}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  expect_same(graph, plain, "create_graph gradient of q");
  EXPECT_TRUE(autograd::gradgradcheck(
      [&](const TensorList& t) { return TensorList{F::detail::sdpa_fused(t[0], k, v, {}, false, 2)}; }, {q}));
}

// The fused cross-entropy has no gradient for a class weight: one that
// requires grad is refused (as torch's nll_loss) rather than left without one.
TEST(DoubleBackwardLayouts, CrossEntropyRefusesAClassWeightThatRequiresGrad) {
  Generator gen(18);
  const Tensor x = randn({3, 4}, kFloat64, &gen).requires_grad_();
  const Tensor target = tensor<int64_t>({0, 3, 1});
  const Tensor weight = rand({4}, TensorOptions(kFloat64), &gen).requires_grad_();
  try {
    F::cross_entropy(x, target, {.weight = weight});
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("cross_entropy"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("weight.detach()"), std::string::npos) << e.what();
  }
  // Without grad mode, or with the weight detached, it runs.
  {
    const NoGradGuard ng;
    EXPECT_NO_THROW(F::cross_entropy(x, target, {.weight = weight}));
  }
  EXPECT_NO_THROW(F::cross_entropy(x, target, {.weight = weight.detach()}));
  // Class-probability targets compose kiln ops: the weight gets its gradient there.
  const Tensor probs = randn({3, 4}, kFloat64, &gen).softmax(1);
  const Tensor g = autograd::grad({F::cross_entropy(x, probs, {.weight = weight})}, {weight})[0];
  EXPECT_TRUE(g.defined());
}

// A custom Function that saves the contiguous copy its kernel read (the
// pattern LayerNorm had), with differentiate_composite for create_graph.
struct CopySavingSquare : autograd::Function<CopySavingSquare> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x) {
    const Tensor xc = x.contiguous();
    ctx.save_for_backward({xc});
    return xc * xc;
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    const Tensor x = ctx.get_saved_variables()[0];
    if (grad_mode_enabled()) {
      return ctx.differentiate_composite({x}, grads, [](const TensorList& in) { return TensorList{in[0] * in[0]}; });
    }
    return {grads[0] * x * 2};
  }
};

// The same with the argument saved: what the fused ops do now.
struct ArgSavingSquare : autograd::Function<ArgSavingSquare> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x) {
    ctx.save_for_backward({x});
    const Tensor xc = x.contiguous();
    return xc * xc;
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    const Tensor x = ctx.get_saved_variables()[0];
    if (grad_mode_enabled()) {
      return ctx.differentiate_composite({x}, grads, [](const TensorList& in) { return TensorList{in[0] * in[0]}; });
    }
    return {grads[0] * x.contiguous() * 2};
  }
};

TEST(DoubleBackwardLayouts, CustomFunctionThatSavedACopyNamesItselfUnderCreateGraph) {
  Generator gen(19);
  const Tensor x = randn({3, 2}, kFloat64, &gen).t().requires_grad_();
  const Tensor y = CopySavingSquare::apply(x).sum();
  // First order never looks at the copy's history.
  EXPECT_TRUE(autograd::grad({y}, {x}, {}, /*retain_graph=*/true)[0].allclose(x.detach() * 2, 0, 0));
  try {
    autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("CopySavingSquareBackward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no history"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(autograd::gradgradcheck([](const TensorList& t) { return TensorList{ArgSavingSquare::apply(t[0])}; },
                                      {x}));
  // Saving the argument: the create_graph gradient has history, and the second order is right.
  const Tensor z = ArgSavingSquare::apply(x).sum();
  const Tensor g = autograd::grad({z}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  expect_same(g, x.detach() * 2, "create_graph gradient");
  expect_same(autograd::grad({g.sum()}, {x})[0], full({2, 3}, 2.0, TensorOptions(kFloat64)), "second order");
}

// A create_graph branch that drops the gradient of an input whose saved
// tensor has no history (LayerNorm's former code, in miniature): its
// first-order function is a constant zero for that input everywhere, so
// only gradgradcheck's comparison with the plain backward can see it.
struct DroppingSquare : autograd::Function<DroppingSquare> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& x) {
    const Tensor xc = x.contiguous();
    ctx.save_for_backward({xc});
    return xc * xc;
  }
  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    const Tensor x = ctx.get_saved_variables()[0];
    if (grad_mode_enabled() && !x.requires_grad()) return {Tensor()};
    return {grads[0] * x * 2};
  }
};

TEST(DoubleBackwardLayouts, GradgradcheckComparesCreateGraphGradientsWithThePlainOnes) {
  Generator gen(20);
  const auto f = [](const TensorList& t) { return TensorList{DroppingSquare::apply(t[0])}; };
  const Tensor contiguous = randn({2, 3}, kFloat64, &gen).requires_grad_();
  EXPECT_TRUE(autograd::gradgradcheck(f, {contiguous}));
  const Tensor transposed = randn({3, 2}, kFloat64, &gen).t().requires_grad_();
  try {
    autograd::gradgradcheck(f, {transposed});
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("undefined"), std::string::npos) << e.what();
  }
  autograd::GradcheckOptions quiet;
  quiet.raise = false;
  EXPECT_FALSE(autograd::gradgradcheck(f, {transposed}, quiet));
}

}  // namespace
