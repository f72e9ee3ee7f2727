// quant INT4 weight-only: nibble packing, round-to-nearest against a reference
// written here, ops::int4_linear against dequantize-then-matmul, GPTQ (equal to
// RTN when H is the identity, better than RTN on correlated inputs), the
// Hessian recorder, GPT's linears swapped, checkpoints and hostile files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/transformer.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/int4.h"
#include "kiln/quant/int4.h"
#include "kiln/quant/int8_dynamic.h"
#include "support/test_util.h"

using namespace kiln;
using kiln::test::TempDir;

namespace {

Tensor randn_seeded(std::vector<int64_t> shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, TensorOptions(kFloat32), &g);
}

double rel_diff(const Tensor& a, const Tensor& b) {
  const NoGradGuard ng;
  const Tensor d = a.to(kFloat64) - b.to(kFloat64);
  return std::sqrt((d * d).sum().item<double>()) / std::sqrt((b.to(kFloat64) * b.to(kFloat64)).sum().item<double>());
}

double max_abs(const Tensor& a) { return a.abs().max().item<double>(); }

// The reference RTN, written without quant's helpers: per (row, group) the
// range [min(w, 0), max(w, 0)] in float, scale = range / 15, zero point and codes
// rounded half to even.
struct RefInt4 {
  std::vector<uint8_t> codes, zeros;
  std::vector<float> scales;
};
RefInt4 reference_rtn(const Tensor& w, int64_t g) {
  const Tensor c = w.contiguous();
  const float* x = c.data_ptr<float>();
  const int64_t out = w.size(0), in = w.size(1), groups = in / g;
  RefInt4 r;
  r.codes.resize(out * in);
  r.scales.resize(out * groups);
  r.zeros.resize(out * groups);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t k = 0; k < groups; ++k) {
      float lo = 0, hi = 0;
      for (int64_t i = 0; i < g; ++i) {
        lo = std::min(lo, x[o * in + k * g + i]);
        hi = std::max(hi, x[o * in + k * g + i]);
      }
      float s = (hi - lo) / 15.0f;
      float z = std::nearbyint(-lo / s);
      if (hi == lo) s = 1.0f, z = 0.0f;
      r.scales[o * groups + k] = s;
      r.zeros[o * groups + k] = static_cast<uint8_t>(z);
      for (int64_t i = 0; i < g; ++i) {
        float q = std::nearbyint(x[o * in + k * g + i] / s) + z;
        q = q < 0 ? 0 : q > 15 ? 15 : q;
        r.codes[o * in + k * g + i] = static_cast<uint8_t>(q);
      }
    }
  return r;
}

}  // namespace

TEST(Int4Pack, RoundTripAndByteLayout) {
  Generator g(3);
  const Tensor codes = randint(0, 16, {6, 10}, TensorOptions(kUInt8), &g);
  const Tensor packed = ops::int4_pack(codes);
  ASSERT_EQ(packed.sizes(), IntArrayRef({6, 5}));
  EXPECT_TRUE(test::bitwise_equal(ops::int4_unpack(packed), codes));
  // Element 2j in the high nibble (NF4's convention).
  const Tensor two = tensor<uint8_t>({1, 2, 15, 0}, {4});
  const Tensor p2 = ops::int4_pack(two);
  EXPECT_EQ(p2.data_ptr<uint8_t>()[0], 0x12);
  EXPECT_EQ(p2.data_ptr<uint8_t>()[1], 0xF0);
  EXPECT_THROW(ops::int4_pack(tensor<uint8_t>({1, 16}, {2})), ValueError);
  EXPECT_THROW(ops::int4_pack(tensor<uint8_t>({1, 2, 3}, {3})), ValueError);
}

