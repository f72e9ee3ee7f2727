// gather / index_select / scatter / masked_fill / where / tile-copy kernels
// (src/kernels/include/kiln/kernels/index.h).
//
// Pure data movement (gather, masked_fill, where, tile copies) moves values
// as unsigned integers of the element's size: the select in masked_fill and
// where then vectorises (g++ does not vectorise a select on bool or on the
// BFloat16 struct), and the masks are read as bytes for the same reason.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <type_traits>

#include "kiln/core/capture.h"
#include "kiln/kernels/index.h"
#include "loop_capture.h"

namespace kiln::kernels {

namespace {

template <size_t N>
using bits_t = std::conditional_t<N == 1, uint8_t,
                                  std::conditional_t<N == 2, uint16_t, std::conditional_t<N == 4, uint32_t, uint64_t>>>;

template <typename T>
inline T add_values(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) {
    return a || b;  // torch: scatter_add on bool is a logical or
  } else {
    return static_cast<T>(static_cast<compute_t<T>>(a) + static_cast<compute_t<T>>(b));
  }
}

int64_t loop_rows(const LoopSpec& s) {
  const int64_t inner = std::max<int64_t>(s.inner_size(), 1);
  return s.ndim <= 1 ? 1 : s.numel() / inner;
}

// Runs body over every row of a scatter loop, in parallel only across a dim
// where self's stride (operand 0) is nonzero — any dim but the scatter dim —
// so threads write disjoint parts of self. Each thread walks its part in
// row-major order, so writes to one element happen in index order and the
// result is bit-identical for every thread count.
template <typename Body>
void for_each_row_disjoint(const LoopSpec& s, Body& body) {
  const int64_t n = s.numel();
  if (n == 0) return;
  int pd = -1;
  for (int d = 0; d < s.ndim; ++d) {
    if (s.strides[0][d] != 0 && (pd < 0 || s.sizes[d] > s.sizes[pd])) pd = d;
  }
  if (pd < 0 || n < kGrainSize) {
    for_each_row_range(s, 0, loop_rows(s), body);
    return;
  }
  const int64_t per_unit = n / s.sizes[pd];
  parallel_for(s.sizes[pd], std::max<int64_t>(1, kGrainSize / per_unit), [&](int64_t b, int64_t e) {
    LoopSpec sub = s;
    sub.sizes[pd] = e - b;
    for (int op = 0; op < s.nops; ++op) sub.data[op] += b * s.strides[op][pd];
    for_each_row_range(sub, 0, loop_rows(sub), body);
  });
}

}  // namespace

bool gather(const LoopSpec& s, DType dt, DType index_dt, int64_t src_dim_stride_bytes, int64_t dim_size) {
  // The result (whether every index was in range) only decides whether the op raises; a bad
  // index reads element 0, so a replay that skips the check stays in bounds.
  KILN_CAPTURE_KERNEL_NOW("gather", (void)gather(s, dt, index_dt, src_dim_stride_bytes, dim_size));
  const int64_t ds = src_dim_stride_bytes;
  const uint64_t limit = static_cast<uint64_t>(dim_size);
  std::atomic<bool> all_valid{true};
  visit_dtype(dt, [&]<typename T>() {
    using S = bits_t<sizeof(T)>;
    visit_index_dtype(index_dt, [&]<typename I>() {
      for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
        // A bad index reads element 0 instead and is reported after the loop:
        // one predictable compare per element, no separate pass over index.
        bool bad = false;
        auto load = [&](const char* base, int64_t v) {
          const bool ok = static_cast<uint64_t>(v) < limit;
          bad |= !ok;
          return *reinterpret_cast<const S*>(base + (ok ? v : 0) * ds);
        };
        const char* src = p[1];
        if (st[0] == static_cast<int64_t>(sizeof(S)) && st[2] == static_cast<int64_t>(sizeof(I))) {
          S* out = reinterpret_cast<S*>(p[0]);
          const I* idx = reinterpret_cast<const I*>(p[2]);
          if (st[1] == 0) {  // the row runs along the gathered dim
            for (int64_t i = 0; i < n; ++i) out[i] = load(src, idx[i]);
          } else {
            for (int64_t i = 0; i < n; ++i) out[i] = load(src + i * st[1], idx[i]);
          }
        } else if (st[2] == 0) {  // index_select: one index value for the whole row
          const int64_t v = *reinterpret_cast<const I*>(p[2]);
          const bool ok = static_cast<uint64_t>(v) < limit;
          bad |= !ok;
          const char* row = src + (ok ? v : 0) * ds;
          for (int64_t i = 0; i < n; ++i) {
            *reinterpret_cast<S*>(p[0] + i * st[0]) = *reinterpret_cast<const S*>(row + i * st[1]);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            *reinterpret_cast<S*>(p[0] + i * st[0]) =
                load(src + i * st[1], *reinterpret_cast<const I*>(p[2] + i * st[2]));
          }
        }
        if (bad) all_valid.store(false, std::memory_order_relaxed);
      });
    });
  });
  return all_valid.load();
}

