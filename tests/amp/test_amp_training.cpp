// Mixed precision end to end: a small classifier trained under bf16 autocast
// reaches the float32 run's loss, and a float16 run with a deliberately huge
// loss overflows, lets the GradScaler back off, and then trains.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "kiln/amp/grad_scaler.h"
#include "kiln/core/autocast.h"
#include "kiln/kiln.h"

namespace kiln {
namespace {

struct Problem {
  Tensor x, y;
};

// 128 points in 16-D labelled by the argmax of a random linear teacher: learnable, not trivial.
Problem make_problem() {
  Generator g(2024);
  const Tensor x = randn({128, 16}, {}, &g);
  const Tensor teacher = randn({16, 4}, {}, &g);
  return {x, x.matmul(teacher).argmax(1)};
}

std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(11);
  auto m = std::make_shared<nn::Sequential>();
  m->push_back(std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 16, .out_features = 64}));
  m->push_back(std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {64}}));
  m->push_back(std::make_shared<nn::ReLU>());
  m->push_back(std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 64, .out_features = 4}));
  return m;
}

// Full-batch Adam; returns the loss of each step (float32 loss of the forward as run).
std::vector<double> train(std::optional<DType> amp_dtype, int steps) {
  const Problem p = make_problem();
  auto model = make_model();
  optim::Adam opt(model->named_parameters(), {.lr = 1e-2});
  std::vector<double> losses;
  for (int k = 0; k < steps; ++k) {
    Tensor loss;
    {
      std::optional<AutocastGuard> amp;
      if (amp_dtype) amp.emplace(*amp_dtype);
      loss = nn::functional::cross_entropy(model->forward(p.x), p.y);
    }
    EXPECT_EQ(loss.dtype(), kFloat32);
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  for (const auto& [name, t] : model->named_parameters()) EXPECT_EQ(t.dtype(), kFloat32) << name;
  return losses;
}

TEST(AmpTraining, Bfloat16ReachesTheFloat32Loss) {
  const int steps = 150;
  const std::vector<double> f32 = train(std::nullopt, steps);
  const std::vector<double> bf16 = train(kBFloat16, steps);
  // Same initial weights: the first losses differ only by bf16 rounding.
  EXPECT_NEAR(bf16[0], f32[0], 0.02 * f32[0]);
  EXPECT_LT(f32.back(), 0.1 * f32[0]) << "the float32 run should learn the problem";
  // Stated tolerance: after 150 steps the bf16 run's loss is within 1e-3
  // (absolute; 0.07% of the initial 1.42) of float32's. bf16 rounds the
  // products' inputs to 8 mantissa bits, so the trajectories drift apart but
  // reach the same fit (measured here: 0.0012726 vs 0.0012762).
  EXPECT_NEAR(bf16.back(), f32.back(), 1e-3) << "f32 " << f32.back() << " bf16 " << bf16.back();
  EXPECT_NEAR(bf16[steps / 2], f32[steps / 2], 0.05 * f32[steps / 2] + 1e-3) << "half way";
  EXPECT_NE(bf16.back(), f32.back()) << "the bf16 run must really have run in bf16";
  std::cout << "[ info ] loss after " << steps << " steps: float32 " << f32.back() << ", bf16 autocast " << bf16.back()
            << " (initial " << f32[0] << ")\n";
}

TEST(AmpTraining, Float16HugeLossOverflowsBacksOffAndRecovers) {
  // The loss is multiplied by 1e4 (and the learning rate divided by it), so the
  // scaled gradients overflow float16 at the default scale 65536.
  const double huge = 1e4;
  const int steps = 120;
  const Problem p = make_problem();
  auto model = make_model();
  optim::SGD opt(model->named_parameters(), {.lr = 0.5 / huge, .momentum = 0.9});
  amp::GradScaler scaler({.growth_interval = 25, .print_messages = false});
  std::vector<double> losses;
  std::vector<bool> stepped;
  for (int k = 0; k < steps; ++k) {
    Tensor loss;
    {
      const AutocastGuard amp(kFloat16);
      loss = nn::functional::cross_entropy(model->forward(p.x), p.y) * huge;
    }
    opt.zero_grad();
    scaler.scale(loss).backward();
    stepped.push_back(scaler.step(opt));
    scaler.update();
    losses.push_back(loss.item<double>() / huge);
  }
  const amp::GradScalerStats st = scaler.stats();
  std::cout << "[ info ] fp16 x1e4 loss: " << st.skipped_steps << " of " << steps << " steps skipped, final scale "
            << st.scale << ", loss " << losses[0] << " -> " << losses.back() << "\n";
  // Overflow at the start: the first step is skipped and the scale backs off...
  EXPECT_FALSE(stepped[0]);
  EXPECT_LT(st.scale, 65536.0);
  EXPECT_GE(st.skipped_steps, 3);
  // ...until steps go through; growth probes later overflow again now and then, not often.
  EXPECT_LT(st.skipped_steps, steps / 4);
  EXPECT_TRUE(stepped.back() || stepped[steps - 2]);
  // It recovered: the model learned, and its float32 masters are finite.
  EXPECT_LT(losses.back(), 0.3 * losses[0]) << "first " << losses[0] << " last " << losses.back();
  for (const auto& [name, t] : model->named_parameters()) {
    int64_t nan = 0, inf = 0;
    autograd::count_nonfinite(t, nan, inf);
    EXPECT_EQ(nan + inf, 0) << name;
  }
  // The opening streak was explained, naming a parameter of the model.
  ASSERT_FALSE(scaler.messages().empty());
  EXPECT_NE(scaler.messages()[0].find("consecutive steps skipped"), std::string::npos) << scaler.messages()[0];
  EXPECT_NE(scaler.messages()[0].find(".weight'"), std::string::npos) << scaler.messages()[0];
}

}  // namespace
}  // namespace kiln
