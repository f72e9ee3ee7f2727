#include "kiln/kernels/copy.h"

#include <cstring>
#include <type_traits>

namespace kiln::kernels {

namespace {

template <typename To, typename From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<To, bool>) {
    return static_cast<compute_t<From>>(v) != compute_t<From>(0);
  } else if constexpr (is_reduced_float_v<To>) {
    return To(static_cast<float>(static_cast<compute_t<From>>(v)));
  } else {
    return static_cast<To>(static_cast<compute_t<From>>(v));
  }
}

}  // namespace

void copy_cast(const LoopSpec& s, DType out, DType in) {
  if (out == in) {
    const int64_t es = element_size(out);
    for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
      if (st[0] == es && st[1] == es) {
        std::memcpy(p[0], p[1], n * es);
      } else {
        for (int64_t i = 0; i < n; ++i) std::memcpy(p[0] + i * st[0], p[1] + i * st[1], es);
      }
    });
    return;
  }
  visit_dtype(out, [&]<typename O>() {
    visit_dtype(in, [&]<typename I>() { map_elements<O, I>(s, [](I v) { return convert<O>(v); }); });
  });
}

void fill(const LoopSpec& s, DType dt, const Scalar& value) {
  visit_dtype(dt, [&]<typename T>() {
    const T v = value.to<T>();
    for_each_row(s, [&](char* const* p, const int64_t* st, int64_t n) {
      if (st[0] == static_cast<int64_t>(sizeof(T))) {
        T* o = reinterpret_cast<T*>(p[0]);
        for (int64_t i = 0; i < n; ++i) o[i] = v;
      } else {
        for (int64_t i = 0; i < n; ++i) *reinterpret_cast<T*>(p[0] + i * st[0]) = v;
      }
    });
  });
}

}  // namespace kiln::kernels
