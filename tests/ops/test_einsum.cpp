// einsum against torch.einsum (1.13, no opt_einsum): a table of equations
// (products, diagonals, sums, ellipsis broadcasting, size-1 broadcasting,
// implicit outputs, three and four operands) compared in float32 and float64,
// gradients for the same grad_output compared with torch.autograd.grad,
// float64 gradcheck and gradgradcheck on a subset, and the error messages
// for malformed equations (torch refuses each of them too).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dense_grad_util.h"
#include "kiln/kiln.h"
#include "kiln/ops/einsum.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::error_message;
using kiln::test::expect_gradcheck;
using kiln::test::expect_gradgradcheck;
using kiln::test::values;

namespace {

struct EinsumCase {
  const char* label;
  const char* equation;
  std::vector<std::vector<int64_t>> shapes;
};

// clang-format off
const EinsumCase kCases[] = {
    {"matmul",                    "ij,jk->ik",            {{3, 4}, {4, 5}}},
    {"matmul implicit",           "ij,jk",                {{3, 4}, {4, 5}}},
    {"matmul spaced",             " ij , jk -> ik ",      {{3, 4}, {4, 5}}},
    {"matrix-vector",             "ij,j->i",              {{3, 4}, {4}}},
    {"bmm",                       "bij,bjk->bik",         {{2, 3, 4}, {2, 4, 5}}},
    {"attention scores",          "bhqd,bhkd->bhqk",      {{2, 3, 4, 5}, {2, 3, 6, 5}}},
    {"attention values",          "bhqk,bhkd->bqhd",      {{2, 3, 4, 6}, {2, 3, 6, 5}}},
    {"outer product",             "i,j->ij",              {{3}, {4}}},
    {"outer product implicit",    "i,j",                  {{3}, {4}}},
    {"dot",                       "i,i->",                {{5}, {5}}},
    {"dot implicit",              "i,i",                  {{5}, {5}}},
    {"trace",                     "ii->",                 {{4, 4}}},
    {"trace implicit",            "ii",                   {{4, 4}}},
    {"diagonal",                  "ii->i",                {{4, 4}}},
    {"batched diagonal",          "...ii->...i",          {{2, 3, 3}}},
    {"diagonal of three dims",    "iii->i",               {{3, 3, 3}}},
    {"repeated label apart",      "iji->ji",              {{3, 4, 3}}},
    {"diagonal times matrix",     "ii,ij->ij",            {{3, 3}, {3, 4}}},
    {"transpose",                 "ij->ji",               {{3, 4}}},
    {"transpose implicit",        "ba",                   {{3, 4}}},
    {"permute 3-D",               "abc->cab",             {{2, 3, 4}}},
    {"sum all",                   "ij->",                 {{3, 4}}},
    {"sum rows",                  "ij->j",                {{3, 4}}},
    {"elementwise",               "ij,ij->ij",            {{3, 4}, {3, 4}}},
    {"elementwise sum",           "ij,ij->",              {{3, 4}, {3, 4}}},
    {"ellipsis broadcast matmul", "...ij,...jk->...ik",   {{2, 1, 3, 4}, {5, 4, 2}}},
    {"ellipsis implicit",         "...ij,...jk",          {{2, 3, 4}, {4, 5}}},
    {"ellipsis in the middle",    "i...j->j...i",         {{2, 3, 4, 5}}},
    {"ellipsis summed",           "...ij->ij",            {{2, 3, 4, 5}}},
    {"ellipsis moved last",       "...ij,...jk->ik...",   {{2, 3, 4}, {2, 4, 5}}},
    {"label of size 1",           "ij,jk->ik",            {{3, 1}, {4, 5}}},
    {"batch label of size 1",     "bij,bjk->bik",         {{1, 3, 4}, {2, 4, 5}}},
    {"output label of size 1",    "ij,kj->ik",            {{1, 4}, {5, 4}}},
    {"several contracted dims",   "abcd,cdbe->ae",        {{2, 3, 4, 5}, {4, 5, 3, 6}}},
    {"three operands chain",      "ij,jk,kl->il",         {{2, 3}, {3, 4}, {4, 5}}},
    {"three operands bilinear",   "bn,anm,bm->ba",        {{2, 3}, {4, 3, 5}, {2, 5}}},
    {"three operands implicit",   "ij,jk,kl",             {{2, 3}, {3, 4}, {4, 5}}},
    {"three with shared batch",   "bi,bj,bk->bijk",       {{2, 3}, {2, 4}, {2, 2}}},
    {"four operands outer",       "a,b,c,d->abcd",        {{2}, {3}, {2}, {2}}},
    {"upper case first",          "ib,bA",                {{3, 4}, {4, 5}}},
    {"0-dim operand",             ",ij->ij",              {{}, {3, 4}}},
    {"empty contraction",         "ij,jk->ik",            {{3, 0}, {0, 4}}},
};
// clang-format on

std::string torch_expr(const EinsumCase& c) {
  std::string e = std::string("torch.einsum('") + c.equation + "'";
  for (size_t i = 0; i < c.shapes.size(); ++i) e += ", x" + std::to_string(i);
  return e + ")";
}

TensorList inputs_of(const EinsumCase& c, uint64_t seed, DType dt) {
  TensorList xs;
  for (const auto& s : c.shapes) {
    Generator g(seed++);
    xs.push_back(randn(s, kFloat64, &g).to(dt));
  }
  return xs;
}

void expect_near(const Tensor& got, const Tensor& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.sizes().vec(), want.sizes().vec()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  const auto a = values(got), b = values(want);
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::abs(a[i] - b[i]), atol + rtol * std::abs(b[i]))
        << what << ": element " << i << " is " << a[i] << ", torch gives " << b[i];
}

}  // namespace

