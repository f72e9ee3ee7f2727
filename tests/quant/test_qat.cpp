// Quantization-aware training (kiln/quant/qat.h).
//
// The fake-quantize ops against torch 1.13 (/usr/bin/python3): values and the
// straight-through gradients compared exactly (both are one float32 rounding
// of the same integer times the same scale, and a mask), per tensor and per
// channel, quint8, qint8 and a 4-bit range, with ties, outliers and values on
// the clamp's edges. FakeQuantize follows its observer while enabled and keeps
// its parameters when not; freezing after K steps stops every observer;
// convert_qat builds exactly the int8 model PTQ's convert builds with the same
// parameters (outputs equal bit for bit) and its int8 outputs match the QAT
// model's fake-quantized ones; an untrained CNN trains with QAT to int8 accuracy
// on the blob data; ResNet's BatchNorms fold first; bad input names what was wrong.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/cnn.h"
#include "kiln/models/resnet.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"
#include "kiln/quant/fuse.h"
#include "kiln/quant/ptq.h"
#include "kiln/quant/qat.h"
#include "support/oracle.h"

using namespace kiln;
using quant::QDType;

namespace {

std::vector<float> floats(const Tensor& t) {
  const Tensor c = t.to(kFloat32).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

// Noise, exact halves after scaling by 0.5 or 0.25 (ties to even), far outliers,
// and values whose rounded integer sits exactly on, or one past, a 0..255 / -128..127 edge.
Tensor data(std::vector<int64_t> shape, uint64_t seed) {
  Generator g(seed);
  Tensor x = randn(shape, TensorOptions(kFloat32), &g).mul(4.0);
  float* p = x.data_ptr<float>();
  const float special[] = {0.25f, 0.75f, -0.25f, -0.75f, 1.25f, -1.25f, 100.0f, -100.0f,
                           0.0f,  63.5f, 63.75f, 64.0f,  -64.0f, -64.25f, -64.5f, 31.75f};
  for (size_t i = 0; i < std::size(special) && static_cast<int64_t>(i) < x.numel(); ++i) p[i] = special[i];
  return x;
}

// Blob images: class c puts a Gaussian blob in quadrant c; noise everywhere (as test_ptq's).
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

models::CNNOptions cnn_options() {
  return {.channels1 = 8, .channels2 = 16, .hidden = 32, .num_classes = 4, .input_size = {12, 12}};
}

void train_steps(nn::Module& m, optim::Optimizer& opt, const Tensor& x, const Tensor& y, int steps,
                 quant::QatPrepared* qat = nullptr) {
  m.train();
  for (int step = 0; step < steps; ++step) {
    const int64_t b = (step * 64) % x.size(0);
    opt.zero_grad();
    nn::functional::cross_entropy(m(x.slice(0, b, b + 64)), y.slice(0, b, b + 64)).backward();
    opt.step();
    if (qat) qat->step();
  }
  m.eval();
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

std::shared_ptr<models::CNN> trained_cnn() {
  manual_seed(0);
  auto m = std::make_shared<models::CNN>(cnn_options());
  Tensor x, y;
  make_data(1024, 1, x, y);
  optim::Adam opt(*m, {.lr = 3e-3});
  train_steps(*m, opt, x, y, 100);
  return m;
}

}  // namespace

TEST(QAT, FakeQuantizePerTensorMatchesTorchWithGradients) {
  const Tensor x = data({7, 37}, 1);
  Generator g(2);
  const Tensor gy = randn({7, 37}, TensorOptions(kFloat32), &g);
  struct Case {
    float scale;
    int64_t zp, qmin, qmax;
  };
  const Case cases[] = {{0.5f, 0, 0, 255},   {0.5f, 128, 0, 255}, {0.037f, 91, 0, 255},
                        {0.25f, 0, -128, 127}, {0.021f, -7, -128, 127}, {0.3f, 3, 0, 15}};
  test::OracleBatch b;
  for (const Case& c : cases) {
    std::ostringstream e;
    e.precision(17);
    e << "torch.fake_quantize_per_tensor_affine(x0, " << static_cast<double>(c.scale) << ", " << c.zp << ", " << c.qmin
      << ", " << c.qmax << ")";
    b.add("fq_pt_" + std::to_string(b.size()), e.str(), {x});
    b.add_grad("fq_pt_grad_" + std::to_string(b.size()), e.str(), {x}, {0}, {gy});
  }
  b.run();
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const auto& fwd = b.outcome(2 * i);
    const auto& bwd = b.outcome(2 * i + 1);
    ASSERT_TRUE(fwd.ok) << fwd.error;
    ASSERT_TRUE(bwd.ok) << bwd.error;
    const Tensor xl = x.clone().requires_grad_(true);
    const Tensor y = quant::fake_quantize_per_tensor_affine(xl, c.scale, c.zp, c.qmin, c.qmax);
    EXPECT_EQ(floats(y), floats(fwd.outputs[0])) << "forward, case " << i;
    y.backward(gy);
    ASSERT_TRUE(xl.grad().defined());
    EXPECT_EQ(floats(xl.grad()), floats(bwd.outputs[0])) << "gradient, case " << i;
    // The gradient is the mask: some elements clipped (the outliers), most passed.
    const std::vector<float> gx = floats(xl.grad()), go = floats(gy);
    int64_t zeroed = 0;
    for (size_t k = 0; k < gx.size(); ++k) zeroed += gx[k] == 0.0f && go[k] != 0.0f;
    EXPECT_GT(zeroed, 0) << "case " << i;
    EXPECT_LT(zeroed, static_cast<int64_t>(gx.size())) << "case " << i;
  }
}

TEST(QAT, FakeQuantizePerChannelMatchesTorchWithGradients) {
  const Tensor x = data({6, 5, 4}, 3);
  Generator g(4);
  const Tensor gy = randn({6, 5, 4}, TensorOptions(kFloat32), &g);
  const Tensor scales0 = rand({6}, TensorOptions(kFloat32), &g).mul(0.1).add(0.01);
  const Tensor scales1 = rand({5}, TensorOptions(kFloat32), &g).mul(0.1).add(0.01);
  const Tensor scales2 = tensor<float>({0.5f, 0.25f, 0.05f, 1.0f}, {4});
  const Tensor zp0 = tensor<int64_t>({0, 3, 128, 255, 17, 60}, {6});
  const Tensor zp1 = tensor<int64_t>({0, -3, 5, 127, -128}, {5});
  const Tensor zp2 = tensor<int64_t>({0, 0, 0, 0}, {4});
  struct Case {
    Tensor s, z;
    int64_t axis, qmin, qmax;
  };
  const Case cases[] = {{scales0, zp0, 0, 0, 255}, {scales1, zp1, 1, -128, 127}, {scales2, zp2, 2, -128, 127}};
  test::OracleBatch b;
  for (const Case& c : cases) {
    std::ostringstream e;
    e << "torch.fake_quantize_per_channel_affine(x0, x1, x2.int(), " << c.axis << ", " << c.qmin << ", " << c.qmax
      << ")";
    b.add("fq_pc_" + std::to_string(b.size()), e.str(), {x, c.s, c.z});
    b.add_grad("fq_pc_grad_" + std::to_string(b.size()), e.str(), {x, c.s, c.z}, {0}, {gy});
  }
  b.run();
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const auto& fwd = b.outcome(2 * i);
    const auto& bwd = b.outcome(2 * i + 1);
    ASSERT_TRUE(fwd.ok) << fwd.error;
    ASSERT_TRUE(bwd.ok) << bwd.error;
    const Tensor xl = x.clone().requires_grad_(true);
    const Tensor y = quant::fake_quantize_per_channel_affine(xl, c.s, c.z, c.axis, c.qmin, c.qmax);
    EXPECT_EQ(floats(y), floats(fwd.outputs[0])) << "forward, case " << i;
    y.backward(gy);
    EXPECT_EQ(floats(xl.grad()), floats(bwd.outputs[0])) << "gradient, case " << i;
  }
}

