// mm, bmm, matmul, linear: shape and dtype checks, operand layout, output
// allocation, and their backward; the products themselves are
// kernels::matmul (oneDNN / BLAS).
//
// Note [Products with transposed operands]
// Every product, forward or backward, goes through product(a, b, ta, tb) =
// op(a) · op(b), where op transposes the last two dims when asked. The
// transposition is only a swap of strides in the kernel's operand
// descriptor, so oneDNN reads aᵀ in place (no copy, no view object), and
// product records its own MmBackward0 / BmmBackward0 whose formula is again
// product with other flags: mm, bmm and 2-D linear differentiate to any
// order without depending on other ops' backward. matmul's broadcasting and
// 1-D cases and linear's leading dims add views (unsqueeze, reshape) and
// sums to the formula; those differentiate again through the view and
// reduction ops' own backward.
#include "kiln/ops/linalg.h"

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "banded_matmul.h"
#include "iter.h"
#include "kiln/autograd/functions.h"
#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"
#include "kiln/core/guards.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/ops/autocast.h"
#include "kiln/ops/factory.h"
#include "op_record.h"

namespace kiln {

namespace {

// One operand of the kernel call: the tensor that owns the memory and the
// (batch, row, col) strides the kernel reads it with.
struct Operand {
  Tensor t;
  int64_t rows = 0, cols = 0;
  int64_t stride[3] = {0, 0, 1};
  int64_t outer_stride = 0;  // a 4-D operand's dim 0 (matrix_operand4)
};

// The last two dims of `t` as a matrix (batch stride: dim -3 when present and
// batched, else 0). Copies to contiguous when the matrix has no unit stride.
Operand matrix_operand(Tensor t, bool batched) {
  const int64_t d = t.dim();
  Operand o;
  o.rows = t.size(d - 2);
  o.cols = t.size(d - 1);
  if (!kernels::blas_layout(o.rows, o.cols, t.stride(d - 2), t.stride(d - 1)).ok) t = t.contiguous();
  o.stride[0] = (batched && d >= 3 && t.size(d - 3) != 1) ? t.stride(d - 3) : 0;
  o.stride[1] = t.stride(d - 2);
  o.stride[2] = t.stride(d - 1);
  o.t = std::move(t);
  return o;
}

// A 4-D operand [outer, batch, rows, cols] whose two batch dims keep their own
// strides (kernels::MatmulArgs::outer); a size-1 dim is a broadcast (stride 0).
Operand matrix_operand4(const Tensor& t) {
  Operand o = matrix_operand(t, true);
  o.outer_stride = o.t.size(0) != 1 ? o.t.stride(0) : 0;
  return o;
}

// A matrix operand read transposed: rows and cols swapped (linear's Wᵀ).
Operand transposed(Operand o) {
  std::swap(o.rows, o.cols);
  std::swap(o.stride[1], o.stride[2]);
  return o;
}

void check_matmul_dtypes(const char* op, const Tensor& a, const Tensor& b, const char* a_name, const char* b_name) {
  KILN_CHECK(a.dtype() == b.dtype(), DTypeError, op, ": expected ", a_name, " and ", b_name,
             " to have the same dtype, got ", dtype_name(a.dtype()), " and ", dtype_name(b.dtype()),
             " (convert one with .to(dtype))");
  KILN_CHECK(a.dtype() != kBool, DTypeError, op,
             ": bool tensors are not supported (as in torch); convert to an integer or floating dtype first");
}

// float16 has no product kernel: `compute` runs on float32 copies of the operands (detached; an undefined one,
// such as an absent bias, stays undefined) and its result converts back to float16. Callers hold a NoGradGuard.
template <typename F, typename... Operands>
Tensor through_float32(F&& compute, const Operands&... operands) {
  auto widen = [](const Tensor& t) { return t.defined() ? t.detach().to(kFloat32) : t; };
  return compute(widen(operands)...).to(kFloat16);
}

// c = a · b (+ bias) into `out` (contiguous, batch * a.rows * b.cols
// elements). float16 callers convert before they get here (through_float32).
// The product a @ b for the kernel: dtype, shape and both operands (batch 1, no bias, no output yet).
kernels::MatmulArgs product_args(const Operand& a, const Operand& b) {
  kernels::MatmulArgs g;
  g.dtype = a.t.dtype();
  g.m = a.rows;
  g.k = a.cols;
  g.n = b.cols;
  g.a.data = a.t.data_ptr();
  g.b.data = b.t.data_ptr();
  for (int i = 0; i < 3; ++i) {
    g.a.stride[i] = a.stride[i];
    g.b.stride[i] = b.stride[i];
  }
  g.a.outer_stride = a.outer_stride;
  g.b.outer_stride = b.outer_stride;
  return g;
}

// out [B, H, m, n] = a · b for 4-D operands (matrix_operand4) in one kernel
// call over all B * H products, out's four strides as they are (its last is 1).
void run_matmul4_into(const Operand& a, const Operand& b, const Tensor& out, kernels::MatmulBand band = {}) {
  kernels::MatmulArgs g = product_args(a, b);
  g.band = band;
  g.outer = out.size(0);
  g.batch = out.size(1);
  g.c = out.data_ptr();
  g.c_outer_stride = out.stride(0);
  g.c_stride[0] = out.stride(1);
  g.c_stride[1] = out.size(2) > 1 ? out.stride(2) : 0;  // a single row's stride is arbitrary
  kernels::matmul(g);
}

void run_matmul_into(const Operand& a, const Operand& b, const Tensor& bias, int64_t batch, const Tensor& out,
                     kernels::MatmulEpilogue epilogue = kernels::MatmulEpilogue::None, int64_t c_batch_stride = 0,
                     int64_t c_row_stride = 0, kernels::MatmulBand band = {}) {
  kernels::MatmulArgs g = product_args(a, b);
  g.band = band;
  g.batch = batch;
  g.bias = bias.defined() ? bias.data_ptr() : nullptr;
  g.c = out.data_ptr();
  g.c_stride[0] = c_batch_stride;
  g.c_stride[1] = c_row_stride;
  g.epilogue = epilogue;
  kernels::matmul(g);
}

// c = a · b (+ bias) into a new contiguous tensor of out_shape.
Tensor run_matmul(const Operand& a, const Operand& b, const Tensor& bias, int64_t batch, IntArrayRef out_shape) {
  Tensor out = ops::new_output(out_shape, a.t.dtype());
  run_matmul_into(a, b, bias, batch, out);
  return out;
}

// True when the batch dims of `t` (all but the last two) can be viewed as one
// without a copy: evenly strided once size-1 dims are skipped.
bool batch_merges(const Tensor& t) {
  int64_t expected = -1;
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (expected != -1 && t.stride(d) != expected) return false;
    expected = t.stride(d) * t.size(d);
  }
  return true;
}

// out [..., m, n] = a [..., m, k] · b [..., k, n] for operands with the same
// batch shape whose batch dims do not merge (attention's heads viewed out of a
// [B, T, 3C] projection: [B, nh, T, hs] with strides [3TC, hs, 3C, 1]).
// Rather than copying an operand to contiguous, it peels leading batch dims
// until four dims are left, and runs those as one product with two strided
// batch dims (one oneDNN call for all B * nh heads: a call per b with nh
// 64×64 products each ran at under half the product's speed): oneDNN reads
// the interleaved heads in place.
void batched_into(const Tensor& a, const Tensor& b, const Tensor& out) {
  if (a.dim() == 4 && a.size(0) > 1 && a.size(1) > 1 && a.dtype() != kFloat16) {
    run_matmul4_into(matrix_operand4(a), matrix_operand4(b), out);
    return;
  }
  if (a.dim() <= 3 || (batch_merges(a) && batch_merges(b))) {
    const int64_t rows = a.size(-2), cols = b.size(-1);
    const int64_t batch = shape_numel(IntArrayRef(a.sizes().data(), a.dim() - 2));
    const Tensor a3 = a.dim() == 2 ? a : a.reshape({batch, rows, a.size(-1)});
    const Tensor b3 = b.dim() == 2 ? b : b.reshape({batch, b.size(-2), cols});
    const bool batched = a3.dim() == 3;
    run_matmul_into(matrix_operand(a3, batched), matrix_operand(b3, batched), Tensor(), batch, out);
    return;
  }
  for (int64_t i = 0; i < a.size(0); ++i) batched_into(a.select(0, i), b.select(0, i), out.select(0, i));
}

// True when all dims but the last of `t` can be viewed as one (evenly strided).
bool rows_merge(const Tensor& t) {
  int64_t expected = -1;  // stride the next outer dim must have
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (expected != -1 && t.stride(d) != expected) return false;
    expected = t.stride(d) * t.size(d);
  }
  return true;
}