// Values in float32 and float64, and float64 gradients, against torch in one oracle run.
TEST(Einsum, MatchesTorch) {
  struct Pending {
    const EinsumCase* c;
    DType dt;
    TensorList xs;
    Tensor gy;  // defined for gradient cases
    size_t index;
  };
  test::OracleBatch batch;
  std::vector<Pending> pending;
  uint64_t seed = 1;
  for (const EinsumCase& c : kCases) {
    for (DType dt : {kFloat32, kFloat64}) {
      TensorList xs = inputs_of(c, seed, dt);
      pending.push_back({&c, dt, xs, Tensor(), batch.add(std::string(c.label) + " " + std::string(dtype_name(dt)), torch_expr(c), xs)});
    }
    // Gradient w.r.t. every operand for a random grad_output of the output's shape.
    TensorList xs = inputs_of(c, seed, kFloat64);
    Generator g(seed + 100);
    Tensor gy = randn(einsum(c.equation, xs).sizes(), kFloat64, &g);
    std::vector<int> all;
    for (size_t i = 0; i < xs.size(); ++i) all.push_back(static_cast<int>(i));
    pending.push_back({&c, kFloat64, xs, gy, batch.add_grad(std::string(c.label) + " grad", torch_expr(c), xs, all, {gy})});
    seed += 10;
  }
  ASSERT_GE(sizeof(kCases) / sizeof(kCases[0]), 25u);
  batch.run();
  for (const Pending& p : pending) {
    const test::OracleOutcome& r = batch.outcome(p.index);
    const std::string what = std::string(p.c->label) + " (" + p.c->equation + ", " + std::string(dtype_name(p.dt)) + ")";
    ASSERT_TRUE(r.ok) << what << ": torch raised " << r.error;
    // float32: sums of up to 30 products of N(0, 1) values.
    const double tol = p.dt == kFloat32 ? 1e-5 : 1e-12;
    if (!p.gy.defined()) {
      ASSERT_EQ(r.outputs.size(), 1u) << what;
      expect_near(einsum(p.c->equation, p.xs), r.outputs[0], tol, tol, what);
      continue;
    }
    TensorList leaves;
    for (const Tensor& x : p.xs) leaves.push_back(x.detach().requires_grad_());
    const TensorList grads = autograd::grad({einsum(p.c->equation, leaves)}, leaves, {p.gy});
    ASSERT_EQ(grads.size(), r.outputs.size()) << what;
    for (size_t i = 0; i < grads.size(); ++i)
      expect_near(grads[i], r.outputs[i], tol, tol, what + " gradient of operand " + std::to_string(i));
  }
}