TEST(QAT, FakeQuantizeOpsRejectBadInput) {
  const Tensor x = data({4, 3}, 5);
  EXPECT_THROW(quant::fake_quantize_per_tensor_affine(x, 0.0f, 0, 0, 255), ValueError);
  EXPECT_THROW(quant::fake_quantize_per_tensor_affine(x, NAN, 0, 0, 255), ValueError);
  EXPECT_THROW(quant::fake_quantize_per_tensor_affine(x, 0.1f, 300, 0, 255), ValueError);
  EXPECT_THROW(quant::fake_quantize_per_tensor_affine(x, 0.1f, 0, 10, 5), ValueError);
  EXPECT_THROW(quant::fake_quantize_per_tensor_affine(x.to(kFloat64), 0.1f, 0, 0, 255), ValueError);
  const Tensor s3 = tensor<float>({0.1f, 0.1f, 0.1f}, {3});
  const Tensor z3 = tensor<int64_t>({0, 0, 0}, {3});
  EXPECT_THROW(quant::fake_quantize_per_channel_affine(x, s3, z3, 0, -128, 127), ValueError);  // 4 channels
  EXPECT_THROW(quant::fake_quantize_per_channel_affine(x, s3, z3, 2, -128, 127), ValueError);
  EXPECT_NO_THROW(quant::fake_quantize_per_channel_affine(x, s3, z3, 1, -128, 127));
  try {
    quant::fake_quantize_per_channel_affine(x, s3, z3, 0, -128, 127);
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("[4]"), std::string::npos) << e.what();
  }
}

