// Tensor factories (include/kiln/ops/factory.h).
//
// Random factories draw from Philox by element index: element i of a fresh
// tensor uses block (offset + i / k) of the generator's stream, where k is
// the number of elements one 128-bit block yields. The fill is therefore the
// same whatever the thread count, and the generator advances by a known
// number of blocks.
#include "kiln/ops/factory.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "iter.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/core/memory_history.h"
#include "kiln/core/parallel.h"
#include "kiln/kernels/copy.h"
#include "kiln/kernels/loop.h"
#include "op_record.h"

namespace kiln {

namespace {

// Sizes must be non-negative and their product (ignoring zeros, which bounds
// every stride too) must fit int64, so no size or stride computation overflows.
void check_sizes(IntArrayRef sizes, const char* op) {
  int64_t dense = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    KILN_CHECK(sizes[i] >= 0, ShapeError, op, ": expected non-negative sizes, got ", sizes, " (dim ", i, " is ",
               sizes[i], ")");
    KILN_CHECK(sizes[i] == 0 || !__builtin_mul_overflow(dense, sizes[i], &dense), ValueError, op, ": sizes ", sizes,
               " hold more elements than int64 can count");
  }
}

Tensor make_tensor(IntArrayRef sizes, IntArrayRef strides, int64_t storage_elems, const TensorOptions& o) {
  const DType dt = o.dtype_or_default();
  KILN_CHECK(!o.requires_grad() || is_floating_point(dt), DTypeError,
             "only floating-point tensors can require gradients, got dtype ", dtype_name(dt));
  int64_t nbytes = 0;
  KILN_CHECK(!__builtin_mul_overflow(storage_elems, element_size(dt), &nbytes), ValueError, "a tensor of sizes ", sizes,
             " and dtype ", dtype_name(dt), " needs more bytes than int64 can count");
  const MemoryCategory cat = o.category().value_or(current_memory_category());
  auto storage = make_intrusive<StorageImpl>(static_cast<size_t>(nbytes), cat);
  memory::detail::annotate(storage->data(), sizes, dt);
  Tensor t(make_intrusive<TensorImpl>(std::move(storage), dt, sizes, strides, 0));
  if (o.requires_grad()) t.impl()->set_requires_grad_flag(true);
  if (inference_mode_enabled()) t.impl()->set_inference(true);
  return t;
}

// 1 + the largest element offset of a strided layout (0 when empty); strides must be >= 0.
int64_t strided_extent(IntArrayRef sizes, IntArrayRef strides, const char* op) {
  KILN_CHECK(sizes.size() == strides.size(), ShapeError, op, ": sizes ", sizes, " and strides ", strides,
             " must have the same length");
  if (shape_numel(sizes) == 0) return 0;
  int64_t extent = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    KILN_CHECK(strides[i] >= 0, ShapeError, op, ": negative strides are not supported, got ", strides);
    int64_t span = 0;
    KILN_CHECK(
        !__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) && !__builtin_add_overflow(extent, span, &extent),
        ValueError, op, ": sizes ", sizes, " with strides ", strides, " span more elements than int64 can count");
  }
  return extent;
}

Generator& gen_or_default(Generator* g) { return g ? *g : default_generator(); }

// Fills contiguous `t` with f(block_words, lane) where each Philox block serves `per_block` elements.
// Under kiln::compile the fill is recorded whole: a replay reserves fresh blocks from the same
// generator and fills the same memory, so the numbers differ from step to step and the generator
// advances exactly as eagerly (a generator passed in must outlive the compiled function).
template <typename T, typename F>
void fill_random(Tensor& t, Generator* gen, int64_t per_block, F f) {
  const int64_t n = t.numel();
  if (n == 0) return;
  Generator* g = &gen_or_default(gen);
  const int64_t blocks = (n + per_block - 1) / per_block;
  T* out = t.data_ptr<T>();
  capture::host_write("random", [g, out, n, blocks, per_block, f] {
    const uint64_t seed = g->get_state().seed;
    const uint64_t first = g->reserve(static_cast<uint64_t>(blocks));
    parallel_for(blocks, 4096, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const auto w = philox4x32(seed, 0, first + static_cast<uint64_t>(blk));
        for (int64_t lane = 0; lane < per_block; ++lane) {
          const int64_t i = blk * per_block + lane;
          if (i < n) out[i] = f(w, lane);
        }
      }
    });
  });
}

