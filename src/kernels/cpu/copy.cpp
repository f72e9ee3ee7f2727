#include "kiln/kernels/copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "elementwise_math.h"
#include "kiln/core/capture.h"
#include "loop_capture.h"
#include "transpose16.h"

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

// Note [Transposing copies]
// A copy between channels-last and NCHW order ([N, C, H, W] contiguous from
// its channels-last view, as a flatten after a convolution makes, or back)
// reads one element per cache line along its innermost output row: one
// scalar load and store per element, about 6 GB/s (cnn's flatten of
// [64, 64, 7, 7]: 130 us at 1 thread). As a batch of 2-D blocks, where the
// output's innermost dim is contiguous and the input is contiguous along the
// next one, it runs as 16 x 16 register transposes, a vector load and store
// per row of a block. A copy moves bits, so the order changes nothing.
bool is_block_transpose(const LoopSpec& s, int64_t es) {
  if (es != 4 || s.ndim < 2 || s.sizes[0] < 8 || s.sizes[1] < 8) return false;
  const int64_t out0 = s.strides[0][0], in0 = s.strides[1][0], out1 = s.strides[0][1], in1 = s.strides[1][1];
  return out0 == 4 && in1 == 4 && in0 > 4 && out1 > 4 && in0 % 4 == 0 && out1 % 4 == 0;
}

// dst word (j, i) at dst[j * dj + i], from src word (i, j) at src[i * si + j]:
// an n0 x n1 block (i < n0, j < n1).
void transpose_block(uint32_t* dst, int64_t dj, const uint32_t* src, int64_t si, int64_t n0, int64_t n1) {
  for (int64_t i0 = 0; i0 < n0; i0 += 16)
    for (int64_t j0 = 0; j0 < n1; j0 += 16)
      detail::transpose16_block(dst + j0 * dj + i0, dj, src + i0 * si + j0, si, std::min<int64_t>(16, n0 - i0),
                                std::min<int64_t>(16, n1 - j0));
}

void block_transpose_copy(const LoopSpec& s) {
  const int64_t n0 = s.sizes[0], si = s.strides[1][0] / 4, dj = s.strides[0][1] / 4;
  LoopSpec outer = s;  // dims 1.. of s: each of its rows is one block
  outer.ndim = s.ndim - 1;
  for (int d = 0; d < outer.ndim; ++d) {
    outer.sizes[d] = s.sizes[d + 1];
    for (int op = 0; op < s.nops; ++op) outer.strides[op][d] = s.strides[op][d + 1];
  }
  for_each_row(
      outer,
      [&](char* const* p, const int64_t*, int64_t n1) {
        transpose_block(reinterpret_cast<uint32_t*>(p[0]), dj, reinterpret_cast<const uint32_t*>(p[1]), si, n0, n1);
      },
      std::max<int64_t>(1, kGrainSize / n0));
}

// Note [Casts by rows]
// float32 <-> bfloat16 casts go through the vector rows of the elementwise
// kernels (elementwise_math.h): VCVTNE2PS2BF16 where it rounds as
// BFloat16(float) does, its integer form where not (NaN, subnormals), so the
// bits are the element loop's, which left the rounding to the compiler. bf16
// autocast casts every weight each step and each residual branch's gradient.
// float16 keeps the element loop: F16C keeps a NaN's payload where Half(float)
// may not.
// Contiguous runs by `row`, strided ones element by element (convert).
template <typename O, typename I, typename Row>
void cast_runs(const LoopSpec& s, Row row) {
  for_each_element_run(s, [&](char* const* p, const int64_t* st, int64_t n) {
    if (st[0] == static_cast<int64_t>(sizeof(O)) && st[1] == static_cast<int64_t>(sizeof(I)))
      return row(reinterpret_cast<O*>(p[0]), reinterpret_cast<const I*>(p[1]), n);
    for (int64_t k = 0; k < n; ++k)
      *reinterpret_cast<O*>(p[0] + k * st[0]) = convert<O>(*reinterpret_cast<const I*>(p[1] + k * st[1]));
  });
}

bool convert_by_rows(const LoopSpec& s, DType out, DType in) {
  if (out == DType::BFloat16 && in == DType::Float32) {
    cast_runs<BFloat16, float>(s, vm::float_to_bf16_row);
    return true;
  }
  if (out == DType::Float32 && in == DType::BFloat16) {
    cast_runs<float, BFloat16>(s, vm::bf16_to_float_row);
    return true;
  }
  return false;
}

}  // namespace

void copy_cast(const LoopSpec& s, DType out, DType in) {
  KILN_CAPTURE_LOOP("copy_cast", s,
                    (ew::ElemSizes{static_cast<int>(element_size(out)), static_cast<int>(element_size(in)), 0, 0}),
                    copy_cast(t, out, in));
  if (out == in) {
    const int64_t es = element_size(out);
    if (is_block_transpose(s, es)) return block_transpose_copy(s);
    for_each_element_run(s, [&](char* const* p, const int64_t* st, int64_t n) {
      if (st[0] == es && st[1] == es) {
        std::memcpy(p[0], p[1], n * es);
      } else {
        strided_copy(p[0], st[0], p[1], st[1], n, es);
      }
    });
    return;
  }
  if (convert_by_rows(s, out, in)) return;
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
