// Single-pass reductions: sum, mean, prod, amax/amin, all/any.
#include "kiln/kernels/reduce.h"

#include <cstring>

#include "kiln/core/capture.h"
#include "kiln/core/capture_loop.h"
#include "reduce_engine.h"

namespace kiln::kernels {

using namespace detail;

namespace {

template <typename T, typename A = sum_acc_t<T>>
struct ProdOp {
  using in_t = T;
  using acc_t = A;
  A identity() const { return A(1); }
  A map(T x, A) const { return static_cast<A>(x); }
  A combine(A a, A b) const { return mul_wrap(a, b); }
};

template <typename T, bool IsAll>
struct AllAnyOp {
  using in_t = T;
  using acc_t = uint8_t;
  uint8_t identity() const { return IsAll ? 1 : 0; }
  uint8_t map(T x, uint8_t) const { return static_cast<compute_t<T>>(x) != compute_t<T>(0) ? 1 : 0; }
  uint8_t combine(uint8_t a, uint8_t b) const { return IsAll ? (a & b) : (a | b); }
};

// While recording: describes a reduction of a whole contiguous array to one value, as
// run_rows computes it (pieces of kReducePiece, then the tree over them), so that
// kiln::compile can fuse it after the elementwise loops that produce the array.
template <typename Op, typename Store>
void note_whole(const ReduceLayout& l, const Op& op, Store store) {
  using T = typename Op::in_t;
  using A = typename Op::acc_t;
  constexpr int64_t es = sizeof(T);
  if (l.out_ndim != 0 || l.red_ndim != 1 || l.red_strides[0] != es || l.red_sizes[0] < 1) return;
  capture::Reduction r;
  r.in = l.in;
  r.numel = l.red_sizes[0];
  r.elem_size = static_cast<int>(es);
  r.piece = kReducePiece;
  r.acc_size = static_cast<int>(sizeof(A));
  r.reduce_piece = [op](const char* p, int64_t n, void* acc) {
    const A a = piece_value(op, p, n, es, A(0));
    std::memcpy(acc, &a, sizeof(A));
  };
  r.finish = [op, store](const void* accs, int64_t pieces) {
    const auto* a = static_cast<const A*>(accs);
    store(0, tree<A>(
                 0, pieces, [&](int64_t q) { return a[q]; }, [&](A x, A y) { return op.combine(x, y); }));
  };
  capture::note_reduction(std::move(r));
}

// Writes acc to out[o] as O; out is `in` (the common case) or int64 (integral sums).
// `run` false: a deferring recorder holds the kernel, which only describes itself.
template <typename T, typename Op>
void reduce_store(const ReduceLayout& l, const Op& op, DType in, DType out, const char* name, bool note, bool run) {
  using A = typename Op::acc_t;
  auto go = [&]<typename O>() {
    O* dst = reinterpret_cast<O*>(l.out);
    const auto store = [dst](int64_t o, A a) { dst[o] = static_cast<O>(a); };
    if (note) note_whole(l, op, store);
    if (run) run_reduce(l, op, nullptr, store);
  };
  if (out == in) {
    go.template operator()<T>();
  } else {
    KILN_ASSERT(out == kInt64, name, ": unsupported output dtype ", dtype_name(out), " for input ", dtype_name(in));
    go.template operator()<int64_t>();
  }
}

}  // namespace

void sum(const ReduceLayout& l, DType in, DType out) {
  const capture::KernelScope cap("sum", capture::kDeferrable);
  const bool note = cap.recording();
  const bool run = !(note && cap.record([=] { sum(l, in, out); }));
  visit_dtype(in, [&]<typename T>() { reduce_store<T>(l, SumOp<T>{}, in, out, "sum", note, run); });
}

void prod(const ReduceLayout& l, DType in, DType out) {
  const capture::KernelScope cap("prod", capture::kDeferrable);
  const bool note = cap.recording();
  const bool run = !(note && cap.record([=] { prod(l, in, out); }));
  visit_dtype(in, [&]<typename T>() { reduce_store<T>(l, ProdOp<T>{}, in, out, "prod", note, run); });
}

void mean(const ReduceLayout& l, DType dt) {
  const capture::KernelScope cap("mean", capture::kDeferrable);
  const bool note = cap.recording();
  const bool run = !(note && cap.record([=] { mean(l, dt); }));
  visit_dtype<kFloatingTypes>(dt, "mean", [&]<typename T>() {
    using A = sum_acc_t<T>;
    const A count = static_cast<A>(l.reduce_numel());
    T* dst = reinterpret_cast<T*>(l.out);
    // Divide in the accumulator type, then round once (16-bit sums never overflow early).
    const auto store = [dst, count](int64_t o, A a) { dst[o] = static_cast<T>(a / count); };
    if (note) note_whole(l, SumOp<T>{}, store);
    if (run) run_reduce(l, SumOp<T>{}, nullptr, store);
  });
}

void amax_amin(const ReduceLayout& l, DType dt, bool is_max) {
  const capture::KernelScope cap("amax_amin", capture::kDeferrable);
  const bool note = cap.recording();
  const bool run = !(note && cap.record([=] { amax_amin(l, dt, is_max); }));
  visit_dtype(dt, [&]<typename T>() {
    if (is_max)
      reduce_store<T>(l, MaxOp<T, true>{}, dt, dt, "amax", note, run);
    else
      reduce_store<T>(l, MaxOp<T, false>{}, dt, dt, "amin", note, run);
  });
}

void all_any(const ReduceLayout& l, DType in, DType out, bool is_all) {
  KILN_CAPTURE_KERNEL("all_any", all_any(l, in, out, is_all));
  KILN_ASSERT(out == kBool || out == kUInt8, "all/any: output must be bool or uint8, got ", dtype_name(out));
  visit_dtype(in, [&]<typename T>() {
    auto go = [&]<bool IsAll>() {
      if (out == kBool) {
        bool* dst = reinterpret_cast<bool*>(l.out);
        run_reduce(l, AllAnyOp<T, IsAll>{}, nullptr, [dst](int64_t o, uint8_t a) { dst[o] = a != 0; });
      } else {
        uint8_t* dst = reinterpret_cast<uint8_t*>(l.out);
        run_reduce(l, AllAnyOp<T, IsAll>{}, nullptr, [dst](int64_t o, uint8_t a) { dst[o] = a; });
      }
    };
    if (is_all)
      go.template operator()<true>();
    else
      go.template operator()<false>();
  });
}

}  // namespace kiln::kernels
