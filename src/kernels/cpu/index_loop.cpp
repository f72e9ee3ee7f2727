// The strided-loop builder for index ops, the index bounds scans and
// index_add (src/kernels/include/kiln/kernels/index.h).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/kernels/index.h"

namespace kiln::kernels {

namespace {

int64_t loop_rows(const LoopSpec& s) {
  const int64_t inner = std::max<int64_t>(s.inner_size(), 1);
  return s.ndim <= 1 ? 1 : s.numel() / inner;
}

void atomic_min(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}
void atomic_max(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

}  // namespace

LoopSpec make_strided_loop(IntArrayRef shape, std::initializer_list<StridedOperand> operands) {
  LoopSpec s;
  KILN_ASSERT(operands.size() <= static_cast<size_t>(kMaxOperands), "make_strided_loop: too many operands");
  s.nops = static_cast<int>(operands.size());
  {
    int op = 0;
    for (const StridedOperand& o : operands) {
      KILN_ASSERT(o.strides.size() == shape.size(), "make_strided_loop: operand ", op, " has ", o.strides.size(),
                  " strides for a loop of ", shape.size(), " dims");
      s.data[op++] = o.data;
    }
  }
  if (shape_numel(shape) == 0) {  // an empty loop stays empty
    s.ndim = 1;
    s.sizes[0] = 0;
    return s;
  }
  const int64_t nd = static_cast<int64_t>(shape.size());
  int out = 0;
  for (int64_t d = nd - 1; d >= 0; --d) {
    const int64_t size = shape[d];
    if (size == 1) continue;
    if (out > 0) {
      bool merge = true;
      int op = 0;
      for (const StridedOperand& o : operands) {
        merge = merge && o.strides[d] * o.element_size == s.strides[op][out - 1] * s.sizes[out - 1];
        ++op;
      }
      if (merge) {
        s.sizes[out - 1] *= size;
        continue;
      }
    }
    KILN_CHECK(out < kMaxLoopDims, ShapeError, "index kernels support at most ", kMaxLoopDims,
               " non-mergeable dims, got shape ", shape);
    s.sizes[out] = size;
    int op = 0;
    for (const StridedOperand& o : operands) {
      s.strides[op][out] = o.strides[d] * o.element_size;
      ++op;
    }
    ++out;
  }
  s.ndim = out;
  return s;
}

IndexRange index_min_max(const LoopSpec& s, DType index_dt) {
  // A validation read (the ops layer raises on a bad index, or sizes one_hot, which breaks itself):
  // a replay skips it.
  if (s.numel() == 0) return {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()};
  return visit_index_dtype(index_dt, [&]<typename I>() {
    std::atomic<int64_t> mn{std::numeric_limits<int64_t>::max()};
    std::atomic<int64_t> mx{std::numeric_limits<int64_t>::min()};
    auto chunk = [&](int64_t b, int64_t e) {
      I lo = std::numeric_limits<I>::max(), hi = std::numeric_limits<I>::min();
      auto body = [&](char* const* p, const int64_t* st, int64_t n) {
        if (st[0] == static_cast<int64_t>(sizeof(I))) {
          const I* x = reinterpret_cast<const I*>(p[0]);
          for (int64_t i = 0; i < n; ++i) {
            lo = std::min(lo, x[i]);
            hi = std::max(hi, x[i]);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const I v = *reinterpret_cast<const I*>(p[0] + i * st[0]);
            lo = std::min(lo, v);
            hi = std::max(hi, v);
          }
        }
      };
      for_each_row_range(s, b, e, body);
      atomic_min(mn, lo);
      atomic_max(mx, hi);
    };
    const int64_t rows = loop_rows(s);
    if (s.numel() < kGrainSize || rows == 1) {
      chunk(0, rows);
    } else {
      // (A temporary: loop.h's parallel_for template does not take an lvalue callable.)
      parallel_for(rows, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(s.inner_size(), 1)),
                   [&](int64_t b, int64_t e) { chunk(b, e); });
    }
    return IndexRange{mn.load(), mx.load()};
  });
}

int64_t first_out_of_range(const LoopSpec& s, DType index_dt, int64_t lo, int64_t hi) {
  // A validation read: a replay skips it.
  return visit_index_dtype(index_dt, [&]<typename I>() {
    bool found = false;
    int64_t bad = 0;
    auto body = [&](char* const* p, const int64_t* st, int64_t n) {
      for (int64_t i = 0; i < n && !found; ++i) {
        const int64_t v = *reinterpret_cast<const I*>(p[0] + i * st[0]);
        if (v < lo || v >= hi) {
          found = true;
          bad = v;
        }
      }
    };
    for_each_row_range(s, 0, loop_rows(s), body);
    KILN_ASSERT(found, "first_out_of_range: every index lies in [", lo, ", ", hi, ")");
    return bad;
  });
}

void index_add_contiguous(char* out, const char* src, const void* index, DType dt, DType index_dt, int64_t index_stride,
                          int64_t outer, int64_t out_size, int64_t k, int64_t inner) {
  KILN_CAPTURE_KERNEL("index_add_contiguous",
                      index_add_contiguous(out, src, index, dt, index_dt, index_stride, outer, out_size, k, inner));
  if (outer == 0 || out_size == 0 || k == 0 || inner == 0) return;
  KILN_ASSERT(is_floating_point(dt), "index_add_contiguous: floating dtypes only, got ", dtype_name(dt));
  // Counting sort of j by index value: row r's contributions are
  // order[start[r] .. start[r + 1]), in ascending j.
  std::vector<int64_t> start(static_cast<size_t>(out_size) + 1, 0), order(static_cast<size_t>(k));
  visit_index_dtype(index_dt, [&]<typename I>() {
    const I* idx = static_cast<const I*>(index);
    for (int64_t j = 0; j < k; ++j) ++start[static_cast<size_t>(idx[j * index_stride]) + 1];
    for (int64_t r = 0; r < out_size; ++r) start[r + 1] += start[r];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t j = 0; j < k; ++j) order[fill[static_cast<size_t>(idx[j * index_stride])]++] = j;
  });
  const int64_t rows = outer * out_size;
  const int64_t per_row = std::max<int64_t>(1, (k / out_size + 1) * inner);
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = compute_t<T>;
      T* o = reinterpret_cast<T*>(out);
      const T* x = reinterpret_cast<const T*>(src);
      parallel_for(rows, std::max<int64_t>(1, kGrainSize / per_row), [&](int64_t b, int64_t e) {
        std::vector<C> acc(static_cast<size_t>(inner));
        for (int64_t row = b; row < e; ++row) {
          const int64_t oi = row / out_size, r = row % out_size;
          const int64_t j0 = start[r], j1 = start[r + 1];
          if (j0 == j1) continue;
          T* orow = o + row * inner;
          for (int64_t i = 0; i < inner; ++i) acc[i] = static_cast<C>(orow[i]);
          for (int64_t p = j0; p < j1; ++p) {
            const T* xrow = x + (oi * k + order[p]) * inner;
            for (int64_t i = 0; i < inner; ++i) acc[i] += static_cast<C>(xrow[i]);
          }
          for (int64_t i = 0; i < inner; ++i) orow[i] = static_cast<T>(acc[i]);
        }
      });
    }
  });
}

void one_hot(const int64_t* index, int64_t n, int64_t num_classes, int64_t* out) {
  KILN_CAPTURE_KERNEL("one_hot", one_hot(index, n, num_classes, out));
  parallel_for(n, std::max<int64_t>(1, kGrainSize / std::max<int64_t>(num_classes, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i * num_classes + index[i]] = 1;
  });
}

}  // namespace kiln::kernels
