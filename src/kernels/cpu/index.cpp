// gather / index_select / scatter / masked_fill / where kernels
// (include/kiln/kernels/index.h). Indices arrive bounds-checked.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kiln/kernels/index.h"

namespace kiln::kernels {

namespace {

template <typename T>
inline T add_values(T a, T b) {
  if constexpr (std::is_same_v<T, bool>) {
    return a || b;  // torch: scatter_add on bool is a logical or
  } else {
    return static_cast<T>(static_cast<compute_t<T>>(a) + static_cast<compute_t<T>>(b));
  }
}

}  // namespace

void gather(const LoopSpec& s, DType dt, DType index_dt, int64_t src_dim_stride_bytes) {
  const int64_t ds = src_dim_stride_bytes;
  visit_dtype(dt, [&]<typename T>() {
    visit_index_dtype(index_dt, [&]<typename I>() {
      for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
        const char* src = p[1];
        if (st[0] == static_cast<int64_t>(sizeof(T)) && st[2] == static_cast<int64_t>(sizeof(I))) {
          T* out = reinterpret_cast<T*>(p[0]);
          const I* idx = reinterpret_cast<const I*>(p[2]);
          if (st[1] == 0) {  // the row runs along the gathered dim
            for (int64_t i = 0; i < n; ++i) out[i] = *reinterpret_cast<const T*>(src + idx[i] * ds);
          } else {
            for (int64_t i = 0; i < n; ++i) out[i] = *reinterpret_cast<const T*>(src + i * st[1] + idx[i] * ds);
          }
        } else if (st[2] == 0) {  // index_select: one index value for the whole row
          const char* row = src + *reinterpret_cast<const I*>(p[2]) * ds;
          for (int64_t i = 0; i < n; ++i) {
            *reinterpret_cast<T*>(p[0] + i * st[0]) = *reinterpret_cast<const T*>(row + i * st[1]);
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t v = *reinterpret_cast<const I*>(p[2] + i * st[2]);
            *reinterpret_cast<T*>(p[0] + i * st[0]) = *reinterpret_cast<const T*>(src + i * st[1] + v * ds);
          }
        }
      });
    });
  });
}

void index_select_contiguous(char* out, const char* src, const void* index, DType dt, DType index_dt,
                             int64_t index_stride, int64_t outer, int64_t src_size, int64_t k, int64_t inner) {
  const int64_t rows = outer * k;
  if (rows == 0 || inner == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / inner);
  visit_dtype(dt, [&]<typename T>() {
    visit_index_dtype(index_dt, [&]<typename I>() {
      const I* idx = static_cast<const I*>(index);
      T* o = reinterpret_cast<T*>(out);
      const T* x = reinterpret_cast<const T*>(src);
      parallel_for(rows, grain, [&](int64_t b, int64_t e) {
        int64_t oi = b / k, j = b % k;
        for (int64_t r = b; r < e; ++r) {
          const int64_t from = (oi * src_size + static_cast<int64_t>(idx[j * index_stride])) * inner;
          if (inner == 1) {
            o[r] = x[from];
          } else {
            std::memcpy(o + r * inner, x + from, static_cast<size_t>(inner) * sizeof(T));
          }
          if (++j == k) {
            j = 0;
            ++oi;
          }
        }
      });
    });
  });
}

void scatter(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, ScatterMode mode) {
  const int64_t ds = self_dim_stride_bytes;
  visit_dtype(dt, [&]<typename T>() {
    visit_index_dtype(index_dt, [&]<typename I>() {
      // Each row is handled by one thread in order, and rows write disjoint
      // parts of self (make_strided_loop's innermost_dim), so duplicates
      // resolve in index order whatever the thread count.
      for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t v = *reinterpret_cast<const I*>(p[2] + i * st[2]);
          T* dst = reinterpret_cast<T*>(p[0] + i * st[0] + v * ds);
          const T x = *reinterpret_cast<const T*>(p[1] + i * st[1]);
          *dst = mode == ScatterMode::Add ? add_values(*dst, x) : x;
        }
      });
    });
  });
}

void scatter_value(const LoopSpec& s, DType dt, DType index_dt, int64_t self_dim_stride_bytes, const Scalar& value) {
  const int64_t ds = self_dim_stride_bytes;
  visit_dtype(dt, [&]<typename T>() {
    const T x = value.to<T>();
    visit_index_dtype(index_dt, [&]<typename I>() {
      for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t v = *reinterpret_cast<const I*>(p[1] + i * st[1]);
          *reinterpret_cast<T*>(p[0] + i * st[0] + v * ds) = x;
        }
      });
    });
  });
}

void masked_fill(const LoopSpec& s, DType dt, const Scalar& value) {
  visit_dtype(dt, [&]<typename T>() {
    const T v = value.to<T>();
    map_elements<T, T, bool>(s, [v](T x, bool m) { return m ? v : x; });
  });
}

void where(const LoopSpec& s, DType dt, DType cond_dt) {
  visit_dtype(dt, [&]<typename T>() {
    if (cond_dt == DType::UInt8) {
      map_elements<T, uint8_t, T, T>(s, [](uint8_t c, T a, T b) { return c ? a : b; });
    } else {
      KILN_ASSERT(cond_dt == DType::Bool, "where: condition dtype ", dtype_name(cond_dt));
      map_elements<T, bool, T, T>(s, [](bool c, T a, T b) { return c ? a : b; });
    }
  });
}

}  // namespace kiln::kernels