// ---- products with transposed operands (Note [Products with transposed operands]) ----

Tensor product(const Tensor& a, const Tensor& b, bool ta, bool tb, autograd::CallSite site);

// A product that a backward formula runs, recorded as the op torch's formula
// calls (aten::mm or aten::bmm under MmBackward0 and AddmmBackward0) with its
// FLOPs, so a profile counts backward's products as well as forward's.
Tensor backward_product(const Tensor& a, const Tensor& b, bool ta, bool tb, autograd::CallSite site) {
  ops::OpScope rs(a.dim() == 3 ? std::string_view("bmm") : std::string_view("mm"), {&a, &b});
  Tensor out = product(a, b, ta, tb, site);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, ta ? a.size(-2) : a.size(-1)));
  return out;
}

// c = op(a) · op(b) over 2-D (mm) or 3-D (bmm) operands.
struct MmBackward final : autograd::Node {
  autograd::SavedVariable a, b;  // each saved only when the other operand's gradient needs it
  bool ta = false, tb = false, batched = false;
  // An operand read as stored that is a column-major matrix (W.t() of a
  // row-major W, as in x.matmul(W.t())) gets its gradient column-major too,
  // as torch's mm_mat1/mat2_backward: then t()'s backward hands the leaf a
  // contiguous gradient that AccumulateGrad takes without a strided copy.
  bool a_col_major = false, b_col_major = false;
  const char* name() const override { return batched ? "BmmBackward0" : "MmBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    TensorList out(2);
    if (!g.defined()) return out;
    // d op(a) = g · op(b)ᵀ and d op(b) = op(a)ᵀ · g, transposed back where a or b was read transposed.
    if (next_edges()[0].is_valid()) {
      const Tensor bv = b.unpack(this);
      if (ta)
        out[0] = backward_product(bv, g, tb, true, site());
      else if (a_col_major)
        out[0] = backward_product(bv, g, tb, true, site()).t();
      else
        out[0] = backward_product(g, bv, false, !tb, site());
    }
    if (next_edges()[1].is_valid()) {
      const Tensor av = a.unpack(this);
      if (tb)
        out[1] = backward_product(g, av, true, ta, site());
      else if (b_col_major)
        out[1] = backward_product(g, av, true, ta, site()).t();
      else
        out[1] = backward_product(av, g, !ta, false, site());
    }
    return out;
  }
  void release_variables() override {
    a.reset();
    b.reset();
  }
};

Tensor product(const Tensor& a, const Tensor& b, bool ta, bool tb, autograd::CallSite site) {
  const bool batched = a.dim() == 3;
  Tensor out;
  if (a.dtype() == kFloat16) {
    const NoGradGuard no_grad;
    out = through_float32([&](const Tensor& a32, const Tensor& b32) { return product(a32, b32, ta, tb, site); }, a, b);
  } else {
    const NoGradGuard no_grad;  // only this op's own node is recorded (below)
    Operand oa = matrix_operand(a, batched), ob = matrix_operand(b, batched);
    if (ta) oa = transposed(std::move(oa));
    if (tb) ob = transposed(std::move(ob));
    const int64_t batch = batched ? std::max(a.size(0), b.size(0)) : 1;
    DimVector out_shape;
    if (batched) out_shape.push_back(batch);
    out_shape.push_back(oa.rows);
    out_shape.push_back(ob.cols);
    out = run_matmul(oa, ob, Tensor(), batch, out_shape);
  }
  if (autograd::compute_requires_grad({&a, &b})) {
    auto node = make_intrusive<MmBackward>();
    node->ta = ta;
    node->tb = tb;
    node->batched = batched;
    const auto col_major = [batched](const Tensor& t) {
      return !batched && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 && t.stride(1) == t.size(0);
    };
    node->a_col_major = !ta && col_major(a);
    node->b_col_major = !tb && col_major(b);
    if (b.requires_grad()) node->a = autograd::SavedVariable(a, false);
    if (a.requires_grad()) node->b = autograd::SavedVariable(b, false);
    autograd::set_history(out, node, {&a, &b}, site);
  }
  return out;
}