TEST(Int4Rtn, ExactAgainstReference) {
  for (int64_t g : {64, 128}) {
    Tensor w = randn_seeded({37, 256}, 11) * 0.05;
    // An all-zero group, an all-positive one and one all-negative: the range always holds 0.
    w.narrow(1, 0, g).narrow(0, 0, 1).zero_();
    w.narrow(1, g, g).narrow(0, 1, 1).abs_();
    w.narrow(1, 0, g).narrow(0, 2, 1).abs_().neg_();
    const quant::Int4Tensor q = quant::quantize_int4_rtn(w, g);
    const RefInt4 r = reference_rtn(w, g);
    const Tensor codes = ops::int4_unpack(q.packed);
    ASSERT_EQ(codes.numel(), static_cast<int64_t>(r.codes.size()));
    EXPECT_EQ(std::memcmp(codes.data_ptr<uint8_t>(), r.codes.data(), r.codes.size()), 0) << "g=" << g;
    EXPECT_EQ(std::memcmp(q.zeros.data_ptr<uint8_t>(), r.zeros.data(), r.zeros.size()), 0) << "g=" << g;
    EXPECT_EQ(std::memcmp(q.scales.data_ptr<float>(), r.scales.data(), r.scales.size() * 4), 0) << "g=" << g;
    // Dequantized within half a step of each weight (plus float rounding), and zeros exact.
    const Tensor d = quant::dequantize_int4(q);
    const Tensor wc = w.contiguous();
    const float* pw = wc.data_ptr<float>();
    const float* pd = d.data_ptr<float>();
    const int64_t groups = 256 / g;
    for (int64_t o = 0; o < 37; ++o)
      for (int64_t i = 0; i < 256; ++i) {
        const float s = r.scales[o * groups + i / g];
        ASSERT_LE(std::abs(pw[o * 256 + i] - pd[o * 256 + i]), 0.5f * s * (1 + 1e-5f)) << o << "," << i;
        if (pw[o * 256 + i] == 0) ASSERT_EQ(pd[o * 256 + i], 0.0f);
      }
    EXPECT_EQ(q.nbytes(), 37 * 128 + 37 * groups * 5);
  }
  EXPECT_THROW(quant::quantize_int4_rtn(randn_seeded({4, 96}, 1), 64), ValueError);
  EXPECT_THROW(quant::quantize_int4_rtn(randn_seeded({4}, 1), 64), ValueError);
}

TEST(Int4Linear, ProductEqualsDequantizeThenMatmul) {
  // n = 300 is not a multiple of the kernel's tile, k = 1024 spans several groups.
  for (int64_t k : {256, 1024}) {
    const quant::Int4Tensor q = quant::quantize_int4_rtn(randn_seeded({300, k}, 5), 64);
    const Tensor bias = randn_seeded({300}, 6);
    const Tensor wd = quant::dequantize_int4(q);
    for (int64_t m : {1, 7, 130}) {
      const Tensor x = randn_seeded({m, k}, 7 + m);
      const Tensor y = ops::int4_linear(x.reshape({1, m, k}), q.packed, q.scales, q.zeros, bias, 64);
      ASSERT_EQ(y.sizes(), IntArrayRef({1, m, 300}));
      const Tensor ref = (x.to(kFloat64).matmul(wd.to(kFloat64).transpose(0, 1)) + bias.to(kFloat64)).to(kFloat32);
      EXPECT_LT(rel_diff(y.reshape({m, 300}), ref), 1e-5) << "m=" << m << " k=" << k;
      const Tensor y0 = ops::int4_linear(x, q.packed, q.scales, q.zeros, Tensor(), 64);
      const Tensor ref0 = x.to(kFloat64).matmul(wd.to(kFloat64).transpose(0, 1)).to(kFloat32);
      EXPECT_LT(rel_diff(y0, ref0), 1e-5);
    }
  }
  const quant::Int4Tensor q = quant::quantize_int4_rtn(randn_seeded({8, 64}, 5), 64);
  EXPECT_THROW(ops::int4_linear(randn_seeded({2, 32}, 1), q.packed, q.scales, q.zeros, Tensor(), 64), ShapeError);
  EXPECT_THROW(ops::int4_linear(randn_seeded({2, 64}, 1), q.packed, q.scales, q.zeros, Tensor(), 32), ShapeError);
  EXPECT_THROW(ops::int4_linear(randn_seeded({2, 64}, 1), q.packed, q.zeros, q.zeros, Tensor(), 64), ShapeError);
}

