// kernels::matmul: oneDNN's matmul primitive for float32/bfloat16 (strided
// operands are passed as strided memory descriptors, so a transposed operand
// such as linear's Wᵀ is read in place), BLAS or loops for the rest.
#include <omp.h>

#include <cstring>
#include <thread>
#include <type_traits>

#include "dnnl_common.h"
#include "gelu_rows.h"
#include "kiln/core/capture.h"
#include "kiln/core/parallel.h"
#include "kiln/core/threads.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"
#include "small_gemm.h"
#include "transpose_copy.h"

namespace kiln::kernels {

namespace {

using namespace dnnl_detail;
using dims = dnnl::memory::dims;

struct MatmulEntry {
  dnnl::matmul prim;
  dnnl::memory src, wei, bias, dst, scratch, addend;
  size_t scratch_bytes = 0;
};

PrimCache<MatmulEntry>& cache() {
  thread_local PrimCache<MatmulEntry> c;
  static const bool registered = (register_clear([] { cache().clear(); }), true);
  (void)registered;
  return c;
}

// A matrix operand as oneDNN sees it: [rows, cols] (2-D) or [1 | batch, rows,
// cols] (3-D; batch 1 when the operand is broadcast over the batch).
// With two batch dims (MatmulArgs::outer > 1) it is 4-D, [1 | outer, 1 | batch, rows, cols].
struct OperandLayout {
  BlasLayout l;
  int64_t batch = 0;  // 0: 2-D descriptor
  int64_t batch_stride = 0;
  int64_t outer = 0;  // 0: no outer dim
  int64_t outer_stride = 0;
};

dnnl::memory::desc matrix_md(dnnl::memory::data_type t, int64_t rows, int64_t cols, const OperandLayout& o) {
  const dims st2 = o.l.trans ? dims{1, o.l.ld} : dims{o.l.ld, 1};
  if (o.batch == 0) return {{rows, cols}, t, st2};
  const int64_t matrix = o.l.ld * (o.l.trans ? cols : rows);  // a stride covering one matrix
  const int64_t bs = o.batch == 1 ? matrix : o.batch_stride;  // any stride will do for a broadcast dim
  if (o.outer == 0) return {{o.batch, rows, cols}, t, {bs, st2[0], st2[1]}};
  const int64_t os = o.outer == 1 ? matrix * o.batch : o.outer_stride;
  return {{o.outer, o.batch, rows, cols}, t, {os, bs, st2[0], st2[1]}};
}

OperandLayout operand_layout(const MatrixOperand& op, const MatmulArgs& g, int64_t rows, int64_t cols) {
  OperandLayout o;
  o.l = blas_layout(rows, cols, op.stride[1], op.stride[2]);
  KILN_ASSERT(o.l.ok, "matmul: operand without a unit stride reached the kernel");
  if (g.batch > 1 || g.outer > 1) {
    o.batch = op.stride[0] == 0 ? 1 : g.batch;
    o.batch_stride = op.stride[0];
  }
  if (g.outer > 1) {
    o.outer = op.outer_stride == 0 ? 1 : g.outer;
    o.outer_stride = op.outer_stride;
  }
  return o;
}

// c's descriptor: [m, n], [batch, m, n] or [outer, batch, m, n], as g says.
dnnl::memory::desc c_desc(const MatmulArgs& g) {
  const auto t = to_dnnl(g.dtype);
  if (g.outer > 1) return {{g.outer, g.batch, g.m, g.n}, t, dims{g.c_outer(), g.c_batch_stride(), g.c_row_stride(), 1}};
  if (g.batch > 1) return {{g.batch, g.m, g.n}, t, dims{g.c_batch_stride(), g.c_row_stride(), 1}};
  return {{g.m, g.n}, t, dims{g.c_row_stride(), 1}};
}

Key matmul_key(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb, bool packed,
               bool float_c = false) {
  Key key(PrimKind::Matmul);
  key.add_all(g.dtype, g.outer, g.batch, g.m, g.n, g.k, g.bias != nullptr, max_threads(), static_cast<int>(g.epilogue),
              packed, g.addend != nullptr, float_c || g.float_c);
  key.add_all(la.l.trans, la.l.ld, la.batch, la.batch_stride, lb.l.trans, lb.l.ld, lb.batch, lb.batch_stride);
  key.add_all(la.outer, la.outer_stride, lb.outer, lb.outer_stride);
  key.add_all(g.c_batch_stride(), g.c_row_stride(), g.c_outer());
  return key;
}

// The [m, n] addend's descriptor (contiguous, batch 1).
dnnl::memory::desc addend_md(const MatmulArgs& g) { return {{g.m, g.n}, to_dnnl(g.dtype), dims{g.n, 1}}; }

// Note [GELU after the product]
// A float32 product with GELU (tanh) runs plain and then kiln's GELU rows
// over its output, still in cache: oneDNN's gelu_tanh post-op cost gpt_infer's
// c_fc 49 µs over the product against 33 µs for a whole separate GELU pass
// (bench/micro BM_InferPart, 1 thread). It also makes linear_gelu's bits
// those of linear followed by gelu. bfloat16 keeps the post-op: it applies
// GELU before the one rounding to bf16. The inference runtime's fused linear
// (dnnl_fused_inference.cpp) does the same, so an optimised gpt's MLP has the
// eager model's bits.
bool gelu_after(const MatmulArgs& g) {
#ifdef KILN_GELU_ROWS
  return g.epilogue == MatmulEpilogue::GeluTanh && g.dtype == DType::Float32 && !g.addend;
#else
  (void)g;
  return false;
#endif
}

// Whether the primitive applies the epilogue as an eltwise post-op.
bool eltwise_post_op(const MatmulArgs& g) { return g.epilogue != MatmulEpilogue::None && !gelu_after(g); }

void apply_gelu_after(const MatmulArgs& g) {
#ifdef KILN_GELU_ROWS
  for (int64_t o = 0; o < g.outer; ++o)
    for (int64_t bi = 0; bi < g.batch; ++bi)
      vm::gelu_tanh_rows_in_place(static_cast<float*>(g.c) + o * g.c_outer() + bi * g.c_batch_stride(), g.m, g.n,
                                  g.c_row_stride());
#else
  (void)g;
#endif
}

// Post-ops in order: the epilogue's eltwise, then the addend's binary add.
dnnl::primitive_attr matmul_attr(const MatmulArgs& g) {
  dnnl::primitive_attr attr = default_attr();
  dnnl::post_ops po;
  if (eltwise_post_op(g)) {
    po.append_eltwise(
        1.0f,
        g.epilogue == MatmulEpilogue::GeluTanh ? dnnl::algorithm::eltwise_gelu_tanh : dnnl::algorithm::eltwise_gelu_erf,
        0.0f, 0.0f);
  }
  if (g.addend) {
    KILN_ASSERT(g.batch == 1 && g.outer == 1, "kernels::matmul: an addend needs batch 1");
    po.append_binary(dnnl::algorithm::binary_add, addend_md(g));
  }
  if (po.len() > 0) attr.set_post_ops(po);
  return attr;
}

// Runs a matmul primitive with whichever of bias and addend g has; b is read
// through `wei` (the plain or the packed descriptor).
void run_matmul_prim(const dnnl::matmul& prim, const MatmulArgs& g, const dnnl::memory& src, const dnnl::memory& wei,
                     const void* b, const dnnl::memory& bias, const dnnl::memory& addend, const dnnl::memory& dst,
                     const dnnl::memory& scratch, size_t scratch_bytes) {
  ScratchBlock block(scratch_bytes);
  const int addend_index = eltwise_post_op(g) ? 1 : 0;
  const Arg a_src{DNNL_ARG_SRC, &src, g.a.data}, a_wei{DNNL_ARG_WEIGHTS, &wei, b}, a_dst{DNNL_ARG_DST, &dst, g.c},
      a_scr{DNNL_ARG_SCRATCHPAD, &scratch, block.data()}, a_bias{DNNL_ARG_BIAS, &bias, g.bias},
      a_add{DNNL_ARG_ATTR_MULTIPLE_POST_OP(addend_index) | DNNL_ARG_SRC_1, &addend, g.addend};
  if (g.bias && g.addend)
    execute(prim, {a_src, a_wei, a_bias, a_add, a_dst, a_scr});
  else if (g.bias)
    execute(prim, {a_src, a_wei, a_bias, a_dst, a_scr});
  else if (g.addend)
    execute(prim, {a_src, a_wei, a_add, a_dst, a_scr});
  else
    execute(prim, {a_src, a_wei, a_dst, a_scr});
  if (gelu_after(g)) apply_gelu_after(g);
}

// The primitive for g with b described by b_md (its plain strides, or
// format any for a packed b).
dnnl::matmul::primitive_desc matmul_pd(const MatmulArgs& g, const dnnl::memory::desc& a_md,
                                       const dnnl::memory::desc& b_md, const dnnl::memory::desc& c_md) {
  const auto t = to_dnnl(g.dtype);
  if (!g.bias) return {dnnl::matmul::desc(a_md, b_md, c_md), matmul_attr(g), engine()};
  const dnnl::memory::desc bias_md = g.outer > 1   ? dnnl::memory::desc({1, 1, 1, g.n}, t, dims{g.n, g.n, g.n, 1})
                                     : g.batch > 1 ? dnnl::memory::desc({1, 1, g.n}, t, dims{g.n, g.n, 1})
                                                   : dnnl::memory::desc({1, g.n}, t, dims{g.n, 1});
  return {dnnl::matmul::desc(a_md, b_md, bias_md, c_md), matmul_attr(g), engine()};
}

// float_c: c is float32 whatever a and b are (a bfloat16 product's partial
// sums); g.float_c asks the same.
MatmulEntry* get_entry(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb, bool float_c = false) {
  float_c = float_c || g.float_c;
  const Key key = matmul_key(g, la, lb, false, float_c);
  auto& c = cache();
  if (MatmulEntry* e = c.find(key)) return e;

  const auto t = to_dnnl(g.dtype);
  const dnnl::memory::desc a_md = matrix_md(t, g.m, g.k, la);
  const dnnl::memory::desc b_md = matrix_md(t, g.k, g.n, lb);
  const dnnl::memory::desc c_md =
      float_c ? dnnl::memory::desc({g.m, g.n}, dnnl::memory::data_type::f32, dims{g.c_row_stride(), 1}) : c_desc(g);
  auto e = std::make_unique<MatmulEntry>();
  try {
    const dnnl::matmul::primitive_desc pd = matmul_pd(g, a_md, b_md, c_md);
    if (g.bias) e->bias = make_memory(pd.bias_desc());
    if (g.addend) e->addend = make_memory(addend_md(g));
    e->prim = dnnl::matmul(pd);
    e->src = make_memory(a_md);
    e->wei = make_memory(b_md);
    e->dst = make_memory(c_md);
    e->scratch_bytes = pd.scratchpad_desc().get_size();
    e->scratch = make_memory(pd.scratchpad_desc());
  } catch (const dnnl::error& err) {
    rethrow(err, "matmul");
  }
  note_created();
  return c.insert(key, std::move(e));
}

// Note [Transposed first operands]
// A weight gradient dW = dYᵀ X reads its first operand transposed, along a
// depth of every token (2048 in gpt). On two threads oneDNN 2.6 ran gpt's
// c_proj weight gradient (256 x 1024 over 2048 tokens) at 250-290 GFLOP/s in
// float32 against 320-370 with a stored row by row (`BM_MlpProduct`,
// 2026-12-06); the likely cause, not confirmed here, is that both threads
// re-block the same rows of a transposed a for their share of the columns. One turned copy of a (transpose_copy.h), m k
// elements read and written once against the product's m n k multiply-adds,
// pays for itself there. It does not on one thread, nor for c_fc's gradient
// (1024 x 256: n = 256 columns share each row of a), where the copy cost
// more than it saved in both dtypes. So a 2-D product on more than one thread
// whose a is transposed, deep (k >= 1024) and wide (n >= 1024) copies a first.
// The result can differ in its last bits from what the transposed-operand
// kernel gives (another kernel, another order of partial sums): gpt's loss at
// 2 threads moves in the 7th digit after 14 float32 steps, and sooner in bf16.
// DESIGN.md's determinism is per thread count, and that holds.
bool copy_a_first(const MatmulArgs& g, const OperandLayout& la) {
  return la.l.trans && la.batch == 0 && la.outer == 0 && g.k >= 1024 && g.n >= 1024 && get_num_threads() > 1;
}

// Note [Packing b first on two threads]
// Given b as a plain or transposed matrix, oneDNN 2.6's kernels re-block it
// into their own layout as they go. On two threads, for gpt's wide products
// (n = 768 or 1024 columns over 2048 rows), that ran slower than packing b once
// into oneDNN's layout (one jit reorder, Note [Packed weights] in
// kiln/kernels/dnnl.h) and running the product on the packed b, the packing
// counted (`BM_PackBFirst`, 2026-12-06, modes 0 against 2 before this rule):
// bf16 6-22 %, float32 3-10 %. Narrow products (n = 256) lost as often as they
// gained, and one thread gained nothing or lost, so only wide products with
// many rows on more than one thread take it. In gpt's step at 2 threads (three
// interleaved pairs, float32) the c_attn and c_fc forward products and c_proj's
// input gradient went 11.0-12.1 -> 9.6-10.0, 14.4-16.0 -> 12.6-13.3 and
// 14.3-16.4 -> 12.1-12.4 ms per step (four layers each); the bits did not move
// (gpt's losses over 14 steps, both dtypes).
bool pack_b_first(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb) {
  return !g.float_c && la.batch == 0 && la.outer == 0 && lb.batch == 0 && g.m >= 1024 && g.n >= 768 &&
         get_num_threads() > 1;
}

// Note [Shares of a product on one thread each]
// In gpt's step on two threads the op before a product (GELU, layer norm, the
// attention rows, the elementwise loops) splits its rows by halves, so the
// first half of the tokens is in one core's cache and the second half in the
// other's, while oneDNN 2.6 splits the product its own way. Handing each
// thread a share of its own tokens made the products faster (the likely
// cause, not confirmed: fewer reads from the other core's cache). Two rules
// do that, each share run as a one-thread product (each thread's own
// primitive, made and cached under a budget of one thread, as SerialScope's
// are in dnnl_common.h):
// - split_rows: a plain first operand with many rows, on a b that
//   pack_b_first leaves alone (narrower than 768 columns): thread t takes rows [m t/T, m (t+1)/T)
//   of a and c, rounded to 16. A row of c is summed by the same kernel either
//   way, so gpt's losses keep their bits (14 steps, both dtypes). Per gpt step
//   at 2 threads (`--profile table` per shape, six interleaved runs): bf16
//   c_proj forward products 7.46 -> 6.68 and 2.13 -> 1.80 ms, c_fc's input
//   gradient 7.64 -> 6.94; float32 the forward products 13.25 -> 12.53 and
//   3.78 -> 3.33 ms, the input gradients unchanged. A few hundred rows gained
//   nothing (mlp and gpt_infer at 128 rows were slower), so each share has at
//   least 512 rows.
// - split_depth: a bf16 weight gradient dW = dYᵀ X (a transposed, the depth k
//   the tokens) gives thread t the tokens [k t/T, k (t+1)/T), rounded to 32, and
//   its own float32 partial dW; the partials are added in thread order and
//   rounded to bf16 once, as oneDNN rounds its float32 sum once. gpt's bf16
//   weight gradients at 2 threads per step: c_fc 9.26 -> 7.96 ms, c_attn
//   7.53 -> 6.23, attention's c_proj 3.65 -> 2.80, MLP's c_proj 8.16 -> 8.13
//   (against its turned copy, Note [Transposed first operands]), and the casts
//   of these gradients to float32 0.5 ms less. In isolation (`BM_MlpProduct/7-8/2/1`, data
//   in cache) 582-663 -> 646-701 GFLOP/s. float32 weight gradients gained
//   nothing measurable, in the step or in isolation, and keep oneDNN's split.
//   The partial sums change the result's last bits against the one-call
//   product (gpt's bf16 loss after 14 steps at 2 threads 3.64430714 ->
//   3.64610744); DESIGN.md's determinism is per thread count, and the split
//   depends on nothing else.
// Neither rule applies on one thread, inside a parallel region, or to batched
// products. Both were measured on two threads only. Up to four threads they
// still apply (each thread re-blocks b for its share, at most four times);
// more threads keep oneDNN's split: many threads each re-blocking b is
// unmeasured here.
constexpr int kMaxShareThreads = 4;
constexpr int64_t kMinShareRows = 512;
constexpr int64_t kMinShareDepth = 1024;
constexpr int64_t kMaxSplitOutput = int64_t{1} << 20;  // m n of a depth-split product, each thread's partial 4 MB

bool split_rows(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb) {
  const int nt = get_num_threads();
  return nt > 1 && nt <= kMaxShareThreads && !g.float_c && !la.l.trans && la.batch == 0 && la.outer == 0 &&
         lb.batch == 0 && !pack_b_first(g, la, lb) && g.m >= kMinShareRows * nt && !omp_in_parallel();
}

bool split_depth(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb) {
  const int nt = get_num_threads();
  return nt > 1 && nt <= kMaxShareThreads && g.dtype == DType::BFloat16 && la.l.trans && la.batch == 0 &&
         la.outer == 0 && lb.batch == 0 && !g.bias && !g.addend && g.epilogue == MatmulEpilogue::None &&
         g.k >= kMinShareDepth * nt && g.m * g.n >= 65536 && g.m * g.n <= kMaxSplitOutput && !omp_in_parallel();
}

// The start of thread t's share of n items, a multiple of `align` (the last share ends at n).
int64_t share_start(int64_t n, int64_t t, int nt, int64_t align) { return t >= nt ? n : (n * t / nt) / align * align; }

// Runs h as a one-thread product on the calling thread (inside a parallel region).
void run_one_thread(const MatmulArgs& h, bool float_c) {
  const OperandLayout la = operand_layout(h.a, h, h.m, h.k);
  const OperandLayout lb = operand_layout(h.b, h, h.k, h.n);
  MatmulEntry* e = get_entry(h, la, lb, float_c);
  run_matmul_prim(e->prim, h, e->src, e->wei, h.b.data, e->bias, e->addend, e->dst, e->scratch, e->scratch_bytes);
}

// OpenMP's budget for the calling thread at one thread while it lives (inside
// a parallel region, where SerialScope does nothing).
class OneThreadBudget {
 public:
  OneThreadBudget() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThreadBudget() { omp_set_num_threads(saved_); }
  OneThreadBudget(const OneThreadBudget&) = delete;
  OneThreadBudget& operator=(const OneThreadBudget&) = delete;