Tensor matmul_impl(const Tensor& self, const Tensor& other, autograd::CallSite site);

// matmul_impl run by a backward formula, recorded as torch's (aten::matmul) with its FLOPs.
Tensor backward_matmul(const Tensor& a, const Tensor& b, autograd::CallSite site) {
  ops::OpScope rs("matmul", {&a, &b});
  Tensor out = matmul_impl(a, b, site);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, a.size(-1)));
  return out;
}

// ---- matmul's backward for everything but 2-D · 2-D (which is mm's) ----

struct MatmulBackward final : autograd::Node {
  autograd::SavedVariable self, other;
  // torch's names where torch runs one op (dot, mv); its other matmul forms are compositions whose
  // last step names the node (UnsafeViewBackward0, SqueezeBackward3...), which says nothing useful.
  const char* name() const override {
    if (input_dims[0] == 1 && input_dims[1] == 1) return "DotBackward0";
    if (input_dims[0] == 2 && input_dims[1] == 1) return "MvBackward0";
    return "MatmulBackward0";
  }
  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    TensorList out(2);
    if (!g.defined()) return out;
    const bool need_a = next_edges()[0].is_valid(), need_b = next_edges()[1].is_valid();
    const Tensor a0 = need_b ? self.unpack(this) : Tensor(), b0 = need_a ? other.unpack(this) : Tensor();
    const int64_t da = input_dims[0], db = input_dims[1];
    if (da == 1 && db == 1) {  // dot: g is 0-dim
      if (need_a) out[0] = g * b0;
      if (need_b) out[1] = g * a0;
      return out;
    }
    // Restore the dims the forward dropped: g becomes [..., m, n].
    Tensor gm = db == 1 ? g.unsqueeze(-1) : g;
    if (da == 1) gm = gm.unsqueeze(-2);
    if (need_a) {
      // grad_a = g · bᵀ over the broadcast batch; the engine sums the batch dims a was broadcast over.
      const Tensor bm = db == 1 ? b0.unsqueeze(-1) : b0;
      Tensor ga = backward_matmul(gm, bm.transpose(-1, -2), site());
      out[0] = da == 1 ? ga.squeeze(-2) : ga;
    }
    if (need_b) {
      const Tensor am = da == 1 ? a0.unsqueeze(0) : a0;
      Tensor gb;
      if (db <= 2 && am.dim() >= 3) {
        // b is shared by every batch: one product over all rows, aᵀ [k, batch * m] · g [batch * m, n].
        const int64_t k = am.size(-1);
        gb = backward_product(am.reshape({-1, k}), gm.reshape({-1, gm.size(-1)}), true, false, site());
      } else {
        gb = backward_matmul(am.transpose(-1, -2), gm, site());
      }
      out[1] = db == 1 ? gb.squeeze(-1) : gb;
    }
    return out;
  }
  void release_variables() override {
    self.reset();
    other.reset();
  }
  int64_t input_dims[2] = {0, 0};
};

// The usual [out_features] bias (or one element) is fused into the product;
// `separate` gets any other bias shape that broadcasts to the output.
void split_bias(const Tensor& bias, IntArrayRef out_shape, int64_t out_features, Tensor& fused, Tensor& separate) {
  if (!bias.defined()) return;
  bool broadcasts = bias.dim() <= static_cast<int64_t>(out_shape.size());
  for (int64_t i = 1; broadcasts && i <= bias.dim(); ++i) {
    const int64_t bs = bias.size(-i);
    broadcasts = bs == 1 || bs == out_shape[out_shape.size() - static_cast<size_t>(i)];
  }
  KILN_CHECK(broadcasts, ShapeError, "linear: bias of shape ", bias.sizes(), " does not broadcast to the output shape ",
             out_shape, " (expected [", out_features, "])");
  if (bias.dim() <= 1) {
    fused = bias.numel() == out_features ? bias.contiguous() : bias.reshape({1}).expand({out_features}).contiguous();
  } else {
    separate = bias;
  }
}

void add_bias_in_place(Tensor& out, const Tensor& bias) {
  const auto loop = ops::make_loop(out.sizes(), {&out, &out, &bias});
  visit_dtype(out.dtype(), [&]<typename T>() {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_ASSERT(false, "linear: bool reached the bias add");
    } else {
      kernels::map_elements<T, T, T>(
          loop, [](T a, T b) { return static_cast<T>(static_cast<compute_t<T>>(a) + static_cast<compute_t<T>>(b)); });
    }
  });
}

// op(a) · op(b) for 2-D bfloat16 a and b into a new float32 tensor: the
// float32 sums unrounded (kernels::MatmulArgs::float_c). No autograd node.
Tensor product_float32_out(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  ops::OpScope rs("mm", {&a, &b});
  KILN_ASSERT(a.dim() == 2 && b.dim() == 2 && a.dtype() == kBFloat16 && b.dtype() == kBFloat16,
              "product_float32_out: 2-D bfloat16 operands");
  Operand oa = matrix_operand(a, false), ob = matrix_operand(b, false);
  if (ta) oa = transposed(std::move(oa));
  if (tb) ob = transposed(std::move(ob));
  Tensor out = ops::new_output({oa.rows, ob.cols}, kFloat32);
  kernels::MatmulArgs g = product_args(oa, ob);
  g.float_c = true;
  g.c = out.data_ptr();
  kernels::matmul(g);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, oa.cols));
  return out;
}

