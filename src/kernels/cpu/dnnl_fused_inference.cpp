// Fused inference convolution and linear on oneDNN with packed weights and
// post-ops (Note [Fused inference epilogue] in kiln/kernels/fused_inference.h).
//
// Each problem has one per-thread cache entry (Note [oneDNN primitive cache]):
// a forward_inference primitive whose weights are format_tag::any, the
// reorder that packs the plain weight into that layout, and the reorders of
// activations whose layout is not the primitive's (an NCHW image into the
// first convolution). Activations are NHWC where oneDNN has a jit kernel for
// it, as kiln's own conv2d (dnnl_conv.cpp says why).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string_view>

#include "dnnl_common.h"
#include "gelu_rows.h"
#include "kiln/core/capture.h"
#include "kiln/kernels/fused_inference.h"

namespace kiln::kernels {

namespace {

using namespace dnnl_detail;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;

// These caches are their own PrimCache types, so their keys never meet the
// other kernels'; the kind word only has to differ between the two here.
constexpr auto kFusedConv = static_cast<PrimKind>(101);
constexpr auto kFusedLinear = static_cast<PrimKind>(102);

FusedWeightLayout layout_of(const dnnl::memory::desc& md) { return {md.get_size(), desc_hash(md)}; }

dnnl::algorithm eltwise_alg(FusedActivation act) {
  switch (act) {
    case FusedActivation::Relu: return dnnl::algorithm::eltwise_relu;
    case FusedActivation::GeluErf: return dnnl::algorithm::eltwise_gelu_erf;
    case FusedActivation::GeluTanh: return dnnl::algorithm::eltwise_gelu_tanh;
    case FusedActivation::None: break;
  }
  KILN_ASSERT(false, "fused inference: no eltwise for FusedActivation::None");
  return dnnl::algorithm::undef;
}

// Post-ops in the epilogue's order: the residual's add, then the activation.
// The matmul reads the residual through a binary-add post-op; the convolution
// through a sum post-op over its destination, into which the residual is
// copied first (residual_md empty): oneDNN 2.6 runs a convolution with a
// binary post-op on its older jit kernel rather than brgconv, measured here
// 1.10 vs 0.90 ms (copy included) for ResNet's 16->16 3x3 at 32x32, batch 32,
// 0.70 vs 0.61 at 64->64 8x8.
dnnl::primitive_attr epilogue_attr(bool residual, const dnnl::memory::desc* residual_md, FusedActivation act) {
  dnnl::primitive_attr attr = default_attr();
  dnnl::post_ops po;
  if (residual && residual_md) po.append_binary(dnnl::algorithm::binary_add, *residual_md);
  if (residual && !residual_md) po.append_sum(1.0f);
  if (act != FusedActivation::None) po.append_eltwise(1.0f, eltwise_alg(act), 0.0f, 0.0f);
  if (po.len() > 0) attr.set_post_ops(po);
  return attr;
}

bool is_reference(const char* impl) { return std::string_view(impl).substr(0, 3) == "ref"; }

// ---- convolution ----

struct ConvEntry {
  dnnl::convolution_forward prim;
  dnnl::reorder pack;
  dnnl::memory wei_plain, wei_packed;
  // src/dst in the caller's layout and in the primitive's (the same object when no reorder is needed).
  dnnl::memory src_user, src_prim, dst_user, dst_prim, bias, scratch;
  dnnl::reorder src_reorder, dst_reorder, residual_reorder;
  bool src_reordered = false, dst_reordered = false;
  size_t scratch_bytes = 0, src_bytes = 0, dst_bytes = 0;
  FusedWeightLayout layout;
};

// Note [Fused conv implementation by measurement]
// oneDNN offers several implementations of a convolution in its order of
// preference, and its first (brgconv) is not always the fastest for
// inference: measured here at 1 thread, jit:avx512_core took 0.25 vs 0.34 ms
// for the cnn's 1->32 3x3 conv at 28x28 (batch 64), 2.43 vs 2.82 ms for its
// 32->64 at 14x14, 0.18 vs 0.25 ms for resnet's 3->16 stem. So a new problem
// (a cache miss: once per shape and thread budget) times its first few
// non-reference implementations on zeroed buffers, best of three runs each,
// and keeps the fastest: a few milliseconds once, as cuDNN's benchmark mode.
// The choice can differ between runs of a program (timing), never between
// the calls of one: the cache entry keeps it.
template <typename Pd>
Pd fastest(Pd& pd) {
  constexpr int kCandidates = 3, kRuns = 3;
  Pd best = pd;
  double best_ms = -1;
  for (int c = 0; c < kCandidates; ++c) {
    if (c > 0 && !pd.next_impl()) break;
    if (is_reference(pd.impl_info_str())) break;
    const size_t sb = align64(pd.src_desc().get_size()), wb = align64(pd.weights_desc().get_size()),
                 bb = align64(pd.bias_desc().get_size()), db = align64(pd.dst_desc().get_size()),
                 xb = align64(pd.scratchpad_desc().get_size());
    ScratchBlock block(sb + wb + bb + db + xb);
    std::memset(block.data(), 0, sb + wb + bb + db + xb);
    char* p = block.data();
    const dnnl::memory src = make_memory(pd.src_desc()), wei = make_memory(pd.weights_desc()),
                       dst = make_memory(pd.dst_desc()), scr = make_memory(pd.scratchpad_desc());
    const dnnl::memory bias = bb > 0 ? make_memory(pd.bias_desc()) : dnnl::memory();
    const dnnl::convolution_forward prim(pd);
    note_created();
    double ms = 1e30;
    for (int r = 0; r < kRuns; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const Arg a_src{DNNL_ARG_SRC, &src, p}, a_wei{DNNL_ARG_WEIGHTS, &wei, p + sb},
          a_bias{DNNL_ARG_BIAS, &bias, p + sb + wb}, a_dst{DNNL_ARG_DST, &dst, p + sb + wb + bb},
          a_scr{DNNL_ARG_SCRATCHPAD, &scr, p + sb + wb + bb + db};
      if (bb > 0)
        execute(prim, {a_src, a_wei, a_bias, a_dst, a_scr});
      else
        execute(prim, {a_src, a_wei, a_dst, a_scr});
      ms = std::min(ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    if (best_ms < 0 || ms < best_ms) {
      best_ms = ms;
      best = pd;
    }
  }
  return best;
}

Key conv_key(const FusedConvArgs& a) {
  const Conv2dParams& p = a.p;
  Key key(kFusedConv);
  key.add_all(p.n, p.c, p.h, p.w, p.o, p.kh, p.kw, p.groups, p.oh, p.ow, a.bias, a.residual, a.act, max_threads());
  key.add_all(p.stride[0], p.stride[1], p.dilation[0], p.dilation[1], p.pad_l[0], p.pad_l[1], p.pad_r[0], p.pad_r[1],
              p.input_nhwc, p.output_nhwc);
  return key;
}

ConvEntry* conv_entry(const FusedConvArgs& a) {
  KILN_ASSERT(a.p.dtype == DType::Float32, "fused conv: float32 only");
  const Key key = conv_key(a);
  auto& c = thread_cache<ConvEntry>();
  if (ConvEntry* e = c.find(key)) return e;

  const Conv2dParams& p = a.p;
  constexpr auto f32 = dnnl::memory::data_type::f32;
  const dims src{p.n, p.c, p.h, p.w}, dst{p.n, p.o, p.oh, p.ow};
  const dims wei =
      p.groups > 1 ? dims{p.groups, p.o / p.groups, p.c / p.groups, p.kh, p.kw} : dims{p.o, p.c, p.kh, p.kw};
  const tag wei_tag = p.groups > 1 ? tag::goihw : tag::oihw;
  const dims strides{p.stride[0], p.stride[1]}, dil{p.dilation[0] - 1, p.dilation[1] - 1};
  const dims pl{p.pad_l[0], p.pad_l[1]}, pr{p.pad_r[0], p.pad_r[1]};
  const dnnl::memory::desc src_user({src, f32, p.input_nhwc ? tag::nhwc : tag::nchw});
  const dnnl::memory::desc dst_user({dst, f32, p.output_nhwc ? tag::nhwc : tag::nchw});
  const dnnl::memory::desc wei_plain(wei, f32, wei_tag), wei_any(wei, f32, tag::any), bias_md({p.o}, f32, tag::x);
  auto e = std::make_unique<ConvEntry>();
  try {
    using Pd = dnnl::convolution_forward::primitive_desc;
    // The implementation iterator walks while its descriptor and attributes live.
    const dnnl::primitive_attr attr = epilogue_attr(a.residual, nullptr, a.act);
    auto make = [&](tag act) {
      const dnnl::memory::desc s(src, f32, act), d(dst, f32, act);
      constexpr auto kInfer = dnnl::prop_kind::forward_inference;
      constexpr auto kDirect = dnnl::algorithm::convolution_direct;
      const auto desc =
          a.bias ? dnnl::convolution_forward::desc(kInfer, kDirect, s, wei_any, bias_md, d, strides, dil, pl, pr)
                 : dnnl::convolution_forward::desc(kInfer, kDirect, s, wei_any, d, strides, dil, pl, pr);
      Pd first(desc, attr, engine());
      return is_reference(first.impl_info_str()) ? first : fastest(first);
    };
    Pd pd = make(tag::nhwc);
    if (is_reference(pd.impl_info_str())) {
      Pd any = make(tag::any);
      if (!is_reference(any.impl_info_str())) pd = any;
    }
    e->prim = dnnl::convolution_forward(pd);
    note_created();
    e->layout = layout_of(pd.weights_desc());
    e->wei_plain = make_memory(wei_plain);
    e->wei_packed = make_memory(pd.weights_desc());
    e->pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), wei_plain, engine(), pd.weights_desc()));
    note_created();
    e->scratch = make_memory(pd.scratchpad_desc());
    e->scratch_bytes = pd.scratchpad_desc().get_size();
    if (a.bias) e->bias = make_memory(bias_md);
    e->src_user = make_memory(src_user);
    e->dst_user = make_memory(dst_user);
    e->src_reordered = pd.src_desc() != src_user;
    e->dst_reordered = pd.dst_desc() != dst_user;
    e->src_prim = e->src_reordered ? make_memory(pd.src_desc()) : e->src_user;
    e->dst_prim = e->dst_reordered ? make_memory(pd.dst_desc()) : e->dst_user;
    if (e->src_reordered) {
      e->src_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), src_user, engine(), pd.src_desc()));
      e->src_bytes = align64(pd.src_desc().get_size());
      note_created();
    }
    if (e->dst_reordered) {
      e->dst_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), pd.dst_desc(), engine(), dst_user));
      e->dst_bytes = align64(pd.dst_desc().get_size());
      note_created();
      if (a.residual) {
        // The sum post-op reads the residual from the destination in the primitive's layout.
        e->residual_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), dst_user, engine(), pd.dst_desc()));
        note_created();
      }
    }
  } catch (const dnnl::error& err) {
    rethrow(err, "fused conv2d (inference)");
  }
  return c.insert(key, std::move(e));
}

