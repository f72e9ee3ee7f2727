// Scaled dot-product attention (include/kiln/ops/attention.h): the argument
// checks, the composite form, and the fused, memory-efficient form (dropout
// only on the heads kernel: Note [Dropout inside the heads] in
// kiln/kernels/attention.h) with its backward beside the forward.
//
// Forward walks the query rows in blocks of `block_rows`: for each block it
// forms S = q_blk kᵀ scale (+ mask, or the causal triangle), the row max m,
// P = exp(S - m), the row sum l, out_blk = P v / l and the row log-sum-exp
// lse = m + log l. q, k, v, out and lse [..., L, 1] are saved: O(T) beyond
// the inputs and output. The blocks' weights P are saved too while they take
// no more than q, k, v and out (Note [Kept weights] in
// kiln/kernels/attention.h: short sequences); beyond, no [L, S] tensor
// outlives its block. Causal blocks read only the keys a block can see (key
// j <= the block's last query row).
//
// Backward takes the kept P, or recomputes P = exp(S - lse), block by block:
//   D = rowsum(dO ∘ out), dV += Pᵀ dO, dP = dO vᵀ, dS = P ∘ (dP - D),
//   dQ = dS k scale, dK += dSᵀ q scale.
// Under create_graph (grad mode on in backward) it instead differentiates the
// composite form with autograd::grad, so double backward is exact.
// The products are kiln matmuls (batched, oneDNN) with grad mode off. Without
// a mask everything between them is one row kernel per block
// (kiln/kernels/attention.h): the raw scores q kᵀ become P with the scale,
// the causal triangle, softmax and lse in one sweep, and in backward P and
// dS (with the scale folded in) are one sweep each. A mask takes kiln's
// general ops instead (it may broadcast in any way).
// Without anything to differentiate (inference) no node is recorded and no
// lse is computed.
#include "kiln/ops/attention.h"
#include "kiln/ops/dropout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "banded_matmul.h"
#include "kiln/autograd/custom_function.h"
#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/core/half.h"
#include "kiln/kernels/attention.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/linalg.h"
#include "op_record.h"

namespace kiln::ops {

namespace {

// The shapes, dtypes and flags every form of the op takes.
void check_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                bool is_causal) {
  KILN_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, ShapeError,
             "scaled_dot_product_attention: expected q [..., L, E], k [..., S, E], v [..., S, Ev] with at least "
             "2 dims, got q ",
             q.shape_string(), ", k ", k.shape_string(), ", v ", v.shape_string());
  KILN_CHECK(q.is_floating_point() && k.is_floating_point() && v.is_floating_point(), DTypeError,
             "scaled_dot_product_attention: expected floating-point q, k, v, got ", dtype_name(q.dtype()), ", ",
             dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  KILN_CHECK(q.size(-1) == k.size(-1), ShapeError,
             "scaled_dot_product_attention: expected q and k to share the last dim E, got q ", q.shape_string(),
             " and k ", k.shape_string());
  KILN_CHECK(k.size(-2) == v.size(-2), ShapeError,
             "scaled_dot_product_attention: expected k and v to share the sequence dim S, got k ", k.shape_string(),
             " and v ", v.shape_string());
  KILN_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, ValueError,
             "scaled_dot_product_attention: expected dropout_p in [0, 1], got ", dropout_p);
  KILN_CHECK(!(is_causal && attn_mask.defined()), ValueError,
             "scaled_dot_product_attention: expected either attn_mask or is_causal, got both");
  if (attn_mask.defined()) {
    const int64_t L = q.size(-2), S = k.size(-2);
    KILN_CHECK(attn_mask.dim() >= 1 && attn_mask.size(-1) == S &&
                   (attn_mask.dim() < 2 || attn_mask.size(-2) == L || attn_mask.size(-2) == 1),
               ShapeError, "scaled_dot_product_attention: expected attn_mask broadcastable to [..., ", L, ", ", S,
               "], got ", attn_mask.shape_string());
    KILN_CHECK(attn_mask.dtype() == kBool || attn_mask.is_floating_point(), DTypeError,
               "scaled_dot_product_attention: expected a bool or floating attn_mask, got ",
               dtype_name(attn_mask.dtype()));
  }
}

// [L, S] bool, true where key j lies after query i (the positions causal attention hides).
Tensor causal_hidden(int64_t L, int64_t S) {
  Tensor rows = arange(L).unsqueeze(1);
  Tensor cols = arange(S).unsqueeze(0);
  return cols.gt(rows);
}

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Carried by value through Function::apply (not a Tensor argument, so it gets no gradient).
struct FusedArgs {
  Tensor mask;  // undefined, bool (true = may attend) or floating (added); never requires grad here
  bool causal = false;
  int64_t block_rows = kAttentionBlockRows;
  /// Dropout on the weights, on the heads kernel only (dropout_on_heads): in
  /// (0, 1), or 0 for none. Backward finds forward's mask bytes in `keep`.
  double dropout_p = 0.0;
  Tensor keep;
};

