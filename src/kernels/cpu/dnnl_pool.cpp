// 2-D pooling forward and backward on oneDNN (float32, bfloat16, NCHW or,
// with p.nhwc, channels-last). pool2d.cpp decides when oneDNN's semantics equal torch's and calls
// in here; otherwise it runs its own loops. A training-mode max pool also
// writes oneDNN's workspace (argmax positions in its own format), which its
// backward reads instead of searching the windows again.
#include <algorithm>

#include "dnnl_common.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

namespace {

using namespace dnnl_detail;
using dims = dnnl::memory::dims;
using tag = dnnl::memory::format_tag;

struct PoolEntry {
  dnnl::pooling_v2_forward::primitive_desc pd;  // the backward primitive's hint
  dnnl::pooling_v2_forward prim;
  dnnl::memory src, dst, workspace, scratch;
  size_t scratch_bytes = 0, workspace_bytes = 0;
};

struct PoolBwdEntry {
  dnnl::pooling_v2_backward prim;
  dnnl::memory diff_dst, diff_src, workspace, scratch;
  size_t scratch_bytes = 0;
};

dnnl::algorithm pool_algorithm(const Pool2dParams& p) {
  return p.kind == PoolKind::Max             ? dnnl::algorithm::pooling_max
         : p.kind == PoolKind::AvgIncludePad ? dnnl::algorithm::pooling_avg_include_padding
                                             : dnnl::algorithm::pooling_avg_exclude_padding;
}

Key pool_key(PrimKind kind, const Pool2dParams& p) {
  Key key(kind);
  key.add_all(p.dtype, p.kind, p.n, p.c, p.h, p.w, p.oh, p.ow, max_threads(), p.nhwc);
  key.add_all(p.kernel[0], p.kernel[1], p.stride[0], p.stride[1], p.pad[0], p.pad[1], p.dilation[0], p.dilation[1]);
  return key;
}

// oneDNN wants the right/bottom padding that makes its output size formula
// exact; torch's symmetric padding may leave the last rows unread (floor) or
// windows that run past the padding (ceil_mode), so derive it from the output.
int64_t pad_right(int64_t in, int64_t out, int64_t k, int64_t s, int64_t d, int64_t pad) {
  return std::max<int64_t>(0, (out - 1) * s + (k - 1) * d + 1 - in - pad);
}

dims pads_right(const Pool2dParams& p) {
  return {pad_right(p.h, p.oh, p.kernel[0], p.stride[0], p.dilation[0], p.pad[0]),
          pad_right(p.w, p.ow, p.kernel[1], p.stride[1], p.dilation[1], p.pad[1])};
}

// Training entries (with a workspace for max pooling) also serve as the backward primitive's hint.
PoolEntry* get_entry(const Pool2dParams& p, bool training) {
  const Key key = pool_key(training ? PrimKind::PoolFwdTraining : PrimKind::PoolFwd, p);
  auto& c = thread_cache<PoolEntry>();
  if (PoolEntry* e = c.find(key)) return e;

  const auto t = to_dnnl(p.dtype);
  auto e = std::make_unique<PoolEntry>();
  try {
    const tag layout = p.nhwc ? tag::nhwc : tag::nchw;
    const dnnl::memory::desc src_md({p.n, p.c, p.h, p.w}, t, layout);
    const dnnl::memory::desc dst_md({p.n, p.c, p.oh, p.ow}, t, layout);
    const dnnl::pooling_v2_forward::desc desc(
        training ? dnnl::prop_kind::forward_training : dnnl::prop_kind::forward_inference, pool_algorithm(p), src_md,
        dst_md, dims{p.stride[0], p.stride[1]}, dims{p.kernel[0], p.kernel[1]},
        dims{p.dilation[0] - 1, p.dilation[1] - 1}, dims{p.pad[0], p.pad[1]}, pads_right(p));
    e->pd = dnnl::pooling_v2_forward::primitive_desc(desc, default_attr(), engine());
    e->prim = dnnl::pooling_v2_forward(e->pd);
    e->src = make_memory(src_md);
    e->dst = make_memory(dst_md);
    e->scratch = make_memory(e->pd.scratchpad_desc());
    e->scratch_bytes = e->pd.scratchpad_desc().get_size();
    e->workspace = make_memory(e->pd.workspace_desc());
    e->workspace_bytes = e->pd.workspace_desc().get_size();
  } catch (const dnnl::error& err) {
    rethrow(err, "pool2d");
  }
  note_created();
  return c.insert(key, std::move(e));
}

PoolBwdEntry* get_bwd_entry(const Pool2dParams& p) {
  const Key key = pool_key(PrimKind::PoolBwd, p);
  auto& c = thread_cache<PoolBwdEntry>();
  if (PoolBwdEntry* e = c.find(key)) return e;

  const PoolEntry* hint = get_entry(p, true);
  const auto t = to_dnnl(p.dtype);
  auto e = std::make_unique<PoolBwdEntry>();
  try {
    const tag layout = p.nhwc ? tag::nhwc : tag::nchw;
    const dnnl::memory::desc src_md({p.n, p.c, p.h, p.w}, t, layout);
    const dnnl::memory::desc dst_md({p.n, p.c, p.oh, p.ow}, t, layout);
    const dnnl::pooling_v2_backward::desc desc(
        pool_algorithm(p), src_md, dst_md, dims{p.stride[0], p.stride[1]}, dims{p.kernel[0], p.kernel[1]},
        dims{p.dilation[0] - 1, p.dilation[1] - 1}, dims{p.pad[0], p.pad[1]}, pads_right(p));
    dnnl::pooling_v2_backward::primitive_desc pd(desc, default_attr(), engine(), hint->pd);
    e->prim = dnnl::pooling_v2_backward(pd);
    e->diff_src = make_memory(src_md);
    e->diff_dst = make_memory(dst_md);
    e->workspace = make_memory(pd.workspace_desc());
    e->scratch = make_memory(pd.scratchpad_desc());
    e->scratch_bytes = pd.scratchpad_desc().get_size();
  } catch (const dnnl::error& err) {
    rethrow(err, "pool2d backward");
  }
  note_created();
  return c.insert(key, std::move(e));
}

}  // namespace