// Transposed, narrowed and expanded operands give what their contiguous copies give.
TEST(Einsum, StridedOperands) {
  Generator g(7);
  const Tensor a = randn({4, 3}, kFloat64, &g), b = randn({5, 4}, kFloat64, &g), v = randn({4}, kFloat64, &g);
  const Tensor base = randn({2, 6, 4}, kFloat64, &g);
  auto same = [](const Tensor& x, const Tensor& y) { return x.sub(y).abs().max().item<double>() < 1e-12; };
  EXPECT_TRUE(same(einsum("ij,jk->ik", {a.t(), b.t()}), einsum("ij,jk->ik", {a.t().contiguous(), b.t().contiguous()})));
  const Tensor n = base.narrow(1, 1, 3);
  EXPECT_TRUE(same(einsum("bij,jk->bik", {n, a}), einsum("bij,jk->bik", {n.contiguous(), a})));
  const Tensor e = v.expand({3, 4});
  EXPECT_TRUE(same(einsum("ij,jk->ik", {e, a}), einsum("ij,jk->ik", {e.contiguous(), a})));
}

TEST(Einsum, Gradcheck) {
  using test::leaf;
  auto f = [](const char* eq) { return [eq](const TensorList& x) { return einsum(eq, x); }; };
  expect_gradcheck(f("ij,jk->ik"), {leaf({3, 4}, 1), leaf({4, 2}, 2)}, "matmul");
  expect_gradcheck(f("bhqd,bhkd->bhqk"), {leaf({2, 2, 3, 4}, 3), leaf({2, 2, 2, 4}, 4)}, "attention scores");
  expect_gradcheck(f("ii->i"), {leaf({4, 4}, 5)}, "diagonal");
  expect_gradcheck(f("ii"), {leaf({4, 4}, 6)}, "trace");
  expect_gradcheck(f("iji->j"), {leaf({3, 2, 3}, 7)}, "repeated label apart, summed");
  expect_gradcheck(f("...ij,...jk->...ik"), {leaf({2, 1, 3, 4}, 8), leaf({3, 4, 2}, 9)}, "ellipsis broadcast");
  expect_gradcheck(f("ij,jk,kl->il"), {leaf({2, 3}, 10), leaf({3, 4}, 11), leaf({4, 2}, 12)}, "three operands");
  expect_gradcheck(f("bn,anm,bm->ba"), {leaf({2, 3}, 13), leaf({2, 3, 4}, 14), leaf({2, 4}, 15)}, "bilinear");
  expect_gradcheck(f("ij,jk->ik"), {leaf({3, 1}, 16), leaf({4, 2}, 17)}, "label of size 1");
  expect_gradcheck(f("i,j->ij"), {leaf({3}, 18), leaf({4}, 19)}, "outer");
  expect_gradcheck(f("ij,ij->"), {leaf({3, 4}, 20), leaf({3, 4}, 21)}, "elementwise sum");
  expect_gradcheck(f("ij,jk->ik"), {test::transposed_leaf({4, 3}, 22), leaf({4, 2}, 23).detach()},
                   "transposed operand, one requires grad");
}