TEST(QAT, FakeQuantizeModuleFollowsItsObserverUntilDisabled) {
  quant::FakeQuantize fq(std::make_unique<quant::MinMaxObserver>(), QDType::QUInt8);
  EXPECT_FALSE(fq.has_qparams());
  EXPECT_THROW(fq.qparams(), ValueError);
  const Tensor a = data({8, 8}, 6).mul(0.1);
  const Tensor y = fq(a);
  quant::MinMaxObserver ref;
  ref.observe(a);
  const quant::QParams p = ref.qparams();
  ASSERT_TRUE(fq.has_qparams());
  EXPECT_EQ(fq.qparams().scales, p.scales);
  EXPECT_EQ(fq.qparams().zero_points, p.zero_points);
  EXPECT_EQ(floats(y), floats(quant::fake_quantize_per_tensor_affine(a, p.scales[0], p.zero_points[0], 0, 255)));
  // The state_dict carries the parameters.
  const auto sd = fq.state_dict();
  ASSERT_EQ(sd.size(), 2u);
  // Observer off: a wider batch no longer moves the parameters, and is clipped by them.
  fq.disable_observer();
  const Tensor wide = a.mul(10.0);
  const Tensor yw = fq(wide);
  EXPECT_EQ(fq.qparams().scales, p.scales);
  EXPECT_EQ(floats(yw), floats(quant::fake_quantize_per_tensor_affine(wide, p.scales[0], p.zero_points[0], 0, 255)));
  // Fake quant off: the identity, the same tensor.
  fq.disable_fake_quant();
  EXPECT_EQ(floats(fq(wide)), floats(wide));
  // Observer back on: it follows again.
  fq.enable_observer();
  fq.enable_fake_quant();
  fq(wide);
  EXPECT_GT(fq.qparams().scales[0], p.scales[0]);
  // Per channel (weights): symmetric qint8 along axis 0, as PTQ's weight parameters.
  quant::FakeQuantize wfq(std::make_unique<quant::PerChannelMinMaxObserver>(0), QDType::QInt8);
  const Tensor w = data({5, 3, 2, 2}, 7);
  const Tensor yq = wfq(w);
  quant::PerChannelMinMaxObserver wref(0);
  wref.observe(w);
  const quant::QParams wp = wref.qparams();
  EXPECT_EQ(wfq.qparams().axis, 0);
  EXPECT_EQ(wfq.qparams().scales, wp.scales);
  EXPECT_EQ(floats(yq), floats(quant::dequantize(quant::quantize(w, wp))));
  // Mismatched dtype for set_qparams.
  EXPECT_THROW(fq.set_qparams(wp), ValueError);
  // Fake quant on, observer off, nothing ever observed: a clear error.
  quant::FakeQuantize empty_fq(std::make_unique<quant::MinMaxObserver>(), QDType::QUInt8);
  empty_fq.disable_observer();
  EXPECT_THROW(empty_fq(a), ValueError);
}

