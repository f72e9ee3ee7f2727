#include "kiln/core/dtype.h"

#include <atomic>
#include <string>

#include "kiln/core/scalar.h"

namespace kiln {

namespace {
std::atomic<DType> g_default_dtype{DType::Float32};
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
    case DType::Int64: return "int64";
    case DType::Int32: return "int32";
    case DType::UInt8: return "uint8";
    case DType::Bool: return "bool";
  }
  return "<invalid dtype>";
}

std::string_view dtype_safetensors_name(DType t) {
  switch (t) {
    case DType::Float32: return "F32";
    case DType::Float64: return "F64";
    case DType::BFloat16: return "BF16";
    case DType::Float16: return "F16";
    case DType::Int64: return "I64";
    case DType::Int32: return "I32";
    case DType::UInt8: return "U8";
    case DType::Bool: return "BOOL";
  }
  return "<invalid dtype>";
}

DType dtype_from_name(std::string_view name) {
  struct Alias {
    std::string_view name;
    DType t;
  };
  static constexpr Alias kAliases[] = {
      {"float32", kFloat32}, {"float", kFloat32},     {"F32", kFloat32},   {"float64", kFloat64}, {"double", kFloat64},
      {"F64", kFloat64},     {"bfloat16", kBFloat16}, {"BF16", kBFloat16}, {"float16", kFloat16}, {"half", kFloat16},
      {"F16", kFloat16},     {"int64", kInt64},       {"long", kInt64},    {"I64", kInt64},       {"int32", kInt32},
      {"int", kInt32},       {"I32", kInt32},         {"uint8", kUInt8},   {"U8", kUInt8},        {"bool", kBool},
      {"BOOL", kBool},
  };
  for (const auto& a : kAliases) {
    if (a.name == name) return a.t;
  }
  throw ValueError(detail::concat("unknown dtype '", name,
                                  "': expected one of float32, float64, bfloat16, float16, int64, int32, uint8, bool"));
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank_category = [](DType t) { return t == kBool ? 0 : (is_floating_point(t) ? 2 : 1); };
  const int ca = rank_category(a), cb = rank_category(b);
  if (ca != cb) return ca > cb ? a : b;
  if (ca == 2) {
    if ((a == kBFloat16 && b == kFloat16) || (a == kFloat16 && b == kBFloat16)) return kFloat32;
    return element_size(a) >= element_size(b) ? a : b;
  }
  // Integers: uint8 with a signed type promotes to the signed one at least int16-wide;
  // we have no int16, so int32/int64 win by size.
  return element_size(a) >= element_size(b) ? (a == kUInt8 ? b : a) : b;
}

namespace detail {

void throw_dtype_not_in(std::string_view op, DTypeSet allowed, DType got) {
  if (allowed == kFloatingTypes)
    throw DTypeError(
        concat(op, ": expected a floating-point tensor (float32, float64, bfloat16, float16), got ", dtype_name(got)));
  std::string names;
  int listed = 0, count = 0;
  for (int i = 0; i < kNumDTypes; ++i) count += allowed.contains(static_cast<DType>(i)) ? 1 : 0;
  for (int i = 0; i < kNumDTypes; ++i) {
    if (!allowed.contains(static_cast<DType>(i))) continue;
    if (listed > 0) names += listed + 1 == count ? " or " : ", ";
    names += dtype_name(static_cast<DType>(i));
    ++listed;
  }
  throw DTypeError(concat(op, ": expected a ", names, " tensor, got ", dtype_name(got)));
}

}  // namespace detail

DType default_dtype() { return g_default_dtype.load(std::memory_order_relaxed); }

void set_default_dtype(DType t) {
  KILN_CHECK(is_floating_point(t), DTypeError, "set_default_dtype: expected a floating-point dtype, got ",
             dtype_name(t));
  g_default_dtype.store(t, std::memory_order_relaxed);
}

DType Scalar::natural_dtype() const {
  switch (kind_) {
    case Kind::Bool: return kBool;
    case Kind::Integral: return kInt64;
    case Kind::Floating: return default_dtype();
  }
  return kInt64;
}

}  // namespace kiln
