// Overflow diagnosis under anomaly mode: float16 overflow in backward while a
// GradScaler is active is recorded (not thrown) and named in the scaler's skip
// message; without a scaler, and in float32, anomaly mode still throws; the
// record does not leak from one step into the next.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <optional>
#include <thread>

#include "kiln/amp/grad_scaler.h"
#include "kiln/autograd/anomaly.h"
#include "kiln/core/autocast.h"
#include "kiln/kiln.h"

namespace kiln {
namespace {

namespace F = nn::functional;

// 128 points in 16-D labelled by a random linear teacher, and a two-layer MLP
// written out with ops so that the nodes' forward call sites are lines of this file.
struct Net {
  Tensor x, y, w1, b1, w2;
  int mm1_line = 0, mm2_line = 0;

  Net() {
    Generator g(2024);
    x = randn({128, 16}, {}, &g);
    y = x.matmul(randn({16, 4}, {}, &g)).argmax(1);
    w1 = (randn({16, 64}, {}, &g) * 0.25).requires_grad_();
    b1 = zeros({64}).requires_grad_();
    w2 = (randn({64, 4}, {}, &g) * 0.125).requires_grad_();
  }
  optim::NamedParams params() const { return {{"w1", w1}, {"b1", b1}, {"w2", w2}}; }

  // The float32 loss of the forward run under autocast `dt` (none: float32).
  Tensor loss(std::optional<DType> dt, double factor, const Tensor* input = nullptr) {
    std::optional<AutocastGuard> amp;
    if (dt) amp.emplace(*dt);
    const Tensor& in = input ? *input : x;
    mm1_line = __LINE__ + 1;
    const Tensor h = relu(in.matmul(w1) + b1);
    mm2_line = __LINE__ + 1;
    const Tensor logits = h.matmul(w2);
    return F::cross_entropy(logits, y) * factor;
  }
};

TEST(OverflowRecord, Float16BackwardOverflowIsRecordedOnlyInsideTheScope) {
  const autograd::AnomalyModeGuard anomaly;
  const Tensor e = full({4}, 150.0, TensorOptions(kFloat16)).requires_grad_();
  const Tensor b = full({4}, 400.0, TensorOptions(kFloat16));
  const int f_line = __LINE__ + 1;
  const Tensor f = e.mul(b);  // 60000: a finite forward
  const Tensor grad = full({4}, 60000.0, TensorOptions(kFloat16));
  // Backward of f = e * b w.r.t. e: grad * b = 60000 * 400 -> Inf in float16.
  {
    autograd::clear_overflow_record();
    const autograd::ExpectedOverflowScope expected;
    EXPECT_TRUE(autograd::overflow_expected());
    EXPECT_NO_THROW(f.backward(grad, /*retain_graph=*/true));
    const std::optional<autograd::OverflowRecord> r = autograd::take_overflow_record();
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->node, std::string("MulBackward0"));
    EXPECT_EQ(r->site.line, static_cast<uint32_t>(f_line));
    EXPECT_EQ(r->input_index, 0u);
    EXPECT_EQ(r->inf, 4);
    EXPECT_EQ(r->nan, 0);
    const std::string s = r->str();
    EXPECT_NE(s.find("test_overflow.cpp:" + std::to_string(f_line)), std::string::npos) << s;
    EXPECT_NE(s.find("4 Inf"), std::string::npos) << s;
    // Only the first event is kept, and take clears it.
    EXPECT_FALSE(autograd::take_overflow_record().has_value());
  }
  EXPECT_FALSE(autograd::overflow_expected());
  // Outside the scope the same backward is an anomaly, with the scaler hint.
  try {
    f.backward(grad, /*retain_graph=*/true);
    ADD_FAILURE() << "expected an anomaly";
  } catch (const autograd::AnomalyError& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find("MulBackward0"), std::string::npos) << m;
    EXPECT_NE(m.find("GradScaler"), std::string::npos) << m;
  }
  EXPECT_FALSE(autograd::take_overflow_record().has_value()) << "nothing is recorded outside the scope";
}

TEST(OverflowRecord, Float32NonFiniteGradientStillThrowsInsideTheScope) {
  const autograd::AnomalyModeGuard anomaly;
  const autograd::ExpectedOverflowScope expected;
  const Tensor x = zeros({3}).requires_grad_();
  const Tensor y = x.sqrt();  // finite forward; d sqrt(x)/dx at 0 is Inf
  EXPECT_THROW(y.sum().backward(), autograd::AnomalyError);
  EXPECT_FALSE(autograd::take_overflow_record().has_value());
}

TEST(OverflowRecord, Float32InfWithAGradScalerStillThrows) {
  const autograd::AnomalyModeGuard anomaly;
  amp::GradScaler scaler({.print_messages = false});
  const Tensor x = zeros({3}).requires_grad_();
  optim::SGD opt({{"x", x}}, {.lr = 0.1});
  const Tensor loss = x.sqrt().sum();
  EXPECT_THROW(scaler.scale(loss).backward(), autograd::AnomalyError);
}

TEST(OverflowRecord, Float16WithoutAScalerStillThrows) {
  const autograd::AnomalyModeGuard anomaly;
  Net net;
  const Tensor loss = net.loss(kFloat16, 1e9);
  try {
    loss.backward();
    ADD_FAILURE() << "expected an anomaly";
  } catch (const autograd::AnomalyError& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find("float16 overflows"), std::string::npos) << m;
  }
}