 private:
  int saved_;
};

// Calls fn(t) once for each thread t, on that thread, with OpenMP's budget at
// one thread, so that the products inside plan for one thread.
template <typename Fn>
void on_each_thread(int nt, Fn&& fn) {
  parallel_for(nt, 1, [&](int64_t b, int64_t e) {
    const OneThreadBudget one;
    for (int64_t t = b; t < e; ++t) fn(t);
  });
}

void split_rows_product(const MatmulArgs& g) {
  const int nt = get_num_threads();
  const int64_t es = element_size(g.dtype);
  on_each_thread(nt, [&](int64_t t) {
    const int64_t r0 = share_start(g.m, t, nt, 16), r1 = share_start(g.m, t + 1, nt, 16);
    MatmulArgs h = g;
    h.m = r1 - r0;
    h.a.data = static_cast<const char*>(g.a.data) + r0 * g.a.stride[1] * es;
    h.c = static_cast<char*>(g.c) + r0 * g.c_row_stride() * es;
    if (g.addend) h.addend = static_cast<const char*>(g.addend) + r0 * g.n * es;
    run_one_thread(h, false);
  });
}

void split_depth_product(const MatmulArgs& g) {
  const int nt = get_num_threads();
  const int64_t es = element_size(g.dtype);
  const int64_t mn = g.m * g.n;
  ScratchBlock parts(static_cast<size_t>(nt * mn) * sizeof(float));
  float* part0 = reinterpret_cast<float*>(parts.data());
  on_each_thread(nt, [&](int64_t t) {
    const int64_t k0 = share_start(g.k, t, nt, 32), k1 = share_start(g.k, t + 1, nt, 32);
    MatmulArgs h = g;
    h.k = k1 - k0;
    h.a.data = static_cast<const char*>(g.a.data) + k0 * g.a.stride[2] * es;
    h.b.data = static_cast<const char*>(g.b.data) + k0 * g.b.stride[1] * es;
    h.c = part0 + t * mn;
    h.c_stride[1] = g.n;
    run_one_thread(h, true);
  });
  // The later partials are added into the first, row by row, then rounded
  // once (or stored as they are for a float32 c).
  parallel_for(g.m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* row = part0 + i * g.n;
      for (int t = 1; t < nt; ++t) {
        const float* p = part0 + t * mn + i * g.n;
        for (int64_t j = 0; j < g.n; ++j) row[j] += p[j];
      }
      if (g.float_c)
        std::memcpy(static_cast<float*>(g.c) + i * g.c_row_stride(), row, static_cast<size_t>(g.n) * sizeof(float));
      else
        vm::float_to_bf16_row(static_cast<BFloat16*>(g.c) + i * g.c_row_stride(), row, g.n);
    }
  });
}

