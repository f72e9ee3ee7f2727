// Dense math kernels: matmul, 2-D convolution and 2-D pooling over raw
// pointers (the kernels layer: no Tensor here). float32 and bfloat16 run on
// oneDNN; float64 and integer types run on OpenBLAS or our own loops, since
// oneDNN has no f64 (see kiln/kernels/blas.h). The ops layer checks shapes
// and dtypes, allocates outputs and converts float16 to float32 before it
// calls in here.
//
// oneDNN primitives are cached per thread, keyed by everything that shapes
// the primitive (dims, strides, dtype, attributes, thread count), so a
// repeated call costs a hash lookup; dnnl_primitives_created() counts cache
// misses for tests. One engine and one stream serve the whole process, and
// every scratchpad comes from kiln's allocator (MemoryCategory::Workspace).
//
// Note [Dense kernels and backward]: each forward takes a plain parameter
// struct, and its backward kernels (convolution backward-data/weights,
// pooling backward) take the same struct and build the forward primitive
// descriptor they need as a hint under the same cache key. Max pooling
// exposes both oneDNN's opaque workspace (pool2d_workspace_bytes) and
// torch-style int64 indices (max_pool2d_with_indices); its backward uses the
// workspace when the forward ran on oneDNN and the indices otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "kiln/core/capture_loop.h"
#include "kiln/core/dtype.h"