// y = x · Wᵀ + b over x [..., in] flattened to [rows, in].
//
// grad_W and grad_b stay a product and a sum rather than oneDNN's
// inner_product backward-weights, which computes both in one pass: for
// x [128, 784], W [512, 784] (float32, 1 thread) the fused primitive took
// 0.403-0.409 ms against 0.400 ms for the product alone, and the bias sum
// adds about 5 us to the whole backward (0.792-0.798 ms with a bias,
// 0.788-0.793 ms without), so fusing does not pay.
struct LinearBackward final : autograd::Node {
  autograd::SavedVariable input, weight;  // input for grad_weight, weight for grad_input
  const char* name() const override { return "LinearBackward0"; }
  TensorList apply(TensorList&& grads) override {
    const Tensor& g = grads[0];
    TensorList out(3);
    if (!g.defined()) return out;
    const int64_t out_features = g.dim() == 0 ? 1 : g.size(-1);
    // [rows, out_features]; 2-D gradients are used as they are, so 2-D linear needs no view's backward.
    const Tensor g2 = g.dim() == 2 ? g : g.reshape({-1, out_features});
    if (next_edges()[0].is_valid()) {
      // grad_x = g · W, as [rows, in] then in x's shape.
      const Tensor w = weight.unpack(this);
      const Tensor gx = backward_product(g2, w, false, false, site());
      out[0] = input_dim == 2 ? gx : gx.reshape(input_shape);
    }
    // Float32 parameters under bf16 autocast (Note [Float32 weight gradients
    // under autocast]): their gradients come out float32, unrounded. Under
    // create_graph the differentiable product is cast instead.
    const bool float_params = float32_param_grads && g2.dtype() == kBFloat16;
    if (next_edges()[1].is_valid()) {
      // grad_W = gᵀ · x over all rows: oneDNN reads g transposed in place.
      const Tensor x = input.unpack(this);
      const Tensor x2 = x.dim() == 2 ? x : x.reshape({-1, x.size(-1)});
      if (float_params && !grad_mode_enabled() && x2.dtype() == kBFloat16)
        out[1] = product_float32_out(g2, x2, true, false);
      else
        out[1] = backward_product(g2, x2, true, false, site());
    }
    if (next_edges()[2].is_valid()) {
      // An [out_features] bias sums the rows; any other (broadcast) shape is reduced by the engine.
      if (bias_is_vector)
        out[2] = float_params ? g2.sum(0).to(kFloat32) : g2.sum(0);
      else
        out[2] = g;
    }
    return out;
  }
  void release_variables() override {
    input.reset();
    weight.reset();
  }
  DimVector input_shape;
  int64_t input_dim = 0;
  bool bias_is_vector = false;
  bool float32_param_grads = false;  // the weight and bias edges lead to float32 tensors
};

Tensor mm_impl(const Tensor& self, const Tensor& mat2, autograd::CallSite site) {
  ops::OpScope rs("mm", {&self, &mat2});
  ops::check_defined(self, "mm", "self");
  ops::check_defined(mat2, "mm", "mat2");
  KILN_CHECK(self.dim() == 2 && mat2.dim() == 2, ShapeError, "mm: expected two 2-D tensors, got shapes ", self.sizes(),
             " and ", mat2.sizes(), " (use matmul for batched or vector products)");
  KILN_CHECK(self.size(1) == mat2.size(0), ShapeError, "mm: cannot multiply ", self.sizes(), " by ", mat2.sizes(),
             ": inner dims ", self.size(1), " and ", mat2.size(0), " differ");
  check_matmul_dtypes("mm", self, mat2, "self", "mat2");
  Tensor out = product(self, mat2, false, false, site);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, self.size(1)));
  return out;
}

// matmul's product once the arguments are checked (not 2-D · 2-D, which is mm).
Tensor matmul_forward(const Tensor& self, const Tensor& other) {
  const int64_t da = self.dim(), db = other.dim(), ka = self.size(-1);
  // 1-D operands become a row (self) or a column (other) matrix; their dim
  // is left out of the result, as torch.
  const Tensor a = da == 1 ? self.unsqueeze(0) : self;
  const Tensor b = db == 1 ? other.unsqueeze(1) : other;
  const int64_t m = a.size(-2), n = b.size(-1);

  if (da <= 2 && db <= 2) {
    DimVector out_shape;
    if (da == 2) out_shape.push_back(m);
    if (db == 2) out_shape.push_back(n);
    return run_matmul(matrix_operand(a, false), matrix_operand(b, false), Tensor(), 1, out_shape);
  }

  // Batched. Broadcast the leading dims.
  const IntArrayRef a_batch(a.sizes().data(), a.dim() - 2), b_batch(b.sizes().data(), b.dim() - 2);
  const size_t nb = std::max(a_batch.size(), b_batch.size());
  DimVector batch_shape(nb, 1);
  for (size_t i = 0; i < nb; ++i) {
    const int64_t sa = i + a_batch.size() >= nb ? a_batch[i + a_batch.size() - nb] : 1;
    const int64_t sb = i + b_batch.size() >= nb ? b_batch[i + b_batch.size() - nb] : 1;
    KILN_CHECK(sa == sb || sa == 1 || sb == 1, ShapeError, "matmul: batch dims of ", self.sizes(), " and ",
               other.sizes(), " do not broadcast: ", sa, " vs ", sb, " at batch dim ", i);
    batch_shape[i] = sa == 1 ? sb : sa;
  }
  DimVector out_shape(batch_shape);
  if (da >= 2) out_shape.push_back(m);
  if (db >= 2) out_shape.push_back(n);
  const int64_t batch = shape_numel(batch_shape);

  // [..., m, k] · [k, n]: fold the batch into the rows, one large product,
  // when the leading dims merge into one without a copy (a transposed batch
  // does not; it takes the batched path below, reading b as a batch of 1).
  if (db <= 2 && da >= 3 && rows_merge(a)) {
    const Tensor a2 = a.reshape({batch * m, ka});
    return run_matmul(matrix_operand(a2, false), matrix_operand(b, false), Tensor(), 1, out_shape);
  }

  // Same batch shape, but the batch dims of an operand do not merge: no copy.
  if (da == db && da >= 4 && a_batch == b_batch && !(batch_merges(a) && batch_merges(b))) {
    Tensor out = ops::new_output(out_shape, a.dtype());
    batched_into(a, b, out);
    return out;
  }

  // One operand as [1 | batch, rows, cols]: a batch of 1 is broadcast by the
  // kernel; otherwise the broadcast batch dims are collapsed, which copies
  // only when the strides cannot be merged (as torch's expand + reshape).
  auto batched = [&](const Tensor& t) {
    const int64_t rows = t.size(-2), cols = t.size(-1);
    if (shape_numel(IntArrayRef(t.sizes().data(), t.dim() - 2)) == 1) return t.reshape({1, rows, cols});
    DimVector full(batch_shape);
    full.push_back(rows);
    full.push_back(cols);
    return t.expand(full).reshape({batch, rows, cols});
  };
  return run_matmul(matrix_operand(batched(a), true), matrix_operand(batched(b), true), Tensor(), batch, out_shape);
}

