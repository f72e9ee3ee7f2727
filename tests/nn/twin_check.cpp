#include "twin_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "kiln/core/guards.h"
#include "kiln/io/safetensors.h"
#include "support/test_util.h"

namespace kiln::test {

std::string mismatch(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes()) return "shape " + a.shape_string() + " vs torch " + b.shape_string();
  auto x = test::to_doubles(a), y = test::to_doubles(b);
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double excess = std::abs(x[i] - y[i]) - (kTwinAtol + kTwinRtol * std::abs(y[i]));
    if (!(excess <= worst)) {
      worst = std::isnan(excess) ? INFINITY : excess;
      at = i;
    }
  }
  if (worst <= 0) return "";
  std::ostringstream s;
  s << "element " << at << ": kiln " << x[at] << " vs torch " << y[at];
  return s.str();
}

std::vector<std::string> keys(const nn::NamedTensors& t) {
  std::vector<std::string> k;
  for (auto& [n, _] : t) k.push_back(n);
  return k;
}


void check_against_twin(nn::Module& model, const std::string& script, const std::string& name,
                        const std::string& config, const Tensor& x, const Tensor& target, const LossFn& loss_fn) {
  ASSERT_EQ(test::python_problem(), "");
  test::TempDir dir;
  auto sd = model.state_dict();
  sd.emplace_back("__input__", x);
  sd.emplace_back("__target__", target);
  io::save_safetensors(dir.file("in.safetensors"), sd, {{"model", name}, {"config", config}});
  std::string out;
  int rc = test::run_command(test::shell_quote(test::python()) + " " +
                                 test::shell_quote(test::source_dir() + "/tests/parity/" + script) + " " +
                                 test::shell_quote(dir.file("in.safetensors")) + " " +
                                 test::shell_quote(dir.file("out.safetensors")),
                             out);
  ASSERT_EQ(rc, 0) << out;
  ASSERT_NE(out.find("OK"), std::string::npos) << out;
  auto ref = io::load_safetensors(dir.file("out.safetensors"));

  model.eval();
  {
    NoGradGuard g;
    EXPECT_EQ(mismatch(model(x), ref.at("eval_out")), "") << "eval output";
  }
  model.train();
  model.zero_grad();
  Tensor y = model(x);
  Tensor loss = loss_fn(y, target);
  loss.backward();
  EXPECT_EQ(mismatch(y.detach(), ref.at("train_out")), "") << "train output";
  EXPECT_EQ(mismatch(loss.detach().reshape({1}), ref.at("loss")), "") << "loss";
  auto params = model.named_parameters();
  ASSERT_FALSE(params.empty());
  size_t torch_grads = 0;
  for (auto& [n, _] : ref.tensors) torch_grads += n.starts_with("grad.");
  EXPECT_EQ(params.size(), torch_grads);  // tied weights: once on both sides
  for (auto& [n, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << n;
    EXPECT_EQ(mismatch(p.grad(), ref.at("grad." + n)), "") << "gradient of " << n;
  }
  for (auto& [n, t] : model.state_dict()) EXPECT_EQ(mismatch(t, ref.at("state." + n)), "") << "state " << n;

  // The other direction: torch-initialised weights load into kiln by name, strictly and exactly.
  nn::NamedTensors torch_init;
  const std::string prefix = "torch_init.";
  for (auto& [n, t] : ref.tensors)
    if (n.starts_with(prefix)) torch_init.emplace_back(n.substr(prefix.size()), t);
  auto result = model.load_state_dict(torch_init, /*strict=*/true);
  EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
  auto loaded = model.state_dict();
  ASSERT_EQ(keys(loaded), keys(torch_init));
  for (size_t i = 0; i < loaded.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(loaded[i].second, torch_init[i].second)) << loaded[i].first;
}

}  // namespace kiln::test
