// scaled_dot_product_attention values and gradients against the reference
// formula softmax(q kᵀ / sqrt(E) + mask) v evaluated in torch 1.13 (which has
// no F.scaled_dot_product_attention); gradcheck in float64; dropout
// statistics; MultiheadAttention against torch.nn.MultiheadAttention loaded
// with the same weights; TransformerBlock against a torch block written out
// from the same weights, and its state_dict names.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kiln/ops/gradcheck.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/transformer.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

// Reference over x0 = q, x1 = k, x2 = v, x3 = mask (when used).
const std::string kScores = "(x0 @ x1.transpose(-2, -1) * x0.size(-1) ** -0.5)";
std::string sdpa_ref(const std::string& masked_scores) { return "torch.softmax(" + masked_scores + ", -1) @ x2"; }

struct SdpaCase {
  std::string id;
  Tensor q, k, v, mask;
  bool causal = false;
  std::string expr;
};

std::vector<SdpaCase> sdpa_cases() {
  manual_seed(21);
  std::vector<SdpaCase> c;
  const int64_t N = 2, H = 3, L = 5, S = 6, E = 4, Ev = 3;
  auto q = [&] { return randn({N, H, L, E}); };
  auto k = [&] { return randn({N, H, S, E}); };
  auto v = [&] { return randn({N, H, S, Ev}); };
  c.push_back({"plain", q(), k(), v(), {}, false, sdpa_ref(kScores)});
  c.push_back({"causal", q(), k(), v(), {}, true,
               sdpa_ref(kScores + ".masked_fill(~torch.ones(5, 6, dtype=torch.bool).tril(), float('-inf'))")});
  // Bool mask: true = keep; column 0 is always kept so no row is empty.
  Tensor keep = rand({L, S}).lt(0.6).logical_or(arange(S).eq(0).unsqueeze(0));
  c.push_back({"bool_mask", q(), k(), v(), keep, false, sdpa_ref(kScores + ".masked_fill(~x3, float('-inf'))")});
  // Float additive mask broadcast over heads.
  c.push_back({"float_mask", q(), k(), v(), randn({N, 1, L, S}), false, sdpa_ref(kScores + " + x3")});
  // No head dim on k and v: broadcast over q's leading dims; unbatched 2-D.
  c.push_back({"broadcast_kv", q(), randn({H, S, E}), randn({H, S, Ev}), {}, false, sdpa_ref(kScores)});
  c.push_back({"unbatched", randn({L, E}), randn({S, E}), randn({S, Ev}), {}, true,
               sdpa_ref(kScores + ".masked_fill(~torch.ones(5, 6, dtype=torch.bool).tril(), float('-inf'))")});
  return c;
}

Tensor run_sdpa(const SdpaCase& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  return F::scaled_dot_product_attention(q, k, v, c.mask, 0.0, c.causal);
}

}  // namespace

TEST(Attention, SdpaValuesAndGradientsMatchTorch) {
  auto cases = sdpa_cases();
  test::OracleBatch b;
  std::vector<Tensor> outs, gouts;
  std::vector<std::vector<Tensor>> grads;
  for (auto& c : cases) {
    std::vector<Tensor> in = {c.q, c.k, c.v};
    if (c.mask.defined()) in.push_back(c.mask);
    b.add(c.id, c.expr, in);
    Tensor q = c.q.clone().requires_grad_(), k = c.k.clone().requires_grad_(), v = c.v.clone().requires_grad_();
    Tensor out = run_sdpa(c, q, k, v);
    Tensor g = randn(out.sizes());
    out.backward(g);
    outs.push_back(out.detach());
    gouts.push_back(g);
    grads.push_back({q.grad(), k.grad(), v.grad()});
    b.add_grad(c.id + "_grad", c.expr, in, {0, 1, 2}, {g});
  }
  b.run();
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = b.outcome(2 * i);
    ASSERT_TRUE(r.ok) << cases[i].id << ": " << r.error;
    ASSERT_EQ(r.outputs[0].sizes(), outs[i].sizes()) << cases[i].id;
    EXPECT_TRUE(outs[i].allclose(r.outputs[0], 1e-5, 1e-5)) << cases[i].id << "\nkiln:\n"
                                                            << outs[i] << "\ntorch:\n"
                                                            << r.outputs[0];
    const auto& rg = b.outcome(2 * i + 1);
    ASSERT_TRUE(rg.ok) << cases[i].id << ": " << rg.error;
    for (int j = 0; j < 3; ++j) {
      ASSERT_EQ(rg.outputs[j].sizes(), grads[i][j].sizes()) << cases[i].id << " grad " << j;
      EXPECT_TRUE(grads[i][j].allclose(rg.outputs[j], 1e-4, 1e-5))
          << cases[i].id << " grad " << j << "\nkiln:\n" << grads[i][j] << "\ntorch:\n" << rg.outputs[j];
    }
  }
}

