// Custom autograd Functions beyond plain Tensor arguments (issue 27): tensors
// inside std::vector<Tensor> and std::optional<Tensor> get gradients (checked
// against float64 central differences), backward may return libtorch's one
// gradient per argument with undefined slots for non-tensor ones, and
// ctx.saved_data names the key and the types when backward reads it wrongly.
#include <gtest/gtest.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/ops/gradcheck.h"
#include "kiln/kiln.h"
#include "support/test_util.h"

using namespace kiln;
using autograd::AutogradContext;

namespace {

// y = scale * sum_i w_i * x_i over a list of same-shaped tensors (w_i = i + 1).
struct WeightedSum : autograd::Function<WeightedSum> {
  static Tensor forward(AutogradContext& ctx, const std::vector<Tensor>& xs, double scale) {
    ctx.saved_data["scale"] = scale;
    ctx.saved_data["n"] = xs.size();
    Tensor y = zeros_like(xs.at(0));
    for (size_t i = 0; i < xs.size(); ++i) y = y + xs[i] * (scale * static_cast<double>(i + 1));
    return y;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    const double scale = ctx.saved_data.get<double>("scale");
    TensorList out;
    for (size_t i = 0; i < ctx.saved_data.get<size_t>("n"); ++i) out.push_back(g[0] * (scale * static_cast<double>(i + 1)));
    return out;  // one per list element: kiln's count
  }
};

// y = x * x + bias (bias optional): libtorch's count, one slot per argument.
struct SquarePlus : autograd::Function<SquarePlus> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, const std::optional<Tensor>& bias, int64_t tag) {
    ctx.save_for_backward({x});
    ctx.saved_data["tag"] = tag;
    return bias ? x * x + *bias : x * x;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    Tensor x = ctx.get_saved_variables()[0];
    // {dx, dbias, (tag)}: the bias slot is the incoming gradient (or unused), the int gets Tensor().
    return {g[0] * 2.0 * x, g[0], Tensor()};
  }
};

}  // namespace

TEST(CustomFunction, VectorOfTensorsArgumentsGetGradients) {
  Tensor a = tensor<double>({0.5, -1.0, 2.0}).requires_grad_();
  Tensor b = tensor<double>({1.5, 0.25, -3.0}).requires_grad_();
  Tensor c = tensor<double>({-0.5, 4.0, 1.0});  // needs no gradient
  WeightedSum::apply(std::vector<Tensor>{a, b, c}, 0.5).sum().backward();
  ASSERT_TRUE(a.grad().defined()) << "a tensor inside std::vector<Tensor> got no gradient";
  ASSERT_TRUE(b.grad().defined());
  EXPECT_TRUE(a.grad().allclose(full({3}, 0.5, kFloat64)));
  EXPECT_TRUE(b.grad().allclose(full({3}, 1.0, kFloat64)));
  EXPECT_FALSE(c.grad().defined());
  Tensor x = tensor<double>({0.3, -0.7}).requires_grad_(), y = tensor<double>({1.1, 0.2}).requires_grad_();
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& in) { return TensorList{WeightedSum::apply(std::vector<Tensor>{in[0], in[1]}, 1.5)}; },
      {x, y}));
}

TEST(CustomFunction, OptionalTensorArgumentGetsAGradientAndOneSlotPerArgumentIsAccepted) {
  Tensor x = tensor<double>({0.5, -1.5, 2.0}).requires_grad_();
  Tensor bias = tensor<double>({1.0, 2.0, 3.0}).requires_grad_();
  SquarePlus::apply(x, std::optional<Tensor>(bias), int64_t{7}).sum().backward();
  ASSERT_TRUE(bias.grad().defined()) << "a tensor inside std::optional<Tensor> got no gradient";
  EXPECT_TRUE(bias.grad().allclose(ones({3}, kFloat64)));
  EXPECT_TRUE(x.grad().allclose(x.detach() * 2.0));
  // An empty optional is an input slot without a tensor: its gradient is dropped.
  Tensor x2 = tensor<double>({0.5, -1.5}).requires_grad_();
  SquarePlus::apply(x2, std::optional<Tensor>(), int64_t{7}).sum().backward();
  EXPECT_TRUE(x2.grad().allclose(x2.detach() * 2.0));
  EXPECT_TRUE(autograd::gradcheck(
      [](const TensorList& in) { return TensorList{SquarePlus::apply(in[0], std::optional<Tensor>(in[1]), int64_t{1})}; },
      {x.detach().requires_grad_(), bias.detach().requires_grad_()}));
}