void packed_product(const MatmulArgs& g);  // below, with the packed entries

void dnnl_matmul(const MatmulArgs& g) {
  const SerialScope serial(g.outer * g.batch * g.m * g.n * g.k < kSerialMacs);
  const OperandLayout la = operand_layout(g.a, g, g.m, g.k);
  const OperandLayout lb = operand_layout(g.b, g, g.k, g.n);
  if (split_depth(g, la, lb)) return split_depth_product(g);
  if (pack_b_first(g, la, lb)) return packed_product(g);
  if (split_rows(g, la, lb)) return split_rows_product(g);
  if (copy_a_first(g, la)) {
    ScratchBlock rows(static_cast<size_t>(g.m * g.k * element_size(g.dtype)));
    detail::transpose_copy(g.dtype, g.a.data, la.l.ld, g.k, g.m, rows.data());
    MatmulArgs h = g;
    h.a = MatrixOperand{rows.data(), {0, g.k, 1}, 0};
    const OperandLayout lh = operand_layout(h.a, h, h.m, h.k);
    MatmulEntry* e = get_entry(h, lh, lb);
    run_matmul_prim(e->prim, h, e->src, e->wei, h.b.data, e->bias, e->addend, e->dst, e->scratch, e->scratch_bytes);
    return;
  }
  MatmulEntry* e = get_entry(g, la, lb);
  run_matmul_prim(e->prim, g, e->src, e->wei, g.b.data, e->bias, e->addend, e->dst, e->scratch, e->scratch_bytes);
}

