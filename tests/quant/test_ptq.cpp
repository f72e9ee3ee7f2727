// quant::prepare / convert on a tiny CNN trained here (a few hundred Adam
// steps on synthetic 12x12 images whose class is the quadrant of a bright
// blob): the converted model's layers are the int8 modules, its accuracy on
// held-out data stays within 2 points of float with every observer (the
// data set has 512 images, so a point is 5 images), its logits stay close,
// keep_float keeps a layer in float, and the per-layer report is complete.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "kiln/quant/ptq.h"

using namespace kiln;

namespace {

// Blob images: class c puts a Gaussian blob in quadrant c; noise everywhere.
void make_data(int64_t n, uint64_t seed, Tensor& x, Tensor& y) {
  Generator g(seed);
  x = randn({n, 1, 12, 12}, TensorOptions(kFloat32), &g).mul(0.5);
  const Tensor u = rand({n, 3}, TensorOptions(kFloat32), &g);
  y = empty({n}, TensorOptions(kInt64));
  float* px = x.data_ptr<float>();
  const float* pu = u.data_ptr<float>();
  int64_t* py = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = std::min<int64_t>(3, static_cast<int64_t>(pu[i * 3] * 4));
    py[i] = c;
    const float cy = (c / 2) * 6 + 1.5f + pu[i * 3 + 1] * 3, cx = (c % 2) * 6 + 1.5f + pu[i * 3 + 2] * 3;
    for (int64_t r = 0; r < 12; ++r)
      for (int64_t s = 0; s < 12; ++s)
        px[i * 144 + r * 12 + s] += 2.0f * std::exp(-((r - cy) * (r - cy) + (s - cx) * (s - cx)) / 4.0f);
  }
}

std::shared_ptr<models::CNN> trained_cnn() {
  static std::shared_ptr<models::CNN> cached;
  if (cached) return cached;
  manual_seed(0);
  auto m = std::make_shared<models::CNN>(
      models::CNNOptions{.channels1 = 8, .channels2 = 16, .hidden = 32, .num_classes = 4, .input_size = {12, 12}});
  Tensor x, y;
  make_data(2048, 1, x, y);
  optim::Adam opt(*m, {.lr = 3e-3});
  for (int step = 0; step < 150; ++step) {
    const int64_t b = (step * 64) % 2048;
    const Tensor xb = x.slice(0, b, b + 64), yb = y.slice(0, b, b + 64);
    opt.zero_grad();
    nn::functional::cross_entropy((*m)(xb), yb).backward();
    opt.step();
  }
  m->eval();
  cached = m;
  return m;
}

std::shared_ptr<models::CNN> copy_of(const models::CNN& src) {
  auto m = std::make_shared<models::CNN>(src.options);
  m->load_state_dict(src.state_dict());
  m->eval();
  return m;
}

double accuracy(nn::Module& m, const Tensor& x, const Tensor& y) {
  const NoGradGuard no_grad;
  const Tensor pred = m(x).argmax(1);
  const int64_t* p = pred.data_ptr<int64_t>();
  const int64_t* t = y.data_ptr<int64_t>();
  int64_t hit = 0;
  for (int64_t i = 0; i < y.numel(); ++i) hit += p[i] == t[i];
  return 100.0 * hit / y.numel();
}

}  // namespace

TEST(PTQ, ConvertKeepsAccuracyWithEveryObserver) {
  auto base = trained_cnn();
  Tensor xt, yt, xc, yc;
  make_data(512, 2, xt, yt);
  make_data(256, 3, xc, yc);
  const double float_acc = accuracy(*base, xt, yt);
  ASSERT_GT(float_acc, 90.0) << "the tiny CNN did not learn its task";
  Tensor float_logits;
  {
    const NoGradGuard no_grad;
    float_logits = (*base)(xt);
  }
  for (const std::string& obs : quant::observer_names()) {
    auto m = copy_of(*base);
    auto prepared = quant::prepare(*m, {.observer = obs});
    ASSERT_EQ(prepared->layers.size(), 4u);
    {
      const NoGradGuard no_grad;
      for (int64_t b = 0; b < 256; b += 64) (*m)(xc.slice(0, b, b + 64));
    }
    const quant::ConvertReport r = quant::convert(*m, *prepared);
    EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv1.get()), nullptr) << obs;
    EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv2.get()), nullptr) << obs;
    EXPECT_NE(dynamic_cast<quant::QuantizedLinear*>(m->fc1.get()), nullptr) << obs;
    EXPECT_NE(dynamic_cast<quant::QuantizedLinear*>(m->fc2.get()), nullptr) << obs;
    ASSERT_EQ(r.layers.size(), 4u);
    for (const auto& l : r.layers) {
      EXPECT_TRUE(l.quantized) << obs << " " << l.path << ": " << l.note;
      EXPECT_GT(l.sqnr_db, 15.0) << obs << " " << l.path;
      EXPECT_LT(l.rel_error, 0.2) << obs << " " << l.path;
    }
    EXPECT_LT(r.int8_weight_bytes * 3, r.float_weight_bytes);
    const double q_acc = accuracy(*m, xt, yt);
    EXPECT_GE(q_acc, float_acc - 2.0) << obs << ": float " << float_acc << " vs int8 " << q_acc << "\n" << r.table();
    const NoGradGuard no_grad;
    const Tensor ql = (*m)(xt);
    const double rel = ql.sub(float_logits).pow(2).sum().item<float>() / float_logits.pow(2).sum().item<float>();
    EXPECT_LT(std::sqrt(rel), 0.1) << obs;
  }
}

TEST(PTQ, KeepFloatAndErrors) {
  auto m = copy_of(*trained_cnn());
  EXPECT_THROW(quant::prepare(*m, {.observer = "kl"}), ValueError);
  EXPECT_THROW(quant::prepare(*m, {.keep_float = {"fc9"}}), ValueError);
  auto prepared = quant::prepare(*m, {.observer = "minmax", .keep_float = {"fc2"}});
  Tensor xc, yc;
  make_data(64, 4, xc, yc);
  {
    const NoGradGuard no_grad;
    // conv1 alone is called: fc1 and conv2 see nothing and must stay float.
    (*m->conv1)(xc);
  }
  const quant::ConvertReport r = quant::convert(*m, *prepared);
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv1.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QuantizedConv2d*>(m->conv2.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QuantizedLinear*>(m->fc2.get()), nullptr);
  ASSERT_EQ(r.layers.size(), 4u);
  EXPECT_EQ(r.layers[3].path, "fc2");
  EXPECT_NE(r.layers[3].note.find("keep_float"), std::string::npos);
  EXPECT_NE(r.layers[1].note.find("never called"), std::string::npos);
  EXPECT_NE(r.table().find("fc2"), std::string::npos);
  EXPECT_THROW(quant::convert(*m, *prepared), ValueError);
  // The model still runs, mixed int8 and float, and its state_dict holds the int8 weight.
  const NoGradGuard no_grad;
  EXPECT_EQ((*m)(xc).sizes(), (std::vector<int64_t>{64, 4}));
  const auto sd = m->state_dict();
  bool found = false;
  for (const auto& [k, v] : sd) found |= k == "conv1.weight_int8" && v.dtype() == kUInt8;
  EXPECT_TRUE(found);
}