TEST(Attention, SdpaGradcheckFloat64) {
  manual_seed(5);
  TensorOptions f64(kFloat64);
  Tensor q = randn({2, 3, 2}, f64).requires_grad_(), k = randn({2, 4, 2}, f64).requires_grad_(),
         v = randn({2, 4, 3}, f64).requires_grad_();
  Tensor fmask = randn({3, 4}, f64).requires_grad_();
  Tensor bmask = tensor<bool>({true, false, true, true, false, true, true, false, true, true, false, false}, {3, 4});
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) { return TensorList{F::scaled_dot_product_attention(x[0], x[1], x[2])}; }, {q, k, v}));
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) {
        return TensorList{F::scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, /*is_causal=*/true)};
      },
      {q, k, v}));
  EXPECT_TRUE(autograd::gradcheck(
      [bmask](const TensorList& x) { return TensorList{F::scaled_dot_product_attention(x[0], x[1], x[2], bmask)}; },
      {q, k, v}));
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& x) { return TensorList{F::scaled_dot_product_attention(x[0], x[1], x[2], x[3])}; },
      {q, k, v, fmask}));
}

TEST(Attention, SdpaDropoutOnlyInTraining) {
  manual_seed(9);
  const int64_t S = 8;
  // q = k = 0: uniform weights 1/S; v = I, so the output is the weight matrix itself.
  Tensor q = zeros({4000, 1, 3}), k = zeros({S, 3}), v = eye(S);
  Tensor y = F::scaled_dot_product_attention(q, k, v, {}, 0.5);
  int64_t kept = 0;
  auto vals = test::to_doubles(y);
  for (double e : vals) {
    if (e != 0.0) {
      ++kept;
      EXPECT_NEAR(e, 2.0 / S, 1e-6);
    }
  }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(vals.size()), 0.5, 0.02);
  Tensor ye = F::scaled_dot_product_attention(q, k, v, {}, 0.5, false, /*training=*/false);
  EXPECT_TRUE(ye.allclose(full({4000, 1, S}, 1.0 / S), 1e-6, 1e-7));
}

TEST(Attention, SdpaErrorsSayWhatWasExpected) {
  Tensor q = zeros({2, 3, 4});
  EXPECT_THROW(F::scaled_dot_product_attention(q, zeros({2, 5, 3}), zeros({2, 5, 4})), ShapeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, zeros({2, 5, 4}), zeros({2, 6, 4})), ShapeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, q, q, ones({3, 3}, kBool), 0.0, true), ValueError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, q, q, ones({3, 4})), ShapeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, q, q, ones({3, 3}, kInt64)), DTypeError);
  EXPECT_THROW(F::scaled_dot_product_attention(q, q, q, {}, 1.5), ValueError);
}