// A kiln::compile record of a oneDNN product that calls its cached primitive
// directly: a replay skips building and hashing the cache key and the lookup,
// a seventh of the tiny workload's replay (measured with perf). On another
// thread than the capture's (whose cache the entry is in) it takes the normal
// path, which finds that thread's own primitive.
template <typename Entry, typename Run>
bool record_direct(const capture::KernelScope& cap, std::shared_ptr<Entry> e, Run run, capture::Replay fallback) {
  const std::thread::id owner = std::this_thread::get_id();
  return cap.record([e = std::move(e), run, fallback = std::move(fallback), owner] {
    if (std::this_thread::get_id() == owner) {
      run(*e);
    } else {
      fallback();
    }
  });
}

bool record_dnnl_matmul(const capture::KernelScope& cap, const MatmulArgs& g) {
  const OperandLayout la = operand_layout(g.a, g, g.m, g.k);
  const OperandLayout lb = operand_layout(g.b, g, g.k, g.n);
  if (split_depth(g, la, lb) || pack_b_first(g, la, lb) || split_rows(g, la, lb) || copy_a_first(g, la))
    return cap.record([g] { dnnl_matmul(g); });
  get_entry(g, la, lb);
  const bool serial = g.outer * g.batch * g.m * g.n * g.k < kSerialMacs;
  return record_direct(
      cap, cache().find_shared(matmul_key(g, la, lb, false)),
      [g, serial](MatmulEntry& e) {
        const SerialScope scope(serial);
        run_matmul_prim(e.prim, g, e.src, e.wei, g.b.data, e.bias, e.addend, e.dst, e.scratch, e.scratch_bytes);
      },
      [g] { matmul(g); });
}

