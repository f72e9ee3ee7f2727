// Printing exactly as PyTorch's repr (torch/_tensor_str.py, 1.13, default
// print options): precision 4, summarise above 1000 elements with 3 edge
// items per dim, 80-column lines, dtype suffix unless the dtype is the
// default float dtype, int64 or bool.
//
// The formatter is chosen from the printed elements only (the edges when
// summarising), as torch does: integers by their widest decimal form;
// floats from their nonzero finite values — "1." style when all are
// integral, scientific when max/min > 1000, max > 1e8 or (non-integral)
// min < 1e-4, else fixed with 4 decimals. Core cannot call ops, so the
// walk uses strides directly.
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/core/tensor.h"

namespace kiln {

namespace {

constexpr int64_t kThreshold = 1000;
constexpr int64_t kEdgeItems = 3;
constexpr int kLineWidth = 80;
constexpr int kPrecision = 4;

// An element: integers kept exact (int64 beyond 2^53 must print exactly).
struct Value {
  double d = 0;
  int64_t i = 0;
};

std::string nonfinite(double v) { return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"); }

std::string printf_str(const char* fmt, int prec, double v) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, prec, v);
  return buf;
}

class Formatter {
 public:
  enum class Kind { Int, Bool, Float };

  explicit Formatter(DType dt) : kind_(dt == kBool ? Kind::Bool : (is_floating_point(dt) ? Kind::Float : Kind::Int)) {}

  // Feeds every element that will be printed.
  void observe(const Value& v) {
    if (kind_ == Kind::Int) {
      width_ = std::max<int>(width_, static_cast<int>(std::to_string(v.i).size()));
    } else if (kind_ == Kind::Bool) {
      width_ = std::max<int>(width_, v.i ? 4 : 5);
    } else if (std::isfinite(v.d) && v.d != 0) {
      finite_.push_back(v.d);
    }
  }

