// DTypes: names, promotion (all 64 pairs against torch.promote_types), and
// the 16-bit float conversions against PyTorch for every bit pattern.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kiln/kiln.h"
#include "support/oracle.h"
#include "support/test_util.h"

using namespace kiln;

namespace {

constexpr DType kAll[] = {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Bit patterns (as int64 holding the uint32) -> an int32 tensor of the same bits.
Tensor bits_tensor(const std::vector<uint32_t>& bits) {
  std::vector<int64_t> v(bits.begin(), bits.end());
  return tensor<int64_t>(v).to(kInt32);  // wraps modulo 2^32: the same bits
}

}  // namespace

TEST(DType, Names) {
  EXPECT_EQ(dtype_name(kBFloat16), "bfloat16");
  EXPECT_EQ(dtype_safetensors_name(kBool), "BOOL");
  for (DType dt : kAll) {
    EXPECT_EQ(dtype_from_name(dtype_name(dt)), dt);
    EXPECT_EQ(dtype_from_name(dtype_safetensors_name(dt)), dt);
  }
  EXPECT_EQ(dtype_from_name("half"), kFloat16);
  EXPECT_EQ(dtype_from_name("long"), kInt64);
  try {
    dtype_from_name("int16");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dtype 'int16'"), std::string::npos) << e.what();
  }
}

TEST(DType, Properties) {
  const int64_t sizes[] = {4, 8, 2, 2, 8, 4, 1, 1};
  for (int i = 0; i < kNumDTypes; ++i) EXPECT_EQ(element_size(kAll[i]), sizes[i]) << dtype_name(kAll[i]);
  EXPECT_TRUE(is_floating_point(kBFloat16));
  EXPECT_FALSE(is_floating_point(kInt32));
  EXPECT_TRUE(is_integral(kUInt8));
  EXPECT_FALSE(is_integral(kBool));
  EXPECT_TRUE(is_integral(kBool, true));
  EXPECT_EQ(Scalar(3).natural_dtype(), kInt64);
  EXPECT_EQ(Scalar(3.0).natural_dtype(), kFloat32);
  EXPECT_EQ(Scalar(true).natural_dtype(), kBool);
}

TEST(DType, DefaultDType) {
  EXPECT_EQ(default_dtype(), kFloat32);
  set_default_dtype(kFloat64);
  EXPECT_EQ(zeros({2}).dtype(), kFloat64);
  EXPECT_EQ(Scalar(1.5).natural_dtype(), kFloat64);
  set_default_dtype(kFloat32);
  EXPECT_THROW(set_default_dtype(kInt64), DTypeError);
  EXPECT_EQ(default_dtype(), kFloat32);
}

TEST(DType, VisitFloatingRejectsIntegers) {
  EXPECT_EQ(visit_dtype<kFloatingTypes>(kBFloat16, "op", []<typename T>() { return sizeof(T); }), 2u);
  try {
    visit_dtype<kFloatingTypes>(kInt32, "my_op", []<typename T>() { return 0; });
    FAIL();
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("my_op: expected a floating-point tensor"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("int32"), std::string::npos);
  }
}

TEST(DType, VisitAllowedSetInstantiatesOnlyItsTypes) {
  constexpr DTypeSet kPair{kFloat32, kFloat64};
  EXPECT_TRUE(kPair.contains(kFloat64));
  EXPECT_FALSE(kPair.contains(kBFloat16));
  EXPECT_EQ(visit_dtype<kPair>(kFloat64, "op", []<typename T>() { return sizeof(T); }), 8u);
  // A body that would not compile for bool is fine: it is instantiated for float and double alone.
  EXPECT_EQ(visit_dtype<kPair>(kFloat32, "op", []<typename T>() { return static_cast<int>(T(1.5) * 2); }), 3);
  try {
    visit_dtype<kPair>(kBFloat16, "sgd", []<typename T>() { return 0; });
    FAIL();
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("sgd: expected a float32 or float64 tensor, got bfloat16"), std::string::npos)
        << e.what();
  }
  try {
    visit_dtype<DTypeSet{kFloat32, kFloat64, kBFloat16}>(kInt64, "pooling", []<typename T>() { return 0; });
    FAIL();
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("pooling: expected a float32, float64 or bfloat16 tensor, got int64"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(visit_dtype<kAllTypes>(kBool, "op", []<typename T>() { return sizeof(T); }), 1u);
}

TEST(DType, PromoteTypesMatchesTorch) {
  // torch.promote_types(row, column) from torch 1.13, in kAll order.
  const DType want[8][8] = {
      {kFloat32, kFloat64, kFloat32, kFloat32, kFloat32, kFloat32, kFloat32, kFloat32},
      {kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64, kFloat64},
      {kFloat32, kFloat64, kBFloat16, kFloat32, kBFloat16, kBFloat16, kBFloat16, kBFloat16},
      {kFloat32, kFloat64, kFloat32, kFloat16, kFloat16, kFloat16, kFloat16, kFloat16},
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt64, kInt64, kInt64},
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kInt32, kInt32},
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kUInt8},
      {kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool},
  };
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(promote_types(kAll[i], kAll[j]), want[i][j])
          << dtype_name(kAll[i]) << " with " << dtype_name(kAll[j]) << " gave "
          << dtype_name(promote_types(kAll[i], kAll[j]));
    }
  }
}

