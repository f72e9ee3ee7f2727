// Element types of tensors, their properties, PyTorch's promotion rules, and
// visit_dtype: the one way kernels dispatch on a runtime dtype (no macros), over every dtype or over a
// DTypeSet of those the caller accepts.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <type_traits>

#include "kiln/core/error.h"
#include "kiln/core/half.h"

namespace kiln {

enum class DType : uint8_t { Float32, Float64, BFloat16, Float16, Int64, Int32, UInt8, Bool };

inline constexpr DType kFloat32 = DType::Float32;
inline constexpr DType kFloat64 = DType::Float64;
inline constexpr DType kBFloat16 = DType::BFloat16;
inline constexpr DType kFloat16 = DType::Float16;
inline constexpr DType kInt64 = DType::Int64;
inline constexpr DType kInt32 = DType::Int32;
inline constexpr DType kUInt8 = DType::UInt8;
inline constexpr DType kBool = DType::Bool;
inline constexpr int kNumDTypes = 8;

/// PyTorch's spelling: "float32", "int64", "bool"...
std::string_view dtype_name(DType t);
/// safetensors' spelling: "F32", "BF16", "I64", "BOOL"...
std::string_view dtype_safetensors_name(DType t);
/// Parses either spelling (and "float", "long", "half" aliases); throws ValueError.
DType dtype_from_name(std::string_view name);

constexpr int64_t element_size(DType t) {
  switch (t) {
    case DType::Float64:
    case DType::Int64: return 8;
    case DType::Float32:
    case DType::Int32: return 4;
    case DType::BFloat16:
    case DType::Float16: return 2;
    case DType::UInt8:
    case DType::Bool: return 1;
  }
  return 0;
}

constexpr bool is_floating_point(DType t) {
  return t == DType::Float32 || t == DType::Float64 || t == DType::BFloat16 || t == DType::Float16;
}
constexpr bool is_integral(DType t, bool include_bool = false) {
  return t == DType::Int64 || t == DType::Int32 || t == DType::UInt8 || (include_bool && t == DType::Bool);
}

/// torch.promote_types: the smallest type both operands convert to without
/// losing category (bool < integer < floating). bfloat16 with float16 gives float32.
DType promote_types(DType a, DType b);

/// The dtype factories and float scalars default to (torch.get_default_dtype()).
DType default_dtype();
void set_default_dtype(DType t);

template <typename T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::Float32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::Float64;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = DType::BFloat16;
};
template <>
struct dtype_of<Half> {
  static constexpr DType value = DType::Float16;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::Int64;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::Int32;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::UInt8;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::Bool;
};
template <typename T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

/// The type arithmetic on T is carried out in: float for the 16-bit floats.
template <typename T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<BFloat16> {
  using type = float;
};
template <>
struct compute_type<Half> {
  using type = float;
};
template <typename T>
using compute_t = typename compute_type<T>::type;

template <typename T>
inline constexpr bool is_reduced_float_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;
template <typename T>
inline constexpr bool is_float_v = std::is_floating_point_v<T> || is_reduced_float_v<T>;

/// A set of dtypes: those a dispatch accepts (visit_dtype<kFloatingTypes>(...)).
struct DTypeSet {
  uint8_t bits = 0;  // bit i: DType i (public: a DTypeSet is a template argument)

  constexpr DTypeSet() = default;
  constexpr DTypeSet(std::initializer_list<DType> types) {
    for (DType t : types) bits = static_cast<uint8_t>(bits | (1u << static_cast<unsigned>(t)));
  }
  constexpr bool contains(DType t) const { return ((bits >> static_cast<unsigned>(t)) & 1u) != 0; }
  constexpr bool operator==(const DTypeSet&) const = default;
};

inline constexpr DTypeSet kAllTypes{kFloat32, kFloat64, kBFloat16, kFloat16, kInt64, kInt32, kUInt8, kBool};
inline constexpr DTypeSet kFloatingTypes{kFloat32, kFloat64, kBFloat16, kFloat16};

namespace detail {
/// "<op>: expected a floating-point tensor (float32, float64, bfloat16, float16), got int64", or for other sets
/// "<op>: expected a float32, float64 or bfloat16 tensor, got int64".
[[noreturn]] void throw_dtype_not_in(std::string_view op, DTypeSet allowed, DType got);
}  // namespace detail

/// Calls f.template operator()<T>() with the C++ type of `t`:
///   visit_dtype(x.dtype(), [&]<typename T>() { ... T ... });
template <typename F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::Float32: return f.template operator()<float>();
    case DType::Float64: return f.template operator()<double>();
    case DType::BFloat16: return f.template operator()<BFloat16>();
    case DType::Float16: return f.template operator()<Half>();
    case DType::Int64: return f.template operator()<int64_t>();
    case DType::Int32: return f.template operator()<int32_t>();
    case DType::UInt8: return f.template operator()<uint8_t>();
    case DType::Bool: return f.template operator()<bool>();
  }
  KILN_ASSERT(false, "visit_dtype: corrupt dtype value ", static_cast<int>(t));
  return f.template operator()<float>();  // unreachable
}

/// As visit_dtype, for the dtypes in `Allowed` only (f is instantiated for those alone); any other raises a
/// DTypeError naming `op` and the allowed dtypes:
///   visit_dtype<kFloatingTypes>(x.dtype(), "softmax", [&]<typename T>() { ... });
///   visit_dtype<DTypeSet{kFloat32, kFloat64}>(p.dtype(), "sgd", [&]<typename T>() { ... });
template <DTypeSet Allowed, typename F>
decltype(auto) visit_dtype(DType t, std::string_view op, F&& f) {
  switch (t) {
    case DType::Float32:
      if constexpr (Allowed.contains(DType::Float32)) return f.template operator()<float>();
      break;
    case DType::Float64:
      if constexpr (Allowed.contains(DType::Float64)) return f.template operator()<double>();
      break;
    case DType::BFloat16:
      if constexpr (Allowed.contains(DType::BFloat16)) return f.template operator()<BFloat16>();
      break;
    case DType::Float16:
      if constexpr (Allowed.contains(DType::Float16)) return f.template operator()<Half>();
      break;
    case DType::Int64:
      if constexpr (Allowed.contains(DType::Int64)) return f.template operator()<int64_t>();
      break;
    case DType::Int32:
      if constexpr (Allowed.contains(DType::Int32)) return f.template operator()<int32_t>();
      break;
    case DType::UInt8:
      if constexpr (Allowed.contains(DType::UInt8)) return f.template operator()<uint8_t>();
      break;
    case DType::Bool:
      if constexpr (Allowed.contains(DType::Bool)) return f.template operator()<bool>();
      break;
  }
  ::kiln::detail::throw_dtype_not_in(op, Allowed, t);
}

}  // namespace kiln