// ---- packed b (Note [Packed weights] in kiln/kernels/dnnl.h) ----

struct PackedEntry {
  dnnl::matmul prim;   // reads b in oneDNN's layout
  dnnl::reorder pack;  // plain b -> that layout (unset when layout.bytes == 0)
  dnnl::memory src, wei_plain, wei_packed, bias, dst, scratch, addend;
  size_t scratch_bytes = 0;
  PackedLayout layout;
};

Key packed_key(const MatmulArgs& g) {
  return matmul_key(g, operand_layout(g.a, g, g.m, g.k), operand_layout(g.b, g, g.k, g.n), true);
}

PackedEntry* get_packed_entry(const MatmulArgs& g) {
  KILN_ASSERT(g.batch == 1 && g.outer == 1 && (g.dtype == DType::Float32 || g.dtype == DType::BFloat16) && g.k > 0,
              "matmul with a packed b: expected a 2-D float32/bfloat16 product with k > 0");
  const OperandLayout la = operand_layout(g.a, g, g.m, g.k);
  const OperandLayout lb = operand_layout(g.b, g, g.k, g.n);
  const Key key = matmul_key(g, la, lb, true);
  auto& c = thread_cache<PackedEntry>();
  if (PackedEntry* e = c.find(key)) return e;

  const auto t = to_dnnl(g.dtype);
  const dnnl::memory::desc a_md = matrix_md(t, g.m, g.k, la);
  const dnnl::memory::desc b_plain = matrix_md(t, g.k, g.n, lb);
  const dnnl::memory::desc b_any({g.k, g.n}, t, dnnl::memory::format_tag::any);
  const dnnl::memory::desc c_md({g.m, g.n}, t, dims{g.c_row_stride(), 1});
  auto e = std::make_unique<PackedEntry>();
  try {
    const dnnl::matmul::primitive_desc pd = matmul_pd(g, a_md, b_any, c_md);
    const dnnl::memory::desc b_packed = pd.weights_desc();
    e->prim = dnnl::matmul(pd);
    e->src = make_memory(a_md);
    e->wei_plain = make_memory(b_plain);
    e->wei_packed = make_memory(b_packed);
    e->dst = make_memory(c_md);
    if (g.bias) e->bias = make_memory(pd.bias_desc());
    if (g.addend) e->addend = make_memory(addend_md(g));
    e->scratch_bytes = pd.scratchpad_desc().get_size();
    e->scratch = make_memory(pd.scratchpad_desc());
    if (b_packed != b_plain) {
      e->layout.bytes = b_packed.get_size();
      e->layout.id = desc_hash(b_packed);
      e->pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), b_plain, engine(), b_packed));
      note_created();
    }
  } catch (const dnnl::error& err) {
    rethrow(err, "matmul with a packed b");
  }
  note_created();
  return c.insert(key, std::move(e));
}

