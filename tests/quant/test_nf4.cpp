// quant::NF4: the 16 levels against normal quantiles computed here (the QLoRA
// paper's construction), quantize/dequantize and its error bound, the double
// quantization of the block scales and its bound, NF4Linear's gradients by
// float64 central differences, the module swap on GPT with its memory saving,
// and QLoRA (LoRA adapters over an NF4 base).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kiln/core/allocator.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/lora.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/optim/optimizer.h"
#include "kiln/quant/nf4.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

// Φ⁻¹(p) by bisection on Φ(x) = erfc(-x / √2) / 2, in long double.
long double normal_ppf(long double p) {
  long double lo = -40, hi = 40;
  for (int i = 0; i < 200; ++i) {
    const long double mid = (lo + hi) / 2;
    (0.5L * std::erfc(-mid / std::sqrt(2.0L)) < p ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

// QLoRA (Dettmers et al. 2023, eq. 4 and Appendix E): 2^(k-1) quantiles of N(0, 1)
// for the positive half and 2^(k-1) - 1 for the negative half, from probability
// offset = (1/2)(1/30 + 1/32) ... as bitsandbytes: offset 0.9677083 down to 1/2
// (the point 1/2 itself dropped), zero added, everything divided by the largest.
std::vector<double> independent_levels() {
  const long double offset = 0.9677083L;
  std::vector<long double> v;
  for (int i = 0; i < 8; ++i) v.push_back(normal_ppf(offset + (0.5L - offset) * i / 8));   // linspace(offset, .5, 9)[:-1]
  for (int i = 0; i < 7; ++i) v.push_back(-normal_ppf(offset + (0.5L - offset) * i / 7));  // linspace(offset, .5, 8)[:-1]
  v.push_back(0);
  std::sort(v.begin(), v.end());
  const long double m = v.back();
  std::vector<double> out;
  for (auto x : v) out.push_back(static_cast<double>(x / m));
  return out;
}

int nearest(const std::vector<double>& levels, double v) {
  int best = 0;
  for (int i = 1; i < 16; ++i)
    if (std::abs(levels[i] - v) < std::abs(levels[best] - v)) best = i;
  return best;
}

}  // namespace

TEST(NF4, LevelsAreTheNormalQuantilesOfTheQLoRAPaper) {
  const auto want = independent_levels();
  const auto& got = quant::nf4_levels();
  ASSERT_EQ(want.size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_NEAR(got[i], want[i], 2e-7) << "level " << i;  // float32 rounding of the table
  EXPECT_EQ(got[0], -1.0f);
  EXPECT_EQ(got[7], 0.0f);
  EXPECT_EQ(got[15], 1.0f);
}

TEST(NF4, QuantizeDequantizeRoundTripWithinTheHalfGapBound) {
  manual_seed(11);
  // 37 × 202 = 7474 elements: 116 full blocks of 64 and a short one of 50.
  Tensor w = randn({37, 202}).mul(0.02);
  auto q = quant::quantize_nf4(w, {.block_size = 64, .double_quant = false});
  EXPECT_EQ(q.num_blocks(), 117);
  EXPECT_EQ(q.codes.numel(), 3737);
  Tensor back = quant::dequantize_nf4(q);
  ASSERT_EQ(back.shape(), w.shape());
  const auto levels = independent_levels();
  double max_half_gap = 0;
  for (int i = 0; i < 15; ++i) max_half_gap = std::max(max_half_gap, (levels[i + 1] - levels[i]) / 2);
  auto x = test::to_doubles(w), y = test::to_doubles(back), s = test::to_doubles(q.absmax);
  double se = 0, sx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const size_t b = i / 64;
    double m = 0;
    for (size_t k = b * 64; k < std::min(x.size(), b * 64 + 64); ++k) m = std::max(m, std::abs(x[k]));
    ASSERT_EQ(s[b], m) << "block " << b << "'s scale is its absmax";
    // The code is the nearest level (independent levels; float32 ties aside) and the value is level · scale.
    const int want = nearest(levels, x[i] / m);
    EXPECT_NEAR(y[i], levels[want] * m, 1e-6 * m) << i;
    EXPECT_LE(std::abs(y[i] - x[i]), max_half_gap * m * (1 + 1e-6)) << i;
    se += (y[i] - x[i]) * (y[i] - x[i]);
    sx += x[i] * x[i];
  }
  // For normal data the relative RMS error of NF4 with blocks of 64 is about 0.1.
  EXPECT_LT(std::sqrt(se / sx), 0.12);
}

TEST(NF4, DoubleQuantizationOfTheScalesWithinHalfAStep) {
  manual_seed(12);
  Tensor w = randn({256, 1024}).mul(0.05);  // 4096 blocks of 64, 16 scale blocks of 256
  auto plain = quant::quantize_nf4(w, {.double_quant = false});
  auto dq = quant::quantize_nf4(w, {.double_quant = true});
  EXPECT_TRUE(test::to_doubles(plain.codes) == test::to_doubles(dq.codes)) << "the codes do not depend on the scales";
  auto exact = test::to_doubles(plain.absmax), coded = test::to_doubles(quant::nf4_block_scales(dq));
  double mean = 0;
  for (double v : exact) mean += v;
  mean /= static_cast<double>(exact.size());
  EXPECT_NEAR(test::to_doubles(dq.absmax_offset)[0], mean, 1e-6 * mean);
  for (size_t k = 0; k < 16; ++k) {
    double m = 0;
    for (size_t b = k * 256; b < k * 256 + 256; ++b) m = std::max(m, std::abs(exact[b] - mean));
    const double step = m / 127;
    for (size_t b = k * 256; b < k * 256 + 256; ++b)
      ASSERT_LE(std::abs(coded[b] - exact[b]), step / 2 + 1e-6 * exact[b]) << "scale " << b;
  }
  // Bits per weight: 4 + 32/64 without, 4 + 8/64 + 32/(64·256) (+ one float) with double quantization.
  const double n = 256.0 * 1024;
  EXPECT_NEAR(plain.nbytes() * 8 / n, 4.5, 1e-9);
  EXPECT_NEAR(dq.nbytes() * 8 / n, 4.0 + 8.0 / 64 + 32.0 / (64 * 256) + 32 / n, 1e-9);
  // The whole weight: the NF4 bound plus the scale error times the largest level (1).
  auto x = test::to_doubles(w), y = test::to_doubles(quant::dequantize_nf4(dq)),
       y0 = test::to_doubles(quant::dequantize_nf4(plain));
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_LE(std::abs(y[i] - y0[i]), std::abs(coded[i / 64] - exact[i / 64]) * (1 + 1e-6) + 1e-9) << i;
}

TEST(NF4, HostileOptionsAreRefused) {
  EXPECT_THROW(quant::quantize_nf4(randn({4, 4}), {.block_size = 63}), ValueError);
  EXPECT_THROW(quant::quantize_nf4(randn({4, 4}), {.block_size = 0}), ValueError);
  EXPECT_THROW(quant::quantize_nf4(zeros({4}, TensorOptions(kInt64))), DTypeError);
  auto q = quant::quantize_nf4(zeros({4, 4}));  // all-zero blocks: scale 0, values 0
  EXPECT_EQ(test::to_doubles(quant::dequantize_nf4(q)), std::vector<double>(16, 0.0));
}

TEST(NF4Linear, ForwardIsTheDequantizedProductAndGradientsPassCentralDifferences) {
  manual_seed(13);
  nn::Linear lin({.in_features = 70, .out_features = 9, .dtype = kFloat64});
  quant::NF4Linear q(lin);
  EXPECT_FALSE(q.weight.defined());
  EXPECT_EQ(q.parameters().size(), 1u);  // the bias only
  EXPECT_FALSE(q.bias.requires_grad());
  Tensor x = randn({3, 2, 70}, TensorOptions(kFloat64));
  Tensor want = kiln::linear(x, q.dequantized_weight().to(kFloat64), q.bias);
  EXPECT_TRUE(test::to_doubles(q(x)) == test::to_doubles(want));
  q.bias.requires_grad_(true);
  x.requires_grad_(true);
  EXPECT_TRUE(autograd::gradcheck([&](const TensorList& in) { return TensorList{q(in[0])}; }, {x}));
  EXPECT_TRUE(autograd::gradcheck([&](const TensorList& in) { return TensorList{q(in[0]).pow(2.0)}; }, {x}));
  q.zero_grad();
  q(x).sum().backward();
  // d sum / d bias = the number of rows.
  EXPECT_EQ(test::to_doubles(q.bias.grad()), std::vector<double>(9, 6.0));
}

TEST(NF4Linear, SwapOnGPTSavesParameterMemoryAndKeepsOutputsClose) {
  manual_seed(14);
  const models::GPTOptions o{.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 64, .activation_checkpointing = {}};
  auto m = std::make_shared<models::GPT>(o);
  m->eval();
  Tensor idx = randint(0, 32, {2, 16}, TensorOptions(kInt64));
  NoGradGuard ng;  // no graph keeps the float weights alive
  Tensor ref = (*m)(idx);
  const int64_t params_before = memory::stats()[MemoryCategory::Parameter].live_bytes;
  auto report = quant::quantize_linears_nf4(*m, {"attn.c_attn", "attn.c_proj", "mlp.*"});
  EXPECT_EQ(report.paths.size(), 8u);
  EXPECT_EQ(report.paths.front(), "transformer.h.0.attn.c_attn");
  EXPECT_NE(dynamic_cast<quant::NF4Linear*>(m->h->named_children()[0].second.get()->named_children()[1].second
                                                .get()
                                                ->named_children()[0]
                                                .second.get()),
            nullptr);
  const int64_t params_after = memory::stats()[MemoryCategory::Parameter].live_bytes;
  // Each float weight (4 bytes per element) became ~0.52 bytes per element.
  EXPECT_EQ(report.float_bytes, 4 * 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64));
  EXPECT_LT(report.nf4_bytes * 7, report.float_bytes);
  EXPECT_LT(params_after, params_before - report.float_bytes + report.nf4_bytes + 64 * 64);
  EXPECT_GT(params_after, params_before - report.float_bytes);
  // Quantization error: logits close, not equal.
  auto a = test::to_doubles((*m)(idx)), b = test::to_doubles(ref);
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i])), scale = std::max(scale, std::abs(b[i]));
  EXPECT_GT(worst, 0.0);
  EXPECT_LT(worst, 0.05 * scale);
  // The tied head is refused by name, as is a target that matches nothing.
  std::string msg = test::error_message([&] { quant::quantize_linears_nf4(*m, {"lm_head", "q_proj"}); });
  EXPECT_NE(msg.find("'lm_head': its weight is tied to 'transformer.wte.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("target 'q_proj' matches no float Linear module"), std::string::npos) << msg;
}

TEST(NF4Linear, QLoRATrainsOnlyTheAdaptersOverTheFrozenNF4Base) {
  manual_seed(15);
  const models::GPTOptions o{.vocab_size = 16, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 64, .activation_checkpointing = {}};
  models::GPT m(o);
  quant::quantize_linears_nf4(m, {"attn.c_attn", "attn.c_proj", "mlp.*"});
  Tensor idx = randint(0, 16, {4, 8}, TensorOptions(kInt64)), tgt = randint(0, 16, {4, 8}, TensorOptions(kInt64));
  m.eval();
  Tensor base = m(idx);
  auto lora = nn::lora::apply(m, {.targets = {"attn.c_attn", "attn.c_proj", "mlp.*"}, .rank = 4, .alpha = 8});
  EXPECT_TRUE(test::to_doubles(m(idx)) == test::to_doubles(base)) << "B = 0 starts at the NF4 base exactly";
  m.train();
  optim::AdamW opt(lora.trainable_parameters(), {.lr = 1e-2});
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    opt.zero_grad();
    Tensor loss = m.loss(idx, tgt);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = test::to_doubles(loss.detach())[0];
  }
  EXPECT_LT(last, first - 0.1);
  EXPECT_EQ(opt.state().size(), 8u);
  for (auto& [n, p] : m.named_parameters())
    if (n.find(".lora_") == std::string::npos) {
      EXPECT_FALSE(p.grad().defined()) << n;
    }
  std::string msg = test::error_message([&] { lora.merge(); });
  EXPECT_NE(msg.find("'transformer.h.0.attn.c_attn': its base has no float weight"), std::string::npos) << msg;
}