// Number of keys rows [r0, r0 + n) may see.
int64_t keys_visible(const FusedArgs& a, int64_t r0, int64_t n, int64_t S) {
  return a.causal ? std::min(S, r0 + n) : S;
}

// Scores of query rows [r0, r0 + n) against keys [0, kend): [..., n, kend], masked.
Tensor block_scores(const Tensor& q, const Tensor& k, const FusedArgs& a, double scale, int64_t r0, int64_t n,
                    int64_t kend) {
  const int64_t L = q.size(-2);
  // Scale the [n, E] query block rather than the [n, kend] scores.
  Tensor s = q.narrow(-2, r0, n).mul(scale).matmul(k.narrow(-2, 0, kend).transpose(-2, -1));
  // Grad mode is off here (forward of a Function, or backward without create_graph): mask in place.
  if (a.causal) {
    Tensor rows = arange(r0, r0 + n).unsqueeze(1);
    Tensor cols = arange(kend).unsqueeze(0);
    s.masked_fill_(cols.gt(rows), kNegInf);
  }
  if (a.mask.defined()) {
    Tensor m = a.mask;
    if (m.dim() >= 2 && m.size(-2) == L && L > 1) m = m.narrow(-2, r0, n);
    if (kend < m.size(-1)) m = m.narrow(-1, 0, kend);
    s = m.dtype() == kBool ? s.masked_fill(m.logical_not(), kNegInf) : s + m;  // may broadcast s: not in place
  }
  return s;
}

using Band = kernels::MatmulBand;

// x · y for the block of query rows from r0: under a causal mask through the
// band of `kind` (Note [Causal products]), which skips the hidden triangle's
// products; operands whose batch dims differ (a broadcast) take matmul.
Tensor block_product(const Tensor& x, const Tensor& y, const FusedArgs& a, Band::Kind kind, int64_t r0) {
  if (!a.causal || x.dim() != y.dim() ||
      IntArrayRef(x.sizes().data(), x.dim() - 2) != IntArrayRef(y.sizes().data(), y.dim() - 2))
    return x.matmul(y);
  return ops::banded_matmul(x, y, Band{kind, r0});
}

// The same into `out` (matmul_into's conditions).
void block_product_into(const Tensor& x, const Tensor& y, const Tensor& out, const FusedArgs& a, Band::Kind kind,
                        int64_t r0) {
  ops::banded_matmul_into(x, y, out, a.causal ? Band{kind, r0} : Band{});
}

// The batch dims of `t` (all but the last two) followed by (r, c).
DimVector with_tail(const Tensor& t, int64_t r, int64_t c) {
  DimVector s(IntArrayRef(t.sizes().data(), t.dim() - 2));
  s.push_back(r);
  s.push_back(c);
  return s;
}

// Without a mask a block runs on the row kernels of kiln/kernels/attention.h
// (scale, causal triangle, softmax and log-sum-exp in one sweep); a mask,
// which may broadcast in any way, takes the general ops.
bool row_kernels(const FusedArgs& a, int64_t kend) { return !a.mask.defined() && kend > 0; }

kernels::AttentionBlock block_of(const Tensor& s, const FusedArgs& a, double scale, int64_t r0, int64_t n, int64_t kend,
                                 int64_t L) {
  KILN_ASSERT(s.is_contiguous(), "sdpa_fused: a score block must be contiguous");
  return {.dtype = s.dtype(),
          .batch = s.numel() / (n * kend),
          .rows = n,
          .cols = kend,
          .scale = scale,
          .causal = a.causal,
          .row0 = r0,
          .row_batch_stride = L};
}

// Row r0 of a contiguous per-row tensor [..., L, 1].
void* row_ptr(const Tensor& t, int64_t r0) { return static_cast<char*>(t.data_ptr()) + r0 * t.element_size(); }