// fill_random's float32 uniforms, a + span * u01_24(word), filled by
// detail::philox_uniform_floats (Note [Philox sixteen at a time] in
// src/core/generator.cpp): the same blocks of the same generator, the same bits.
void fill_uniform_float(Tensor& t, Generator* gen, float a, float span) {
  const int64_t n = t.numel();
  if (n == 0) return;
  Generator* g = &gen_or_default(gen);
  const int64_t blocks = (n + 3) / 4;
  float* out = t.data_ptr<float>();
  capture::host_write("random", [g, out, n, blocks, a, span] {
    const uint64_t seed = g->get_state().seed;
    const uint64_t first = g->reserve(static_cast<uint64_t>(blocks));
    parallel_for(blocks, 4096, [&](int64_t b, int64_t e) {
      const int64_t lo = b * 4, hi = std::min(n, e * 4);
      detail::philox_uniform_floats(out + lo, hi - lo, seed, first + static_cast<uint64_t>(b), a, span);
    });
  });
}

inline double u01_53(uint32_t hi, uint32_t lo) {
  const uint64_t bits = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}
inline float u01_24(uint32_t w) { return static_cast<float>(w >> 8) * (1.0f / 16777216.0f); }

// Writes the random values into a contiguous tensor of `dt`, generating in float/double first.
template <typename Gen>
void random_into(Tensor& t, Gen&& gen_float_or_double) {
  if (t.dtype() == kFloat64 || t.dtype() == kFloat32) {
    gen_float_or_double(t);
    return;
  }
  Tensor tmp = empty(t.sizes(), kFloat32);
  gen_float_or_double(tmp);
  t.copy_(tmp);
}

void uniform_fill(Tensor& t, double from, double to, Generator* gen) {
  if (t.dtype() == kFloat64) {
    fill_random<double>(t, gen, 2, [=](const std::array<uint32_t, 4>& w, int64_t lane) {
      return from + (to - from) * u01_53(w[2 * lane], w[2 * lane + 1]);
    });
  } else {
    fill_uniform_float(t, gen, static_cast<float>(from), static_cast<float>(to - from));
  }
}

void normal_fill(Tensor& t, double mean, double std, Generator* gen) {
  // Box-Muller: one pair of uniforms yields two normals.
  if (t.dtype() == kFloat64) {
    fill_random<double>(t, gen, 2, [=](const std::array<uint32_t, 4>& w, int64_t lane) {
      const double u1 = 1.0 - u01_53(w[0], w[1]);  // (0, 1]: log is finite
      const double u2 = u01_53(w[2], w[3]);
      const double r = std::sqrt(-2.0 * std::log(u1));
      const double th = 2.0 * std::numbers::pi * u2;
      return mean + std * r * (lane == 0 ? std::cos(th) : std::sin(th));
    });
  } else {
    fill_random<float>(t, gen, 4, [=](const std::array<uint32_t, 4>& w, int64_t lane) {
      const int64_t pair = lane / 2;
      const double u1 = 1.0 - static_cast<double>(u01_24(w[2 * pair]));
      const double u2 = static_cast<double>(u01_24(w[2 * pair + 1]));
      const double r = std::sqrt(-2.0 * std::log(u1));
      const double th = 2.0 * std::numbers::pi * u2;
      return static_cast<float>(mean + std * r * ((lane & 1) == 0 ? std::cos(th) : std::sin(th)));
    });
  }
}

Tensor empty_for(IntArrayRef sizes, const TensorOptions& options, const char* op) {
  check_sizes(sizes, op);
  return make_tensor(sizes, contiguous_strides(sizes), shape_numel(sizes), options);
}

}  // namespace

Tensor empty(IntArrayRef sizes, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("empty", {});
  memory::note_call_site(loc.file_name(), loc.line());
  return empty_for(sizes, options, "empty");
}

Tensor empty_strided(IntArrayRef sizes, IntArrayRef strides, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("empty_strided", {});
  memory::note_call_site(loc.file_name(), loc.line());
  check_sizes(sizes, "empty_strided");
  return make_tensor(sizes, strides, strided_extent(sizes, strides, "empty_strided"), options);
}