void index_select_contiguous(char* out, const char* src, const void* index, DType dt, DType index_dt,
                             int64_t index_stride, int64_t outer, int64_t src_size, int64_t k, int64_t inner) {
  KILN_CAPTURE_KERNEL("index_select_contiguous",
                      index_select_contiguous(out, src, index, dt, index_dt, index_stride, outer, src_size, k, inner));
  const int64_t rows = outer * k;
  if (rows == 0 || inner == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / inner);
  visit_dtype(dt, [&]<typename T>() {
    using S = bits_t<sizeof(T)>;
    visit_index_dtype(index_dt, [&]<typename I>() {
      const I* idx = static_cast<const I*>(index);
      S* o = reinterpret_cast<S*>(out);
      const S* x = reinterpret_cast<const S*>(src);
      // Rows r = (oi, j) of the output, split in ranges; within a range, runs
      // of j for one oi so the inner == 1 case is a tight loop.
      parallel_for(rows, grain, [&](int64_t b, int64_t e) {
        int64_t oi = b / k, j = b % k, r = b;
        while (r < e) {
          const int64_t jend = std::min(k, j + (e - r));
          const S* xrow = x + oi * src_size * inner;
          S* orow = o + oi * k * inner;
          if (inner == 1) {
            for (int64_t jj = j; jj < jend; ++jj) orow[jj] = xrow[static_cast<int64_t>(idx[jj * index_stride])];
          } else {
            for (int64_t jj = j; jj < jend; ++jj) {
              std::memcpy(orow + jj * inner, xrow + static_cast<int64_t>(idx[jj * index_stride]) * inner,
                          static_cast<size_t>(inner) * sizeof(S));
            }
          }
          r += jend - j;
          j = 0;
          ++oi;
        }
      });
    });
  });
}

void scatter(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, ScatterMode mode) {
  KILN_CAPTURE_KERNEL("scatter", scatter(s, dt, index_dt, self_dim_stride_bytes, mode));
  const int64_t ds = self_dim_stride_bytes;
  visit_dtype(dt, [&]<typename T>() {
    visit_index_dtype(index_dt, [&]<typename I>() {
      auto body = [&](char* const* p, const int64_t* st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t v = *reinterpret_cast<const I*>(p[2] + i * st[2]);
          T* dst = reinterpret_cast<T*>(p[0] + i * st[0] + v * ds);
          const T x = *reinterpret_cast<const T*>(p[1] + i * st[1]);
          *dst = mode == ScatterMode::Add ? add_values(*dst, x) : x;
        }
      };
      for_each_row_disjoint(s, body);
    });
  });
}

void scatter_value(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, const Scalar& value) {
  KILN_CAPTURE_KERNEL("scatter_value", scatter_value(s, dt, index_dt, self_dim_stride_bytes, value));
  const int64_t ds = self_dim_stride_bytes;
  visit_dtype(dt, [&]<typename T>() {
    const T x = value.to<T>();
    visit_index_dtype(index_dt, [&]<typename I>() {
      auto body = [&](char* const* p, const int64_t* st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t v = *reinterpret_cast<const I*>(p[1] + i * st[1]);
          *reinterpret_cast<T*>(p[0] + i * st[0] + v * ds) = x;
        }
      };
      for_each_row_disjoint(s, body);
    });
  });
}