TEST(QAT, PrepareSharesParametersAndFreezesAfterKSteps) {
  auto m = trained_cnn();
  const Tensor w_before = m->conv1->weight;
  auto qat = quant::prepare_qat(*m);
  ASSERT_EQ(qat->layers.size(), 4u);
  auto* c1 = dynamic_cast<quant::QatConv2d*>(m->conv1.get());
  ASSERT_NE(c1, nullptr);
  EXPECT_NE(dynamic_cast<quant::QatLinear*>(m->fc2.get()), nullptr);
  EXPECT_EQ(c1->weight.data_ptr<float>(), w_before.data_ptr<float>());  // the same tensor, trained in place
  EXPECT_EQ(c1->input_fake_quant->observer().name(), "moving_average");
  EXPECT_THROW(quant::prepare_qat(*m), ValueError);  // twice
  Tensor x, y;
  make_data(512, 8, x, y);
  optim::Adam opt(*m, {.lr = 1e-3});
  qat->freeze_observers_after(3);
  train_steps(*m, opt, x, y, 2, qat.get());
  EXPECT_FALSE(qat->observers_frozen());
  EXPECT_TRUE(c1->input_fake_quant->observer_enabled());
  const std::vector<float> s2 = c1->input_fake_quant->qparams().scales;
  train_steps(*m, opt, x, y, 1, qat.get());
  EXPECT_EQ(qat->steps(), 3);
  EXPECT_TRUE(qat->observers_frozen());
  for (const auto& l : qat->layers) {
    EXPECT_FALSE(l.input_fq->observer_enabled()) << l.path;
    EXPECT_FALSE(l.weight_fq->observer_enabled()) << l.path;
    EXPECT_TRUE(l.input_fq->fake_quant_enabled()) << l.path;
  }
  // After the freeze the parameters stay while the weights keep training.
  const std::vector<float> s3 = c1->input_fake_quant->qparams().scales;
  const std::vector<float> ws3 = c1->weight_fake_quant->qparams().scales;
  const std::vector<float> w3 = floats(c1->weight);
  train_steps(*m, opt, x, y, 5, qat.get());
  EXPECT_EQ(c1->input_fake_quant->qparams().scales, s3);
  EXPECT_EQ(c1->weight_fake_quant->qparams().scales, ws3);
  EXPECT_NE(floats(c1->weight), w3);
  EXPECT_NE(s2.size(), 0u);
  EXPECT_THROW(qat->freeze_observers_after(-1), ValueError);
  EXPECT_THROW(quant::prepare_qat(*trained_cnn(), {.observer = "kl"}), ValueError);
  EXPECT_THROW(quant::prepare_qat(*trained_cnn(), {.keep_float = {"fc9"}}), ValueError);
}

TEST(QAT, ConvertEqualsPtqConvertWithTheSameParameters) {
  auto m = trained_cnn();
  auto twin = std::make_shared<models::CNN>(cnn_options());
  auto qat = quant::prepare_qat(*m, {.keep_float = {"fc2"}});
  Tensor x, y;
  make_data(512, 9, x, y);
  optim::Adam opt(*m, {.lr = 1e-3});
  train_steps(*m, opt, x, y, 20, qat.get());
  // The twin: the fine-tuned weights in a plain float CNN.
  {
    auto sd = m->state_dict();
    decltype(sd) plain;
    for (auto& [k, v] : sd)
      if (k.find("fake_quant") == std::string::npos) plain.emplace_back(k, v);
    twin->load_state_dict(plain);
    twin->eval();
  }
  Tensor xt, yt;
  make_data(128, 10, xt, yt);
  Tensor y_fake;
  {
    qat->freeze_observers();
    const NoGradGuard no_grad;
    y_fake = (*m)(xt);
  }
  // PTQ convert of the twin with the fake quantizers' parameters.
  auto ptq = quant::prepare(*twin, {.observer = "minmax", .keep_float = {"fc2"}});
  ASSERT_EQ(ptq->layers.size(), qat->layers.size());
  for (size_t i = 0; i < ptq->layers.size(); ++i) {
    ASSERT_EQ(ptq->layers[i].path, qat->layers[i].path);
    ptq->layers[i].input_qparams = qat->layers[i].input_fq->qparams();
    ptq->layers[i].weight_qparams = qat->layers[i].weight_fq->qparams();
    ptq->layers[i].calls = 1;
  }
  const quant::ConvertReport rp = quant::convert(*twin, *ptq);
  const quant::ConvertReport rq = quant::convert_qat(*m, *qat);
  ASSERT_EQ(rq.layers.size(), 4u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(rq.layers[i].quantized) << rq.layers[i].path;
    EXPECT_EQ(rq.layers[i].input_scale, rp.layers[i].input_scale);
    EXPECT_EQ(rq.layers[i].input_zero_point, rp.layers[i].input_zero_point);
    // The int8 layer computes what the fake-quantized one did (int32 sums, float rounding apart).
    EXPECT_LT(rq.layers[i].rel_error, 1e-5) << rq.layers[i].path;
  }
  EXPECT_FALSE(rq.layers[3].quantized);
  EXPECT_NE(rq.layers[3].note.find("keep_float"), std::string::npos);
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv1.get()), nullptr);
  EXPECT_NE(dynamic_cast<quant::QuantizedLinear*>(m->fc1.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QuantizedLinear*>(m->fc2.get()), nullptr);
  // fc2 stays a float layer: its fake quantizers are off.
  const NoGradGuard no_grad;
  const Tensor y_qat = (*m)(xt), y_ptq = (*twin)(xt);
  EXPECT_EQ(floats(y_qat), floats(y_ptq));
  const std::vector<float> a = floats(y_qat), f = floats(y_fake);
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) err += (a[i] - f[i]) * (a[i] - f[i]), ref += f[i] * f[i];
  EXPECT_LT(std::sqrt(err / ref), 1e-4);
  EXPECT_THROW(quant::convert_qat(*m, *qat), ValueError);
}