void packed_product(const MatmulArgs& g) {
  PackedEntry* e = get_packed_entry(g);
  if (e->layout.bytes == 0) {
    run_matmul_prim(e->prim, g, e->src, e->wei_packed, g.b.data, e->bias, e->addend, e->dst, e->scratch,
                    e->scratch_bytes);
    return;
  }
  ScratchBlock packed(e->layout.bytes);
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, g.b.data}, {DNNL_ARG_TO, &e->wei_packed, packed.data()}});
  run_matmul_prim(e->prim, g, e->src, e->wei_packed, packed.data(), e->bias, e->addend, e->dst, e->scratch,
                  e->scratch_bytes);
}

}  // namespace

PackedLayout matmul_packed_layout(const MatmulArgs& g) {
  if (g.dtype == kBFloat16 && !bf16_products_on_dnnl()) return {};  // read as given, through float32
  return get_packed_entry(g)->layout;
}

void matmul_pack_b(const MatmulArgs& g, void* packed) {
  KILN_CAPTURE_KERNEL("matmul_pack_b", matmul_pack_b(g, packed));
  PackedEntry* e = get_packed_entry(g);
  KILN_ASSERT(e->layout.bytes > 0, "matmul_pack_b: this problem reads b as given");
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, g.b.data}, {DNNL_ARG_TO, &e->wei_packed, packed}});
}