size_t dnnl_pool2d_workspace_bytes(const Pool2dParams& p) {
  return p.kind == PoolKind::Max ? get_entry(p, true)->workspace_bytes : 0;
}

void dnnl_pool2d_forward(const Pool2dParams& p, const void* input, void* output, void* workspace) {
  const bool training = workspace != nullptr && p.kind == PoolKind::Max;
  PoolEntry* e = get_entry(p, training);
  ScratchBlock scratch(e->scratch_bytes);
  if (training) {
    execute(e->prim, {{DNNL_ARG_SRC, &e->src, input},
                      {DNNL_ARG_DST, &e->dst, output},
                      {DNNL_ARG_WORKSPACE, &e->workspace, workspace},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  } else {
    execute(e->prim, {{DNNL_ARG_SRC, &e->src, input},
                      {DNNL_ARG_DST, &e->dst, output},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  }
}

// grad_input from grad_output (and, for max pooling, the forward's workspace).
void dnnl_pool2d_backward(const Pool2dParams& p, const void* grad_output, const void* workspace, void* grad_input) {
  PoolBwdEntry* e = get_bwd_entry(p);
  ScratchBlock scratch(e->scratch_bytes);
  if (p.kind == PoolKind::Max) {
    execute(e->prim, {{DNNL_ARG_DIFF_DST, &e->diff_dst, grad_output},
                      {DNNL_ARG_WORKSPACE, &e->workspace, workspace},
                      {DNNL_ARG_DIFF_SRC, &e->diff_src, grad_input},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  } else {
    execute(e->prim, {{DNNL_ARG_DIFF_DST, &e->diff_dst, grad_output},
                      {DNNL_ARG_DIFF_SRC, &e->diff_src, grad_input},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  }
}

}  // namespace kiln::kernels
