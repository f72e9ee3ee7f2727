// kernels::matmul: oneDNN's matmul primitive for float32/bfloat16 (strided
// operands are passed as strided memory descriptors, so a transposed operand
// such as linear's Wᵀ is read in place), BLAS or loops for the rest.
#include <cstring>

#include "dnnl_common.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"

namespace kiln::kernels {

namespace {

using namespace dnnl_detail;
using dims = dnnl::memory::dims;

struct MatmulEntry {
  dnnl::matmul prim;
  dnnl::memory src, wei, bias, dst, scratch;
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
struct OperandLayout {
  BlasLayout l;
  int64_t batch = 0;  // 0: 2-D descriptor
  int64_t batch_stride = 0;
};

dnnl::memory::desc matrix_md(dnnl::memory::data_type t, int64_t rows, int64_t cols, const OperandLayout& o) {
  const dims st2 = o.l.trans ? dims{1, o.l.ld} : dims{o.l.ld, 1};
  if (o.batch == 0) return {{rows, cols}, t, st2};
  int64_t bs = o.batch_stride;
  if (o.batch == 1) bs = o.l.ld * (o.l.trans ? cols : rows);  // any stride covering the matrix
  return {{o.batch, rows, cols}, t, {bs, st2[0], st2[1]}};
}

OperandLayout operand_layout(const MatrixOperand& op, int64_t batch, int64_t rows, int64_t cols) {
  OperandLayout o;
  o.l = blas_layout(rows, cols, op.stride[1], op.stride[2]);
  KILN_ASSERT(o.l.ok, "matmul: operand without a unit stride reached the kernel");
  if (batch > 1) {
    o.batch = op.stride[0] == 0 ? 1 : batch;
    o.batch_stride = op.stride[0];
  }
  return o;
}

MatmulEntry* get_entry(const MatmulArgs& g, const OperandLayout& la, const OperandLayout& lb) {
  Key key(PrimKind::Matmul);
  key.add_all(g.dtype, g.batch, g.m, g.n, g.k, g.bias != nullptr, max_threads(), static_cast<int>(g.epilogue));
  key.add_all(la.l.trans, la.l.ld, la.batch, la.batch_stride, lb.l.trans, lb.l.ld, lb.batch, lb.batch_stride);
  auto& c = cache();
  if (MatmulEntry* e = c.find(key)) return e;

  const auto t = to_dnnl(g.dtype);
  const bool batched = g.batch > 1;
  const dnnl::memory::desc a_md = matrix_md(t, g.m, g.k, la);
  const dnnl::memory::desc b_md = matrix_md(t, g.k, g.n, lb);
  const dnnl::memory::desc c_md = batched ? dnnl::memory::desc({g.batch, g.m, g.n}, t, dims{g.m * g.n, g.n, 1})
                                          : dnnl::memory::desc({g.m, g.n}, t, dims{g.n, 1});
  auto e = std::make_unique<MatmulEntry>();
  try {
    dnnl::primitive_attr attr = default_attr();
    if (g.epilogue != MatmulEpilogue::None) {
      dnnl::post_ops po;
      po.append_eltwise(1.0f,
                        g.epilogue == MatmulEpilogue::GeluTanh ? dnnl::algorithm::eltwise_gelu_tanh
                                                              : dnnl::algorithm::eltwise_gelu_erf,
                        0.0f, 0.0f);
      attr.set_post_ops(po);
    }
    dnnl::matmul::primitive_desc pd;
    if (g.bias) {
      const dnnl::memory::desc bias_md = batched ? dnnl::memory::desc({1, 1, g.n}, t, dims{g.n, g.n, 1})
                                                 : dnnl::memory::desc({1, g.n}, t, dims{g.n, 1});
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, engine());
      e->bias = make_memory(bias_md);
    } else {
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine());
    }
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

void dnnl_matmul(const MatmulArgs& g) {
  const OperandLayout la = operand_layout(g.a, g.batch, g.m, g.k);
  const OperandLayout lb = operand_layout(g.b, g.batch, g.k, g.n);
  MatmulEntry* e = get_entry(g, la, lb);
  ScratchBlock scratch(e->scratch_bytes);
  if (g.bias) {
    execute(e->prim, {{DNNL_ARG_SRC, &e->src, g.a.data},
                      {DNNL_ARG_WEIGHTS, &e->wei, g.b.data},
                      {DNNL_ARG_BIAS, &e->bias, g.bias},
                      {DNNL_ARG_DST, &e->dst, g.c},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  } else {
    execute(e->prim, {{DNNL_ARG_SRC, &e->src, g.a.data},
                      {DNNL_ARG_WEIGHTS, &e->wei, g.b.data},
                      {DNNL_ARG_DST, &e->dst, g.c},
                      {DNNL_ARG_SCRATCHPAD, &e->scratch, scratch.data()}});
  }
}

}  // namespace

void matmul(const MatmulArgs& g) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  if (g.k == 0) {
    // An empty sum: the bias (or zero) everywhere. oneDNN cannot take k = 0.
    const size_t row = static_cast<size_t>(g.n * element_size(g.dtype));
    char* c = static_cast<char*>(g.c);
    for (int64_t r = 0; r < g.batch * g.m; ++r) {
      if (g.bias) {
        std::memcpy(c + r * row, g.bias, row);
      } else {
        std::memset(c + r * row, 0, row);
      }
    }
    return;
  }
  switch (g.dtype) {
    case DType::Float32:
    case DType::BFloat16: dnnl_matmul(g); return;
    case DType::Float64:
    case DType::Int64:
    case DType::Int32:
    case DType::UInt8:
      KILN_ASSERT(g.epilogue == MatmulEpilogue::None, "kernels::matmul: an epilogue needs float32 or bfloat16");
      blas_matmul(g);
      return;
    default: KILN_ASSERT(false, "kernels::matmul: unsupported dtype ", dtype_name(g.dtype));
  }
}

}  // namespace kiln::kernels