// The factories below fill a new tensor that may already require grad (a
// leaf): the fill is its initial value, not an in-place op autograd sees.
Tensor zeros(IntArrayRef sizes, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("zeros", {});
  memory::note_call_site(loc.file_name(), loc.line());
  Tensor t = empty_for(sizes, options, "zeros");
  NoGradGuard no_grad;
  t.zero_();
  return t;
}

Tensor ones(IntArrayRef sizes, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("ones", {});
  memory::note_call_site(loc.file_name(), loc.line());
  Tensor t = empty_for(sizes, options, "ones");
  NoGradGuard no_grad;
  t.fill_(1);
  return t;
}

Tensor full(IntArrayRef sizes, const Scalar& value, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("full", {});
  memory::note_call_site(loc.file_name(), loc.line());
  if (!options.dtype_opt()) options = options.dtype(value.natural_dtype());
  ops::check_scalar_fits(value, options.dtype_or_default(), "full");
  Tensor t = empty_for(sizes, options, "full");
  NoGradGuard no_grad;
  t.fill_(value);
  return t;
}

Tensor scalar_tensor(const Scalar& value, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("scalar_tensor", {});
  memory::note_call_site(loc.file_name(), loc.line());
  return full({}, value, options);
}

namespace {
TensorOptions like_options(const Tensor& t, const std::optional<TensorOptions>& o) {
  if (o) return o->dtype_opt() ? *o : o->dtype(t.dtype());
  return TensorOptions(t.dtype());
}
}  // namespace