// ---- linear ----

struct LinearEntry {
  dnnl::matmul prim;
  dnnl::reorder pack;
  dnnl::memory src, wei_plain, wei_packed, bias, residual, dst, scratch;
  size_t scratch_bytes = 0;
  FusedWeightLayout layout;
};

// GELU (tanh) as kiln's rows over the product's output rather than oneDNN's
// post-op, as kernels::matmul does (Note [GELU after the product] in
// dnnl_matmul.cpp); after the residual's add, as the post-ops would be.
bool gelu_after(const FusedLinearArgs& a) {
#ifdef KILN_GELU_ROWS
  return a.act == FusedActivation::GeluTanh;
#else
  (void)a;
  return false;
#endif
}

LinearEntry* linear_entry(const FusedLinearArgs& a) {
  Key key(kFusedLinear);
  key.add_all(a.m, a.n, a.k, a.bias, a.residual, a.act, max_threads());
  auto& c = thread_cache<LinearEntry>();
  if (LinearEntry* e = c.find(key)) return e;

  constexpr auto f32 = dnnl::memory::data_type::f32;
  const dnnl::memory::desc src_md({a.m, a.k}, f32, dims{a.k, 1}), dst_md({a.m, a.n}, f32, dims{a.n, 1});
  // W [n, k] row-major is Wᵀ [k, n] with strides {1, k}.
  const dnnl::memory::desc wei_plain({a.k, a.n}, f32, dims{1, a.k}), wei_any({a.k, a.n}, f32, tag::any);
  const dnnl::memory::desc bias_md({1, a.n}, f32, dims{a.n, 1});
  auto e = std::make_unique<LinearEntry>();
  try {
    const auto desc =
        a.bias ? dnnl::matmul::desc(src_md, wei_any, bias_md, dst_md) : dnnl::matmul::desc(src_md, wei_any, dst_md);
    const FusedActivation act = gelu_after(a) ? FusedActivation::None : a.act;
    const dnnl::matmul::primitive_desc pd(desc, epilogue_attr(a.residual, &dst_md, act), engine());
    e->prim = dnnl::matmul(pd);
    note_created();
    e->layout = layout_of(pd.weights_desc());
    e->wei_plain = make_memory(wei_plain);
    e->wei_packed = make_memory(pd.weights_desc());
    e->pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), wei_plain, engine(), pd.weights_desc()));
    note_created();
    e->src = make_memory(src_md);
    e->dst = make_memory(dst_md);
    if (a.bias) e->bias = make_memory(bias_md);
    if (a.residual) e->residual = make_memory(dst_md);
    e->scratch = make_memory(pd.scratchpad_desc());
    e->scratch_bytes = pd.scratchpad_desc().get_size();
  } catch (const dnnl::error& err) {
    rethrow(err, "fused linear (inference)");
  }
  return c.insert(key, std::move(e));
}