TEST(Int4Gptq, IdentityHessianIsRtn) {
  // With H = I every column's error stays in its column: GPTQ is RTN exactly.
  const Tensor w = randn_seeded({16, 256}, 21);
  const quant::Int4Tensor r = quant::quantize_int4_rtn(w, 64);
  const quant::Int4Tensor g = quant::quantize_int4_gptq(w, eye(256, std::nullopt, TensorOptions(kFloat64)), {.group_size = 64});
  EXPECT_TRUE(test::bitwise_equal(g.packed, r.packed));
  EXPECT_TRUE(test::bitwise_equal(g.scales, r.scales));
  EXPECT_TRUE(test::bitwise_equal(g.zeros, r.zeros));
}

TEST(Int4Gptq, ReducesLayerOutputErrorOnCorrelatedInputs) {
  // X = Z A: inputs correlated through a random mixing matrix, as activations are.
  const int64_t in = 256, out = 64, n = 2048;
  const Tensor x = randn_seeded({n, 32}, 31).matmul(randn_seeded({32, in}, 32)) + randn_seeded({n, in}, 33) * 0.1;
  const Tensor w = randn_seeded({out, in}, 34) * 0.05;
  // The recorder hooks the model's sub-modules, so the layer sits in a container.
  nn::Sequential seq;
  auto child = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = in, .out_features = out, .bias = false});
  {
    const NoGradGuard ng;
    child->weight.copy_(w);
  }
  seq.push_back(child);
  quant::HessianRecorder rec2(seq, {"0"});
  {
    const NoGradGuard ng;
    seq(x.narrow(0, 0, 1000));
    seq(x.narrow(0, 1000, n - 1000));
  }
  EXPECT_EQ(rec2.rows("0"), n);
  const Tensor h = rec2.hessian("0");
  const Tensor h_ref = x.to(kFloat64).transpose(0, 1).matmul(x.to(kFloat64)) * (2.0 / n);
  EXPECT_LT(rel_diff(h, h_ref), 1e-5);  // each call's XᵀX is float32
  const Tensor y = x.matmul(w.transpose(0, 1));
  for (int64_t g : {64, 128}) {
    const Tensor wr = quant::dequantize_int4(quant::quantize_int4_rtn(w, g));
    const Tensor wg = quant::dequantize_int4(quant::quantize_int4_gptq(w, h, {.group_size = g}));
    const double e_rtn = rel_diff(x.matmul(wr.transpose(0, 1)), y);
    const double e_gptq = rel_diff(x.matmul(wg.transpose(0, 1)), y);
    EXPECT_LT(e_gptq, 0.8 * e_rtn) << "g=" << g << " rtn " << e_rtn << " gptq " << e_gptq;
    std::printf("g=%lld: relative output error rtn %.4f, gptq %.4f\n", static_cast<long long>(g), e_rtn, e_gptq);
  }
  EXPECT_THROW(quant::quantize_int4_gptq(w, eye(128, std::nullopt, TensorOptions(kFloat64)), {}), ValueError);
  EXPECT_THROW(quant::quantize_int4_gptq(w, h, {.group_size = 128, .block_size = 64}), ValueError);
}

namespace {

models::GPTOptions tiny_gpt() {
  models::GPTOptions o;
  o.vocab_size = 32;
  o.block_size = 16;
  o.n_layer = 2;
  o.n_head = 2;
  o.n_embd = 64;
  return o;
}

Tensor tokens(uint64_t seed) {
  Generator g(seed);
  return randint(0, 32, {3, 16}, TensorOptions(kInt64), &g);
}

Tensor logits(models::GPT& m, const Tensor& idx) {
  const NoGradGuard ng;
  return m(idx).contiguous();
}

}  // namespace