  // Decides the float mode and width once all elements were observed.
  void finish() {
    if (kind_ != Kind::Float || finite_.empty()) return;
    double mx = 0, mn = INFINITY;
    for (double v : finite_) {
      mx = std::max(mx, std::fabs(v));
      mn = std::min(mn, std::fabs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    if (int_mode_) {
      sci_ = mx / mn > 1000.0 || mx > 1e8;
    } else {
      sci_ = mx / mn > 1000.0 || mx > 1e8 || mn < 1e-4;
    }
    for (double v : finite_) {
      int w;
      if (sci_)
        w = static_cast<int>(printf_str("%.*e", kPrecision, v).size());
      else if (int_mode_)
        w = static_cast<int>(printf_str("%.*f", 0, v).size()) + 1;
      else
        w = static_cast<int>(printf_str("%.*f", kPrecision, v).size());
      width_ = std::max(width_, w);
    }
    finite_.clear();
    finite_.shrink_to_fit();
  }

  int width() const { return width_; }

  std::string format(const Value& v) const {
    std::string s;
    if (kind_ == Kind::Int) {
      s = std::to_string(v.i);
    } else if (kind_ == Kind::Bool) {
      s = v.i ? "True" : "False";
    } else if (!std::isfinite(v.d)) {
      s = nonfinite(v.d);
    } else if (sci_) {
      s = printf_str("%.*e", kPrecision, v.d);
    } else if (int_mode_) {
      s = printf_str("%.*f", 0, v.d) + ".";
    } else {
      s = printf_str("%.*f", kPrecision, v.d);
    }
    if (static_cast<int>(s.size()) < width_) s.insert(0, width_ - s.size(), ' ');
    return s;
  }

 private:
  Kind kind_;
  bool int_mode_ = true;
  bool sci_ = false;
  int width_ = 1;
  std::vector<double> finite_;
};

class Printer {
 public:
  Printer(const Tensor& t, bool summarize) : t_(t), summarize_(summarize), fm_(t.dtype()) {
    observe(0, 0);
    fm_.finish();
  }

  std::string str(int indent) {
    if (t_.dim() == 0) return fm_.format(at(0));
    return tensor_str(0, 0, indent);
  }

 private:
  Value at(int64_t offset) const {
    return visit_dtype(t_.dtype(), [&]<typename T>() -> Value {
      const T v = static_cast<const T*>(t_.data_ptr())[offset];
      if constexpr (is_float_v<T>)
        return {static_cast<double>(static_cast<compute_t<T>>(v)), 0};
      else
        return {0, static_cast<int64_t>(v)};
    });
  }

  // Indices along a dim that get printed: all, or the first and last kEdgeItems.
  bool elided(int64_t n) const { return summarize_ && n > 2 * kEdgeItems; }

  template <typename F>
  void for_printed(int64_t n, F&& f) const {
    for (int64_t i = 0; i < n; ++i) {
      if (elided(n) && i == kEdgeItems) i = n - kEdgeItems;
      f(i);
    }
  }

  void observe(int64_t d, int64_t offset) {
    if (d == t_.dim()) {
      fm_.observe(at(offset));
      return;
    }
    for_printed(t_.sizes()[d], [&](int64_t i) { observe(d + 1, offset + i * t_.strides()[d]); });
  }

  std::string vector_str(int64_t offset, int indent) const {
    const int64_t n = t_.sizes().back(), stride = t_.strides().back();
    const int element_length = fm_.width() + 2;
    const int per_line =
        std::max(1, static_cast<int>(std::floor(static_cast<double>(kLineWidth - indent) / element_length)));
    std::vector<std::string> data;
    for_printed(n, [&](int64_t i) {
      if (elided(n) && i == n - kEdgeItems) data.emplace_back(" ...");
      data.push_back(fm_.format(at(offset + i * stride)));
    });
    std::string out = "[";
    for (size_t k = 0; k < data.size(); ++k) {
      if (k > 0) out += k % per_line == 0 ? ",\n" + std::string(indent + 1, ' ') : ", ";
      out += data[k];
    }
    return out + "]";
  }

  std::string tensor_str(int64_t d, int64_t offset, int indent) const {
    if (d == t_.dim() - 1) return vector_str(offset, indent);
    const int64_t n = t_.sizes()[d];
    std::string sep = ",";  // piecewise: g++ 12 warns falsely (-Wrestrict) on "," + std::string(...)
    sep.append(static_cast<size_t>(t_.dim() - d - 1), '\n');
    sep.append(static_cast<size_t>(indent + 1), ' ');
    std::string out = "[";
    bool first = true;
    for_printed(n, [&](int64_t i) {
      if (!first) out += sep;
      if (elided(n) && i == n - kEdgeItems) {
        out += "...";
        out += sep;
      }
      first = false;
      out += tensor_str(d + 1, offset + i * t_.strides()[d], indent + 1);
    });
    return out + "]";
  }

  const Tensor& t_;
  bool summarize_;
  Formatter fm_;
};

// "(2, 0)": Python's tuple for a shape.
std::string py_tuple(IntArrayRef s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

// torch's _add_suffixes: ", suffix" on the last line while it fits in 80 columns.
std::string add_suffixes(std::string s, const std::vector<std::string>& suffixes, int indent) {
  const size_t nl = s.rfind('\n');
  int64_t last_line_len =
      static_cast<int64_t>(s.size()) - (nl == std::string::npos ? -1 : static_cast<int64_t>(nl)) + 1;
  for (const auto& suffix : suffixes) {
    const int64_t len = static_cast<int64_t>(suffix.size());
    if (last_line_len + len + 2 > kLineWidth) {
      s += ",\n" + std::string(indent, ' ') + suffix;
      last_line_len = indent + len;
    } else {
      s += ", " + suffix;
      last_line_len += len + 2;
    }
  }
  return s + ")";
}

}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  // As torch.compile breaks on print(): a replay would not print the new values.
  capture::graph_break_if_recording("printing a tensor (Tensor.__repr__) reads its values on the host");
  const std::string prefix = "tensor(";
  const int indent = static_cast<int>(prefix.size());
  const DType dt = dtype();
  const std::string dtype_suffix = "dtype=torch." + std::string(dtype_name(dt));
  std::vector<std::string> suffixes;
  std::string body;
  if (numel() == 0) {
    if (dim() != 1) suffixes.push_back("size=" + py_tuple(sizes()));
    if (dt != default_dtype()) suffixes.push_back(dtype_suffix);
    body = "[]";
  } else {
    if (!(dt == default_dtype() || dt == kInt64 || dt == kBool)) suffixes.push_back(dtype_suffix);
    Printer p(*this, numel() > kThreshold);
    body = p.str(indent);
  }
  if (requires_grad()) suffixes.push_back("requires_grad=True");
  return add_suffixes(prefix + body, suffixes, indent);
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

}  // namespace kiln