Tensor matmul_impl(const Tensor& self, const Tensor& other, autograd::CallSite site) {
  ops::check_defined(self, "matmul", "self");
  ops::check_defined(other, "matmul", "other");
  const int64_t da = self.dim(), db = other.dim();
  KILN_CHECK(da >= 1 && db >= 1, ShapeError, "matmul: both arguments need at least 1 dim, got shapes ", self.sizes(),
             " (", da, "-D) and ", other.sizes(), " (", db, "-D)");
  const int64_t ka = self.size(-1), kb = other.size(db >= 2 ? -2 : -1);
  KILN_CHECK(ka == kb, ShapeError, "matmul: cannot multiply ", self.sizes(), " by ", other.sizes(), ": inner dims ", ka,
             " and ", kb, " differ");
  check_matmul_dtypes("matmul", self, other, "self", "other");
  if (da == 2 && db == 2) return product(self, other, false, false, site);  // torch records MmBackward0 too

  Tensor out;
  {
    const NoGradGuard no_grad;  // the views and copies below are internal; the node is recorded once, below
    if (self.dtype() == kFloat16) {
      out = through_float32([&](const Tensor& s32, const Tensor& o32) { return matmul_impl(s32, o32, site); }, self,
                            other);
    } else {
      out = matmul_forward(self, other);
    }
  }
  if (autograd::compute_requires_grad({&self, &other})) {
    auto node = make_intrusive<MatmulBackward>();
    node->input_dims[0] = da;
    node->input_dims[1] = db;
    if (other.requires_grad()) node->self = autograd::SavedVariable(self, false);
    if (self.requires_grad()) node->other = autograd::SavedVariable(other, false);
    autograd::set_history(out, node, {&self, &other}, site);
  }
  return out;
}

}  // namespace

Tensor mm(const Tensor& self, const Tensor& mat2, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::mm, [&](const Tensor& a, const Tensor& b) { return mm(a, b, loc); }, self, mat2);
  return mm_impl(self, mat2, autograd::CallSite::from(loc));
}

Tensor bmm(const Tensor& self, const Tensor& mat2, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::bmm, [&](const Tensor& a, const Tensor& b) { return bmm(a, b, loc); }, self, mat2);
  ops::OpScope rs("bmm", {&self, &mat2});
  ops::check_defined(self, "bmm", "self");
  ops::check_defined(mat2, "bmm", "mat2");
  KILN_CHECK(self.dim() == 3 && mat2.dim() == 3, ShapeError, "bmm: expected two 3-D tensors, got shapes ", self.sizes(),
             " and ", mat2.sizes(), " (use matmul to broadcast batch dims)");
  KILN_CHECK(self.size(0) == mat2.size(0), ShapeError, "bmm: batch sizes differ: ", self.sizes(), " and ", mat2.sizes(),
             " (", self.size(0), " vs ", mat2.size(0), "); use matmul to broadcast a batch of 1");
  KILN_CHECK(self.size(2) == mat2.size(1), ShapeError, "bmm: cannot multiply ", self.sizes(), " by ", mat2.sizes(),
             ": inner dims ", self.size(2), " and ", mat2.size(1), " differ");
  check_matmul_dtypes("bmm", self, mat2, "self", "mat2");
  Tensor out = product(self, mat2, false, false, autograd::CallSite::from(loc));
  if (rs.recording()) rs.set_flops(ops::product_flops(out, self.size(2)));
  return out;
}

Tensor matmul(const Tensor& self, const Tensor& other, std::source_location loc) {
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::matmul, [&](const Tensor& a, const Tensor& b) { return matmul(a, b, loc); }, self, other);
  ops::OpScope rs("matmul", {&self, &other});
  Tensor out = matmul_impl(self, other, autograd::CallSite::from(loc));
  if (rs.recording()) rs.set_flops(ops::product_flops(out, self.size(-1)));
  return out;
}

