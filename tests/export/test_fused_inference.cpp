// ops::PackedConv2d / ops::PackedLinear against the unfused ops (conv2d,
// linear, relu, gelu, +) within 1e-5 relative to the output's scale, over the
// strides, paddings and groups the zoo's models use, with and without bias,
// residual and activation; and their refusal of inputs that require grad.
#include <gtest/gtest.h>

#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/ops/linalg.h"
#include "kiln/ops/conv.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/fused_inference.h"
#include "kiln/ops/memory_format.h"
#include "support/onnx_consumers.h"

namespace kiln::test {
namespace {

using ops::InferenceActivation;

Tensor activate(const Tensor& y, InferenceActivation a) {
  switch (a) {
    case InferenceActivation::Relu: return y.relu();
    case InferenceActivation::GeluErf: return y.gelu("none");
    case InferenceActivation::GeluTanh: return y.gelu("tanh");
    case InferenceActivation::None: break;
  }
  return y;
}

struct ConvCase {
  int64_t n, c, h, o, k, stride, pad, groups;
  bool bias, residual;
  InferenceActivation act;
  bool channels_last_input;
};

class PackedConv : public ::testing::TestWithParam<ConvCase> {};

TEST_P(PackedConv, MatchesConv2dThenEpilogue) {
  const ConvCase c = GetParam();
  manual_seed(3);
  const NoGradGuard no_grad;
  const Tensor w = randn({c.o, c.c / c.groups, c.k, c.k});
  const Tensor b = c.bias ? randn({c.o}) : Tensor();
  Tensor x = randn({c.n, c.c, c.h, c.h});
  if (c.channels_last_input) x = contiguous(x, MemoryFormat::ChannelsLast);
  Tensor want = conv2d(x, w, b, c.stride, c.pad, 1, c.groups);
  const Tensor res = c.residual ? randn(want.sizes()) : Tensor();
  if (c.residual) want = want + res;
  want = activate(want, c.act);
  const ops::PackedConv2d conv(
      w, b,
      {.stride = {c.stride, c.stride}, .padding = {c.pad, c.pad}, .groups = c.groups, .activation = c.act});
  for (int rep = 0; rep < 2; ++rep) {  // the second call reads the packed weight the first one made
    const Tensor got = conv(x, res);
    EXPECT_TRUE(is_contiguous(got, MemoryFormat::ChannelsLast));
    EXPECT_LE(scaled_max_diff(got.contiguous(), want.contiguous()), 1e-5);
  }
}

// The zoo's convolutions: CNN's 5x5 / 3x3 on images, ResNet's stem, 3x3 blocks
// (residual + ReLU) and strided 1x1 shortcuts, ViT's patch embedding; plus a
// grouped (depthwise) one.
INSTANTIATE_TEST_SUITE_P(
    Zoo, PackedConv,
    ::testing::Values(ConvCase{2, 3, 16, 8, 3, 1, 1, 1, true, false, InferenceActivation::Relu, false},
                      ConvCase{3, 8, 12, 16, 3, 1, 1, 1, true, true, InferenceActivation::Relu, true},
                      ConvCase{2, 8, 12, 16, 1, 2, 0, 1, true, false, InferenceActivation::None, true},
                      ConvCase{2, 16, 9, 16, 3, 2, 1, 1, false, false, InferenceActivation::Relu, true},
                      ConvCase{1, 3, 32, 24, 4, 4, 0, 1, true, false, InferenceActivation::None, false},
                      ConvCase{2, 16, 10, 16, 3, 1, 1, 16, true, true, InferenceActivation::GeluErf, true},
                      ConvCase{2, 12, 10, 24, 3, 1, 1, 3, false, false, InferenceActivation::GeluTanh, false}));

TEST(PackedLinearTest, MatchesLinearThenEpilogueOnMatricesAndSequences) {
  manual_seed(4);
  const NoGradGuard no_grad;
  for (const auto act : {InferenceActivation::None, InferenceActivation::Relu, InferenceActivation::GeluErf,
                         InferenceActivation::GeluTanh}) {
    for (const bool bias : {true, false}) {
      for (const bool residual : {false, true}) {
        const Tensor w = randn({24, 40}) * 0.2;
        const Tensor b = bias ? randn({24}) : Tensor();
        const ops::PackedLinear lin(w, b, act);
        for (const std::vector<int64_t>& shape : {std::vector<int64_t>{5, 40}, std::vector<int64_t>{2, 7, 40}}) {
          const Tensor x = randn(shape);
          Tensor want = linear(x, w, b);
          const Tensor res = residual ? randn(want.sizes()) : Tensor();
          if (residual) want = want + res;
          want = activate(want, act);
          const Tensor got = lin(x, res);
          EXPECT_LE(scaled_max_diff(got, want), 1e-5)
              << ops::activation_name(act) << " bias " << bias << " residual " << residual << " rank " << shape.size();
        }
      }
    }
  }
}

TEST(PackedLinearTest, GeluIsTheExactErfForm) {
  // Far enough from 0 that erf and tanh GELU differ by more than the tolerance.
  const NoGradGuard no_grad;
  const Tensor w = eye(4);
  const Tensor x = tensor(std::vector<float>{-3.0f, -1.5f, 1.5f, 3.0f}, {1, 4});
  const Tensor got = ops::PackedLinear(w, {}, InferenceActivation::GeluErf)(x);
  EXPECT_LE(scaled_max_diff(got, x.gelu("none")), 1e-6);
  EXPECT_GT(scaled_max_diff(got, x.gelu("tanh")), 1e-5);
}

TEST(PackedInference, RefusesInputsThatRequireGrad) {
  const Tensor w = randn({4, 3}, TensorOptions().requires_grad(true));
  const ops::PackedLinear lin(w, {});  // a parameter as weight is fine: it is copied, detached
  const Tensor x = randn({2, 3}, TensorOptions().requires_grad(true));
  try {
    lin(x);
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("inference-only"), std::string::npos) << e.what();
  }
  const ops::PackedConv2d conv(randn({4, 3, 3, 3}), {});
  EXPECT_THROW(conv(randn({1, 3, 8, 8}, TensorOptions().requires_grad(true))), ValueError);
  EXPECT_THROW(conv(randn({1, 5, 8, 8})), ShapeError);
}

}  // namespace
}  // namespace kiln::test