TEST(DType, PromoteTypesTableIsTorchs) {
  // The embedded table above, re-derived from torch at test time (cached).
  std::string expr = "[";
  const char* names[] = {"float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8", "bool"};
  for (const char* a : names) {
    for (const char* b : names) {
      expr += std::string("[torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, "
                          "torch.uint8, torch.bool].index(torch.promote_types(torch.") + a + ", torch." + b + ")),";
    }
  }
  expr += "]";
  const auto r = test::torch_eval(expr);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.outputs.size(), 64u);
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(promote_types(kAll[i], kAll[j]), kAll[r.outputs[i * 8 + j].item<int64_t>()])
          << dtype_name(kAll[i]) << " with " << dtype_name(kAll[j]);
    }
  }
}

// Every 16-bit pattern widened to float32, against torch (bitwise, NaN payloads included).
TEST(DType, SixteenBitToFloatAllPatterns) {
  std::vector<uint32_t> patterns(65536);
  for (uint32_t i = 0; i < 65536; ++i) patterns[i] = i;
  const Tensor bits = bits_tensor(patterns);
  test::OracleBatch b;
  const size_t bf = b.add("bf16->f32", "x0.to(torch.int16).view(torch.bfloat16).float().view(torch.int32)", {bits});
  const size_t hf = b.add("f16->f32", "x0.to(torch.int16).view(torch.float16).float().view(torch.int32)", {bits});
  b.run();
  ASSERT_TRUE(b.outcome(bf).ok) << b.outcome(bf).error;
  ASSERT_TRUE(b.outcome(hf).ok) << b.outcome(hf).error;
  const int32_t* want_bf = b.outcome(bf).outputs[0].data_ptr<int32_t>();
  const int32_t* want_hf = b.outcome(hf).outputs[0].data_ptr<int32_t>();
  int bad_bf = 0, bad_hf = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint32_t got_bf = float_bits(BFloat16::from_bits(static_cast<uint16_t>(i)));
    const uint32_t got_hf = float_bits(Half::from_bits(static_cast<uint16_t>(i)));
    if (got_bf != static_cast<uint32_t>(want_bf[i]) && bad_bf++ < 5) {
      ADD_FAILURE() << "bfloat16 0x" << std::hex << i << " -> 0x" << got_bf << ", torch 0x" << want_bf[i];
    }
    if (got_hf != static_cast<uint32_t>(want_hf[i]) && bad_hf++ < 5) {
      ADD_FAILURE() << "float16 0x" << std::hex << i << " -> 0x" << got_hf << ", torch 0x" << want_hf[i];
    }
  }
  EXPECT_EQ(bad_bf, 0);
  EXPECT_EQ(bad_hf, 0);
}

