// Scalar: a number passed to an op (x + 2, x.clamp(0.0, 6.0), full(..., 3)).
//
// It remembers whether it was written as a bool, an integer or a floating
// value, because PyTorch's promotion depends on that category: an int64
// tensor plus 2 stays int64, plus 2.5 becomes the default float dtype.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kiln/core/dtype.h"

namespace kiln {

class Scalar {
 public:
  enum class Kind : uint8_t { Bool, Integral, Floating };

  Scalar() : Scalar(int64_t{0}) {}
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Scalar(T v) : kind_(Kind::Integral), i_(static_cast<int64_t>(v)) {}  // NOLINT
  template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  Scalar(T v) : kind_(Kind::Floating), d_(static_cast<double>(v)) {}  // NOLINT
  Scalar(bool v) : kind_(Kind::Bool), i_(v ? 1 : 0) {}                // NOLINT
  Scalar(BFloat16 v) : Scalar(static_cast<float>(v)) {}               // NOLINT
  Scalar(Half v) : Scalar(static_cast<float>(v)) {}                   // NOLINT

  Kind kind() const { return kind_; }
  bool is_floating_point() const { return kind_ == Kind::Floating; }
  bool is_integral() const { return kind_ == Kind::Integral; }
  bool is_bool() const { return kind_ == Kind::Bool; }

  double to_double() const { return kind_ == Kind::Floating ? d_ : static_cast<double>(i_); }
  int64_t to_int64() const { return kind_ == Kind::Floating ? static_cast<int64_t>(d_) : i_; }
  bool to_bool() const { return kind_ == Kind::Floating ? d_ != 0.0 : i_ != 0; }

  template <typename T>
  T to() const {
    if constexpr (std::is_same_v<T, bool>)
      return to_bool();
    else if constexpr (std::is_integral_v<T>)
      return static_cast<T>(to_int64());
    else if constexpr (std::is_same_v<T, double>)
      return to_double();
    else
      return T(static_cast<float>(to_double()));
  }

  /// The dtype a tensor made from this scalar alone gets (float -> default dtype).
  DType natural_dtype() const;

 private:
  Kind kind_;
  union {
    int64_t i_;
    double d_;
  };
};

}  // namespace kiln
