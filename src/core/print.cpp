// Printing in PyTorch's style: tensor([[1.0000, 2.5000], ...], dtype=float64).
//
// Float formatting follows torch._tensor_str: integral values print as "1.",
// others with 4 decimals, and scientific notation when the magnitudes span
// more than 1000x or leave [1e-4, 1e8). Tensors of over 1000 elements are
// summarised with the first and last 3 entries of each dim.
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/tensor.h"

namespace kiln {

namespace {

constexpr int64_t kSummarizeThreshold = 1000;
constexpr int64_t kEdgeItems = 3;

struct Formatter {
  enum class Mode { Int, Bool, FloatInt, Fixed, Sci } mode = Mode::Int;
  int width = 1;

  std::string format(double v) const {
    char buf[64];
    switch (mode) {
      case Mode::Bool: return v != 0 ? "True" : "False";
      case Mode::Int: std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v)); break;
      case Mode::FloatInt:
        if (std::isfinite(v)) std::snprintf(buf, sizeof buf, "%.0f.", v);
        else std::snprintf(buf, sizeof buf, "%s", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
        break;
      case Mode::Fixed:
        if (std::isfinite(v)) std::snprintf(buf, sizeof buf, "%.4f", v);
        else std::snprintf(buf, sizeof buf, "%s", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
        break;
      case Mode::Sci:
        if (std::isfinite(v)) std::snprintf(buf, sizeof buf, "%.4e", v);
        else std::snprintf(buf, sizeof buf, "%s", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
        break;
    }
    return buf;
  }
};

double element_at(const Tensor& t, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
  return visit_dtype(t.dtype(), [&]<typename T>() -> double {
    return static_cast<double>(static_cast<compute_t<T>>(static_cast<const T*>(t.data_ptr())[off]));
  });
}

// Visits the elements that will be printed (respecting summarisation).
template <typename F>
void visit_printed(const Tensor& t, bool summarize, F&& f) {
  std::vector<int64_t> idx(t.dim());
  auto rec = [&](auto&& self, int64_t d) -> void {
    if (d == t.dim()) {
      f(element_at(t, idx));
      return;
    }
    const int64_t n = t.sizes()[d];
    for (int64_t i = 0; i < n; ++i) {
      if (summarize && n > 2 * kEdgeItems && i == kEdgeItems) i = n - kEdgeItems;
      idx[d] = i;
      self(self, d + 1);
    }
  };
  rec(rec, 0);
}

Formatter make_formatter(const Tensor& t, bool summarize) {
  Formatter fm;
  if (t.dtype() == kBool) {
    fm.mode = Formatter::Mode::Bool;
  } else if (!is_floating_point(t.dtype())) {
    fm.mode = Formatter::Mode::Int;
  } else {
    bool all_int = true, any_finite = false;
    double max_abs = 0, min_abs = INFINITY;
    visit_printed(t, summarize, [&](double v) {
      if (!std::isfinite(v)) return;
      any_finite = true;
      if (v != std::nearbyint(v)) all_int = false;
      const double a = std::fabs(v);
      max_abs = std::max(max_abs, a);
      if (a != 0) min_abs = std::min(min_abs, a);
    });
    if (!any_finite) {
      fm.mode = Formatter::Mode::Fixed;
    } else if (all_int) {
      fm.mode = max_abs > 1e8 ? Formatter::Mode::Sci : Formatter::Mode::FloatInt;
    } else {
      if (min_abs == INFINITY) min_abs = max_abs;
      const bool sci = (max_abs / min_abs > 1000.0) || max_abs > 1e8 || min_abs < 1e-4;
      fm.mode = sci ? Formatter::Mode::Sci : Formatter::Mode::Fixed;
    }
  }
  visit_printed(t, summarize, [&](double v) { fm.width = std::max<int>(fm.width, fm.format(v).size()); });
  return fm;
}

void print_rec(std::ostream& os, const Tensor& t, const Formatter& fm, bool summarize, std::vector<int64_t>& idx,
               int64_t d, int indent) {
  auto pad = [&](const std::string& s) { return std::string(fm.width - s.size(), ' ') + s; };
  const int64_t n = t.sizes()[d];
  os << '[';
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && n > 2 * kEdgeItems && i == kEdgeItems) {
      if (d == t.dim() - 1) os << "...";
      else os << "...";
      os << ',';
      if (d == t.dim() - 1) os << ' ';
      else os << std::string(t.dim() - d - 1, '\n') << std::string(indent + 1, ' ');
      i = n - kEdgeItems;
    }
    idx[d] = i;
    if (d == t.dim() - 1) {
      os << pad(fm.format(element_at(t, idx)));
    } else {
      print_rec(os, t, fm, summarize, idx, d + 1, indent + 1);
    }
    if (i + 1 < n) {
      os << ',';
      if (d == t.dim() - 1) os << ' ';
      else os << std::string(t.dim() - d - 1, '\n') << std::string(indent + 1, ' ');
    }
  }
  os << ']';
}

}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  const bool summarize = numel() > kSummarizeThreshold;
  os << "tensor(";
  const DType dt = dtype();
  const bool show_dtype = !(dt == default_dtype() || dt == kInt64 || dt == kBool);
  if (numel() == 0) {
    os << "[]";
    if (dim() != 1) os << ", size=" << sizes();
  } else {
    const Formatter fm = make_formatter(*this, summarize);
    if (dim() == 0) {
      os << fm.format(element_at(*this, {}));
    } else {
      std::vector<int64_t> idx(dim());
      print_rec(os, *this, fm, summarize, idx, 0, 7);
    }
  }
  if (show_dtype) os << ", dtype=" << dtype_name(dt);
  if (requires_grad()) os << ", requires_grad=True";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.to_string(); }

}  // namespace kiln
