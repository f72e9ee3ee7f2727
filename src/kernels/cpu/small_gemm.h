// Internal to the kernels layer: kiln's own bfloat16 and float32 products for
// batches of small matrices (attention's heads), where oneDNN's matmul is slow.
//
// Note [Small products]
// Attention runs its products per block of 64 query rows over all B x H heads:
// 64 products of 64 x 64 x 64 or 64 x 128 x 64, whose operands are views of
// the fused qkv projection (row stride 3C, heads side by side). Given such
// strided heads oneDNN 2.6 picks gemm:jit at 175-190 GFLOP/s (bf16, 1 thread);
// only dense heads reach brgemm (335-347), and the copies that make them dense
// cost about what brgemm saves. This kernel reads the views as they are: it
// packs b into pairs of k (the layout VDPBF16PS multiplies), reads a's rows
// in place when they are contiguous in k (else packs a too), and keeps a
// 6 x 64 tile of c in registers, rounding to bf16 once at the store. Measured
// on gpt's attention operands: 318-351 GFLOP/s with the packing, 390-435
// without (bench/micro BM_AttentionScoresProduct, docs/amp.md).
//
// float32 takes the same 6 x 64 tile with one FMA per lane and k: a is read
// in place whatever its strides (each step broadcasts one element), b in
// place when its rows are contiguous and otherwise transposed into rows. On
// the head views oneDNN's gemm:jit ran 123-176 GFLOP/s, this kernel 148-179,
// and in gpt's step the products went 27 -> 23 ms (1 thread).
//
// Each bf16 c element is the float32 sum over k in pairs, in k order, as
// VDPBF16PS computes it (subnormal inputs and results flushed to zero, round
// to nearest even): the same instruction oneDNN's bf16 kernels and so
// torch's CPU bf16 matmul use, though not necessarily in the same order.
// The result does not depend on the thread count: each product is computed
// whole by one thread.
//
// Under a causal band (Note [Causal products] in kiln/kernels/dnnl.h) each
// 6-row tile computes only its rows' span: the 16-column vectors up to its
// last row's last visible key (Columns, then the hidden entries are written
// 0), or the depth steps between its rows' first and last visible terms.
// Tiles are whole vectors and bf16 steps whole pairs, so a tile also computes
// some hidden entries (overwritten) or zero terms (exact): the bits of every
// visible entry are those of the whole product. At gpt's blocks (rows 0-63
// against keys 0-63 and rows 64-127 against 0-127) the products took
// 14-40 % less time (bench/micro BM_AttentionBlockProducts).
//
// Note [Prefetching inside the tiles]
// Attention's heads are views with rows 3 KiB apart (q, k and v side by side
// in the fused projection), which the hardware prefetcher does not follow, so
// the next head's rows are asked for while this head computes. Asked for all
// at once (1,536 lines a head in gpt's forward) the prefetches stall: each
// holds one of the core's few line fill buffers until its line arrives from
// L3, and the burst waits for them as a load would (perf put 11 % of the
// float32 forward on the instruction after the prefetch). So the lines are
// handed to the products instead, and each tile issues one every
// kPrefetchEvery depth steps among its multiply-adds, which keeps a dozen in
// flight; what the products have no steps left for goes out at the head's end.
// Prefetches change no value.
//
// Note [Tiny products]
// A single float32 product of a few thousand multiply-adds (the tiny MLP's
// [8, 32] x [32, 64]) costs oneDNN more in its call than in its arithmetic:
// 660-1030 ns through the cached primitive against 240-670 ns on the 6 x 64
// tile here (1 thread, 2026-12-05, shapes of the tiny workload's layers),
// where oneDNN's execute builds a hash map of its arguments and allocates on
// every call. The two meet near 64 x 128 x 64 (5.5 us each) and oneDNN pulls
// ahead beyond, so products of at most kTinyMacs multiply-adds take the tile.
// A bias is added to each row after the product: the float32 sum is exact in
// its register until stored, so sum + bias rounds once, as in oneDNN's fused
// bias.
#pragma once

#include "kiln/kernels/dnnl.h"

namespace kiln::kernels::detail {

/// Whether g takes the small-product kernel: bfloat16 or float32, a batch of
/// at least two products each at most 512 in m, n and k, no bias, epilogue or
/// addend, and a build for a CPU with AVX512-BF16.
bool small_matmul_applies(const MatmulArgs& g);
/// Runs g on that kernel (small_matmul_applies(g) must hold).
void small_matmul(const MatmulArgs& g);
/// Whether g fits that kernel whatever its batch (small_matmul_applies
/// without the batch of two): one head's product inside a kernel that runs
/// its heads across threads itself (attention_heads.cpp).
bool small_matmul_fits(const MatmulArgs& g);
/// Cache lines for the tiles to prefetch while they compute (Note [Prefetching
/// inside the tiles]): lines[next, count) are still to be asked for.
struct PrefetchLines {
  const char* const* lines = nullptr;
  int64_t count = 0;
  int64_t next = 0;
};
/// Runs every product of g on the calling thread (small_matmul_fits(g) must
/// hold), its tiles asking for `prefetch`'s lines as they go when given.
void small_matmul_here(const MatmulArgs& g, PrefetchLines* prefetch = nullptr);
/// Whether g is one float32 product small enough for Note [Tiny products]:
/// batch 1, no band, epilogue or addend (a bias is fine).
bool tiny_matmul_applies(const MatmulArgs& g);
/// Runs it on the calling thread (tiny_matmul_applies(g) must hold).
void tiny_matmul(const MatmulArgs& g);

}  // namespace kiln::kernels::detail
