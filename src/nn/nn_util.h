// Helpers shared by the nn modules' sources (private to src/nn): the default
// dtype of a module's options, and the pieces of extra_repr() that print
// values as PyTorch's module reprs do.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/dtype.h"
#include "kiln/core/tensor.h"

namespace kiln::nn::util {

/// Options of the given dtype, or of the default dtype when none is given.
inline TensorOptions dtype_or_default(const std::optional<DType>& d) { return TensorOptions(d ? *d : default_dtype()); }

/// A Python tuple: (3,) for one value, (2, 3) for two.
inline std::string int_tuple(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

/// One value as a plain int (kernel_size=3), more as a tuple (2, 3).
inline std::string int_or_tuple(const std::vector<int64_t>& v) {
  if (v.size() == 1) return std::to_string(v[0]);
  return int_tuple(v);
}

/// Python's True / False.
inline const char* py_bool(bool b) { return b ? "True" : "False"; }

/// A double as an ostream prints it (1e-05, 0.1).
inline std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace kiln::nn::util