constexpr int kResidualArg = DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1;

}  // namespace

// Each entry point runs under the thread budget the forward runs under: the
// cache key holds it, so the layout asked for, the packing and the forward
// all find the same primitive (and so the same weight layout).
namespace {
bool serial(const FusedConvArgs& a) {
  const Conv2dParams& p = a.p;
  return p.n * p.o * p.oh * p.ow * (p.c / p.groups) * p.kh * p.kw < kSerialMacs;
}
bool serial(const FusedLinearArgs& a) { return a.m * a.n * a.k < kSerialMacs; }
}  // namespace

FusedWeightLayout fused_conv_weight_layout(const FusedConvArgs& a) {
  const SerialScope scope(serial(a));
  return conv_entry(a)->layout;
}

void fused_conv_pack_weight(const FusedConvArgs& a, const void* weight, void* packed) {
  KILN_CAPTURE_KERNEL("fused_conv_pack_weight", fused_conv_pack_weight(a, weight, packed));
  const SerialScope scope(serial(a));
  ConvEntry* e = conv_entry(a);
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, weight}, {DNNL_ARG_TO, &e->wei_packed, packed}});
}

void fused_conv_forward(const FusedConvArgs& a, const void* input, const void* packed, const void* bias,
                        const void* residual, void* output) {
  KILN_CAPTURE_KERNEL("fused_conv_forward", fused_conv_forward(a, input, packed, bias, residual, output));
  const SerialScope scope(serial(a));
  ConvEntry* e = conv_entry(a);
  ScratchBlock block(e->src_bytes + e->dst_bytes + align64(e->scratch_bytes));
  char* src_buf = block.data();
  char* dst_buf = src_buf + e->src_bytes;
  char* scratch = dst_buf + e->dst_bytes;
  const void* src = input;
  if (e->src_reordered) {
    execute(e->src_reorder, {{DNNL_ARG_FROM, &e->src_user, input}, {DNNL_ARG_TO, &e->src_prim, src_buf}});
    src = src_buf;
  }
  void* dst = e->dst_reordered ? static_cast<void*>(dst_buf) : output;
  if (a.residual) {
    // The sum post-op adds what the destination holds: the residual, copied in.
    if (e->dst_reordered)
      execute(e->residual_reorder, {{DNNL_ARG_FROM, &e->dst_user, residual}, {DNNL_ARG_TO, &e->dst_prim, dst_buf}});
    else
      std::memcpy(output, residual, e->dst_user.get_desc().get_size());
  }
  const Arg a_src{DNNL_ARG_SRC, &e->src_prim, src}, a_wei{DNNL_ARG_WEIGHTS, &e->wei_packed, packed},
      a_dst{DNNL_ARG_DST, &e->dst_prim, dst}, a_scr{DNNL_ARG_SCRATCHPAD, &e->scratch, scratch},
      a_bias{DNNL_ARG_BIAS, &e->bias, bias};
  if (a.bias)
    execute(e->prim, {a_src, a_wei, a_bias, a_dst, a_scr});
  else
    execute(e->prim, {a_src, a_wei, a_dst, a_scr});
  if (e->dst_reordered)
    execute(e->dst_reorder, {{DNNL_ARG_FROM, &e->dst_prim, dst_buf}, {DNNL_ARG_TO, &e->dst_user, output}});
}