TEST(Int4Gpt, SwapsTheBlocksLinearsAndKeepsTheTiedHeadFloat) {
  for (bool gptq : {false, true}) {
    manual_seed(4);
    models::GPT m(tiny_gpt());
    m.eval();
    const Tensor idx = tokens(9);
    const Tensor y_float = logits(m, idx);
    std::unique_ptr<quant::HessianRecorder> rec;
    if (gptq) {
      rec = std::make_unique<quant::HessianRecorder>(m, quant::gpt_int4_targets());
      for (uint64_t s = 0; s < 4; ++s) logits(m, tokens(50 + s));
    }
    const quant::Int4Report r = quant::quantize_linears_int4(m, quant::gpt_int4_targets(), {.group_size = 64}, rec.get());
    rec.reset();
    ASSERT_EQ(r.paths.size(), 8u);
    EXPECT_EQ(r.paths[0], "transformer.h.0.attn.c_attn");
    auto block = std::dynamic_pointer_cast<nn::TransformerBlock>((*m.h)[0]);
    ASSERT_TRUE(block);
    EXPECT_TRUE(std::dynamic_pointer_cast<quant::Int4Linear>(block->attn->c_attn));
    EXPECT_TRUE(std::dynamic_pointer_cast<quant::Int4Linear>(block->mlp->c_proj));
    EXPECT_EQ(dynamic_cast<quant::Int4Linear*>(m.lm_head.get()), nullptr);
    // 4 bits + 40 / 64 bits of scale and zero point per weight, against 32.
    EXPECT_LE(r.int4_bytes * 6, r.float_bytes);
    const Tensor y = logits(m, idx);
    EXPECT_LT(rel_diff(y, y_float), 0.1) << (gptq ? "gptq" : "rtn");
  }
  models::GPT m(tiny_gpt());
  EXPECT_THROW(quant::quantize_linears_int4(m, {"lm_head"}), ValueError);  // tied to wte
  EXPECT_THROW(quant::quantize_linears_int4(m, {"nothing"}), ValueError);
  EXPECT_THROW(quant::quantize_linears_int4(m, quant::gpt_int4_targets(), {.group_size = 48}), ValueError);
}

namespace {

struct SavedGpt {
  std::vector<std::pair<std::string, Tensor>> tensors;
  io::Metadata metadata;
  Tensor y;  // the int4 model's logits on tokens(9)
};

const SavedGpt& saved_gpt() {
  static SavedGpt s = [] {
    manual_seed(4);
    models::GPT m(tiny_gpt());
    m.eval();
    quant::quantize_linears_int4(m, quant::gpt_int4_targets(), {.group_size = 64});
    TempDir dir;
    quant::save_int4(m, dir.file("m.safetensors"), {{"note", "test"}});
    const io::SafetensorsFile f = io::load_safetensors(dir.file("m.safetensors"));
    SavedGpt out;
    for (const auto& [k, t] : f.tensors) out.tensors.emplace_back(k, t.clone());
    out.metadata = f.metadata;
    out.y = logits(m, tokens(9));
    return out;
  }();
  return s;
}

Tensor& tensor_of(SavedGpt& s, const std::string& name) {
  for (auto& [k, t] : s.tensors)
    if (k == name) return t;
  throw std::runtime_error("no tensor " + name);
}

template <typename E>
void expect_refused(const std::function<void(SavedGpt&)>& mutate, const std::vector<std::string>& needles) {
  SavedGpt s = saved_gpt();
  for (auto& [k, t] : s.tensors) t = t.clone();
  mutate(s);
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  io::save_safetensors(path, s.tensors, s.metadata);
  manual_seed(5);
  models::GPT m(tiny_gpt());
  m.eval();
  const Tensor y_before = logits(m, tokens(9));
  try {
    quant::load_int4(m, path);
    ADD_FAILURE() << "expected an error naming " << needles[0];
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "'" << n << "' in: " << what;
  }
  EXPECT_TRUE(test::bitwise_equal(logits(m, tokens(9)), y_before)) << "a refused file changed the model";
  auto block = std::dynamic_pointer_cast<nn::TransformerBlock>((*m.h)[0]);
  EXPECT_FALSE(std::dynamic_pointer_cast<quant::Int4Linear>(block->mlp->c_fc)) << "a refused file swapped a layer";
}

}  // namespace

TEST(Int4Checkpoint, RoundTripIsBitExact) {
  const SavedGpt& s = saved_gpt();
  EXPECT_EQ(s.metadata.at("kiln.quantized"), "int4-weight-only");
  EXPECT_EQ(s.metadata.at("note"), "test");
  TempDir dir;
  io::save_safetensors(dir.file("m.safetensors"), s.tensors, s.metadata);
  manual_seed(99);  // different float weights: all must come from the file
  models::GPT m(tiny_gpt());
  m.eval();
  const auto paths = quant::load_int4(m, dir.file("m.safetensors"));
  EXPECT_EQ(paths.size(), 8u);
  EXPECT_TRUE(test::bitwise_equal(logits(m, tokens(9)), s.y));
}

