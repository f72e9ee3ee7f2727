// A model trained a few steps in kiln, saved with kiln::io, loads into the
// same torch.nn model (strict, same key order) and gives the same eval output
// (tests/parity/nn_state_dict.py).
#include <gtest/gtest.h>

#include <memory>

#include "kiln/ops/factory.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "kiln/nn/layers.h"
#include "kiln/nn/norm.h"
#include "support/test_util.h"

using namespace kiln;

TEST(Parity, StateDictLoadsIntoTorchAndMatches) {
  ASSERT_EQ(test::python_problem(), "");
  manual_seed(5);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Conv2d>(nn::Conv2dOptions{.in_channels = 3, .out_channels = 4, .kernel_size = {3}, .padding = {1}}),
      std::make_shared<nn::BatchNorm2d>(nn::BatchNormOptions{.num_features = 4}),
      std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(nn::Pool2dOptions{.kernel_size = {2}}),
      std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 36, .out_features = 5}),
      std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {5}}),
      std::make_shared<nn::GELU>(),
      std::make_shared<nn::Dropout>(0.5)});
  // A few SGD steps so that BatchNorm's running stats and the LayerNorm affine move.
  for (int step = 0; step < 3; ++step) {
    model->zero_grad();
    (*model)(randn({8, 3, 6, 6})).pow(2.0).mean().backward();
    NoGradGuard g;
    for (auto& p : model->parameters()) p.sub_(p.grad().mul(0.1));
  }
  model->eval();
  Tensor x = randn({2, 3, 6, 6});
  Tensor y = (*model)(x).detach();
  auto sd = model->state_dict();
  sd.emplace_back("__input__", x);
  sd.emplace_back("__output__", y);
  test::TempDir dir;
  io::save_safetensors(dir.file("model.safetensors"), sd);
  std::string out;
  int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                 test::shell_quote(test::source_dir() + "/tests/parity/nn_state_dict.py") + " " +
                                 test::shell_quote(dir.file("model.safetensors")),
                             out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("OK"), std::string::npos) << out;
}