Tensor empty_like(const Tensor& t, std::optional<TensorOptions> o, std::source_location loc) {
  ops::OpScope rs("empty_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return empty(t.sizes(), like_options(t, o));
}
Tensor zeros_like(const Tensor& t, std::optional<TensorOptions> o, std::source_location loc) {
  ops::OpScope rs("zeros_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return zeros(t.sizes(), like_options(t, o));
}
Tensor ones_like(const Tensor& t, std::optional<TensorOptions> o, std::source_location loc) {
  ops::OpScope rs("ones_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return ones(t.sizes(), like_options(t, o));
}
Tensor full_like(const Tensor& t, const Scalar& v, std::optional<TensorOptions> o, std::source_location loc) {
  ops::OpScope rs("full_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return full(t.sizes(), v, like_options(t, o));
}
Tensor rand_like(const Tensor& t, Generator* gen, std::source_location loc) {
  ops::OpScope rs("rand_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return rand(t.sizes(), t.dtype(), gen);
}
Tensor randn_like(const Tensor& t, Generator* gen, std::source_location loc) {
  ops::OpScope rs("randn_like", {&t});
  memory::note_call_site(loc.file_name(), loc.line());
  return randn(t.sizes(), t.dtype(), gen);
}

Tensor arange(const Scalar& end, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("arange", {});
  memory::note_call_site(loc.file_name(), loc.line());
  return arange(0, end, 1, options);
}

// Note [arange and linspace follow ATen 1.13's CPU kernels]
// PyTorch converts start/end/step to the output's accumulate type first
// (int64 for integer outputs, float for bfloat16/float16, double otherwise),
// so arange(0.5, 3.2, 0.7, dtype=int32) has step 0 and fails, and
// arange(1.5, dtype=int64) has one element while int32 gets two (its size
// comes from the unconverted doubles). linspace computes in the output type
// itself (float arithmetic for float32, rounding every step for bfloat16),
// counting up from start for the first half and down from end for the rest.
// We follow the scalar path of those kernels.
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step, TensorOptions options,
              std::source_location loc) {
  ops::OpScope rs("arange", {});
  memory::note_call_site(loc.file_name(), loc.line());
  const bool all_int = !start.is_floating_point() && !end.is_floating_point() && !step.is_floating_point();
  if (!options.dtype_opt()) options = options.dtype(all_int ? kInt64 : default_dtype());
  const DType dt = options.dtype_or_default();
  KILN_CHECK(dt != kBool, DTypeError, "arange: dtype bool is not supported (as in PyTorch); use arange(...).to(kBool)");
  Tensor out;
  visit_dtype(dt, [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using Acc =
          std::conditional_t<std::is_integral_v<T>, int64_t, std::conditional_t<is_reduced_float_v<T>, float, double>>;
      if constexpr (std::is_integral_v<T>) {  // NaN, inf or > 2^63 would make the conversion undefined
        for (const Scalar* v : {&start, &end, &step}) ops::check_scalar_fits(*v, kInt64, "arange");
      }
      const Acc xs = start.to<Acc>(), xe = end.to<Acc>(), xst = step.to<Acc>();
      KILN_CHECK(xst > 0 || xst < 0, ValueError, "arange: step must be nonzero (got step=", step.to_double(),
                 ", which is 0 as ", dtype_name(dt), ")");
      KILN_CHECK(std::isfinite(static_cast<double>(xs)) && std::isfinite(static_cast<double>(xe)), ValueError,
                 "arange: unsupported range ", static_cast<double>(xs), " -> ", static_cast<double>(xe));
      KILN_CHECK((xst > 0 && xe >= xs) || (xst < 0 && xe <= xs), ValueError,
                 "arange: upper bound and larger bound inconsistent with step sign: start=", start.to_double(),
                 ", end=", end.to_double(), ", step=", step.to_double());
      double size_d;
      if constexpr (std::is_same_v<T, int64_t>) {
        const __int128 sgn = xst > 0 ? 1 : -1;
        size_d = static_cast<double>((static_cast<__int128>(xe) - xs + xst - sgn) / xst);
      } else {
        size_d = std::ceil((end.to_double() - start.to_double()) / step.to_double());
      }
      KILN_CHECK(size_d >= 0 && size_d <= 9.2e18, ValueError, "arange: invalid size ", size_d,
                 " (possible overflow) for start=", start.to_double(), ", end=", end.to_double(),
                 ", step=", step.to_double());
      const int64_t n = static_cast<int64_t>(size_d);
      out = empty_for({n}, options, "arange");
      capture::host_write("arange", [p = out.data_ptr<T>(), n, xs, xst]() {
        for (int64_t i = 0; i < n; ++i) {
          if constexpr (std::is_integral_v<T>) {
            // Wrapping (unsigned) arithmetic: a huge range into int32 wraps as in PyTorch, without UB.
            p[i] = static_cast<T>(static_cast<int64_t>(static_cast<uint64_t>(xs) +
                                                       static_cast<uint64_t>(xst) * static_cast<uint64_t>(i)));
          } else {
            p[i] = T(static_cast<compute_t<T>>(xs + xst * static_cast<Acc>(i)));
          }
        }
      });
    }
  });
  return out;
}

Tensor linspace(const Scalar& start, const Scalar& end, int64_t steps, TensorOptions options,
                std::source_location loc) {
  ops::OpScope rs("linspace", {});
  memory::note_call_site(loc.file_name(), loc.line());
  KILN_CHECK(steps >= 0, ValueError, "linspace: number of steps must be non-negative, got ", steps);
  const DType dt = options.dtype_or_default();
  KILN_CHECK(dt != kBool, DTypeError, "linspace: dtype bool is not supported (as in PyTorch)");
  ops::check_scalar_fits(start, dt, "linspace");
  ops::check_scalar_fits(end, dt, "linspace");
  Tensor t = empty_for({steps}, options, "linspace");
  if (steps == 0) return t;
  if (steps == 1) {
    NoGradGuard no_grad;
    return t.fill_(start);
  }
  const int64_t half = steps / 2;
  visit_dtype(dt, [&]<typename T>() {
    T* p = t.data_ptr<T>();
    if constexpr (std::is_integral_v<T>) {
      const T s = start.to<T>(), e = end.to<T>();
      const double step = (static_cast<double>(e) - static_cast<double>(s)) / static_cast<double>(steps - 1);
      capture::host_write("linspace", [p, steps, half, s, e, step]() {
        for (int64_t i = 0; i < steps; ++i) {
          const double v = i < half ? s + step * static_cast<double>(i) : e - step * static_cast<double>(steps - i - 1);
          p[i] = static_cast<T>(v);
        }
      });
    } else {
      // Arithmetic in T: float for float32, double for float64, rounded after every operation for 16-bit floats.
      using C = compute_t<T>;
      auto r = [](C x) -> C { return static_cast<C>(T(x)); };
      const C s = r(start.to<C>()), e = r(end.to<C>());
      const C step = r(r(e - s) / r(static_cast<C>(steps - 1)));
      capture::host_write("linspace", [p, steps, half, s, e, step, r]() {
        for (int64_t i = 0; i < steps; ++i) {
          const C v =
              i < half ? r(s + r(step * r(static_cast<C>(i)))) : r(e - r(step * r(static_cast<C>(steps - i - 1))));
          p[i] = T(v);
        }
      });
    }
  });
  return t;
}

Tensor eye(int64_t n, std::optional<int64_t> m, TensorOptions options, std::source_location loc) {
  ops::OpScope rs("eye", {});
  memory::note_call_site(loc.file_name(), loc.line());
  const int64_t cols = m.value_or(n);
  KILN_CHECK(n >= 0, ValueError, "eye: n must be greater or equal to 0, got ", n);
  KILN_CHECK(cols >= 0, ValueError, "eye: m must be greater or equal to 0, got ", cols);
  Tensor t = empty_for({n, cols}, options, "eye");
  {
    NoGradGuard no_grad;
    t.zero_();
  }
  visit_dtype(t.dtype(), [&]<typename T>() {
    capture::host_write("eye", [p = t.data_ptr<T>(), n, cols]() {
      for (int64_t i = 0; i < std::min(n, cols); ++i) p[i * cols + i] = T(1);
    });
  });
  return t;
}

Tensor& uniform_(Tensor& t, double from, double to, Generator* gen) {
  ops::OpScope rs("uniform_", {&t});
  KILN_CHECK(t.is_floating_point(), DTypeError, "uniform_: expected a floating-point tensor, got ",
             dtype_name(t.dtype()));
  KILN_CHECK(from <= to, ValueError, "uniform_: expected from <= to, got from=", from, ", to=", to);
  if (t.is_contiguous()) {
    random_into(t, [&](Tensor& x) { uniform_fill(x, from, to, gen); });
  } else {
    Tensor tmp = empty(t.sizes(), t.dtype());
    random_into(tmp, [&](Tensor& x) { uniform_fill(x, from, to, gen); });
    t.copy_(tmp);
  }
  t.bump_version();
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  ops::OpScope rs("normal_", {&t});
  KILN_CHECK(t.is_floating_point(), DTypeError, "normal_: expected a floating-point tensor, got ",
             dtype_name(t.dtype()));
  KILN_CHECK(std >= 0, ValueError, "normal_: expected std >= 0, got ", std);
  if (t.is_contiguous()) {
    random_into(t, [&](Tensor& x) { normal_fill(x, mean, std, gen); });
  } else {
    Tensor tmp = empty(t.sizes(), t.dtype());
    random_into(tmp, [&](Tensor& x) { normal_fill(x, mean, std, gen); });
    t.copy_(tmp);
  }
  t.bump_version();
  return t;
}

Tensor rand(IntArrayRef sizes, TensorOptions options, Generator* gen, std::source_location loc) {
  ops::OpScope rs("rand", {});
  memory::note_call_site(loc.file_name(), loc.line());
  Tensor t = empty(sizes, options.requires_grad(false));
  uniform_(t, 0.0, 1.0, gen);
  if (options.requires_grad()) t.impl()->set_requires_grad_flag(true);
  return t;
}

Tensor randn(IntArrayRef sizes, TensorOptions options, Generator* gen, std::source_location loc) {
  ops::OpScope rs("randn", {});
  memory::note_call_site(loc.file_name(), loc.line());
  Tensor t = empty(sizes, options.requires_grad(false));
  normal_(t, 0.0, 1.0, gen);
  if (options.requires_grad()) t.impl()->set_requires_grad_flag(true);
  return t;
}

Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, TensorOptions options, Generator* gen,
               std::source_location loc) {
  ops::OpScope rs("randint", {});
  memory::note_call_site(loc.file_name(), loc.line());
  KILN_CHECK(low < high, ValueError, "randint: expected low < high, got low=", low, ", high=", high);
  if (!options.dtype_opt()) options = options.dtype(kInt64);
  Tensor idx = empty(sizes, kInt64);
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);  // no signed overflow
  fill_random<int64_t>(idx, gen, 2, [=](const std::array<uint32_t, 4>& w, int64_t lane) {
    const uint64_t r = (static_cast<uint64_t>(w[2 * lane]) << 32) | w[2 * lane + 1];
    return static_cast<int64_t>(static_cast<uint64_t>(low) + r % range);
  });
  return options.dtype_or_default() == kInt64 ? idx : idx.to(options.dtype_or_default());
}

Tensor randperm(int64_t n, Generator* gen, std::source_location loc) {
  ops::OpScope rs("randperm", {});
  memory::note_call_site(loc.file_name(), loc.line());
  KILN_CHECK(n >= 0, ValueError, "randperm: expected n >= 0, got ", n);
  Tensor t = arange(n);
  // Replayed as fill_random's fills are; arange's own record restores 0..n-1 before it.
  capture::host_write("randperm", [p = t.data_ptr<int64_t>(), g = &gen_or_default(gen), n] {
    const uint64_t seed = g->get_state().seed;
    const uint64_t first = g->reserve(static_cast<uint64_t>(n));
    for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates, one block per swap
      const auto w = philox4x32(seed, 0, first + static_cast<uint64_t>(i));
      const uint64_t r = (static_cast<uint64_t>(w[0]) << 32) | w[1];
      std::swap(p[i], p[static_cast<int64_t>(r % static_cast<uint64_t>(i + 1))]);
    }
  });
  return t;
}