// A [B, H, rows, cols] tensor with a unit last stride as the kernels' head operand.
kernels::HeadOperand head_operand(const Tensor& t) { return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

// Backward's D = Σ dO ∘ out over the last dim, [..., L, 1]: one kernel over
// the rows (kernels::attention_output_dots, the products unrounded) for
// float32 and bf16 heads of up to 4 dims with rows contiguous, else the ops.
Tensor output_dots(const Tensor& dout, const Tensor& out) {
  const int64_t d = out.dim();
  if (d < 2 || d > 4 || dout.sizes() != out.sizes() || dout.dtype() != out.dtype() ||
      (out.dtype() != kFloat32 && out.dtype() != kBFloat16) || out.stride(-1) != 1 || dout.stride(-1) != 1)
    return (dout * out).sum({-1}, /*keepdim=*/true);
  DimVector shape(out.sizes());
  shape.back() = 1;
  Tensor D = empty(shape, TensorOptions(out.dtype()));
  // As [B, H, L, Ev] heads: missing leading dims have size 1 (stride 0).
  auto as_heads = [&](const Tensor& t) {
    kernels::HeadOperand o{t.data_ptr(), 0, 0, t.stride(-2)};
    if (d >= 3) o.head = t.stride(-3);
    if (d == 4) o.outer = t.stride(0);
    return o;
  };
  const int64_t B = d == 4 ? out.size(0) : 1, H = d >= 3 ? out.size(-3) : 1;
  if (D.numel() > 0 && out.size(-1) > 0)
    kernels::attention_output_dots(out.dtype(), B, H, out.size(-2), out.size(-1), as_heads(dout), as_heads(out),
                                   D.data_ptr());
  else
    D.zero_();
  return D;
}

// q, k, v as heads run one head at a time (Note [Attention by head]): when
// they are 4-D heads [B, H, T, E] with a unit last stride, unmasked, and the
// kernel takes their sizes; nothing otherwise.
std::optional<kernels::AttentionHeads> heads_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const FusedArgs& a) {
  if (a.mask.defined() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype() || q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1)
    return std::nullopt;
  for (int d = 0; d < 2; ++d)
    if (k.size(d) != q.size(d) || v.size(d) != q.size(d)) return std::nullopt;
  if (k.size(3) != q.size(3) || v.size(2) != k.size(2)) return std::nullopt;
  kernels::AttentionHeads h;
  h.dtype = q.dtype();
  h.B = q.size(0);
  h.H = q.size(1);
  h.L = q.size(2);
  h.S = k.size(2);
  h.E = q.size(3);
  h.Ev = v.size(3);
  h.scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  h.causal = a.causal;
  h.block_rows = a.block_rows;
  h.q = head_operand(q);
  h.k = head_operand(k);
  h.v = head_operand(v);
  if (!kernels::attention_heads_apply(h)) return std::nullopt;
  return h;
}

// Whether backward gets the forward's weights rather than recomputing them
// (Note [Kept weights] in kiln/kernels/attention.h): unmasked, q, k, v with
// the same batch dims, and weights no larger than q, k, v and out.
bool keeps_weights(const Tensor& q, const Tensor& k, const Tensor& v, const FusedArgs& a) {
  if (a.mask.defined() || q.dim() != k.dim() || q.dim() != v.dim() || k.size(-2) == 0 ||
      IntArrayRef(q.sizes().data(), q.dim() - 2) != IntArrayRef(k.sizes().data(), k.dim() - 2) ||
      IntArrayRef(q.sizes().data(), q.dim() - 2) != IntArrayRef(v.sizes().data(), v.dim() - 2))
    return false;
  return kernels::attention_keeps_weights(q.size(-2), k.size(-2), q.size(-1), v.size(-1), a.causal, a.block_rows);
}

double attention_flops(const Tensor& q, const Tensor& k, const Tensor& out, bool causal);

// The heads kernel's dropout (Note [Dropout inside the heads]) with
// dropout_train's scalars as its composite uses them on the heads' dtype:
// `u < 1 - p` and `keep * (1 / (1 - p))` round both scalars to it.
void set_dropout(kernels::AttentionHeads& h, const Tensor& keep, double p) {
  const auto in_dtype = [&](double x) {
    return h.dtype == kBFloat16 ? static_cast<float>(BFloat16(static_cast<float>(x))) : static_cast<float>(x);
  };
  h.keep = keep.data_ptr<uint8_t>();
  h.keep_below = in_dtype(1.0 - p);
  h.dropout_scale = in_dtype(1.0 / (1.0 - p));
}