TEST(Int4Checkpoint, HostileFilesAreRefusedAndLeaveTheModelAlone) {
  const std::string L = "transformer.h.0.mlp.c_fc";
  expect_refused<FormatError>([](SavedGpt& s) { s.metadata.erase("kiln.quantized"); }, {"kiln.quantized"});
  expect_refused<ValueError>([&](SavedGpt& s) { tensor_of(s, L + ".weight_scales") = tensor_of(s, L + ".weight_scales").to(kFloat64); },
                             {L + ".weight_scales", "float32"});
  expect_refused<ValueError>([&](SavedGpt& s) { tensor_of(s, L + ".weight_int4") = tensor_of(s, L + ".weight_int4").narrow(1, 0, 16).contiguous(); },
                             {L + ".weight_int4", "[256, 32]"});
  expect_refused<ValueError>([&](SavedGpt& s) { tensor_of(s, L + ".weight_zeros") = tensor_of(s, L + ".weight_zeros").to(kFloat32); },
                             {L + ".weight_zeros", "uint8"});
  expect_refused<ValueError>([&](SavedGpt& s) { tensor_of(s, L + ".weight_scales").data_ptr<float>()[3] = 0.0f; },
                             {L + ".weight_scales", "scales > 0"});
  expect_refused<ValueError>(
      [&](SavedGpt& s) { tensor_of(s, L + ".weight_scales").data_ptr<float>()[0] = std::numeric_limits<float>::quiet_NaN(); },
      {L + ".weight_scales", "finite"});
  expect_refused<ValueError>([&](SavedGpt& s) { tensor_of(s, L + ".weight_zeros").data_ptr<uint8_t>()[5] = 16; },
                             {L + ".weight_zeros", "[0, 15]", "16"});
  expect_refused<ValueError>(
      [&](SavedGpt& s) {
        std::erase_if(s.tensors, [&](const auto& kv) { return kv.first == L + ".weight_zeros"; });
      },
      {L + ".weight_zeros", "got none"});
  expect_refused<ValueError>([&](SavedGpt& s) { s.tensors.emplace_back("extra", zeros({2})); }, {"extra"});

  // A truncated file: safetensors' own FormatError, model unchanged.
  TempDir dir;
  const std::string good = dir.file("good.safetensors"), cut = dir.file("cut.safetensors");
  io::save_safetensors(good, saved_gpt().tensors, saved_gpt().metadata);
  const std::string bytes = test::read_file(good);
  std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  models::GPT m(tiny_gpt());
  m.eval();
  const Tensor y_before = logits(m, tokens(9));
  EXPECT_THROW(quant::load_int4(m, cut), FormatError);
  EXPECT_TRUE(test::bitwise_equal(logits(m, tokens(9)), y_before));
}