namespace kiln::kernels {

// ---------------------------------------------------------------------------
// Matmul: c[b] = a[b] · b[b] (+ bias), b in [0, batch).
// ---------------------------------------------------------------------------

/// One strided operand of a batched matmul. Strides are in elements:
/// stride[0] steps the batch (0: the same matrix for every batch, i.e.
/// broadcast), stride[1] the rows, stride[2] the columns. Each matrix must
/// have a unit stride in one of its two dims and must not overlap itself
/// (the ops layer copies anything else to contiguous first).
struct MatrixOperand {
  const void* data = nullptr;
  int64_t stride[3] = {0, 0, 1};
  /// The outer batch dim's stride when MatmulArgs::outer > 1 (0: broadcast).
  int64_t outer_stride = 0;
};

/// Note [Causal products]
/// Causal attention's products over a block of query rows r0, r0 + 1, ...:
/// query row i sees keys j <= r0 + i only, so the products that form or
/// consume its scores have a triangle the mask hides. A band names it, with
/// `offset` = r0, in the product's own indices (i a row of c, j a column, p
/// a term of the sum), and the kernel skips that part:
///   Columns    c[i][j] = (j <= i + offset) ? sum_p a[i][p] b[p][j] : 0
///              (S = q kᵀ and dP = dO vᵀ: the hidden scores are written 0);
///   DepthUpTo  c[i][j] = sum over p <= i + offset (P v and dS k, whose a is 0
///              past its row's last key);
///   DepthFrom  c[i][j] = sum over p >= i - offset (Pᵀ dO and dSᵀ q: a key
///              row is seen only by queries from its own index on).
/// For the two depth bands the caller guarantees that a is 0 at the terms left
/// out, so the full product is the same sum: a kernel may skip those terms or
/// not, and skipping exact zeros changes no bit of a finite result. The
/// small-product kernel skips them tile by tile; every other path computes
/// the full product and, for Columns, writes the zeros after.
struct MatmulBand {
  enum class Kind : uint8_t { None, Columns, DepthUpTo, DepthFrom };
  Kind kind = Kind::None;
  int64_t offset = 0;
  /// How many leading indices of row i lie at or before i + offset, clamped
  /// to [0, limit]: the columns a Columns band keeps, the terms a DepthUpTo sums.
  int64_t through(int64_t i, int64_t limit) const {
    const int64_t e = i + offset + 1;
    return e < 0 ? 0 : e > limit ? limit : e;
  }
  /// The first term a DepthFrom band sums in row i, clamped to [0, limit].
  int64_t from(int64_t i, int64_t limit) const {
    const int64_t s = i - offset;
    return s < 0 ? 0 : s > limit ? limit : s;
  }
};

/// Multiply-adds one [m, k] · [k, n] product does under `band`: m·n·k for
/// Kind::None, the terms of the visible entries otherwise (what the profiler
/// counts as the product's FLOPs, halved).
double band_multiply_adds(int64_t m, int64_t n, int64_t k, MatmulBand band);

/// An activation applied to c (after the bias) inside the product, while each
/// tile of c is still in registers: oneDNN eltwise post-ops. float32 and
/// bfloat16 only (the oneDNN path).
enum class MatmulEpilogue : uint8_t { None, GeluTanh, GeluErf };

struct MatmulArgs {
  DType dtype = DType::Float32;  // a, b, bias and c all have this dtype
  /// Two batch dims, [outer, batch]: attention's [B, H] heads, each dim with
  /// its own stride, where B and H of a head view of a [B, T, 3C] projection
  /// cannot merge into one. One primitive covers all outer * batch products
  /// rather than a call per outer index with a handful of products each.
  int64_t outer = 1;
  int64_t batch = 1;
  int64_t m = 0, n = 0, k = 0;  // a is [m, k], b is [k, n], c is [m, n]
  MatrixOperand a, b;
  /// Optional bias of n contiguous elements, added to every row of c.
  const void* bias = nullptr;
  /// [batch, m, n] with unit column stride: contiguous unless c_stride says
  /// otherwise. A product can so fill rows of a larger tensor in place.
  void* c = nullptr;
  /// Batch and row strides of c in elements; 0 means contiguous (m * n, n).
  int64_t c_stride[2] = {0, 0};
  int64_t c_batch_stride() const { return c_stride[0] ? c_stride[0] : m * n; }
  int64_t c_row_stride() const { return c_stride[1] ? c_stride[1] : n; }
  /// Outer batch stride of c; 0 means batch * c_batch_stride().
  int64_t c_outer_stride = 0;
  int64_t c_outer() const { return c_outer_stride ? c_outer_stride : batch * c_batch_stride(); }
  MatmulEpilogue epilogue = MatmulEpilogue::None;
  /// Optional contiguous [m, n] (batch 1 only) added to c after the bias and
  /// the epilogue, inside the product (a oneDNN binary post-op): a residual
  /// connection without a separate pass. float32/bfloat16 only.
  const void* addend = nullptr;
  /// The causal triangle to skip, if any (Note [Causal products]); no bias,
  /// epilogue or addend with a band.
  MatmulBand band;
  /// c is float32 while a and b are bfloat16: the float32 sums unrounded
  /// (Note [Float32 weight gradients under autocast] in src/ops/linalg.cpp).
  /// One 2-D product (batch and outer 1) without bias, epilogue, addend or band.
  bool float_c = false;
};

/// float32, bfloat16: oneDNN. float64: cblas_dgemm. int64, int32, uint8: a
/// plain loop (torch supports integer mm on CPU). Other dtypes are a bug in
/// the caller (KILN_ASSERT).
void matmul(const MatmulArgs& args);

// Note [Packed weights]
// oneDNN's matmul reads b fastest in a blocked layout of its own choosing.
// Given b as a plain (or transposed) matrix it re-blocks parts of b on every
// call; for a product with few rows (inference: 128 tokens × 256 → 768) that
// copy is a large part of the call (measured: 206 → 194 µs on 1 thread, 130 →
// 101 µs on 2). When b is a weight that stays the same across calls, the
// caller can keep b packed in oneDNN's layout and pass that instead. The
// kernels only describe, fill and read the packed buffer; who owns it and
// when it is stale (the weight changed) is the caller's business.

/// The layout oneDNN picks for b of a 2-D float32/bfloat16 product (batch 1).
struct PackedLayout {
  size_t bytes = 0;  // 0: b is read best as given; nothing to pack
  uint64_t id = 0;   // equal ids: the same layout (a hash of oneDNN's descriptor)
};
/// The layout for g's problem (its data pointers are not read).
PackedLayout matmul_packed_layout(const MatmulArgs& g);
/// Writes g.b into `packed` (PackedLayout::bytes) in that layout.
void matmul_pack_b(const MatmulArgs& g, void* packed);
/// c = a · b (+ bias, epilogue) as matmul(g), reading b from `packed`, which
/// matmul_pack_b filled for a problem with the same PackedLayout::id.
void matmul_with_packed_b(const MatmulArgs& g, const void* packed);

// ---------------------------------------------------------------------------
// 2-D convolution, NCHW.
// ---------------------------------------------------------------------------

struct Conv2dParams {
  DType dtype = DType::Float32;
  int64_t n = 0, c = 0, h = 0, w = 0;  // input [n, c, h, w]
  int64_t o = 0, kh = 0, kw = 0;       // weight [o, c / groups, kh, kw]
  int64_t groups = 1;
  int64_t oh = 0, ow = 0;  // output [n, o, oh, ow]
  int64_t stride[2] = {1, 1};
  int64_t dilation[2] = {1, 1};  // torch's convention: 1 is a dense kernel
  int64_t pad_l[2] = {0, 0};     // top, left
  int64_t pad_r[2] = {0, 0};     // bottom, right (may differ: padding="same")
  // Memory layout of the activation buffers of a call (oneDNN types only;
  // float64 and integers are always NCHW): true means NHWC (channels-last).
  bool input_nhwc = false;   // input, grad_input
  bool output_nhwc = false;  // output, grad_output
};

/// output = conv(input, weight) + bias. Activations are dense NCHW, or NHWC
/// where p.input_nhwc / p.output_nhwc say so; weight is contiguous OIHW; bias
/// is null or o contiguous elements. float32/bfloat16 run on oneDNN, whose
/// primitives take NHWC activations (measured faster here than its blocked
/// nChw16c, and no reorder when the tensors are channels-last already);
/// float64 and integers run im2col + gemm.
void conv2d_forward(const Conv2dParams& p, const void* input, const void* weight, const void* bias, void* output);

/// The oneDNN implementation (its name, e.g. "brgconv:avx512_core") that the
/// float32 or bfloat16 forward primitive for p without a bias runs: which
/// kernel Note [Forward convolution kernel] picked, for checks and diagnostics.
std::string conv2d_forward_impl(const Conv2dParams& p);

/// The gradient w.r.t. the input: grad_input [n, c, h, w] (overwritten; rows
/// and columns no window reads get 0) from grad_output [n, o, oh, ow] and the
/// weight. All contiguous. float32/bfloat16: oneDNN convolution_backward_data;
/// float64: gemm + col2im.
void conv2d_backward_input(const Conv2dParams& p, const void* grad_output, const void* weight, void* grad_input);

/// The gradient w.r.t. the weight [o, c / groups, kh, kw] and, when grad_bias
/// is not null, the bias [o] (both overwritten), from grad_output and the
/// input. float32/bfloat16: oneDNN convolution_backward_weights, which sums the
/// bias gradient in the same pass, except where ConvWeightGradPath::Auto picks
/// the product or the direct sum, and for a float32 convolution over one input
/// channel into NCHW grad_output at 2+ threads, whose bias gradient is summed
/// apart (Note [Single-channel weight gradient] in
/// src/kernels/cpu/dnnl_conv.cpp); float64: im2col + gemm.
void conv2d_backward_weight(const Conv2dParams& p, const void* grad_output, const void* input, void* grad_weight,
                            void* grad_bias);

/// How a bfloat16 or float32 convolution's weight gradient runs (Note
/// [Weight gradient by unfolding] in src/kernels/cpu/conv_weight_gemm.cpp):
/// oneDNN's backward-weights primitive, or the input unfolded into its
/// windows and one product with grad_output (NHWC activations, groups 1).
/// Auto takes the product for strided bfloat16 convolutions with windows
/// larger than 1x1 over 32 channels or more (16 at 2 threads or more), whose
/// unfolded input fits in 64 MiB: where oneDNN 2.6's primitive is slowest.
/// The two differ only in the order each gradient element's terms are summed.
/// Direct sums grad_output's channel vectors times each tap's input value
/// (Note [Few-channel weight gradient] in src/kernels/cpu/conv_direct.cpp),
/// for convolutions over at most 4 input channels into at most 64, NHWC
/// grad_output, groups 1; Auto takes it for those over one input channel (a
/// grayscale stem; resnet's 3-channel stem ran faster on the primitive).
/// Where a path does not take a convolution, Auto's choice runs.
/// Process-wide; for tests and benchmarks, which compare them.
enum class ConvWeightGradPath : uint8_t { Auto, Primitive, Product, Direct };
void set_conv_weight_grad_path(ConvWeightGradPath path);
ConvWeightGradPath conv_weight_grad_path();

/// Whether conv2d_backward_weight runs p on the direct sum.
bool conv2d_backward_weight_direct(const Conv2dParams& p);

/// Both of the above in one call: oneDNN then reorders grad_output into its
/// layout once for both primitives (when it needs reordering at all).
void conv2d_backward(const Conv2dParams& p, const void* grad_output, const void* input, const void* weight,
                     void* grad_input, void* grad_weight, void* grad_bias);

// ---------------------------------------------------------------------------
// 2-D pooling, NCHW.
// ---------------------------------------------------------------------------

enum class PoolKind : uint8_t { Max, AvgIncludePad, AvgExcludePad };

struct Pool2dParams {
  DType dtype = DType::Float32;
  PoolKind kind = PoolKind::Max;
  int64_t n = 0, c = 0, h = 0, w = 0;  // input [n, c, h, w]
  int64_t oh = 0, ow = 0;              // output [n, c, oh, ow]
  int64_t kernel[2] = {1, 1};
  int64_t stride[2] = {1, 1};
  int64_t pad[2] = {0, 0};       // torch's symmetric padding; windows may run past it (ceil_mode)
  int64_t dilation[2] = {1, 1};  // torch's convention (max pooling only)
  /// Average pooling divides by this instead of the window size when nonzero.
  int64_t divisor_override = 0;
  /// Input, output and their gradients are NHWC (channels-last) in memory.
  /// Only where pool2d_uses_dnnl(p): our own loops are NCHW.
  bool nhwc = false;
};

/// Whether pooling p runs on oneDNN (float32/bfloat16 with torch's semantics;
/// a max pool's input must also be free of NaN, checked per call).
bool pool2d_uses_dnnl(const Pool2dParams& p);

/// Bytes of workspace a training-mode max pool writes for its backward (0 when
/// the call would not run on oneDNN or needs none): oneDNN's, or for a
/// channels-last max pool kiln's own kernel's (Note [Channels-last max
/// pooling] in src/kernels/cpu/pool_max_nhwc.cpp), which replaces oneDNN's
/// there and needs no NaN scan.
size_t pool2d_workspace_bytes(const Pool2dParams& p);

/// Torch semantics throughout: average pooling with count_include_pad divides
/// by the window clipped to the padded input (so ceil_mode windows that run
/// past the padding count fewer), max pooling propagates NaN. `workspace`,
/// when not null, must hold pool2d_workspace_bytes(p) and receives oneDNN's
/// max-pool workspace. Input and output are contiguous. Returns whether
/// oneDNN ran (and so wrote the workspace): a NaN in a max pool's input, for
/// one, sends it to our own loop, which does not. With p.nhwc the loop cannot
/// run: a NaN input then returns false having written nothing, and the
/// caller retries in NCHW.
bool pool2d_forward(const Pool2dParams& p, const void* input, void* output, void* workspace = nullptr);

/// Max pooling that also writes, per output element, the flat index
/// (row * w + col) of the chosen input element in its plane, as torch's
/// max_pool2d_with_indices. Floating dtypes.
void max_pool2d_with_indices(const Pool2dParams& p, const void* input, void* output, int64_t* indices);

/// Torch's adaptive average pooling: output cell i covers input rows
/// [floor(i * h / oh), ceil((i + 1) * h / oh)) and likewise for columns.
/// Uniform bins (h % oh == 0 and w % ow == 0) on float32/bfloat16 go to
/// oneDNN; the rest run our own loop.
void adaptive_avg_pool2d(DType dtype, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow, const void* input,
                         void* output);

// Pooling backward. grad_input [n, c, h, w] is overwritten; grad_output is
// [n, c, oh, ow]; both contiguous; float32, float64, bfloat16 (16-bit types
// accumulate in float32 and round once).

/// The adjoint of average pooling (p.kind AvgIncludePad / AvgExcludePad,
/// divisor_override as in the forward): oneDNN pooling backward wherever the
/// forward runs on oneDNN, our loop otherwise.
void avg_pool2d_backward(const Pool2dParams& p, const void* grad_output, void* grad_input);

/// Max pooling backward from the oneDNN workspace that pool2d_forward wrote
/// (only valid when it returned true).
void max_pool2d_backward_workspace(const Pool2dParams& p, const void* grad_output, const void* workspace,
                                   void* grad_input);

/// kiln::compile's rewrite of a max pool's backward followed by the weight
/// gradient of the convolution whose output the pool read (docs/compile.md,
/// "Rewrites"): the weight (and bias) gradient of `conv` read through the
/// channels-last pool `pool` (disjoint windows) from its output gradient and
/// workspace, with the bits of max_pool2d_backward_workspace then
/// conv2d_backward_weight and without the full-size gradient between them.
/// Applies where the convolution's weight gradient takes the direct sum.
bool conv2d_backward_weight_pooled_applies(const Conv2dParams& conv, const Pool2dParams& pool);
void conv2d_backward_weight_pooled(const Conv2dParams& conv, const Pool2dParams& pool, const void* grad_pooled,
                                   const uint8_t* workspace, const void* input, void* grad_weight, void* grad_bias);

/// kiln::compile's rewrite of the same convolution's forward and the max pool
/// after it (disjoint windows, no padding; with the ReLU-pooling rewrite's
/// threshold when not null): the pooled output and workspace, with the bits of
/// conv2d_forward then pool2d_forward (max_pool_nhwc_forward with the
/// threshold) and without the convolution's full-size output. Applies where the
/// forward takes the direct sum (one input channel, NHWC output).
bool conv2d_forward_pooled_applies(const Conv2dParams& conv, const Pool2dParams& pool);
void conv2d_forward_pooled(const Conv2dParams& conv, const Pool2dParams& pool, const void* input, const void* weight,
                           const void* bias, void* pooled, uint8_t* workspace, const float* relu_threshold);
/// The same from what the two kernels noted in a capture ("conv2d_forward_direct",
/// "max_pool_nhwc_forward"): the pooled kernel's operands (input, weight, bias,
/// pooled output, workspace; the pool's threshold as its scalar) and how to run
/// it, or nothing where the pair does not fuse.
std::optional<std::pair<capture::Operands, capture::OperandsRun>> conv2d_forward_pooled_fusion(
    const capture::Operands& conv_forward, const capture::Operands& pool_forward);

/// The same for kiln::compile, from what the two kernels noted in a capture
/// (capture::Operands "max_pool_nhwc_backward" and "conv2d_backward_weight"):
/// the pooled kernel's operands (the pool's output gradient, its workspace,
/// the convolution's input, grad_weight, grad_bias) and how to run it, or
/// nothing where the pair does not fuse (conv2d_backward_weight_pooled_applies,
/// and the weight gradient reading the gradient the pool's backward writes).
std::optional<std::pair<capture::Operands, capture::OperandsRun>> conv2d_backward_weight_pooled_fusion(
    const capture::Operands& pool_backward, const capture::Operands& weight_grad);

/// Max pooling backward from max_pool2d_with_indices' indices: each
/// grad_output element is added to grad_input at its index (overlapping
/// windows that chose the same element add up).
void max_pool2d_backward_indices(const Pool2dParams& p, const void* grad_output, const int64_t* indices,
                                 void* grad_input);

/// The adjoint of max_pool2d_backward_indices (double backward):
/// out[plane, o] = src[plane, indices[plane, o]], src shaped like the input.
void max_pool2d_gather(const Pool2dParams& p, const void* src, const int64_t* indices, void* out);

/// The adjoint of adaptive_avg_pool2d: each output cell's gradient, divided
/// by its bin's area, added over the bin (bins may overlap).
void adaptive_avg_pool2d_backward(DType dtype, int64_t planes, int64_t h, int64_t w, int64_t oh, int64_t ow,
                                  const void* grad_output, void* grad_input);

// ---------------------------------------------------------------------------
// Primitive cache introspection (tests, diagnostics).
// ---------------------------------------------------------------------------

/// oneDNN primitives (and reorders) created so far in this process, on any thread.
int64_t dnnl_primitives_created();
/// Drops this thread's cached primitives.
void dnnl_clear_cache();
/// True when oneDNN can run `dt` with a real kernel on this CPU (float32
/// always; bfloat16 from AVX-512 on, natively with AVX512_BF16, not on an
/// AVX2-only CPU; float16 not on CPUs without AVX512_FP16). Where it cannot,
/// the products, convolutions and pooling of that dtype compute in float32
/// and round once (Note [Kernels without AVX-512] in docs/decisions.md).
/// KILN_ONEDNN_BF16=0 says no for bfloat16 on any CPU (the tests' switch).
bool dnnl_supports(DType dt);

/// Whether bfloat16 products (matmuls, convolutions, pooling) run on oneDNN's
/// bfloat16 kernels (true) or widened to float32 and rounded once (false):
/// native with AMX, or where the CPU's bf16 dot product does at least
/// kBf16NativeRate of float32's flops per second (timed once per process);
/// not where oneDNN would emulate it (Note [bf16 products where bf16 is slow]
/// in src/kernels/cpu/bf16_products.cpp). KILN_ONEDNN_BF16=1 forces native
/// where a kernel exists, =0 forces float32.
bool bf16_products_on_dnnl();
/// vdpbf16ps's flops per second over vfmadd231ps's on this core, measured
/// now (0 where oneDNN may not use AVX512_BF16: the CPU lacks it, or
/// ONEDNN_MAX_CPU_ISA caps oneDNN below it).
double bf16_dot_flop_rate_vs_fma();
inline constexpr double kBf16NativeRate = 0.75;
/// The rate bf16_products_on_dnnl() decided on, where it timed one; else
/// bf16_dot_flop_rate_vs_fma() measured now.
double bf16_products_decision_rate();
/// Whether oneDNN may use AMX on this CPU (the CPU has it and
/// ONEDNN_MAX_CPU_ISA does not cap it).
bool dnnl_has_amx();

/// oneDNN primitives run so far with more than one thread allowed. Each may
/// open a parallel region (oneDNN runs a small problem on one thread, so this
/// counts an upper bound); a benchmark reads it beside parallel_regions()
/// (Note [Parallel regions] in bench/workloads/main.cpp).
int64_t dnnl_threaded_calls();

}  // namespace kiln::kernels