// The attention output, query rows in blocks; `lse`, when not null, gets the
// per-row log-sum-exp [..., L, 1] that backward recomputes the weights from,
// and `weights`, when not null and keeps_weights holds, each block's weights
// [..., rows, keys seen] (views of one buffer on the heads path).
Tensor attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const FusedArgs& a, Tensor* lse,
                         std::vector<Tensor>* weights = nullptr, Tensor* keep = nullptr) {
  const int64_t L = q.size(-2), S = k.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  std::vector<Tensor> outs, lses;
  Tensor lse_all;
  if (weights && !keeps_weights(q, k, v, a)) weights = nullptr;
  // Heads [B, H, L, E] (attention inside a transformer): the output is
  // allocated as [B, L, H, Ev] and returned as its [B, H, L, Ev] view, so the
  // caller's head merge (transpose(1, 2).reshape([B, L, H * Ev])) is a view,
  // and each block's product writes its rows in place (matmul_into) rather
  // than into pieces that a cat then copies.
  const bool heads = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && S > 0 && !a.mask.defined() &&
                     q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                     q.size(1) == v.size(1);
  Tensor out_heads;
  if (heads) out_heads = empty({q.size(0), L, q.size(1), v.size(-1)}, TensorOptions(q.dtype())).transpose(1, 2);
  if (std::optional<kernels::AttentionHeads> h = heads ? heads_args(q, k, v, a) : std::nullopt) {
    if (lse) *lse = empty({q.size(0), q.size(1), L, 1}, TensorOptions(q.dtype()));
    h->out = head_operand(out_heads);
    h->lse = lse ? lse->data_ptr() : nullptr;
    Tensor kept;
    if (weights) {
      kept = empty({kernels::attention_heads_weights_size(*h)}, TensorOptions(q.dtype()));
      h->weights = kept.data_ptr();
    }
    Tensor mask_bytes;
    if (a.dropout_p > 0.0) {
      // dropout_train's scalars and Philox elements (Note [Dropout inside the heads]).
      mask_bytes = empty({h->B, h->H, L, S}, TensorOptions(kUInt8));
      set_dropout(*h, mask_bytes, a.dropout_p);
      if (keep) *keep = mask_bytes;
    }
    {
      // Its two products run inside the kernel, not as matmul events: they are
      // counted here, where their time is (Note [Attention FLOPs where they run]).
      OpScope rs("attention_fused_forward", {&q, &k, &v});
      if (rs.recording()) rs.set_flops(attention_flops(q, k, out_heads, a.causal));
      if (h->keep) {
        // Recorded whole under kiln::compile, as dropout_train is: a replay reserves fresh blocks.
        capture::host_write("attention_fused_forward", [h = *h, g = &default_generator()]() mutable {
          h.seed = g->get_state().seed;
          h.first_block = g->reserve(static_cast<uint64_t>((h.B * h.H * h.L * h.S + 3) / 4));
          kernels::attention_heads_forward(h);
        });
      } else {
        kernels::attention_heads_forward(*h);
      }
    }
    if (weights) {  // block by block, each [B, H, n, kend] (what the block path below keeps)
      for (int64_t r0 = 0; r0 < L; r0 += a.block_rows) {
        const int64_t n = std::min(a.block_rows, L - r0), kend = keys_visible(a, r0, n, S);
        const int64_t at = h->B * h->H * kernels::attention_weights_per_head(r0, S, a.causal, a.block_rows);
        weights->push_back(kept.narrow(0, at, h->B * h->H * n * kend).view({h->B, h->H, n, kend}));
      }
    }
    return out_heads;
  }
  KILN_ASSERT(a.dropout_p == 0.0, "sdpa_fused: dropout off the heads kernel");
  for (int64_t r0 = 0; r0 < L; r0 += a.block_rows) {
    const int64_t n = std::min(a.block_rows, L - r0), kend = keys_visible(a, r0, n, S);
    if (row_kernels(a, kend)) {
      Tensor s = block_product(q.narrow(-2, r0, n), k.narrow(-2, 0, kend).transpose(-2, -1), a, Band::Kind::Columns,
                               r0);  // raw scores
      if (lse && !lse_all.defined()) lse_all = empty(with_tail(s, L, 1), TensorOptions(s.dtype()));
      kernels::attention_weights(block_of(s, a, scale, r0, n, kend, L), s.data_ptr(),
                                 lse ? row_ptr(lse_all, r0) : nullptr);
      if (weights) weights->push_back(s);
      if (heads)
        block_product_into(s, v.narrow(-2, 0, kend), out_heads.narrow(-2, r0, n), a, Band::Kind::DepthUpTo, r0);
      else
        outs.push_back(block_product(s, v.narrow(-2, 0, kend), a, Band::Kind::DepthUpTo, r0));
    } else {
      Tensor s = block_scores(q, k, a, scale, r0, n, kend);
      // softmax and logsumexp are single kiln kernels (row max, exp, row sum inside).
      outs.push_back(s.softmax(-1).matmul(v.narrow(-2, 0, kend)));
      if (lse) lses.push_back(s.logsumexp({-1}, /*keepdim=*/true));
    }
  }
  if (lse) *lse = lse_all.defined() ? lse_all : (lses.size() == 1 ? lses[0] : cat(lses, -2));
  if (heads) return out_heads;
  return outs.size() == 1 ? outs[0] : cat(outs, -2);
}

// q, k and v as the heads of one fused projection: a [B, T, 3C] tensor split
// into three [B, T, C] pieces along its last dim, each viewed [B, H, T, E]
// (the GPT block's layout). Backward then writes their gradients into one
// [B, T, 3C] buffer in that same layout, and the split's backward finds the
// three pieces side by side and joins them without a copy (SplitBackward).
bool fused_projection_heads(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes() || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype() || !k.is_alias_of(q) || !v.is_alias_of(q))
    return false;
  const int64_t H = q.size(1), T = q.size(2), E = q.size(3), C = H * E;
  const DimVector want{T * 3 * C, E, 3 * C, 1};
  if (q.strides() != IntArrayRef(want.data(), 4) || k.strides() != IntArrayRef(want.data(), 4) ||
      v.strides() != IntArrayRef(want.data(), 4))
    return false;
  const auto* p = static_cast<const char*>(q.data_ptr());
  const int64_t piece = C * q.element_size();
  return static_cast<const char*>(k.data_ptr()) == p + piece && static_cast<const char*>(v.data_ptr()) == p + 2 * piece;
}