namespace {

// torch.nn.MultiheadAttention with kiln's weights: x0..x2 = query, key, value,
// x3..x6 = in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias, then `extra`.
std::string torch_mha(int64_t E, int64_t H, bool batch_first, const std::string& call) {
  return "(lambda m: (m.load_state_dict({'in_proj_weight': x3, 'in_proj_bias': x4, 'out_proj.weight': x5, "
         "'out_proj.bias': x6}), " +
         call + "[0])[1])(torch.nn.MultiheadAttention(" + std::to_string(E) + ", " + std::to_string(H) +
         ", batch_first=" + (batch_first ? "True" : "False") + "))";
}

void perturb(nn::Module& m) {
  NoGradGuard g;
  for (auto& p : m.parameters()) p.add_(randn(p.sizes()).mul(0.2));
}

}  // namespace

TEST(Attention, MultiheadAttentionMatchesTorch) {
  manual_seed(33);
  const int64_t E = 8, H = 2, N = 3, L = 5, S = 4;
  nn::MultiheadAttention mha({.embed_dim = E, .num_heads = H});
  perturb(mha);  // non-zero biases so they matter
  nn::MultiheadAttention mha_lnf({.embed_dim = E, .num_heads = H, .batch_first = false});
  mha_lnf.load_state_dict(mha.state_dict());
  Tensor x = randn({N, L, E}), kk = randn({N, S, E}), vv = randn({N, S, E});
  Tensor hide = rand({L, S}).lt(0.4).logical_and(arange(S).ne(0).unsqueeze(0));  // true = masked, as torch
  Tensor fmask = randn({N * H, L, S});
  Tensor causal = arange(L).unsqueeze(0).gt(arange(L).unsqueeze(1));
  std::vector<Tensor> w = {mha.in_proj_weight.detach(), mha.in_proj_bias.detach(), mha.out_proj->weight.detach(),
                           mha.out_proj->bias.detach()};
  auto ins = [&](std::vector<Tensor> qkv, std::vector<Tensor> extra = {}) {
    for (auto& t : w) qkv.push_back(t);
    for (auto& t : extra) qkv.push_back(t);
    return qkv;
  };
  test::OracleBatch b;
  std::vector<std::pair<std::string, Tensor>> got;
  b.add("mha_cross", torch_mha(E, H, true, "m(x0, x1, x2, need_weights=False)"), ins({x, kk, vv}));
  got.push_back({"mha_cross", mha.forward(x, kk, vv)});
  b.add("mha_bool_mask", torch_mha(E, H, true, "m(x0, x1, x2, need_weights=False, attn_mask=x7)"),
        ins({x, kk, vv}, {hide}));
  got.push_back({"mha_bool_mask", mha.forward(x, kk, vv, hide)});
  b.add("mha_float_mask_3d", torch_mha(E, H, true, "m(x0, x1, x2, need_weights=False, attn_mask=x7)"),
        ins({x, kk, vv}, {fmask}));
  got.push_back({"mha_float_mask_3d", mha.forward(x, kk, vv, fmask)});
  b.add("mha_self_causal", torch_mha(E, H, true, "m(x0, x1, x2, need_weights=False, attn_mask=x7)"),
        ins({x, x, x}, {causal}));
  got.push_back({"mha_self_causal", mha.forward(x, x, x, {}, /*is_causal=*/true)});
  Tensor xt = x.transpose(0, 1).contiguous();
  b.add("mha_seq_first", torch_mha(E, H, false, "m(x0, x1, x2, need_weights=False)"), ins({xt, xt, xt}));
  got.push_back({"mha_seq_first", mha_lnf(xt)});
  Tensor x2 = randn({L, E});
  b.add("mha_unbatched", torch_mha(E, H, true, "m(x0, x1, x2, need_weights=False)"), ins({x2, x2, x2}));
  got.push_back({"mha_unbatched", mha(x2)});
  b.run();
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << got[i].first << ": " << r.error;
    ASSERT_EQ(r.outputs[0].sizes(), got[i].second.sizes()) << got[i].first;
    EXPECT_TRUE(got[i].second.allclose(r.outputs[0], 1e-5, 1e-5)) << got[i].first << "\nkiln:\n"
                                                                    << got[i].second << "\ntorch:\n"
                                                                    << r.outputs[0];
  }
  // Every parameter receives a gradient.
  mha.forward(x, kk, vv, hide).sum().backward();
  for (auto& [n, p] : mha.named_parameters()) EXPECT_TRUE(p.grad().defined()) << n;
}

