// The PyTorch oracle itself (tests/support/oracle.h): values, every dtype
// bit-exact through the round trip, tuples and Python numbers, strides and
// expanded dims rebuilt on the Python side, per-case errors, the cache.
#include "support/oracle.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kiln/kiln.h"
#include "ops/specs/op_spec.h"
#include "support/compare.h"
#include "support/test_util.h"

using namespace kiln;

TEST(Oracle, PythonAndTorchAreInstalled) {
  const std::string& problem = test::python_problem(true);
  EXPECT_TRUE(problem.empty()) << problem;
}

TEST(Oracle, EveryDTypeRoundTripsBitExact) {
  test::OracleBatch b;
  std::vector<Tensor> inputs;
  uint64_t seed = 100;
  for (DType dt : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool}) {
    inputs.push_back(ops::sample_tensor({3, 4}, dt, seed++));
    b.add(std::string("identity ") + std::string(dtype_name(dt)), "x0", {inputs.back()});
  }
  // NaN, infinities and -0 in the 16-bit types travel as raw bits.
  const Tensor special = tensor<float>({std::nanf(""), INFINITY, -INFINITY, -0.0f, 1e-7f, 65504.0f});
  for (DType dt : {kBFloat16, kFloat16}) {
    inputs.push_back(special.to(dt));
    b.add("special", "x0.clone()", {inputs.back()});
  }
  b.run();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& r = b.outcome(i);
    ASSERT_TRUE(r.ok) << r.error;
    ASSERT_EQ(r.outputs.size(), 1u);
    EXPECT_FALSE(r.is_number[0]);
    EXPECT_TRUE(test::bitwise_equal(r.outputs[0], inputs[i])) << "case " << i << ": " << r.outputs[0];
  }
}

TEST(Oracle, ValuesTuplesNumbersAndErrors) {
  test::OracleBatch b;
  const Tensor a = tensor<float>({1.0f, -2.0f, 3.5f}, {3});
  const Tensor m = tensor<int64_t>({4, 9, 2, 7, 1, 8}, {2, 3});
  const size_t add = b.add("add", "torch.add(x0, x0, alpha=2)", {a});
  const size_t max = b.add("max", "torch.max(x0, dim=1)", {m});
  const size_t item = b.add("item", "x0.sum().item()", {a});
  const size_t boolean = b.add("bool", "torch.equal(x0, x0)", {a});
  const size_t integer = b.add("int", "x0.numel()", {m});
  const size_t fails = b.add("fails", "torch.mm(x0, x0)", {a});
  const size_t int16 = b.add("int16", "x0.to(torch.int16)", {m});
  const size_t syntax = b.add("syntax", "x0 +* 1", {a});
  const size_t after = b.add("after failures", "F.relu(x0)", {a});
  b.run();

  const auto& r_add = b.outcome(add);
  ASSERT_TRUE(r_add.ok) << r_add.error;
  EXPECT_TRUE(test::compare_tensors(r_add.outputs[0], tensor<float>({3.0f, -6.0f, 10.5f}), 0, 0).ok);

  const auto& r_max = b.outcome(max);
  ASSERT_TRUE(r_max.ok) << r_max.error;
  ASSERT_EQ(r_max.outputs.size(), 2u);
  EXPECT_TRUE(test::bitwise_equal(r_max.outputs[0], tensor<int64_t>({9, 8})));
  EXPECT_TRUE(test::bitwise_equal(r_max.outputs[1], tensor<int64_t>({1, 2})));

  const auto& r_item = b.outcome(item);
  ASSERT_TRUE(r_item.ok) << r_item.error;
  EXPECT_TRUE(r_item.is_number[0]);
  EXPECT_EQ(r_item.outputs[0].dtype(), kFloat64);
  EXPECT_EQ(r_item.outputs[0].dim(), 0);
  EXPECT_DOUBLE_EQ(r_item.outputs[0].item<double>(), 2.5);

  const auto& r_bool = b.outcome(boolean);
  ASSERT_TRUE(r_bool.ok) << r_bool.error;
  EXPECT_EQ(r_bool.outputs[0].dtype(), kBool);
  EXPECT_TRUE(r_bool.outputs[0].item<bool>());
  EXPECT_EQ(b.outcome(integer).outputs.at(0).item<int64_t>(), 6);

  EXPECT_FALSE(b.outcome(fails).ok);
  EXPECT_NE(b.outcome(fails).error.find("RuntimeError"), std::string::npos) << b.outcome(fails).error;
  EXPECT_FALSE(b.outcome(int16).ok);
  EXPECT_NE(b.outcome(int16).error.find("kiln does not have"), std::string::npos) << b.outcome(int16).error;
  EXPECT_FALSE(b.outcome(syntax).ok);
  EXPECT_NE(b.outcome(syntax).error.find("SyntaxError"), std::string::npos) << b.outcome(syntax).error;
  ASSERT_TRUE(b.outcome(after).ok) << "a failing case must not affect the others";
  EXPECT_TRUE(test::bitwise_equal(b.outcome(after).outputs[0], tensor<float>({1.0f, 0.0f, 3.5f})));
}