FusedWeightLayout fused_linear_weight_layout(const FusedLinearArgs& a) {
  const SerialScope scope(serial(a));
  return linear_entry(a)->layout;
}

void fused_linear_pack_weight(const FusedLinearArgs& a, const void* weight, void* packed) {
  KILN_CAPTURE_KERNEL("fused_linear_pack_weight", fused_linear_pack_weight(a, weight, packed));
  const SerialScope scope(serial(a));
  LinearEntry* e = linear_entry(a);
  execute(e->pack, {{DNNL_ARG_FROM, &e->wei_plain, weight}, {DNNL_ARG_TO, &e->wei_packed, packed}});
}

void fused_linear_forward(const FusedLinearArgs& a, const void* x, const void* packed, const void* bias,
                          const void* residual, void* y) {
  KILN_CAPTURE_KERNEL("fused_linear_forward", fused_linear_forward(a, x, packed, bias, residual, y));
  const SerialScope scope(serial(a));
  LinearEntry* e = linear_entry(a);
  ScratchBlock block(e->scratch_bytes);
  const Arg a_src{DNNL_ARG_SRC, &e->src, x}, a_wei{DNNL_ARG_WEIGHTS, &e->wei_packed, packed},
      a_dst{DNNL_ARG_DST, &e->dst, y}, a_scr{DNNL_ARG_SCRATCHPAD, &e->scratch, block.data()},
      a_bias{DNNL_ARG_BIAS, &e->bias, bias}, a_res{kResidualArg, &e->residual, residual};
  if (a.bias && a.residual)
    execute(e->prim, {a_src, a_wei, a_bias, a_res, a_dst, a_scr});
  else if (a.bias)
    execute(e->prim, {a_src, a_wei, a_bias, a_dst, a_scr});
  else if (a.residual)
    execute(e->prim, {a_src, a_wei, a_res, a_dst, a_scr});
  else
    execute(e->prim, {a_src, a_wei, a_dst, a_scr});
#ifdef KILN_GELU_ROWS
  if (gelu_after(a)) vm::gelu_tanh_rows_in_place(static_cast<float*>(y), a.m, a.n, a.n);
#endif
}

}  // namespace kiln::kernels