TEST(Einsum, Gradgradcheck) {
  using test::leaf;
  auto f = [](const char* eq) { return [eq](const TensorList& x) { return einsum(eq, x); }; };
  expect_gradgradcheck(f("ij,jk->ik"), {leaf({3, 4}, 31), leaf({4, 2}, 32)}, "matmul");
  expect_gradgradcheck(f("bij,bkj->bik"), {leaf({2, 3, 4}, 33), leaf({2, 2, 4}, 34)}, "bmm with a transposed operand");
  expect_gradgradcheck(f("ii,ij->ij"), {leaf({3, 3}, 35), leaf({3, 2}, 36)}, "diagonal times matrix");
  expect_gradgradcheck(f("ij,jk,kl->il"), {leaf({2, 3}, 37), leaf({3, 2}, 38), leaf({2, 2}, 39)}, "three operands");
}

// A pairwise contraction is one matrix product: the graph holds mm / bmm nodes, not a broadcast mul.
TEST(Einsum, ContractsWithMatrixProducts) {
  const Tensor a = randn({3, 4}).requires_grad_(), b = randn({4, 5}).requires_grad_();
  const Tensor q = randn({2, 3, 4, 5}).requires_grad_(), k = randn({2, 3, 6, 5}).requires_grad_();
  auto names = [](const Tensor& y) {  // every node of the graph, depth first
    std::string s;
    std::vector<autograd::Node*> stack{y.grad_fn()};
    while (!stack.empty()) {
      autograd::Node* n = stack.back();
      stack.pop_back();
      s += std::string(n->name()) + " ";
      for (const auto& e : n->next_edges())
        if (e.function) stack.push_back(e.function.get());
    }
    return s;
  };
  const std::string mm_graph = names(einsum("ij,jk->ik", {a, b}));
  EXPECT_NE(mm_graph.find("MmBackward0"), std::string::npos) << mm_graph;
  EXPECT_EQ(mm_graph.find("MulBackward0"), std::string::npos) << mm_graph;
  const std::string bmm_graph = names(einsum("bhqd,bhkd->bhqk", {q, k}));
  EXPECT_NE(bmm_graph.find("BmmBackward0"), std::string::npos) << bmm_graph;
}