TEST(Oracle, NoneAndGradientCases) {
  test::OracleBatch b;
  const Tensor a = tensor<double>({1.0, -2.0, 3.0});
  const Tensor c = tensor<double>({0.5, 0.5, 0.5});
  const size_t none = b.add("none", "(x0, None)", {a});
  // d(sum(g * x0 * x1))/dx0 = g * x1, /dx1 = g * x0; the int64 argmax output gets no grad_output.
  const size_t grad = b.add_grad("grad", "(x0 * x1, x0.argmax())", {a, c}, {0, 1}, {tensor<double>({1.0, 2.0, 3.0}), {}});
  const size_t unused = b.add_grad("unused", "x0 * 2", {a, c}, {0, 1}, {tensor<double>({1.0, 1.0, 1.0})});
  b.run();
  const auto& r_none = b.outcome(none);
  ASSERT_TRUE(r_none.ok) << r_none.error;
  ASSERT_EQ(r_none.outputs.size(), 2u);
  EXPECT_TRUE(r_none.outputs[0].defined());
  EXPECT_FALSE(r_none.outputs[1].defined());

  const auto& r_grad = b.outcome(grad);
  ASSERT_TRUE(r_grad.ok) << r_grad.error;
  ASSERT_EQ(r_grad.outputs.size(), 2u);
  EXPECT_TRUE(test::compare_tensors(r_grad.outputs[0], tensor<double>({0.5, 1.0, 1.5}), 0, 0).ok);
  EXPECT_TRUE(test::compare_tensors(r_grad.outputs[1], tensor<double>({1.0, -4.0, 9.0}), 0, 0).ok);
  EXPECT_EQ(r_grad.output_requires_grad, (std::vector<bool>{true, false}));

  const auto& r_unused = b.outcome(unused);
  ASSERT_TRUE(r_unused.ok) << r_unused.error;
  ASSERT_EQ(r_unused.outputs.size(), 2u);
  EXPECT_TRUE(test::compare_tensors(r_unused.outputs[0], tensor<double>({2.0, 2.0, 2.0}), 0, 0).ok);
  EXPECT_FALSE(r_unused.outputs[1].defined()) << "torch returns None for an unused input";
}

TEST(Oracle, LayoutIsRebuilt) {
  const Tensor base = ops::sample_tensor({4, 6}, kFloat32, 5);
  const Tensor transposed = base.t();                          // strides [1, 6]
  const Tensor expanded = ops::sample_tensor({3, 1}, kInt32, 6).expand({3, 5});  // strides [1, 0]
  const Tensor stepped = base.slice(1, 0, std::nullopt, 2);   // strides [6, 2]
  test::OracleBatch b;
  const size_t c0 = b.add("contig?", "x0.is_contiguous()", {transposed});
  const size_t c1 = b.add("stride", "x0.stride()", {transposed});
  const size_t c2 = b.add("expanded stride", "x0.stride()", {expanded});
  const size_t c3 = b.add("expanded values", "x0.contiguous()", {expanded});
  const size_t c4 = b.add("stepped stride", "x0.stride()", {stepped});
  const size_t c5 = b.add("in-place on expanded", "x0.add_(1)", {expanded});
  b.run();
  EXPECT_FALSE(b.outcome(c0).outputs.at(0).item<bool>());
  auto strides = [&](size_t c) {
    std::vector<int64_t> s;
    for (const Tensor& t : b.outcome(c).outputs) s.push_back(t.item<int64_t>());
    return s;
  };
  EXPECT_EQ(strides(c1), (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(strides(c2), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(strides(c4), (std::vector<int64_t>{6, 2}));
  EXPECT_TRUE(test::bitwise_equal(b.outcome(c3).outputs.at(0), expanded.contiguous()));
  EXPECT_FALSE(b.outcome(c5).ok) << "torch refuses in-place writes to an expanded tensor";
}

TEST(Oracle, SecondRunComesFromTheCache) {
  if (std::getenv("KILN_ORACLE_NO_CACHE")) GTEST_SKIP() << "KILN_ORACLE_NO_CACHE is set";
  const Tensor x = ops::sample_tensor({5}, kFloat64, 77);
  test::OracleBatch first;
  first.add("cache", "torch.exp(x0)", {x});
  first.run();
  test::OracleBatch second;
  second.add("cache", "torch.exp(x0)", {x});
  second.run();
  EXPECT_TRUE(second.from_cache());
  EXPECT_TRUE(test::bitwise_equal(first.outcome(0).outputs.at(0), second.outcome(0).outputs.at(0)));
  // Different input bytes are a different key.
  test::OracleBatch third;
  third.add("cache", "torch.exp(x0)", {ops::sample_tensor({5}, kFloat64, 78)});
  third.run();
  EXPECT_FALSE(test::bitwise_equal(first.outcome(0).outputs.at(0), third.outcome(0).outputs.at(0)));
}
