// mm, bmm, matmul, linear: shape and dtype checks, operand layout, output
// allocation; the products themselves are kernels::matmul (oneDNN / BLAS).
// Backward formulas (grad_a = grad · bᵀ, grad_b = aᵀ · grad, grad_bias = sum)
// will sit beside each forward (autograd issue); they reuse run_matmul with
// transposed operand strides, which the kernel reads in place.
#include "kiln/ops/linalg.h"

#include <type_traits>

#include "iter.h"
#include "kiln/kernels/blas.h"
#include "kiln/kernels/dnnl.h"

namespace kiln {

namespace {

// One operand of the kernel call: the tensor that owns the memory and the
// (batch, row, col) strides the kernel reads it with.
struct Operand {
  Tensor t;
  int64_t rows = 0, cols = 0;
  int64_t stride[3] = {0, 0, 1};
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

// c = a · b (+ bias) into a new contiguous tensor of out_shape, whose numel
// is batch * a.rows * b.cols. float16 callers convert before they get here.
Tensor run_matmul(const Operand& a, const Operand& b, const Tensor& bias, int64_t batch, IntArrayRef out_shape) {
  const DType dt = a.t.dtype();
  Tensor out = ops::new_output(out_shape, dt);
  kernels::MatmulArgs g;
  g.dtype = dt;
  g.batch = batch;
  g.m = a.rows;
  g.k = a.cols;
  g.n = b.cols;
  g.a.data = a.t.data_ptr();
  g.b.data = b.t.data_ptr();
  for (int i = 0; i < 3; ++i) {
    g.a.stride[i] = a.stride[i];
    g.b.stride[i] = b.stride[i];
  }
  g.bias = bias.defined() ? bias.data_ptr() : nullptr;
  g.c = out.data_ptr();
  kernels::matmul(g);
  return out;
}

Tensor to_float32(const Tensor& t) { return t.defined() ? t.to(kFloat32) : t; }

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

}  // namespace

Tensor mm(const Tensor& self, const Tensor& mat2) {
  ops::check_defined(self, "mm", "self");
  ops::check_defined(mat2, "mm", "mat2");
  KILN_CHECK(self.dim() == 2 && mat2.dim() == 2, ShapeError, "mm: expected two 2-D tensors, got shapes ",
             self.sizes(), " and ", mat2.sizes(), " (use matmul for batched or vector products)");
  KILN_CHECK(self.size(1) == mat2.size(0), ShapeError, "mm: cannot multiply ", self.sizes(), " by ", mat2.sizes(),
             ": inner dims ", self.size(1), " and ", mat2.size(0), " differ");
  check_matmul_dtypes("mm", self, mat2, "self", "mat2");
  if (self.dtype() == kFloat16) return mm(self.to(kFloat32), mat2.to(kFloat32)).to(kFloat16);
  const int64_t out_shape[2] = {self.size(0), mat2.size(1)};
  return run_matmul(matrix_operand(self, false), matrix_operand(mat2, false), Tensor(), 1, {out_shape, 2});
}

Tensor bmm(const Tensor& self, const Tensor& mat2) {
  ops::check_defined(self, "bmm", "self");
  ops::check_defined(mat2, "bmm", "mat2");
  KILN_CHECK(self.dim() == 3 && mat2.dim() == 3, ShapeError, "bmm: expected two 3-D tensors, got shapes ",
             self.sizes(), " and ", mat2.sizes(), " (use matmul to broadcast batch dims)");
  KILN_CHECK(self.size(0) == mat2.size(0), ShapeError, "bmm: batch sizes differ: ", self.sizes(), " and ",
             mat2.sizes(), " (", self.size(0), " vs ", mat2.size(0), "); use matmul to broadcast a batch of 1");
  KILN_CHECK(self.size(2) == mat2.size(1), ShapeError, "bmm: cannot multiply ", self.sizes(), " by ", mat2.sizes(),
             ": inner dims ", self.size(2), " and ", mat2.size(1), " differ");
  check_matmul_dtypes("bmm", self, mat2, "self", "mat2");
  if (self.dtype() == kFloat16) return bmm(self.to(kFloat32), mat2.to(kFloat32)).to(kFloat16);
  const int64_t out_shape[3] = {self.size(0), self.size(1), mat2.size(2)};
  return run_matmul(matrix_operand(self, true), matrix_operand(mat2, true), Tensor(), self.size(0), {out_shape, 3});
}

Tensor matmul(const Tensor& self, const Tensor& other) {
  ops::check_defined(self, "matmul", "self");
  ops::check_defined(other, "matmul", "other");
  const int64_t da = self.dim(), db = other.dim();
  KILN_CHECK(da >= 1 && db >= 1, ShapeError, "matmul: both arguments need at least 1 dim, got shapes ", self.sizes(),
             " (", da, "-D) and ", other.sizes(), " (", db, "-D)");
  const int64_t ka = self.size(-1), kb = other.size(db >= 2 ? -2 : -1);
  KILN_CHECK(ka == kb, ShapeError, "matmul: cannot multiply ", self.sizes(), " by ", other.sizes(), ": inner dims ",
             ka, " and ", kb, " differ");
  check_matmul_dtypes("matmul", self, other, "self", "other");
  if (self.dtype() == kFloat16) return matmul(self.to(kFloat32), other.to(kFloat32)).to(kFloat16);

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

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  ops::check_defined(input, "linear", "input");
  ops::check_defined(weight, "linear", "weight");
  KILN_CHECK(weight.dim() == 2, ShapeError, "linear: expected weight of shape [out_features, in_features], got ",
             weight.sizes());
  KILN_CHECK(input.dim() >= 1, ShapeError, "linear: expected input of shape [..., in_features], got a 0-dim tensor");
  KILN_CHECK(input.size(-1) == weight.size(1), ShapeError, "linear: input of shape ", input.sizes(),
             " has in_features ", input.size(-1), " but weight of shape ", weight.sizes(), " expects ",
             weight.size(1), " (weight is [out_features, in_features])");
  check_matmul_dtypes("linear", input, weight, "input", "weight");
  if (bias.defined()) check_matmul_dtypes("linear", input, bias, "input", "bias");
  if (input.dtype() == kFloat16) {
    return linear(input.to(kFloat32), weight.to(kFloat32), to_float32(bias)).to(kFloat16);
  }
  const int64_t in = weight.size(1), out_features = weight.size(0);
  DimVector out_shape(input.sizes());
  out_shape.back() = out_features;

  // The usual bias, [out_features] (or one element), is fused into the
  // product; any other shape that broadcasts to the output is added after.
  Tensor fused, separate;
  if (bias.defined()) {
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
  const Tensor x2 = input.reshape({shape_numel(IntArrayRef(input.sizes().data(), input.dim() - 1)), in});
  const Operand w_t = transposed(matrix_operand(weight, false));
  Tensor out = run_matmul(matrix_operand(x2, false), w_t, fused, 1, out_shape);
  if (separate.defined()) {
    const auto loop = ops::make_loop(out.sizes(), {&out, &out, &separate});
    visit_dtype(out.dtype(), [&]<typename T>() {
      if constexpr (std::is_same_v<T, bool>) {
        KILN_ASSERT(false, "linear: bool reached the bias add");
      } else {
        kernels::map_elements<T, T, T>(loop, [](T a, T b) {
          return static_cast<T>(static_cast<compute_t<T>>(a) + static_cast<compute_t<T>>(b));
        });
      }
    });
  }
  return out;
}

// ---- Tensor methods ----

Tensor Tensor::mm(const Tensor& other) const { return kiln::mm(*this, other); }
Tensor Tensor::bmm(const Tensor& other) const { return kiln::bmm(*this, other); }
Tensor Tensor::matmul(const Tensor& other) const { return kiln::matmul(*this, other); }

}  // namespace kiln