template <typename T>
Tensor tensor(const std::vector<T>& values, IntArrayRef sizes, std::source_location loc) {
  ops::OpScope rs("tensor", {});
  memory::note_call_site(loc.file_name(), loc.line());
  DimVector shape = sizes.empty() ? DimVector{static_cast<int64_t>(values.size())} : DimVector(sizes);
  KILN_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), ShapeError, "tensor: shape ", shape, " holds ",
             shape_numel(shape), " elements but ", values.size(), " values were given");
  // Plain int literals give int64, as torch.tensor([1, 2]) does in Python.
  using Stored = std::conditional_t<std::is_same_v<T, int>, int64_t, T>;
  Tensor t = empty(shape, dtype_of_v<Stored>);
  auto write = [p = t.data_ptr<Stored>()](const std::vector<T>& vals) {
    for (size_t i = 0; i < vals.size(); ++i) p[i] = static_cast<Stored>(vals[i]);
  };
  // The values are copied into the record only while a capture records.
  const capture::KernelScope cap("tensor", capture::kDeferrable);
  if (cap.recording() && cap.record([write, vals = values]() { write(vals); })) return t;
  write(values);
  return t;
}

template Tensor tensor<float>(const std::vector<float>&, IntArrayRef, std::source_location);
template Tensor tensor<double>(const std::vector<double>&, IntArrayRef, std::source_location);
template Tensor tensor<int64_t>(const std::vector<int64_t>&, IntArrayRef, std::source_location);
template Tensor tensor<int>(const std::vector<int>&, IntArrayRef, std::source_location);
template Tensor tensor<uint8_t>(const std::vector<uint8_t>&, IntArrayRef, std::source_location);
template Tensor tensor<bool>(const std::vector<bool>&, IntArrayRef, std::source_location);
template Tensor tensor<BFloat16>(const std::vector<BFloat16>&, IntArrayRef, std::source_location);
template Tensor tensor<Half>(const std::vector<Half>&, IntArrayRef, std::source_location);

Tensor from_blob(void* data, IntArrayRef sizes, DType dtype, std::function<void(void*)> deleter) {
  return from_blob(data, sizes, contiguous_strides(sizes), dtype, std::move(deleter));
}

Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides, DType dtype, std::function<void(void*)> deleter) {
  check_sizes(sizes, "from_blob");
  KILN_CHECK(data != nullptr || shape_numel(sizes) == 0, ValueError, "from_blob: data is null");
  const int64_t extent = strided_extent(sizes, strides, "from_blob");
  auto storage =
      make_intrusive<StorageImpl>(data, static_cast<size_t>(extent * element_size(dtype)), std::move(deleter));
  return Tensor(make_intrusive<TensorImpl>(std::move(storage), dtype, sizes, strides, 0));
}

}  // namespace kiln