namespace {

// linear with a weight of shape [in_features]: input · weight, the last dim
// dropped (torch.nn.functional.linear's 1-D weight form), then + bias. The
// product is matmul's (its 2-D · 1-D and 1-D · 1-D rules, and their backward);
// the bias must broadcast to the output without enlarging it, as torch's
// in-place add_ of the bias requires: a 0-dim bias is the usual one.
Tensor linear_vector_weight(const Tensor& input, const Tensor& weight, const Tensor& bias, std::source_location loc) {
  KILN_CHECK(input.dim() >= 1, ShapeError, "linear: expected input of shape [..., in_features], got a 0-dim tensor");
  KILN_CHECK(input.size(-1) == weight.size(0), ShapeError, "linear: input of shape ", input.sizes(),
             " has in_features ", input.size(-1), " but the 1-D weight of shape ", weight.sizes(), " expects ",
             weight.size(0), " (a 1-D weight is [in_features])");
  check_matmul_dtypes("linear", input, weight, "input", "weight");
  Tensor out = matmul_impl(input, weight, autograd::CallSite::from(loc));
  if (!bias.defined()) return out;
  check_matmul_dtypes("linear", input, bias, "input", "bias");
  bool fits = bias.dim() <= out.dim();
  for (int64_t i = 1; fits && i <= bias.dim(); ++i) fits = bias.size(-i) == 1 || bias.size(-i) == out.size(-i);
  KILN_CHECK(fits, ShapeError, "linear: bias of shape ", bias.sizes(), " does not broadcast to the output shape ",
             out.sizes(), " (with a 1-D weight the output drops input's last dim; expected a 0-dim bias)");
  return out.add(bias, 1, loc);
}

// Note [Float32 weight gradients under autocast]
// Under bf16 autocast torch casts a float32 weight to bf16 for the product;
// backward computes the weight gradient as a bf16 product (float32 sums
// rounded to bf16), and the cast's backward widens it back to float32 for the
// parameter. kiln's linear records its node against the float32 weight and
// bias themselves instead, and computes the weight gradient as the same
// product with a float32 output (oneDNN's bf16 kernel, its sums not rounded):
// one rounding fewer (the gradient is closer to float32's than torch's, by at
// most half a bf16 ulp) and no widening pass over every weight gradient. The
// bias gradient stays torch's, the bf16 sum of the output gradient's rows
// widened: sum(dtype=float32) widened the whole [rows, out] gradient first
// and cost more than the pass it saved. The weight is still cast once per
// autocast region (the cache) for the forward product and the input gradient.
// In gpt's bf16 step the casts went 1.6-2.1 -> 1.2-1.7 ms per step (1
// thread), and the step moved by less than its noise: 16 interleaved pairs of
// processes read -0.66 % (median of the pairs' ratios) at 1 thread and -0.11 %
// at 2, the new form faster in 10 of 16 at each (2026-12-06). It applies to
// float32 weights that require grad when the autocast dtype is bf16 and grad
// mode is on; float16 keeps torch's path, whose overflow reports name the
// casts.
bool float32_param_linear(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  return grad_mode_enabled() && autocast_dtype() == kBFloat16 && weight.defined() && weight.dim() == 2 &&
         weight.dtype() == kFloat32 && weight.requires_grad() && input.defined() &&
         (input.dtype() == kFloat32 || input.dtype() == kBFloat16) && (!bias.defined() || bias.dtype() == kFloat32);
}

// linear on arguments in their dtypes. With float32 parameters given (the
// weight and bias that `weight` and `bias` are bf16 casts of), the node's
// weight and bias edges lead to them instead.
Tensor linear_body(const Tensor& input, const Tensor& weight, const Tensor& bias, std::source_location loc,
                   const Tensor* float32_weight = nullptr, const Tensor* float32_bias = nullptr) {
  ops::OpScope rs("linear", {&input, &weight, &bias});
  ops::check_defined(input, "linear", "input");
  ops::check_defined(weight, "linear", "weight");
  if (weight.dim() == 1) {
    Tensor out = linear_vector_weight(input, weight, bias, loc);
    if (rs.recording()) rs.set_flops(ops::product_flops(out, input.size(-1)));
    return out;
  }
  KILN_CHECK(weight.dim() == 2, ShapeError,
             "linear: expected weight of shape [out_features, in_features] or [in_features], got ", weight.sizes());
  KILN_CHECK(input.dim() >= 1, ShapeError, "linear: expected input of shape [..., in_features], got a 0-dim tensor");
  KILN_CHECK(input.size(-1) == weight.size(1), ShapeError, "linear: input of shape ", input.sizes(),
             " has in_features ", input.size(-1), " but weight of shape ", weight.sizes(), " expects ", weight.size(1),
             " (weight is [out_features, in_features])");
  check_matmul_dtypes("linear", input, weight, "input", "weight");
  if (bias.defined()) check_matmul_dtypes("linear", input, bias, "input", "bias");
  const int64_t in = weight.size(1), out_features = weight.size(0);
  DimVector out_shape(input.sizes());
  out_shape.back() = out_features;

  Tensor out;
  {
    const NoGradGuard no_grad;  // internal reshapes and conversions record nothing; the node is recorded below
    auto compute = [&](const Tensor& x, const Tensor& w, const Tensor& b) {
      Tensor fused, separate;
      split_bias(b, out_shape, out_features, fused, separate);
      const Tensor x2 = x.reshape({shape_numel(IntArrayRef(x.sizes().data(), x.dim() - 1)), in});
      Tensor o = run_matmul(matrix_operand(x2, false), transposed(matrix_operand(w, false)), fused, 1, out_shape);
      if (separate.defined()) add_bias_in_place(o, separate);
      return o;
    };
    out = input.dtype() == kFloat16 ? through_float32(compute, input, weight, bias) : compute(input, weight, bias);
  }
  const bool float_params = float32_weight != nullptr;
  const Tensor& wp = float_params ? *float32_weight : weight;  // where the weight and bias edges lead
  const Tensor& bp = float_params ? *float32_bias : bias;
  if (autograd::compute_requires_grad({&input, &wp, &bp})) {
    auto node = make_intrusive<LinearBackward>();
    node->input_shape = DimVector(input.sizes());
    node->input_dim = input.dim();
    node->bias_is_vector = bias.defined() && bias.dim() == 1 && bias.numel() == out_features;
    node->float32_param_grads = float_params;
    if (wp.requires_grad()) node->input = autograd::SavedVariable(input, false);
    if (input.requires_grad()) node->weight = autograd::SavedVariable(float_params ? weight.detach() : weight, false);
    autograd::set_history(out, node, {&input, &wp, &bp}, autograd::CallSite::from(loc));
  }
  if (rs.recording()) rs.set_flops(ops::product_flops(out, in));
  return out;
}

}  // namespace

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias, std::source_location loc) {
  if (autocast_enabled() && float32_param_linear(input, weight, bias)) {
    const autocast_detail::SuspendGuard suspend;
    constexpr AutocastPolicy kLower = AutocastPolicy::LowerPrecision;
    return linear_body(ops::autocast_arg(input, kBFloat16, kLower), ops::autocast_arg(weight, kBFloat16, kLower),
                       ops::autocast_arg(bias, kBFloat16, kLower), loc, &weight, &bias);
  }
  if (autocast_enabled())
    return ops::autocast_call(
        AutocastOp::linear, [&](const Tensor& x, const Tensor& w, const Tensor& b) { return linear(x, w, b, loc); },
        input, weight, bias);
  return linear_body(input, weight, bias, loc);
}

namespace {

// The stride that steps the merged batch dims of `t` (all but the last two;
// batch_merges(t) holds): that of the innermost one with more than one element.
int64_t merged_batch_stride(const Tensor& t) {
  for (int64_t d = t.dim() - 3; d >= 0; --d)
    if (t.size(d) != 1) return t.stride(d);
  return 0;
}

// No two elements of `t` share memory: taken in increasing stride order, each
// dim (of more than one element) steps past everything the dims before it span.
bool non_overlapping(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements the smaller-stride dims reach, plus one
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * (size - 1) + span;
  }
  return true;
}

