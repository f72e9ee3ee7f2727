// Whether bfloat16 products run on oneDNN's bfloat16 kernels or through
// float32 (matmul_through_float32.cpp, conv_detail::kernel_dtype).
//
// Note [bf16 products where bf16 is slow]
// oneDNN runs a bfloat16 product wherever it has a kernel, but that kernel is
// only faster than the float32 one where the CPU's bfloat16 dot product is:
//   - AMX (avx512_core_amx): tiles, many times float32. Native.
//   - AVX512_BF16 on AMD EPYC (family 26, the machines of
//     bench/results/bf16.md): oneDNN's bf16 probe about 2x its float32 one.
//   - AVX512_BF16 on an Intel Xeon without AMX (family 6, model 207,
//     2026-12-07): vdpbf16ps does 64 flops where vfmadd231ps does 32, but ran
//     at 0.48-0.56 of its flop rate (12 independent chains each, the loop
//     below), and oneDNN's bf16 products ran at 85-88 GFLOP/s against
//     float32's 150-164 (BM_MlpProduct/5 and /6). gpt's bf16 step took 0.70x
//     float32's speed on oneDNN's kernels, 0.79x through float32; cnn 0.66x
//     and 0.84x; resnet 0.72x and 0.89x (1 thread).
//   - AVX-512 without AVX512_BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE on that
//     Xeon): oneDNN emulates the dot product, 32 GFLOP/s against 158.
// So a bfloat16 product runs natively with AMX, through float32 where oneDNN
// would emulate, and in between by the two instructions' rates, timed once
// per process, interleaved, best of five: native from 0.75 of float32's flop
// rate on. The rates measured sit at 0.5 and 2, far from that line, so the
// choice does not flip from run to run; KILN_ONEDNN_BF16=1 or =0 fixes it.
// Either way the arithmetic is the same (exact bf16 x bf16 products summed in
// float32, one rounding to bfloat16); only the order of the sums differs.

#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>

#include "dnnl_common.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

namespace {

double now_seconds() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Twelve independent accumulators, enough to cover either instruction's
// latency on both ports: the loop measures throughput, not a dependency chain.
// The operands are set to 1.0 first: whatever a register held before might be
// a denormal, which slows an FMA many times and not vdpbf16ps (it flushes
// them). Inline assembly on registers 0-13, so that this file builds for any
// x86-64 (a build without AVX-512 may not name registers 16-31); it runs only
// where oneDNN found AVX512_BF16.
#define KILN_TWELVE(OP)                                                                                       \
  OP " %%zmm12, %%zmm13, %%zmm0\n\t" OP " %%zmm12, %%zmm13, %%zmm1\n\t" OP " %%zmm12, %%zmm13, %%zmm2\n\t" OP \
     " %%zmm12, %%zmm13, %%zmm3\n\t" OP " %%zmm12, %%zmm13, %%zmm4\n\t" OP " %%zmm12, %%zmm13, %%zmm5\n\t" OP \
     " %%zmm12, %%zmm13, %%zmm6\n\t" OP " %%zmm12, %%zmm13, %%zmm7\n\t" OP " %%zmm12, %%zmm13, %%zmm8\n\t" OP \
     " %%zmm12, %%zmm13, %%zmm9\n\t" OP " %%zmm12, %%zmm13, %%zmm10\n\t" OP " %%zmm12, %%zmm13, %%zmm11\n\t"
#define KILN_TIMED_LOOP(OP)                                                                                     \
  do {                                                                                                          \
    long n = kIterations;                                                                                       \
    const float one = 1.0f;                                                                                     \
    __asm__ volatile("vbroadcastss %1, %%zmm12\n\tvbroadcastss %1, %%zmm13\n\t" KILN_TWELVE(                    \
                         "vpxord") "1:\n\t" KILN_TWELVE(OP) "dec %0\n\tjnz 1b\n\t"                              \
                     : "+r"(n)                                                                                  \
                     : "m"(one)                                                                                 \
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                       "xmm11", "xmm12", "xmm13", "cc");                                                        \
  } while (false)

constexpr long kIterations = 20000;  // 240,000 instructions: about 0.1 ms of FMAs

double fma_seconds() {
  const double t = now_seconds();
  KILN_TIMED_LOOP("vfmadd231ps");
  return now_seconds() - t;
}

double dpbf16_seconds() {
  const double t = now_seconds();
  KILN_TIMED_LOOP("vdpbf16ps");
  return now_seconds() - t;
}

#undef KILN_TIMED_LOOP
#undef KILN_TWELVE

}  // namespace

double bf16_dot_flop_rate_vs_fma() {
  if (!dnnl_detail::isa_has(dnnl_cpu_isa_avx512_core_bf16)) return 0;
  fma_seconds();  // the first 512-bit work of a process may run at a lower clock
  dpbf16_seconds();
  double fma = 1e30, dot = 1e30;
  for (int round = 0; round < 5; ++round) {
    fma = std::min(fma, fma_seconds());
    dot = std::min(dot, dpbf16_seconds());
  }
  return 2.0 * fma / dot;  // vdpbf16ps does twice the flops of vfmadd231ps
}

bool dnnl_has_amx() { return dnnl_detail::isa_has(dnnl_cpu_isa_avx512_core_amx); }

namespace {
// The rate the decision below was made on (-1: it was made without one), so
// that a run reports the figure that chose its path, not a second timing that
// may fall on the other side of the line.
std::atomic<double> g_decided_rate{-1.0};
}  // namespace

bool bf16_products_on_dnnl() {
  static const bool native = [] {
    if (!dnnl_supports(kBFloat16)) return false;
    const char* v = std::getenv("KILN_ONEDNN_BF16");
    if (v != nullptr && std::string_view(v) == "1") return true;
    if (dnnl_has_amx()) return true;
    const double rate = bf16_dot_flop_rate_vs_fma();
    g_decided_rate.store(rate);
    return rate >= kBf16NativeRate;
  }();
  return native;
}

double bf16_products_decision_rate() {
  bf16_products_on_dnnl();
  const double rate = g_decided_rate.load();
  return rate >= 0 ? rate : bf16_dot_flop_rate_vs_fma();
}

}  // namespace kiln::kernels