// float32 -> bfloat16/float16 rounding against torch: every exponent with mantissas at and around the
// rounding boundaries (ties to even), subnormals, overflow to inf, NaN; plus random patterns.
TEST(DType, FloatToSixteenBitRounding) {
  std::vector<uint32_t> patterns;
  const uint32_t lows[] = {0x0, 0x1, 0x7ff, 0xfff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x5000,
                           0x7fff, 0x8000, 0x8001, 0xffff, 0x10000, 0x18000, 0x28000, 0x7fffff};
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t e = 0; e < 256; ++e) {
      for (uint32_t hi : {0u, 0x10000u, 0x3f0000u, 0x400000u, 0x7e0000u, 0x7f0000u, 0x2000u, 0x6000u}) {
        for (uint32_t lo : lows) patterns.push_back(sign | (e << 23) | ((hi | lo) & 0x7fffffu));
      }
    }
  }
  std::mt19937 rng(2024);
  for (int i = 0; i < 100000; ++i) patterns.push_back(rng());
  const Tensor bits = bits_tensor(patterns);
  test::OracleBatch b;
  const size_t bf = b.add("f32->bf16", "x0.view(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int32)",
                          {bits});
  const size_t hf = b.add("f32->f16", "x0.view(torch.float32).to(torch.float16).view(torch.int16).to(torch.int32)",
                          {bits});
  b.run();
  ASSERT_TRUE(b.outcome(bf).ok) << b.outcome(bf).error;
  ASSERT_TRUE(b.outcome(hf).ok) << b.outcome(hf).error;
  const int32_t* want_bf = b.outcome(bf).outputs[0].data_ptr<int32_t>();
  const int32_t* want_hf = b.outcome(hf).outputs[0].data_ptr<int32_t>();
  int bad = 0;
  for (size_t i = 0; i < patterns.size(); ++i) {
    const float f = bits_float(patterns[i]);
    const uint16_t got_bf = BFloat16(f).bits, got_hf = Half(f).bits;
    const uint16_t w_bf = static_cast<uint16_t>(want_bf[i]), w_hf = static_cast<uint16_t>(want_hf[i]);
    // NaN bits differ between torch's scalar and vector paths; only NaN-ness is specified.
    const bool ok_bf = std::isnan(f) ? std::isnan(static_cast<float>(BFloat16::from_bits(w_bf))) &&
                                           std::isnan(static_cast<float>(BFloat16::from_bits(got_bf)))
                                     : got_bf == w_bf;
    const bool ok_hf = std::isnan(f) ? std::isnan(static_cast<float>(Half::from_bits(w_hf))) &&
                                           std::isnan(static_cast<float>(Half::from_bits(got_hf)))
                                     : got_hf == w_hf;
    if ((!ok_bf || !ok_hf) && bad++ < 10) {
      ADD_FAILURE() << std::hex << "float 0x" << patterns[i] << " (" << f << "): bf16 0x" << got_bf << " torch 0x"
                    << w_bf << "; f16 0x" << got_hf << " torch 0x" << w_hf;
    }
  }
  EXPECT_EQ(bad, 0) << "of " << patterns.size() << " patterns";
}

TEST(DType, SixteenBitRoundingCases) {
  // Hand-checked cases: ties to even, the float16 overflow threshold, subnormals.
  EXPECT_EQ(BFloat16(1.0f + 0x1p-8f).bits, 0x3f80);              // tie -> even (1.0)
  EXPECT_EQ(BFloat16(1.0f + 0x3p-8f).bits, 0x3f82);              // tie -> even (up)
  EXPECT_EQ(BFloat16(3.4028235e38f).bits, 0x7f80);               // float max rounds to inf
  EXPECT_EQ(BFloat16(std::nanf("")).bits & 0x7fc0, 0x7fc0);
  EXPECT_EQ(Half(65504.0f).bits, 0x7bff);
  EXPECT_EQ(Half(65519.0f).bits, 0x7bff);                        // below the halfway point
  EXPECT_EQ(Half(65520.0f).bits, 0x7c00);                        // halfway to 2^16 -> inf
  EXPECT_EQ(Half(-1e6f).bits, 0xfc00);
  EXPECT_EQ(Half(0x1p-24f).bits, 0x0001);                        // smallest subnormal
  EXPECT_EQ(Half(0x1p-25f).bits, 0x0000);                        // tie -> even (0)
  EXPECT_EQ(Half(0x3p-25f).bits, 0x0002);                        // tie -> even (2)
  EXPECT_EQ(Half(1.0f + 0x1p-11f).bits, 0x3c00);
  EXPECT_EQ(Half(1.0f + 0x3p-11f).bits, 0x3c02);
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(std::nanf("")))));
  EXPECT_EQ(static_cast<float>(Half::from_bits(0x0001)), 0x1p-24f);
  EXPECT_EQ(static_cast<float>(Half::from_bits(0x7c00)), INFINITY);
}