// The kept weights as the heads kernel's one buffer (AttentionHeads::weights):
// the blocks' views must lie one after another and fill the buffer the heads
// kernel reads, as the heads path's forward leaves them; null (recompute)
// otherwise.
void* kept_heads_weights(const kernels::AttentionHeads& h, const std::vector<Tensor>& kept) {
  if (kept.empty()) return nullptr;
  char* const base = static_cast<char*>(kept[0].data_ptr());
  const int64_t es = element_size(h.dtype);
  char* next = base;
  for (const Tensor& w : kept) {
    if (!w.is_contiguous() || w.dtype() != h.dtype || static_cast<char*>(w.data_ptr()) != next) return nullptr;
    next += w.numel() * es;
  }
  return next - base == kernels::attention_heads_weights_size(h) * es ? base : nullptr;
}

// The composite's weights softmax(q kᵀ scale + mask or causal triangle), as kiln ops autograd records.
Tensor composite_weights(const Tensor& q, const Tensor& k, const Tensor& attn_mask, bool is_causal) {
  const int64_t L = q.size(-2), S = k.size(-2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  Tensor scores = q.matmul(k.transpose(-2, -1)).mul(scale);  // [..., L, S]
  if (is_causal) scores = scores.masked_fill(causal_hidden(L, S), kNegInf);
  if (attn_mask.defined()) {
    KILN_CHECK(attn_mask.dim() >= 1 && attn_mask.size(-1) == S &&
                   (attn_mask.dim() < 2 || attn_mask.size(-2) == L || attn_mask.size(-2) == 1),
               ShapeError, "scaled_dot_product_attention: expected attn_mask broadcastable to [..., ", L, ", ", S,
               "], got ", attn_mask.shape_string());
    if (attn_mask.dtype() == kBool) {
      scores = scores.masked_fill(attn_mask.logical_not(), kNegInf);
    } else {
      KILN_CHECK(attn_mask.is_floating_point(), DTypeError,
                 "scaled_dot_product_attention: expected a bool or floating attn_mask, got ",
                 dtype_name(attn_mask.dtype()));
      scores = scores + attn_mask;
    }
  }
  return scores.softmax(-1);
}

// The composite form with forward's dropout mask (a.keep) as a constant
// factor: what a create_graph backward differentiates after a dropped forward.
Tensor dropped_composite(const Tensor& q, const Tensor& k, const Tensor& v, const FusedArgs& a) {
  Tensor factor;
  {
    const NoGradGuard no_grad;
    factor = a.keep.to(q.dtype()).mul(1.0 / (1.0 - a.dropout_p));
  }
  return (composite_weights(q, k, Tensor(), a.causal) * factor).matmul(v);
}

struct FusedSdpa : autograd::Function<FusedSdpa> {
  static Tensor forward(autograd::AutogradContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const FusedArgs& a) {
    Tensor lse, keep;
    std::vector<Tensor> weights;
    Tensor out = attention_forward(q, k, v, a, &lse, &weights, &keep);
    TensorList saved{q, k, v, out, lse};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx.save_for_backward(saved);
    FusedArgs kept_args = a;
    kept_args.keep = keep;
    ctx.saved_data["args"] = kept_args;
    return out;
  }

  static TensorList backward(autograd::AutogradContext& ctx, TensorList grads) {
    TensorList saved = ctx.get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const std::vector<Tensor> kept(saved.begin() + 5, saved.end());  // Note [Kept weights]: one per block
    const auto a = std::any_cast<FusedArgs>(ctx.saved_data["args"]);
    const Tensor& dout = grads[0];
    if (grad_mode_enabled()) {
      // create_graph: differentiate the composite so the returned gradients
      // carry their own history, for only the arguments that want one, and
      // through an alias each (self-attention passes one tensor as q, k, v).
      return ctx.differentiate_composite({q, k, v}, grads, [&](const TensorList& in) {
        if (a.keep.defined()) return TensorList{dropped_composite(in[0], in[1], in[2], a)};
        return TensorList{attention_composite(in[0], in[1], in[2], a.mask, 0.0, a.causal, false)};
      });
    }
    const int64_t L = q.size(-2), S = k.size(-2);
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const Tensor D = output_dots(dout, out);  // [..., L, 1]
    std::optional<kernels::AttentionHeads> h = heads_args(q, k, v, a);
    const bool dropped = a.keep.defined();
    KILN_ASSERT(!dropped || (h && dout.sizes() == out.sizes() && D.is_contiguous()),
                "sdpa_fused: dropout's backward off the heads kernel");
    if (h && (dropped || fused_projection_heads(q, k, v)) && dout.sizes() == out.sizes() &&
        (dout.stride(3) == 1 || dropped) && D.is_contiguous()) {
      Tensor dq, dk, dv;
      if (fused_projection_heads(q, k, v)) {
        // One [B, T, 3C] buffer for the three gradients, as below.
        const int64_t B = q.size(0), H = q.size(1), E = q.size(3);
        const Tensor g = empty({B, L, 3, H, E}, TensorOptions(q.dtype()));
        dq = g.select(2, 0).transpose(1, 2);
        dk = g.select(2, 1).transpose(1, 2);
        dv = g.select(2, 2).transpose(1, 2);
      } else {
        dq = empty(q.sizes(), TensorOptions(q.dtype()));
        dk = empty(k.sizes(), TensorOptions(k.dtype()));
        dv = empty(v.sizes(), TensorOptions(v.dtype()));
      }
      if (dropped) set_dropout(*h, a.keep, a.dropout_p);
      const Tensor dO = dout.stride(3) == 1 ? dout : dout.contiguous();
      h->lse = lse.data_ptr();
      h->weights = kept_heads_weights(*h, kept);
      h->dout = head_operand(dO);
      h->D = D.data_ptr();
      h->dq = head_operand(dq);
      h->dk = head_operand(dk);
      h->dv = head_operand(dv);
      // Its five products run inside one kernel, not as matmul events: the
      // scores again (E), dP (Ev), dv (Ev), dq and dk (E), each over the scores
      // the forward computed (attention_flops counts two of them).
      OpScope rs("attention_fused_backward", {&dO, &q, &k, &v});
      if (rs.recording())
        rs.set_flops(attention_flops(q, k, out, a.causal) * static_cast<double>(3 * q.size(3) + 2 * v.size(3)) /
                     static_cast<double>(q.size(3) + v.size(3)));
      kernels::attention_heads_backward(*h);
      return {dq, dk, dv};
    }
    Tensor dk, dv;
    std::vector<Tensor> dqs;
    // One [B, T, 3C] buffer for the three gradients when q, k, v are heads of
    // one projection (fused_projection_heads): dq_all, dk_all, dv_all are its
    // heads, written in place by the row-kernel path below.
    Tensor dk_all, dv_all;
    const bool joint = !a.mask.defined() && fused_projection_heads(q, k, v);
    // dq's blocks are row ranges of one tensor: the row-kernel path writes each
    // block's product into its rows (matmul_into) when q, k and the scores
    // share their batch dims, instead of a cat of the blocks at the end.
    Tensor dq_all;
    if (joint) {
      const int64_t B = q.size(0), H = q.size(1), E = q.size(3);
      const Tensor g = empty({B, L, 3, H, E}, TensorOptions(q.dtype()));
      dq_all = g.select(2, 0).transpose(1, 2);
      dk_all = g.select(2, 1).transpose(1, 2);
      dv_all = g.select(2, 2).transpose(1, 2);
    } else if (row_kernels(a, 1) && q.dim() >= 3 && k.dim() == q.dim() && dout.dim() == q.dim() &&
               IntArrayRef(q.sizes().data(), q.dim() - 2) == IntArrayRef(k.sizes().data(), k.dim() - 2) &&
               IntArrayRef(q.sizes().data(), q.dim() - 2) == IntArrayRef(dout.sizes().data(), dout.dim() - 2))
      dq_all = empty(q.sizes(), TensorOptions(q.dtype()));
    // Last block first: it sees every key (causal or not), so its products
    // become dk and dv as they are and the earlier blocks add into their
    // leading rows: no zero-filled accumulators, no full-size add.
    const int64_t last = (L - 1) / a.block_rows * a.block_rows;
    for (int64_t r0 = last; r0 >= 0; r0 -= a.block_rows) {
      const int64_t n = std::min(a.block_rows, L - r0), kend = keys_visible(a, r0, n, S);
      Tensor dob = dout.narrow(-2, r0, n);
      Tensor kb = k.narrow(-2, 0, kend), vb = v.narrow(-2, 0, kend), qb = q.narrow(-2, r0, n);
      Tensor p, dqb, dkb, dvb;
      bool into_joint = false;  // this block's dk, dv go straight into the joint buffer's heads
      if (row_kernels(a, kend)) {
        const bool recompute = kept.empty();
        p = recompute ? block_product(qb, kb.transpose(-2, -1), a, Band::Kind::Columns, r0)  // raw scores
                      : kept[static_cast<size_t>(r0 / a.block_rows)];
        const kernels::AttentionBlock blk = block_of(p, a, scale, r0, n, kend, L);
        if (recompute) kernels::attention_recompute_weights(blk, p.data_ptr(), row_ptr(lse, r0));
        Tensor dp = block_product(dob, vb.transpose(-2, -1), a, Band::Kind::Columns, r0);
        // The first block sees every key: its products are dk and dv.
        into_joint = joint && !dv.defined() && kend == S && dp.sizes() == p.sizes() && D.numel() == blk.batch * L;
        if (into_joint) {
          block_product_into(p.transpose(-2, -1), dob, dv_all, a, Band::Kind::DepthFrom, r0);
        } else {
          dvb = block_product(p.transpose(-2, -1), dob, a, Band::Kind::DepthFrom, r0);
        }
        if (dp.sizes() == p.sizes() && D.numel() == blk.batch * L) {
          kernels::attention_scores_grad(blk, dp.data_ptr(), p.data_ptr(), row_ptr(D, r0));  // dS, scaled
          if (dq_all.defined() && dp.sizes() == IntArrayRef(with_tail(q, n, kend)))
            block_product_into(dp, kb, dq_all.narrow(-2, r0, n), a, Band::Kind::DepthUpTo, r0);
          else
            dqb = block_product(dp, kb, a, Band::Kind::DepthUpTo, r0);
          if (into_joint) {
            block_product_into(dp.transpose(-2, -1), qb, dk_all, a, Band::Kind::DepthFrom, r0);
          } else {
            dkb = block_product(dp.transpose(-2, -1), qb, a, Band::Kind::DepthFrom, r0);
          }
        } else {  // p broadcasts against dO's batch: the general ops
          Tensor ds = dp.sub_(D.narrow(-2, r0, n)).mul_(p);
          dqb = ds.matmul(kb).mul_(scale);
          dkb = ds.transpose(-2, -1).matmul(qb).mul_(scale);
        }
      } else {
        Tensor s = block_scores(q, k, a, scale, r0, n, kend);
        p = s.sub_(lse.narrow(-2, r0, n)).exp_();  // [..., n, kend], in place: s is a fresh tensor
        dvb = p.transpose(-2, -1).matmul(dob);
        Tensor ds = dob.matmul(vb.transpose(-2, -1)).sub_(D.narrow(-2, r0, n)).mul_(p);
        dqb = ds.matmul(kb).mul_(scale);
        dkb = ds.transpose(-2, -1).matmul(qb).mul_(scale);
      }
      if (dqb.defined()) {
        if (dq_all.defined()) {
          dq_all.narrow(-2, r0, n).copy_(dqb);
        } else {
          dqs.push_back(dqb);
        }
      }
      if (into_joint) {
        dv = dv_all;
        dk = dk_all;
      } else if (!dv.defined() && kend == S && dvb.sizes() == IntArrayRef(with_tail(out, S, v.size(-1))) &&
                 dkb.sizes() == IntArrayRef(with_tail(out, S, k.size(-1)))) {
        dv = dvb;
        dk = dkb;
      } else {
        if (!dv.defined() && joint) {
          dv = dv_all.zero_();
          dk = dk_all.zero_();
        } else if (!dv.defined()) {
          dv = zeros(with_tail(out, S, v.size(-1)), TensorOptions(v.dtype()));
          dk = zeros(with_tail(out, S, k.size(-1)), TensorOptions(k.dtype()));
        }
        dv.narrow(-2, 0, kend).add_(dvb);
        dk.narrow(-2, 0, kend).add_(dkb);
      }
    }
    std::reverse(dqs.begin(), dqs.end());
    Tensor dq = dq_all.defined() ? dq_all : dqs.size() == 1 ? dqs[0] : cat(dqs, -2);
    return {dq, dk, dv};
  }
};

// Note [Attention FLOPs where they run]
// The profiler counts a product's FLOPs on the event whose self time holds
// its arithmetic, so GFLOP/s is a rate and the FLOPs of nested events add up
// once. The heads kernel runs attention's products inside itself: its
// forward counts them on "attention_fused_forward" and its backward on
// "attention_fused_backward". Every other path (the blocks of rows, the
// composite) runs them as matmul events, which count their own. The count
// once sat on scaled_dot_product_attention, whose self time leaves the kernel
// out (gpt's attention read as free beside its FLOPs) and whose count the
// blocks' matmul events then repeated.
//
// The FLOPs of the heads kernel's two products, q·kᵀ and weights·v: 2·batch·
// (E + Ev) per score it computes (4·B·H·L·S·D when E = Ev), and under a
// causal mask only the scores it leaves (the lower triangle, diagonal
// included: blocks of rows skip the keys past their last row, and the banded
// products the rest, Note [Causal products]).
double attention_flops(const Tensor& q, const Tensor& k, const Tensor& out, bool causal) {
  const int64_t L = q.size(-2), S = k.size(-2), E = q.size(-1), Ev = out.size(-1);
  if (L == 0 || Ev == 0) return 0;
  const double batch = static_cast<double>(out.numel() / (L * Ev));
  double scores = static_cast<double>(L) * static_cast<double>(S);
  if (causal) {
    scores = 0;
    for (int64_t i = 0; i < L; ++i) scores += static_cast<double>(std::min(S, i + 1));
  }
  return 2.0 * batch * scores * static_cast<double>(E + Ev);
}

// Note [Query blocks for bf16 training]
// The fused path walks the query rows in blocks (attention_fused's
// block_rows, 64 by default). Backward runs the products that sum over a
// block's rows (dV = Pᵀ dO and dK = dSᵀ Q) once per block and adds each
// later block's into the first's. When every query row fits one block of
// 128, those products get twice the depth and the additions go. For bf16
// with a gradient to compute that pays: gpt's heads (`BM_SdpaGptHeadsBf16`,
// B 16, H 4, T 128, E 64, causal; interleaved repetitions, 2026-12-06) took
// 2628 -> 2448 us forward + backward at 1 thread and 1165 -> 1097 at 2,
// though the forward alone went 917 -> 959 us. float32 lost at 1 thread
// (3994 -> 4155 us) and inference (forward only) loses, so they keep 64, as
// do longer sequences, which were not measured. The summation order changes
// with the blocks, so bf16 gradients move in their last bits against 64-row
// blocks; the same inputs and thread count still give the same bits
// (DESIGN.md's determinism).
int64_t fused_block_rows(const Tensor& q, const Tensor& k, const Tensor& v) {
  constexpr int64_t kWhole = 128;
  const bool backward = grad_mode_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  const int64_t L = q.size(-2);
  return backward && q.dtype() == kBFloat16 && L > kAttentionBlockRows && L <= kWhole ? kWhole : kAttentionBlockRows;
}

// Whether the heads kernel runs this attention's dropout (Note [Dropout
// inside the heads] in kiln/kernels/attention.h): float32 or bf16 heads
// [B, H, L, E] that it takes, no mask, 0 < p < 1 (p = 1 stays the
// composite's zeros).
bool dropout_on_heads(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double p,
                      bool is_causal, int64_t block_rows) {
  if (!(p > 0.0 && p < 1.0) || attn_mask.defined() || (q.dtype() != kFloat32 && q.dtype() != kBFloat16)) return false;
  FusedArgs a;
  a.causal = is_causal;
  a.block_rows = block_rows;
  return heads_args(q, k, v, a).has_value();
}

// attention_fused, with dropout_p on the heads kernel when dropout_on_heads
// says it takes it (0: none).
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool is_causal,
                       int64_t block_rows, double dropout_p, std::source_location loc) {
  OpScope rs("attention_fused", {&q, &k, &v, &attn_mask});
  const autograd::CallSite site = autograd::CallSite::from(loc);
  check_args(q, k, v, attn_mask, 0.0, is_causal);
  KILN_CHECK(block_rows > 0, ValueError, "sdpa_fused: expected block_rows > 0, got ", block_rows);
  KILN_CHECK(!(attn_mask.defined() && attn_mask.requires_grad() && grad_mode_enabled()), ValueError,
             "sdpa_fused: expected an attn_mask that does not require grad (the composite path differentiates "
             "the mask), got one that does");
  const FusedArgs args{.mask = attn_mask.defined() ? attn_mask.detach() : Tensor(),
                       .causal = is_causal,
                       .block_rows = block_rows,
                       .dropout_p = dropout_p,
                       .keep = Tensor()};
  // Nothing to differentiate (inference): no graph node, no log-sum-exp.
  if (!grad_mode_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad()))
    return attention_forward(q, k, v, args, nullptr);
  return FusedSdpa::apply_at(site, q, k, v, args);
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, bool training, std::source_location loc) {
  OpScope rs("scaled_dot_product_attention", {&q, &k, &v, &attn_mask});
  memory::note_call_site(loc.file_name(), loc.line());  // the composite's ops run under the caller's line
  check_args(q, k, v, attn_mask, dropout_p, is_causal);
  const bool dropout_active = training && dropout_p > 0.0;
  const bool mask_needs_grad = attn_mask.defined() && attn_mask.requires_grad() && grad_mode_enabled();
  const int64_t block_rows = fused_block_rows(q, k, v);
  const bool dropout_fused = dropout_active && dropout_on_heads(q, k, v, attn_mask, dropout_p, is_causal, block_rows);
  const bool fused = (!dropout_active || dropout_fused) && !mask_needs_grad;
  return fused ? fused_attention(q, k, v, attn_mask, is_causal, block_rows, dropout_fused ? dropout_p : 0.0, loc)
               : attention_composite(q, k, v, attn_mask, dropout_p, is_causal, training);
}

// The composite form: autograd records matmul, softmax and masked_fill, so
// gradients of any order follow without a hand-written backward; it keeps the
// [..., L, S] scores and weights for backward (O(T^2) per head).
Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, double dropout_p,
                           bool is_causal, bool training) {
  OpScope rs("attention_composite", {&q, &k, &v, &attn_mask});
  Tensor weights = composite_weights(q, k, attn_mask, is_causal);
  if (training && dropout_p > 0.0) {
    if (dropout_p == 1.0) {
      weights = weights * zeros_like(weights);
    } else {
      weights = dropout_train(weights, dropout_p);  // Note [Dropout in one pass] in dropout.cpp
    }
  }
  return weights.matmul(v);
}

Tensor attention_fused(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool is_causal,
                       int64_t block_rows, std::source_location loc) {
  return fused_attention(q, k, v, attn_mask, is_causal, block_rows, 0.0, loc);
}

}  // namespace kiln::ops