TEST(Einsum, Errors) {
  const Tensor m34 = zeros({3, 4}), m56 = zeros({5, 6}), m33 = zeros({3, 3});
  struct ErrorCase {
    const char* label;
    std::function<void()> f;
    std::vector<std::string> want;  // substrings of the message
    std::string torch;              // the same call in torch (must raise too); "" to skip
  };
  const std::vector<ErrorCase> cases = {
      {"fewer operands", [&] { einsum("ij,jk->ik", {m34}); },
       {"equation \"ij,jk->ik\" has subscripts for 2 operands but 1 operand was given"},
       "torch.einsum('ij,jk->ik', x0)"},
      {"more operands", [&] { einsum("ij->i", {m34, m34}); },
       {"has subscripts for 1 operand but 2 operands were given"}, "torch.einsum('ij->i', x0, x0)"},
      {"no operands", [&] { einsum("", {}); }, {"expected at least one operand"}, ""},
      {"too many subscripts", [&] { einsum("ijk->i", {m34}); },
       {"operand 0 has subscripts \"ijk\" (3 dims) but shape [3, 4] (2 dims)", "write \"...\""},
       "torch.einsum('ijk->i', x0)"},
      {"too few subscripts", [&] { einsum("i->i", {m34}); }, {"operand 0 has subscripts \"i\" (1 dims)"},
       "torch.einsum('i->i', x0)"},
      {"too many subscripts with ellipsis", [&] { einsum("...ijk", {m34}); },
       {"operand 0 has subscripts \"...ijk\" (3 named dims and \"...\") but shape [3, 4] (2 dims)"},
       "torch.einsum('...ijk', x0)"},
      {"size mismatch", [&] { einsum("ij,jk->ik", {m34, m56}); },
       {"subscript 'j' has size 4 in operand 0 (shape [3, 4]) but size 5 in operand 1 (shape [5, 6])",
        "or be 1 to broadcast"},
       "torch.einsum('ij,jk->ik', x0, torch.zeros(5, 6))"},
      {"repeated label sizes", [&] { einsum("ii->i", {m34}); },
       {"subscript 'i' is repeated in operand 0 (shape [3, 4]) with sizes 3 and 4", "diagonal"},
       "torch.einsum('ii->i', x0)"},
      {"ellipsis dims mismatch", [&] { einsum("...i,...i->...i", {zeros({2, 3}), zeros({4, 3})}); },
       {"dim 0 of the broadcast \"...\" dims has size 2 in operand 0", "size 4 in operand 1"},
       "torch.einsum('...i,...i->...i', torch.zeros(2, 3), torch.zeros(4, 3))"},
      {"invalid character", [&] { einsum("i1,jk", {m34, m34}); },
       {"invalid character '1' at index 1 of equation \"i1,jk\"", "[a-zA-Z]"}, "torch.einsum('i1,jk', x0, x0)"},
      {"invalid character in output", [&] { einsum("ij->i,j", {m34}); },
       {"invalid character ',' at index 5", "the output (after \"->\") takes subscripts [a-zA-Z] and \"...\" only"},
       "torch.einsum('ij->i,j', x0)"},
      {"output label not in inputs", [&] { einsum("ij->ik", {m34}); },
       {"output subscript 'k' of equation \"ij->ik\" does not appear in the subscripts of any input operand"},
       "torch.einsum('ij->ik', x0)"},
      {"repeated output label", [&] { einsum("ij->ii", {m34}); },
       {"output subscript 'i' appears more than once in the output of equation \"ij->ii\""},
       "torch.einsum('ij->ii', x0)"},
      {"broken ellipsis", [&] { einsum("i..j->ij", {zeros({3, 2, 4})}); },
       {"'.' at index 1 of equation \"i..j->ij\" is not part of an ellipsis \"...\" (in operand 0)"},
       "torch.einsum('i..j->ij', torch.zeros(3, 2, 4))"},
      {"two ellipses", [&] { einsum("...i...->i", {m34}); },
       {"operand 0 of equation \"...i...->i\" has a second ellipsis \"...\" at index 4"},
       "torch.einsum('...i...->i', x0)"},
      {"dtype mismatch", [&] { einsum("ij,jk->ik", {m34, zeros({4, 2}, kFloat64)}); },
       {"expected operands of one dtype, got float32 for operand 0 and float64 for operand 1"},
       "torch.einsum('ij,jk->ik', x0, torch.zeros(4, 2, dtype=torch.float64))"},
      {"undefined operand", [&] { einsum("ij,jk->ik", {m34, Tensor()}); }, {"operand 1 is an undefined tensor"}, ""},
  };
  test::OracleBatch batch;
  std::vector<size_t> index(cases.size(), 0);
  for (size_t i = 0; i < cases.size(); ++i)
    if (!cases[i].torch.empty()) index[i] = batch.add(cases[i].label, cases[i].torch, {m34});
  batch.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const ErrorCase& c = cases[i];
    const std::string msg = error_message(c.f);
    for (const std::string& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << c.label << ": " << msg;
    EXPECT_EQ(msg.rfind("einsum: ", 0), 0u) << c.label << ": " << msg;
    if (!c.torch.empty()) {
      EXPECT_FALSE(batch.outcome(index[i]).ok) << c.label << ": torch accepts " << c.torch;
    }
  }
  // Shape problems are ShapeErrors, equation problems ValueErrors, as elsewhere in kiln.
  EXPECT_NE(error_message<ShapeError>([&] { einsum("ij,jk->ik", {m34, m56}); }), "<no error>");
  EXPECT_NE(error_message<ValueError>([&] { einsum("ij->ik", {m34}); }), "<no error>");
  EXPECT_NE(error_message<DTypeError>([&] { einsum("ij,jk->ik", {m34, zeros({4, 2}, kFloat64)}); }), "<no error>");
  EXPECT_EQ(einsum("ii", {m33}).dim(), 0);
}