TEST(Attention, MultiheadAttentionNamesAndInitAsTorch) {
  manual_seed(1);
  const int64_t E = 16;
  nn::MultiheadAttention mha({.embed_dim = E, .num_heads = 4});
  std::vector<std::string> keys;
  for (auto& [n, t] : mha.state_dict()) keys.push_back(n);
  EXPECT_EQ(keys, (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(mha.in_proj_weight.sizes(), (std::vector<int64_t>{3 * E, E}));
  EXPECT_TRUE(mha.in_proj_bias.equal(zeros({3 * E})));
  EXPECT_TRUE(mha.out_proj->bias.equal(zeros({E})));
  // xavier_uniform_: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) = sqrt(6 / (E + 3E)).
  const double a = std::sqrt(6.0 / (4.0 * E));
  EXPECT_LE(mha.in_proj_weight.abs().max().item<double>(), a);
  EXPECT_GT(mha.in_proj_weight.abs().max().item<double>(), 0.9 * a);
  // out_proj keeps Linear's kaiming_uniform(a=sqrt(5)): bound 1/sqrt(E).
  EXPECT_LE(mha.out_proj->weight.abs().max().item<double>(), 1.0 / std::sqrt(static_cast<double>(E)));
  nn::MultiheadAttention nob({.embed_dim = E, .num_heads = 4, .bias = false});
  keys.clear();
  for (auto& [n, t] : nob.state_dict()) keys.push_back(n);
  EXPECT_EQ(keys, (std::vector<std::string>{"in_proj_weight", "out_proj.weight"}));
  EXPECT_THROW(nn::MultiheadAttention({.embed_dim = 10, .num_heads = 4}), ValueError);
  EXPECT_THROW(mha(zeros({2, 3, 8})), ShapeError);
  EXPECT_THROW(mha.forward(zeros({2, 3, E}), zeros({2, 3, E}), zeros({2, 3, E}), ones({3, 2}, kBool)), ShapeError);
}

namespace {

// nanoGPT's Block written out in torch ops over x0 = input, x1..x12 = the
// block's parameters in state_dict order.
std::string torch_block(int64_t B, int64_t T, int64_t C, int64_t nh) {
  return "(lambda F, B, T, C, nh: (lambda att: (lambda h: h + F.linear(F.gelu(F.linear(F.layer_norm(h, (C,), x7, x8), "
         "x9, x10), approximate='tanh'), x11, x12))(x0 + att(F.layer_norm(x0, (C,), x1, x2))))("
         "lambda u: F.linear((lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * (C // nh) ** -0.5 + "
         "torch.full((T, T), float('-inf'), dtype=u.dtype).triu(1), -1) @ v)("
         "*[t.view(B, T, nh, C // nh).transpose(1, 2) for t in F.linear(u, x3, x4).split(C, dim=2)])"
         ".transpose(1, 2).reshape(B, T, C), x5, x6)))(torch.nn.functional, " +
         std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(C) + ", " + std::to_string(nh) + ")";
}

}  // namespace

TEST(Attention, TransformerBlockMatchesTorch) {
  manual_seed(44);
  const int64_t B = 2, T = 5, C = 8, nh = 2;
  nn::TransformerBlock blk({.d_model = C, .n_head = nh, .d_ff = 12});
  perturb(blk);  // LayerNorm affines away from 1 and 0
  Tensor x = randn({B, T, C});
  std::vector<Tensor> in = {x};
  for (auto& [n, t] : blk.state_dict()) in.push_back(t);
  ASSERT_EQ(in.size(), 13u);
  Tensor g = randn({B, T, C});
  test::OracleBatch b;
  b.add("block", torch_block(B, T, C, nh), in);
  std::vector<int> wrt;
  for (int i = 0; i < 13; ++i) wrt.push_back(i);
  b.add_grad("block_grad", torch_block(B, T, C, nh), in, wrt, {g});
  b.run();
  const auto& r = b.outcome(0);
  ASSERT_TRUE(r.ok) << r.error;
  Tensor xg = x.clone().requires_grad_();
  Tensor y = blk(xg);
  EXPECT_TRUE(y.allclose(r.outputs[0], 1e-5, 1e-5)) << "kiln:\n" << y << "\ntorch:\n" << r.outputs[0];
  y.backward(g);
  const auto& rg = b.outcome(1);
  ASSERT_TRUE(rg.ok) << rg.error;
  EXPECT_TRUE(xg.grad().allclose(rg.outputs[0], 1e-4, 1e-5)) << "input grad";
  auto params = blk.named_parameters();
  ASSERT_EQ(params.size(), 12u);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& pg = params[i].second.grad();
    ASSERT_TRUE(pg.defined()) << params[i].first;
    EXPECT_TRUE(pg.allclose(rg.outputs[i + 1], 1e-4, 1e-5)) << params[i].first << "\nkiln:\n"
                                                             << pg << "\ntorch:\n"
                                                             << rg.outputs[i + 1];
  }
}

TEST(Attention, TransformerBlockNamesCausalityAndGradcheck) {
  manual_seed(45);
  nn::TransformerBlock blk({.d_model = 8, .n_head = 2});
  std::vector<std::string> keys;
  for (auto& [n, t] : blk.state_dict()) keys.push_back(n);
  EXPECT_EQ(keys, (std::vector<std::string>{"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                            "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                                            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
                                            "mlp.c_proj.bias"}));
  EXPECT_EQ(blk.options.d_ff, 32);
  EXPECT_EQ(blk.mlp->c_fc->weight.sizes(), (std::vector<int64_t>{32, 8}));
  // Causal: changing the last position leaves earlier outputs unchanged.
  Tensor x = randn({1, 4, 8});
  Tensor x2 = x.clone();
  {
    NoGradGuard ng;
    x2.narrow(1, 3, 1).add_(ones({1, 1, 8}));
  }
  Tensor y = blk(x), y2 = blk(x2);
  EXPECT_TRUE(y.narrow(1, 0, 3).allclose(y2.narrow(1, 0, 3), 1e-6, 1e-6));
  EXPECT_FALSE(y.narrow(1, 3, 1).allclose(y2.narrow(1, 3, 1), 1e-3, 1e-3));
  // Dropout acts only in training; eval is deterministic.
  nn::TransformerBlock drop({.d_model = 8, .n_head = 2, .dropout = 0.5});
  EXPECT_FALSE(drop(x).allclose(drop(x), 1e-6, 1e-6));
  drop.eval();
  EXPECT_TRUE(drop(x).equal(drop(x)));
  // gradcheck in float64 through the whole block.
  blk.to(kFloat64);
  Tensor xd = randn({1, 3, 8}, TensorOptions(kFloat64)).requires_grad_();
  TensorList inputs = {xd};
  for (auto& p : blk.parameters()) inputs.push_back(p);
  EXPECT_TRUE(autograd::gradcheck([&blk, xd](const TensorList&) { return TensorList{blk(xd)}; }, inputs,
                                  {.fast_mode = true}));
  EXPECT_THROW(nn::TransformerBlock({.d_model = 8, .n_head = 3}), ValueError);
  EXPECT_THROW(blk(zeros({2, 8}, TensorOptions(kFloat64))), ShapeError);
}