void matmul_with_packed_b(const MatmulArgs& g, const void* packed) {
  const capture::KernelScope cap("matmul_with_packed_b", capture::kDeferrable);
  if (cap.recording()) {
    get_packed_entry(g);
    if (record_direct(
            cap, thread_cache<PackedEntry>().find_shared(packed_key(g)),
            [g, packed](PackedEntry& e) {
              run_matmul_prim(e.prim, g, e.src, e.wei_packed, packed, e.bias, e.addend, e.dst, e.scratch,
                              e.scratch_bytes);
            },
            [g, packed] { matmul_with_packed_b(g, packed); }))
      return;
  }
  PackedEntry* e = get_packed_entry(g);
  KILN_ASSERT(e->layout.bytes > 0, "matmul_with_packed_b: this problem reads b as given");
  run_matmul_prim(e->prim, g, e->src, e->wei_packed, packed, e->bias, e->addend, e->dst, e->scratch, e->scratch_bytes);
}

namespace {

// Writes the zeros of a Columns band over a product computed whole.
void zero_hidden_columns(const MatmulArgs& g) {
  const int64_t es = element_size(g.dtype);
  for (int64_t o = 0; o < g.outer; ++o)
    for (int64_t bi = 0; bi < g.batch; ++bi)
      for (int64_t i = 0; i < g.m; ++i) {
        const int64_t from = g.band.through(i, g.n);
        char* row = static_cast<char*>(g.c) + (o * g.c_outer() + bi * g.c_batch_stride() + i * g.c_row_stride()) * es;
        std::memset(row + from * es, 0, static_cast<size_t>((g.n - from) * es));
      }
}

}  // namespace

double band_multiply_adds(int64_t m, int64_t n, int64_t k, MatmulBand band) {
  using Kind = MatmulBand::Kind;
  double terms = 0;
  for (int64_t i = 0; i < m; ++i) {
    switch (band.kind) {
      case Kind::None: terms += static_cast<double>(n * k); break;
      case Kind::Columns: terms += static_cast<double>(band.through(i, n) * k); break;
      case Kind::DepthUpTo: terms += static_cast<double>(n * band.through(i, k)); break;
      case Kind::DepthFrom: terms += static_cast<double>(n * (k - band.from(i, k))); break;
    }
  }
  return terms;
}