TEST(OverflowRecord, TheScopeIsPerThreadAndClosedByTheScaler) {
  {
    amp::GradScaler scaler({.print_messages = false});
    const Tensor p = ones({2}).requires_grad_();
    (void)scaler.scale(p.sum());
    EXPECT_TRUE(autograd::overflow_expected());
    (void)scaler.scale(p.sum());  // a second loss in the same iteration: still one scope
    bool other_thread_sees_it = true;
    std::thread([&] { other_thread_sees_it = autograd::overflow_expected(); }).join();
    EXPECT_FALSE(other_thread_sees_it);
    amp::GradScaler copy = scaler;  // a copy does not own the scope
    (void)copy;
  }
  // Destroyed without update(): the scaler closed its scope.
  EXPECT_FALSE(autograd::overflow_expected());
  amp::GradScaler disabled({.enabled = false, .print_messages = false});
  (void)disabled.scale(ones({1}));
  EXPECT_FALSE(autograd::overflow_expected()) << "a disabled scaler expects nothing";
}

TEST(OverflowTraining, Float16HugeLossWithAnomalyModeSkipsNamesTheOpAndRecovers) {
  const autograd::AnomalyModeGuard anomaly;
  // The loss is multiplied by 1e4 (and the learning rate divided by it), so
  // the scaled gradients overflow float16 at the default scale 65536.
  const double huge = 1e4;
  const int steps = 80;
  Net net;
  optim::SGD opt(net.params(), {.lr = 0.5 / huge, .momentum = 0.9});
  amp::GradScaler scaler({.growth_interval = 25, .print_messages = false});
  std::vector<double> losses;
  std::vector<bool> stepped;
  for (int k = 0; k < steps; ++k) {
    const Tensor loss = net.loss(kFloat16, huge);
    opt.zero_grad();
    scaler.scale(loss).backward();  // anomaly mode is on: this must not throw
    stepped.push_back(scaler.step(opt));
    scaler.update();
    EXPECT_FALSE(autograd::overflow_expected()) << "update() closes the scope, step " << k;
    EXPECT_FALSE(autograd::take_overflow_record().has_value()) << "update() clears the record, step " << k;
    losses.push_back(loss.item<double>() / huge);
  }
  const amp::GradScalerStats st = scaler.stats();
  std::cout << "[ info ] fp16 x1e4 loss with anomaly mode: " << st.skipped_steps << " of " << steps
            << " steps skipped, final scale " << st.scale << ", loss " << losses[0] << " -> " << losses.back() << "\n";
  EXPECT_FALSE(stepped[0]);
  EXPECT_GE(st.skipped_steps, 3);
  EXPECT_LT(st.scale, 65536.0);
  EXPECT_LT(st.skipped_steps, steps / 4);
  EXPECT_LT(losses.back(), 0.5 * losses[0]) << "first " << losses[0] << " last " << losses.back();

  ASSERT_FALSE(scaler.messages().empty());
  const std::string& msg = scaler.messages()[0];
  std::cout << "[ info ] " << msg << "\n";
  EXPECT_NE(msg.find("consecutive steps skipped"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the first non-finite gradient is 'w"), std::string::npos) << msg;
  // Where float16 overflowed: the gradient of the logits, cast to float16 for
  // the second matmul's backward (autocast's cast of the matmul's output for
  // cross_entropy, whose backward runs in float32), named with this file's line.
  EXPECT_NE(msg.find("where float16 first overflowed in backward: ToCopyBackward0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the gradient of the output of MmBackward0 (forward at "), std::string::npos) << msg;
  EXPECT_NE(msg.find("test_overflow.cpp:" + std::to_string(net.mm2_line)), std::string::npos)
      << msg << "\nexpected the second matmul's line " << net.mm2_line;
  ASSERT_TRUE(st.first_overflow.has_value());
  EXPECT_GT(st.first_overflow->inf, 0);
}

TEST(OverflowTraining, TheRecordDoesNotCarryIntoTheNextStep) {
  const autograd::AnomalyModeGuard anomaly;
  Net net;
  optim::SGD opt(net.params(), {.lr = 1e-6});
  amp::GradScaler scaler({.print_messages = false});
  // Step 1: float16 overflow in backward, recorded and reported.
  {
    const Tensor loss = net.loss(kFloat16, 1e4);
    opt.zero_grad();
    scaler.scale(loss).backward();
    EXPECT_FALSE(scaler.step(opt));
    scaler.update();
    ASSERT_TRUE(scaler.stats().first_overflow.has_value());
  }
  // Step 2: finite; step 3: a non-finite gradient made outside the graph (no
  // float16 backward overflowed), so the skip must not be blamed on step 1's op.
  {
    const Tensor loss = net.loss(kFloat16, 1.0);
    opt.zero_grad();
    scaler.scale(loss).backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
  }
  {
    const Tensor loss = net.loss(kFloat16, 1.0);
    opt.zero_grad();
    scaler.scale(loss).backward();
    {
      const NoGradGuard no_grad;
      net.w2.mutable_grad().fill_(std::numeric_limits<double>::quiet_NaN());
    }
    EXPECT_FALSE(scaler.step(opt));
    scaler.update();
    const amp::GradScalerStats st = scaler.stats();
    EXPECT_EQ(st.skipped_steps, 2);
    EXPECT_EQ(st.first_nonfinite_param, "w2");
    EXPECT_FALSE(st.first_overflow.has_value()) << st.first_overflow->str();
  }
}

}  // namespace
}  // namespace kiln