// matmul_into and banded_matmul_into: out = self · other, under `band`
// (Note [Causal products] in kiln/kernels/dnnl.h), recorded as "matmul"
// with the FLOPs the band leaves.
void product_into(const Tensor& self, const Tensor& other, const Tensor& out, kernels::MatmulBand band,
                  std::source_location loc) {
  ops::OpScope rs("matmul", {&self, &other, &out});
  ops::check_defined(self, "matmul_into", "self");
  ops::check_defined(other, "matmul_into", "other");
  ops::check_defined(out, "matmul_into", "out");
  KILN_CHECK(self.dim() >= 2 && other.dim() == self.dim() && out.dim() == self.dim(), ShapeError,
             "matmul_into: expected self, other and out with the same number of dims (at least 2), got ", self.sizes(),
             ", ", other.sizes(), " and ", out.sizes());
  const int64_t d = self.dim(), m = self.size(-2), k = self.size(-1), n = other.size(-1);
  DimVector want(self.sizes());
  want[d - 1] = n;
  KILN_CHECK(other.size(-2) == k &&
                 IntArrayRef(self.sizes().data(), d - 2) == IntArrayRef(other.sizes().data(), d - 2) &&
                 out.sizes() == IntArrayRef(want),
             ShapeError, "matmul_into: expected [..., m, k] · [..., k, n] into [..., m, n] with equal batch dims, got ",
             self.sizes(), " · ", other.sizes(), " into ", out.sizes());
  check_matmul_dtypes("matmul_into", self, other, "self", "other");
  check_matmul_dtypes("matmul_into", self, out, "self", "out");
  KILN_CHECK(!autograd::compute_requires_grad({&self, &other}), ValueError,
             "matmul_into: writes into an existing tensor and records no gradient, but an operand requires grad "
             "(use matmul)");
  const int64_t batch = shape_numel(IntArrayRef(self.sizes().data(), d - 2));
  if (rs.recording()) rs.set_flops(2.0 * static_cast<double>(batch) * kernels::band_multiply_adds(m, n, k, band));
  const NoGradGuard no_grad;
  const bool rows_ok = self.dtype() != kFloat16 && out.stride(-1) == 1 && (m == 1 || out.stride(-2) >= n);
  const bool direct = rows_ok && batch_merges(self) && batch_merges(other) && batch_merges(out) &&
                      (batch == 1 || merged_batch_stride(out) > 0);
  // Four dims whose batch dims do not merge (attention's output rows written
  // into a [B, T, H, E] buffer viewed as [B, H, n, E]): two strided batch dims.
  const bool heads = !direct && rows_ok && d == 4 && out.size(0) > 1 && out.size(1) > 1 && non_overlapping(out);
  if (heads && self.numel() > 0 && out.numel() > 0) {
    run_matmul4_into(matrix_operand4(self), matrix_operand4(other), out, band);
    out.bump_version();
    return;
  }
  if (!direct || self.numel() == 0 || out.numel() == 0) {
    Tensor o = out;
    o.copy_(matmul_impl(self, other, autograd::CallSite::from(loc)));
    if (band.kind == kernels::MatmulBand::Kind::Columns) {  // the depth bands' left-out terms are 0 already
      const Tensor last = arange(band.offset, band.offset + m).unsqueeze(1), cols = arange(n).unsqueeze(0);
      o.masked_fill_(cols.gt(last), 0.0);
    }
    return;
  }
  const bool batched = d > 2;
  const Tensor a3 = batched ? self.reshape({batch, m, k}) : self;
  const Tensor b3 = batched ? other.reshape({batch, k, n}) : other;
  run_matmul_into(matrix_operand(a3, batched), matrix_operand(b3, batched), Tensor(), batch, out,
                  kernels::MatmulEpilogue::None, batch > 1 ? merged_batch_stride(out) : 0, m > 1 ? out.stride(-2) : 0,
                  band);
  out.bump_version();
}

}  // namespace

void matmul_into(const Tensor& self, const Tensor& other, const Tensor& out, std::source_location loc) {
  product_into(self, other, out, {}, loc);
}

namespace ops {

void banded_matmul_into(const Tensor& self, const Tensor& other, const Tensor& out, kernels::MatmulBand band) {
  product_into(self, other, out, band, std::source_location::current());
}

Tensor banded_matmul(const Tensor& self, const Tensor& other, kernels::MatmulBand band) {
  KILN_CHECK(self.dim() >= 2 && other.dim() == self.dim(), ShapeError,
             "banded_matmul: expected two operands with the same number of dims (at least 2), got ", self.sizes(),
             " and ", other.sizes());
  DimVector shape(self.sizes());
  shape.back() = other.size(-1);
  Tensor out = new_output(shape, self.dtype());
  product_into(self, other, out, band, std::source_location::current());
  return out;
}

}  // namespace ops

// ---- inference products: GELU epilogue, packed weights ----

struct WeightPack::State {
  std::mutex mu;
  Tensor source;  // the weight packed (kept alive, so its storage cannot be reused meanwhile)
  uint32_t version = 0;
  uint64_t layout = 0;
  Tensor packed;         // uint8 bytes in oneDNN's layout
  uint64_t capture = 0;  // the kiln::compile capture that packed it (the packing is recorded), 0: none
};

WeightPack::WeightPack() : state_(std::make_shared<State>()) {}

struct WeightPackAccess {
  static WeightPack::State& state(WeightPack& p) { return *p.state_; }
  static std::shared_ptr<WeightPack::State> shared(WeightPack& p) { return p.state_; }
  // Packs `weight` into s.packed unless the pack already holds this tensor at this version
  // in layout `id`. The caller holds s.mu.
  static void repack_if_stale(WeightPack::State& s, const kernels::MatmulArgs& g, const Tensor& weight, uint64_t id) {
    const bool fresh = s.layout == id && s.source.is_alias_of(weight) && s.source.data_ptr() == weight.data_ptr() &&
                       s.source.sizes() == weight.sizes() && s.source.strides() == weight.strides() &&
                       s.version == weight.version();
    if (fresh) {
      // Packed before this capture: the record uses the pack as it is (see Recorder::reused_derivation).
      if (s.capture != capture::current_capture()) capture::note_reused_derivation("a packed weight", weight);
      return;
    }
    kernels::matmul_pack_b(g, s.packed.data_ptr());
    s.source = weight.detach();
    s.version = weight.version();
    s.layout = id;
    s.capture = capture::current_capture();
  }
};

