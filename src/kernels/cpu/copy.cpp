#include "kiln/kernels/copy.h"

#include <cstring>
#include <type_traits>

#include "kiln/core/capture.h"
#include "loop_capture.h"

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

namespace {

// One element at a time, by value for the common sizes: a memcpy call per
// element costs several times the copy (a channels-last <-> NCHW transpose
// runs entirely in here).
template <typename U>
void strided_copy_as(char* o, int64_t so, const char* i, int64_t si, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    U v;
    std::memcpy(&v, i + k * si, sizeof(U));
    std::memcpy(o + k * so, &v, sizeof(U));
  }
}

void strided_copy(char* o, int64_t so, const char* i, int64_t si, int64_t n, int64_t es) {
  switch (es) {
    case 1: strided_copy_as<uint8_t>(o, so, i, si, n); return;
    case 2: strided_copy_as<uint16_t>(o, so, i, si, n); return;
    case 4: strided_copy_as<uint32_t>(o, so, i, si, n); return;
    case 8: strided_copy_as<uint64_t>(o, so, i, si, n); return;
    default:
      for (int64_t k = 0; k < n; ++k) std::memcpy(o + k * so, i + k * si, static_cast<size_t>(es));
  }
}

}  // namespace

void copy_cast(const LoopSpec& s, DType out, DType in) {
  KILN_CAPTURE_LOOP("copy_cast", s,
                    (ew::ElemSizes{static_cast<int>(element_size(out)), static_cast<int>(element_size(in)), 0, 0}),
                    copy_cast(t, out, in));
  if (out == in) {
    const int64_t es = element_size(out);
    for_each_element_run(s, [&](char* const* p, const int64_t* st, int64_t n) {
      if (st[0] == es && st[1] == es) {
        std::memcpy(p[0], p[1], n * es);
      } else {
        strided_copy(p[0], st[0], p[1], st[1], n, es);
      }
    });
    return;
  }
  visit_dtype(out, [&]<typename O>() {
    visit_dtype(in, [&]<typename I>() { map_elements<O, I>(s, [](I v) { return convert<O>(v); }); });
  });
}

void fill(const LoopSpec& s, DType dt, const Scalar& value) {
  KILN_CAPTURE_LOOP("fill", s, ew::sizes_all(static_cast<int>(element_size(dt))), fill(t, dt, value));
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