TEST(QAT, AnUntrainedCnnTrainsWithFakeQuantization) {
  manual_seed(3);
  auto m = std::make_shared<models::CNN>(cnn_options());
  Tensor x, y, xt, yt;
  make_data(2048, 11, x, y);
  make_data(512, 12, xt, yt);
  auto qat = quant::prepare_qat(*m);
  qat->freeze_observers_after(120);
  optim::Adam opt(*m, {.lr = 3e-3});
  const double before = accuracy(*m, xt, yt);
  train_steps(*m, opt, x, y, 150, qat.get());
  const double fake = accuracy(*m, xt, yt);
  quant::convert_qat(*m, *qat);
  const double int8 = accuracy(*m, xt, yt);
  // Four balanced classes: chance is 25 %; the blobs are easy.
  EXPECT_LT(before, 50.0);
  EXPECT_GT(fake, 90.0);
  EXPECT_GT(int8, 90.0);
  EXPECT_LE(std::fabs(int8 - fake), 1.0);  // 5 images of 512
}

TEST(QAT, ResnetFoldsBatchNormFirst) {
  manual_seed(4);
  models::ResNetOptions o;
  o.in_channels = 1;
  o.stem_channels = 4;
  o.widths = {4, 8};
  o.blocks = {1, 1};
  o.num_classes = 4;
  auto m = std::make_shared<models::ResNet>(o);
  m->train();
  EXPECT_THROW(quant::prepare_qat(*m, {.fuse_bn = true}), ValueError);  // BatchNorm in training mode
  m->eval();
  auto qat = quant::prepare_qat(*m, {.fuse_bn = true});
  int64_t convs = 0, folded = 0;
  for (auto& [path, mod] : m->named_modules()) {
    convs += dynamic_cast<quant::QatConv2d*>(mod) != nullptr;
    folded += dynamic_cast<quant::FoldedBatchNorm2d*>(mod) != nullptr;
  }
  EXPECT_EQ(convs, 6);  // stem, 2 + 2 block convs, 1 downsample
  EXPECT_EQ(folded, 6);
  Tensor x, y;
  make_data(256, 13, x, y);
  optim::Adam opt(*m, {.lr = 1e-3});
  train_steps(*m, opt, x, y, 4, qat.get());
  const quant::ConvertReport r = quant::convert_qat(*m, *qat);
  for (const auto& l : r.layers) EXPECT_TRUE(l.quantized) << l.path << ": " << l.note;
  EXPECT_EQ(r.layers.size(), 7u);
}

TEST(QAT, LayersNeverObservedBecomePlainFloatLayers) {
  auto m = trained_cnn();
  auto qat = quant::prepare_qat(*m);
  Tensor x, y;
  make_data(64, 14, x, y);
  {
    const NoGradGuard no_grad;
    (*m->conv1)(x);  // conv1 alone observes anything
  }
  const quant::ConvertReport r = quant::convert_qat(*m, *qat);
  ASSERT_EQ(r.layers.size(), 4u);
  EXPECT_TRUE(r.layers[0].quantized);
  EXPECT_NE(dynamic_cast<quant::QuantizedConv2d*>(m->conv1.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QatConv2d*>(m->conv2.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QuantizedConv2d*>(m->conv2.get()), nullptr);
  EXPECT_EQ(dynamic_cast<quant::QatLinear*>(m->fc1.get()), nullptr);
  for (size_t i = 1; i < 4; ++i) {
    EXPECT_FALSE(r.layers[i].quantized);
    EXPECT_NE(r.layers[i].note.find("never observed"), std::string::npos) << r.layers[i].note;
  }
  // The state_dict is the float CNN's plus conv1's int8 tensors: it reloads into a fresh CNN.
  for (const auto& [k, v] : m->state_dict()) EXPECT_EQ(k.find("fake_quant"), std::string::npos) << k;
  const std::string path = ::testing::TempDir() + "qat_partial_" + std::to_string(::getpid()) + ".safetensors";
  quant::save_quantized(*m, path);
  auto fresh = std::make_shared<models::CNN>(cnn_options());
  fresh->eval();
  const auto quantized = quant::load_quantized(*fresh, path);
  std::remove(path.c_str());
  EXPECT_EQ(quantized, (std::vector<std::string>{"conv1"}));
  const NoGradGuard no_grad;
  m->eval();
  EXPECT_EQ(floats((*m)(x)), floats((*fresh)(x)));
}