namespace {

// True when y = act(x · Wᵀ + b) may run as one oneDNN product with nothing recorded for autograd.
bool inference_product(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  const DType dt = input.dtype();
  return !autocast_enabled() && input.defined() && weight.defined() && (dt == kFloat32 || dt == kBFloat16) &&
         weight.dtype() == dt && weight.dim() == 2 && input.dim() >= 1 && input.size(-1) == weight.size(1) &&
         weight.size(1) > 0 &&
         (!bias.defined() || (bias.dtype() == dt && bias.dim() == 1 && bias.numel() == weight.size(0))) &&
         !autograd::compute_requires_grad({&input, &weight, &bias});
}

Tensor inference_linear(const Tensor& input, const Tensor& weight, const Tensor& bias, kernels::MatmulEpilogue epilogue,
                        WeightPack* pack, const Tensor& addend = {}) {
  const NoGradGuard no_grad;
  const DType dt = input.dtype();
  const int64_t in = weight.size(1);
  DimVector out_shape(input.sizes());
  out_shape.back() = weight.size(0);
  const Tensor x2 = input.reshape({shape_numel(IntArrayRef(input.sizes().data(), input.dim() - 1)), in});
  const Operand a = matrix_operand(x2, false), b = transposed(matrix_operand(weight, false));
  const Tensor fused_bias = bias.defined() ? bias.contiguous() : Tensor();
  Tensor out = ops::new_output(out_shape, dt);
  kernels::MatmulArgs g = product_args(a, b);
  g.bias = fused_bias.defined() ? fused_bias.data_ptr() : nullptr;
  g.c = out.data_ptr();
  g.epilogue = epilogue;
  g.addend = addend.defined() ? addend.data_ptr() : nullptr;
  if (pack == nullptr || x2.size(0) == 0) {
    kernels::matmul(g);
    return out;
  }
  const kernels::PackedLayout layout = kernels::matmul_packed_layout(g);
  if (layout.bytes == 0) {
    kernels::matmul(g);
    return out;
  }
  auto& st = WeightPackAccess::state(*pack);
  std::unique_lock<std::mutex> lock(st.mu);
  if (!st.packed.defined() || st.packed.numel() != static_cast<int64_t>(layout.bytes)) {
    const MemoryCategoryGuard category(MemoryCategory::Buffer);
    st.packed = empty({static_cast<int64_t>(layout.bytes)}, TensorOptions(kUInt8));
    st.source = Tensor();
  }
  // Whether the pack is fresh is host state that changes with the weight's version (an
  // optimizer step inside a compiled step bumps it): a capture records the check, not
  // what it found, so a replay packs again exactly when eager execution would.
  if (capture::recording()) {
    void* packed = st.packed.data_ptr();
    lock.unlock();  // the recorded check takes the lock on every replay
    capture::host_write("linear (weight pack)",
                        [state = WeightPackAccess::shared(*pack), g, w = weight.detach(), id = layout.id] {
                          const std::lock_guard<std::mutex> l(state->mu);
                          WeightPackAccess::repack_if_stale(*state, g, w, id);
                        });
    kernels::matmul_with_packed_b(g, packed);
    return out;
  }
  WeightPackAccess::repack_if_stale(st, g, weight, layout.id);
  kernels::matmul_with_packed_b(g, st.packed.data_ptr());
  return out;
}

}  // namespace

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias, WeightPack& pack,
              std::source_location loc) {
  // Training (the common case for a Linear) leaves at the first test.
  if (autograd::compute_requires_grad({&input, &weight, &bias}) || !inference_product(input, weight, bias))
    return linear(input, weight, bias, loc);
  ops::OpScope rs("linear", {&input, &weight, &bias});
  Tensor out = inference_linear(input, weight, bias, kernels::MatmulEpilogue::None, &pack);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, weight.size(1)));
  return out;
}

Tensor linear_add(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& addend, WeightPack* pack,
                  std::source_location loc) {
  if (!inference_product(input, weight, bias) || !addend.defined() || addend.dtype() != input.dtype() ||
      !addend.is_contiguous() || autograd::compute_requires_grad({&addend}) || addend.dim() != input.dim() ||
      addend.size(-1) != weight.size(0) ||
      !std::equal(input.sizes().begin(), input.sizes().end() - 1, addend.sizes().begin()))
    return addend + (pack ? linear(input, weight, bias, *pack, loc) : linear(input, weight, bias, loc));
  ops::OpScope rs("linear_add", {&input, &weight, &bias, &addend});
  Tensor out = inference_linear(input, weight, bias, kernels::MatmulEpilogue::None, pack, addend);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, weight.size(1)));
  return out;
}

Tensor linear_gelu(const Tensor& input, const Tensor& weight, const Tensor& bias, std::string_view approximate,
                   WeightPack* pack, std::source_location loc) {
  if (!inference_product(input, weight, bias) || (approximate != "tanh" && approximate != "none"))
    return linear(input, weight, bias, loc).gelu(approximate, loc);
  ops::OpScope rs("linear_gelu", {&input, &weight, &bias});
  Tensor out = inference_linear(
      input, weight, bias, approximate == "tanh" ? kernels::MatmulEpilogue::GeluTanh : kernels::MatmulEpilogue::GeluErf,
      pack);
  if (rs.recording()) rs.set_flops(ops::product_flops(out, weight.size(1)));
  return out;
}

// ---- Tensor methods ----

Tensor Tensor::mm(const Tensor& other, std::source_location loc) const { return kiln::mm(*this, other, loc); }
Tensor Tensor::bmm(const Tensor& other, std::source_location loc) const { return kiln::bmm(*this, other, loc); }
Tensor Tensor::matmul(const Tensor& other, std::source_location loc) const { return kiln::matmul(*this, other, loc); }

}  // namespace kiln