void masked_fill(const LoopSpec& s, DType dt, const Scalar& value) {
  const int esz = static_cast<int>(element_size(dt));
  KILN_CAPTURE_LOOP("masked_fill", s, (ew::ElemSizes{esz, esz, 1, 0}), masked_fill(t, dt, value));
  visit_dtype(dt, [&]<typename T>() {
    using S = bits_t<sizeof(T)>;
    const S v = std::bit_cast<S>(value.to<T>());
    constexpr int64_t es = sizeof(S);
    for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
      const S fill = v;  // a local copy: the compiler cannot prove stores to out leave a captured v alone
      if (st[0] == es && st[1] == es && st[2] == 1) {
        S* out = reinterpret_cast<S*>(p[0]);
        const S* x = reinterpret_cast<const S*>(p[1]);
        const uint8_t* m = reinterpret_cast<const uint8_t*>(p[2]);
        for (int64_t i = 0; i < n; ++i) {
          const S xv = x[i];
          const uint8_t mv = m[i];
          out[i] = mv ? fill : xv;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) {
          const S xv = *reinterpret_cast<const S*>(p[1] + i * st[1]);
          const uint8_t mv = *reinterpret_cast<const uint8_t*>(p[2] + i * st[2]);
          *reinterpret_cast<S*>(p[0] + i * st[0]) = mv ? fill : xv;
        }
      }
    });
  });
}

void where(const LoopSpec& s, DType dt, DType cond_dt) {
  const int esz = static_cast<int>(element_size(dt));
  KILN_CAPTURE_LOOP("where", s, (ew::ElemSizes{esz, static_cast<int>(element_size(cond_dt)), esz, esz}),
                    where(t, dt, cond_dt));
  KILN_ASSERT(cond_dt == DType::Bool || cond_dt == DType::UInt8, "where: condition dtype ", dtype_name(cond_dt));
  visit_dtype(dt, [&]<typename T>() {
    using S = bits_t<sizeof(T)>;
    constexpr int64_t es = sizeof(S);
    for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
      if (st[0] == es && st[1] == 1 && st[2] == es && st[3] == es) {
        S* out = reinterpret_cast<S*>(p[0]);
        const uint8_t* c = reinterpret_cast<const uint8_t*>(p[1]);
        const S* a = reinterpret_cast<const S*>(p[2]);
        const S* b = reinterpret_cast<const S*>(p[3]);
        for (int64_t i = 0; i < n; ++i) {
          const S av = a[i], bv = b[i];
          const uint8_t cv = c[i];
          out[i] = cv ? av : bv;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) {
          const S av = *reinterpret_cast<const S*>(p[2] + i * st[2]);
          const S bv = *reinterpret_cast<const S*>(p[3] + i * st[3]);
          const uint8_t cv = *reinterpret_cast<const uint8_t*>(p[1] + i * st[1]);
          *reinterpret_cast<S*>(p[0] + i * st[0]) = cv ? av : bv;
        }
      }
    });
  });
}

void tile_copy(const LoopSpec& s, DType dt) {
  KILN_CAPTURE_KERNEL("tile_copy", tile_copy(s, dt));
  visit_dtype(dt, [&]<typename T>() {
    using S = bits_t<sizeof(T)>;
    constexpr int64_t es = sizeof(S);
    for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
      S* out = reinterpret_cast<S*>(p[0]);
      if (st[0] == es && st[1] == es) {
        std::memcpy(out, p[1], static_cast<size_t>(n * es));
      } else if (st[0] == es && st[1] == 0) {  // one value along the row: a fill that vectorises
        const S v = *reinterpret_cast<const S*>(p[1]);
        for (int64_t i = 0; i < n; ++i) out[i] = v;
      } else {
        for (int64_t i = 0; i < n; ++i) {
          *reinterpret_cast<S*>(p[0] + i * st[0]) = *reinterpret_cast<const S*>(p[1] + i * st[1]);
        }
      }
    });
  });
}

}  // namespace kiln::kernels