void matmul(const MatmulArgs& g) {
  const capture::KernelScope cap("matmul", capture::kDeferrable);
  KILN_ASSERT(g.band.kind == MatmulBand::Kind::None || (!g.bias && !g.addend && g.epilogue == MatmulEpilogue::None),
              "kernels::matmul: a band with a bias, addend or epilogue");
  KILN_ASSERT(!g.float_c || (g.dtype == kBFloat16 && g.outer == 1 && g.batch == 1 && !g.bias && !g.addend &&
                             g.epilogue == MatmulEpilogue::None && g.band.kind == MatmulBand::Kind::None),
              "kernels::matmul: a float32 c needs one bfloat16 product without bias, addend, epilogue or band");
  if (cap.recording()) {
    // The products dnnl_matmul runs below (the others' records call matmul again).
    const bool on_dnnl = (g.dtype == kFloat32 || (g.dtype == kBFloat16 && bf16_products_on_dnnl())) && g.k > 0 &&
                         g.band.kind == MatmulBand::Kind::None && !detail::small_matmul_applies(g);
    bool deferred;
    if (detail::tiny_matmul_applies(g)) {
      deferred = cap.record([g] { detail::tiny_matmul(g); });
    } else if (on_dnnl && g.outer > 0 && g.batch > 0 && g.m > 0 && g.n > 0) {
      deferred = record_dnnl_matmul(cap, g);
    } else {
      deferred = cap.record([g] { matmul(g); });
    }
    if (deferred) return;
  }
  if (g.outer <= 0 || g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  if (g.dtype == kBFloat16 && !bf16_products_on_dnnl() && !detail::small_matmul_applies(g))
    return matmul_through_float32(g);
  if (g.band.kind != MatmulBand::Kind::None && !detail::small_matmul_applies(g)) {
    // Whole, then the hidden columns' zeros; the depth bands' left-out terms are 0 (Note [Causal products]).
    MatmulArgs whole = g;
    whole.band = {};
    matmul(whole);
    if (g.band.kind == MatmulBand::Kind::Columns) zero_hidden_columns(g);
    return;
  }
  if (g.outer > 1 && !((g.dtype == kFloat32 || g.dtype == kBFloat16) && g.k > 0)) {
    // Two batch dims outside oneDNN: one call per outer index.
    const int64_t es = element_size(g.dtype);
    for (int64_t o = 0; o < g.outer; ++o) {
      MatmulArgs s = g;
      s.outer = 1;
      s.a.data = static_cast<const char*>(g.a.data) + o * g.a.outer_stride * es;
      s.b.data = static_cast<const char*>(g.b.data) + o * g.b.outer_stride * es;
      s.c = static_cast<char*>(g.c) + o * g.c_outer() * es;
      matmul(s);
    }
    return;
  }
  if (g.k == 0) {
    // An empty sum: the bias (or zero) everywhere. oneDNN cannot take k = 0.
    KILN_ASSERT(g.epilogue == MatmulEpilogue::None && !g.addend, "kernels::matmul: k = 0 with an epilogue or addend");
    const int64_t es = g.float_c ? int64_t{4} : element_size(g.dtype);
    const size_t row = static_cast<size_t>(g.n * es);
    for (int64_t bi = 0; bi < g.batch; ++bi) {
      for (int64_t i = 0; i < g.m; ++i) {
        char* c = static_cast<char*>(g.c) + (bi * g.c_batch_stride() + i * g.c_row_stride()) * es;
        if (g.bias) {
          std::memcpy(c, g.bias, row);
        } else {
          std::memset(c, 0, row);
        }
      }
    }
    return;
  }
  if (detail::tiny_matmul_applies(g)) return detail::tiny_matmul(g);
  if (detail::small_matmul_applies(g)) return detail::small_matmul(g);
  // oneDNN runs float32 and bfloat16; BLAS (or kernels::gemm's integer loop) the others.
  constexpr DTypeSet kMatmulTypes{kFloat32, kFloat64, kBFloat16, kInt64, kInt32, kUInt8};
  visit_dtype<kMatmulTypes>(g.dtype, "kernels::matmul", [&]<typename T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
      dnnl_matmul(g);
    } else {
      KILN_ASSERT(g.epilogue == MatmulEpilogue::None && !g.addend,
                  "kernels::matmul: an epilogue or addend needs float32 or bfloat16");
      blas_matmul(g);
    }
  });
}

}  // namespace kiln::kernels