TEST(CustomFunction, WrongGradientCountsAndDefinedNonTensorSlotsAreNamed) {
  struct TooMany : autograd::Function<TooMany> {
    static Tensor forward(AutogradContext&, const Tensor& x, double k) { return x * k; }
    static TensorList backward(AutogradContext&, TensorList g) { return {g[0], g[0], g[0]}; }
  };
  struct GradForDouble : autograd::Function<GradForDouble> {
    static Tensor forward(AutogradContext&, const Tensor& x, double k) { return x * k; }
    static TensorList backward(AutogradContext&, TensorList g) { return {g[0], g[0]}; }
  };
  Tensor x = ones({2}).requires_grad_();
  std::string msg = test::error_message<ValueError>([&] { TooMany::apply(x, 2.0).sum().backward(); });
  EXPECT_NE(msg.find("returned 3 gradients; expected 1 (one per tensor input"), std::string::npos) << msg;
  EXPECT_NE(msg.find("or 2 (one per argument"), std::string::npos) << msg;
  msg = test::error_message<ValueError>([&] { GradForDouble::apply(x, 2.0).sum().backward(); });
  EXPECT_NE(msg.find("defined gradient at position 1, which is a non-tensor argument"), std::string::npos) << msg;
  // Containers whose tensors kiln would not see do not compile as arguments.
  static_assert(autograd::fn_args::HidesTensors<std::array<Tensor, 2>>::value);
  static_assert(autograd::fn_args::HidesTensors<std::tuple<int, Tensor>>::value);
  static_assert(!autograd::fn_args::HidesTensors<std::tuple<int, double>>::value);
}

namespace {
std::string g_missing, g_wrong_type, g_after;
bool g_inserted = true;

struct ReadsSavedData : autograd::Function<ReadsSavedData> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, int mode) {
    ctx.saved_data["scale"] = 2.0;
    ctx.saved_data["mode"] = mode;
    return x * 2.0;
  }
  static TensorList backward(AutogradContext& ctx, TensorList g) {
    const int mode = std::any_cast<int>(ctx.saved_data["mode"]);
    if (mode == 0) {
      g_missing = test::error_message<ValueError>([&] { (void)ctx.saved_data["scael"]; });
      g_inserted = ctx.saved_data.contains("scael");
      g_wrong_type = test::error_message<ValueError>([&] { (void)ctx.saved_data.get<float>("scale"); });
    } else {
      (void)std::any_cast<float>(ctx.saved_data["scale"]);  // the wrong type through std::any_cast
    }
    return {g[0] * ctx.saved_data.get<double>("scale"), Tensor()};
  }
};
}  // namespace

TEST(CustomFunction, SavedDataLookupsNameTheKeyAndTheTypes) {
  Tensor x = ones({2}).requires_grad_();
  ReadsSavedData::apply(x, 0).sum().backward();
  EXPECT_NE(g_missing.find("ctx.saved_data[\"scael\"]: forward saved no value under this key"), std::string::npos)
      << g_missing;
  EXPECT_NE(g_missing.find("'scale' (double)"), std::string::npos) << g_missing;
  EXPECT_FALSE(g_inserted) << "a lookup in backward must not insert an empty value";
  EXPECT_NE(g_wrong_type.find("ctx.saved_data[\"scale\"]: expected a value of type float, got one of type double"),
            std::string::npos)
      << g_wrong_type;
  EXPECT_TRUE(x.grad().allclose(full({2}, 2.0)));
  const std::string msg = test::error_message<ValueError>([&] { ReadsSavedData::apply(x, 1).sum().backward(); });
  EXPECT_NE(msg.find("ReadsSavedDataBackward.backward: std::any_cast failed on the value last read from "
                     "ctx.saved_data, 'scale' (double)"),
            std::string::npos)
      << msg;
}