// Dynamic int8 (include/kiln/quant/int8_dynamic.h): the layer against a
// reference computed here (per-channel int8 weights, per-token uint8 codes
// around 128, integer dot products in int64), and GPT close to float.
TEST(DynamicInt8, LinearMatchesIntegerReferenceAndGptStaysClose) {
  const int64_t in = 64, out = 24, rows = 10;
  nn::Linear lin(nn::LinearOptions{.in_features = in, .out_features = out, .bias = true});
  const Tensor x = randn_seeded({2, 5, in}, 71);
  quant::DynamicInt8Linear q(lin);
  Tensor y;
  {
    const NoGradGuard ng;
    y = q(x).contiguous();
  }
  const Tensor residual = randn_seeded({2, 5, out}, 72);
  Tensor y_tanh, y_erf, y_res;
  {
    const NoGradGuard ng;
    y_tanh = q.forward_gelu(x, "tanh").contiguous();
    y_erf = q.forward_gelu(x, "none").contiguous();
    y_res = q.forward_add(x, residual).contiguous();
  }
  const float* py_tanh = y_tanh.data_ptr<float>();
  const float* py_erf = y_erf.data_ptr<float>();
  const float* py_res = y_res.data_ptr<float>();
  const Tensor rc = residual.contiguous();
  const float* pr = rc.data_ptr<float>();
  ASSERT_EQ(y.sizes(), IntArrayRef({2, 5, out}));
  const Tensor w = lin.weight.detach().contiguous(), b = lin.bias.detach().contiguous(), xc = x.contiguous();
  const float* pw = w.data_ptr<float>();
  const float* px = xc.data_ptr<float>();
  const float* py = y.data_ptr<float>();
  for (int64_t o = 0; o < out; ++o) {
    float sw = 0;
    for (int64_t i = 0; i < in; ++i) sw = std::max(sw, std::abs(pw[o * in + i]));
    sw /= 127.0f;
    for (int64_t t = 0; t < rows; ++t) {
      float sx = 0;
      for (int64_t i = 0; i < in; ++i) sx = std::max(sx, std::abs(px[t * in + i]));
      sx /= 127.0f;
      int64_t acc = 0;
      for (int64_t i = 0; i < in; ++i)
        acc += static_cast<int64_t>(std::nearbyint(px[t * in + i] * (1.0f / sx))) *
               static_cast<int64_t>(std::nearbyint(pw[o * in + i] / sw));
      const double ref = static_cast<double>(sx) * sw * acc + b.data_ptr<float>()[o];
      EXPECT_NEAR(py[t * out + o], ref, 1e-5 * (1 + std::abs(ref))) << t << "," << o;
      const double g_tanh = 0.5 * ref * (1 + std::tanh(0.79788456080286535588 * (ref + 0.044715 * ref * ref * ref)));
      const double g_erf = 0.5 * ref * (1 + std::erf(ref * 0.70710678118654752440));
      EXPECT_NEAR(py_tanh[t * out + o], g_tanh, 1e-5 * (1 + std::abs(ref))) << t << "," << o;
      EXPECT_NEAR(py_erf[t * out + o], g_erf, 1e-5 * (1 + std::abs(ref))) << t << "," << o;
      const double with_res = ref + pr[t * out + o];
      EXPECT_NEAR(py_res[t * out + o], with_res, 1e-5 * (1 + std::abs(with_res))) << t << "," << o;
    }
  }
  // A row of zeros codes as 128 with scale 1 and gives the bias; an infinite input is refused.
  {
    const NoGradGuard ng;
    Tensor yz = q(zeros({1, in})).contiguous();
    for (int64_t o = 0; o < out; ++o) EXPECT_EQ(yz.data_ptr<float>()[o], b.data_ptr<float>()[o]);
    Tensor bad = x.clone();
    bad.data_ptr<float>()[3] = std::numeric_limits<float>::infinity();
    EXPECT_THROW(q(bad), ValueError);
    // A NaN is coded as the zero point (real 0), as kernels::quantize_rows_absmax_u8 documents: the row
    // gives what the same row with a 0 there gives.
    Tensor with_nan = x.clone(), with_zero = x.clone();
    with_nan.data_ptr<float>()[3] = std::numeric_limits<float>::quiet_NaN();
    with_zero.data_ptr<float>()[3] = 0.0f;
    EXPECT_TRUE(q(with_nan).equal(q(with_zero)));
    EXPECT_THROW(q.forward_add(x, randn_seeded({2, 5, out + 1}, 5)), ShapeError);
    EXPECT_THROW(q.forward_gelu(x, "sigmoid"), ValueError);
  }
  manual_seed(4);
  models::GPT m(tiny_gpt());
  m.eval();
  const Tensor idx = tokens(9);
  const Tensor y_float = logits(m, idx);
  EXPECT_EQ(quant::quantize_linears_int8_dynamic(m, quant::gpt_int4_targets()).size(), 8u);
  const Tensor y_int8 = logits(m, idx);
  EXPECT_LT(rel_diff(y_int8, y_float), 0.03);
  // The blocks reach the int8 layers through forward_gelu / forward_add (GELU and the residual add in
  // the layer's epilogue); a hook on every block's c_fc and c_proj makes them call forward() and the
  // GELU and add one by one instead: the same numbers.
  for (auto& [path, mod] : m.named_modules())
    if (path.size() > 5 && (path.ends_with("c_fc") || path.ends_with("c_proj")))
      mod->register_forward_hook([](nn::Module&, const Tensor&, const Tensor&) { return Tensor(); });
  EXPECT_LT(rel_diff(logits(m, idx), y_int8), 1e-6);
  models::GPT m2(tiny_gpt());
  EXPECT_THROW(quant::quantize_linears_int8_dynamic(m2, {"lm_head"}), ValueError);
}
