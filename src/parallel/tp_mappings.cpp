// The conjugate operators of tensor parallelism (f, g, scatter, gather) and
// the vocabulary-parallel cross-entropy, as custom autograd Functions whose
// forward or backward runs a collective over the tp group.
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kiln/autograd/custom_function.h"
#include "kiln/core/error.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/parallel/tensor_parallel.h"

namespace kiln::parallel {
namespace {

using autograd::AutogradContext;
using dist::ProcessGroupPtr;

// A contiguous copy that a collective may overwrite: the engine's gradient
// tensors (and forward's inputs) may be shared with other consumers.
Tensor owned(const Tensor& t) { return t.is_contiguous() ? t.clone() : t.contiguous(); }

// The label of a collective for diagnostics: "tensor parallel 'h.0.attn.c_proj': forward all-reduce".
std::string label_for(const std::string& who, const char* what) {
  return "tensor parallel '" + (who.empty() ? std::string("(unnamed)") : who) + "': " + what;
}

Tensor all_reduce_sum(const Tensor& x, const ProcessGroupPtr& g, const std::string& who, const char* what) {
  if (g->size() == 1) return x;
  Tensor t = owned(x);
  dist::CollectiveLabel l(label_for(who, what));
  g->allreduce(t, dist::ReduceOp::Sum)->wait();
  return t;
}

Tensor all_gather_last(const Tensor& x, const ProcessGroupPtr& g, const std::string& who, const char* what) {
  if (g->size() == 1) return x;
  Tensor in = x.contiguous();
  std::vector<Tensor> parts;
  for (int r = 0; r < g->size(); ++r) parts.push_back(kiln::empty(in.sizes(), TensorOptions(in.dtype())));
  {
    dist::CollectiveLabel l(label_for(who, what));
    g->allgather(parts, in)->wait();
  }
  return cat(parts, -1).contiguous();
}

Tensor slice_last(const Tensor& x, const ProcessGroupPtr& g, const std::string& who) {
  const int64_t last = x.size(x.dim() - 1);
  KILN_CHECK(last % g->size() == 0, ShapeError, "tensor parallel '", who, "': expected the last dim (", last,
             ") to divide evenly across ", g->describe(), ", got shape ", x.shape_string());
  const int64_t part = last / g->size();
  return x.narrow(x.dim() - 1, part * g->rank(), part).contiguous();
}

// Along dim 1 (the sequence): every rank's chunk, concatenated in rank order.
Tensor all_gather_seq(const Tensor& x, const ProcessGroupPtr& g, const std::string& who, const char* what) {
  if (g->size() == 1) return x;
  Tensor in = x.contiguous();
  std::vector<Tensor> parts;
  for (int r = 0; r < g->size(); ++r) parts.push_back(kiln::empty(in.sizes(), TensorOptions(in.dtype())));
  {
    dist::CollectiveLabel l(label_for(who, what));
    g->allgather(parts, in)->wait();
  }
  return cat(parts, 1).contiguous();
}

// The sum over ranks of x's chunk rank() along dim 1.
Tensor reduce_scatter_seq(const Tensor& x, const ProcessGroupPtr& g, const std::string& who, const char* what) {
  KILN_CHECK(x.dim() >= 2 && x.size(1) % g->size() == 0, ShapeError, "sequence parallel '", who,
             "': expected dim 1 (the sequence) to divide evenly across ", g->describe(), ", got shape ",
             x.shape_string());
  if (g->size() == 1) return x;
  const int64_t chunk = x.size(1) / g->size();
  std::vector<Tensor> in;
  for (int r = 0; r < g->size(); ++r) in.push_back(x.narrow(1, chunk * r, chunk).contiguous());
  Tensor out = kiln::empty(in[0].sizes(), TensorOptions(x.dtype()));
  dist::CollectiveLabel l(label_for(who, what));
  g->reduce_scatter(out, in, dist::ReduceOp::Sum)->wait();
  return out;
}

// What a region operator's backward needs: the group and the layer's name (for labels and errors).
void keep(AutogradContext& ctx, const ProcessGroupPtr& g, const std::string& who) {
  ctx.saved_data["g"] = g;
  ctx.saved_data["who"] = who;
}
ProcessGroupPtr group_of(AutogradContext& ctx) { return ctx.saved_data.get<ProcessGroupPtr>("g"); }
std::string who_of(AutogradContext& ctx) { return ctx.saved_data.get<std::string>("who"); }

struct GatherSequence : autograd::Function<GatherSequence> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, ProcessGroupPtr g, std::string who) {
    keep(ctx, g, who);
    return all_gather_seq(x, g, who, "forward all-gather of the sequence");
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    return {reduce_scatter_seq(grads[0], group_of(ctx), who_of(ctx), "backward reduce-scatter of the sequence")};
  }
};

struct ReduceScatterSequence : autograd::Function<ReduceScatterSequence> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, ProcessGroupPtr g, std::string who) {
    keep(ctx, g, who);
    return reduce_scatter_seq(x, g, who, "forward reduce-scatter of the sequence");
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    return {all_gather_seq(grads[0], group_of(ctx), who_of(ctx), "backward all-gather of the sequence")};
  }
};

struct CopyToRegion : autograd::Function<CopyToRegion> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, ProcessGroupPtr g, std::string who) {
    keep(ctx, g, who);
    return x;
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    return {all_reduce_sum(grads[0], group_of(ctx), who_of(ctx), "backward all-reduce (f)")};
  }
};

struct ReduceFromRegion : autograd::Function<ReduceFromRegion> {
  static Tensor forward(AutogradContext&, const Tensor& x, ProcessGroupPtr g, std::string who) {
    return all_reduce_sum(x, g, who, "forward all-reduce (g)");
  }
  static TensorList backward(AutogradContext&, TensorList grads) { return {grads[0]}; }
};

struct ScatterToRegion : autograd::Function<ScatterToRegion> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, ProcessGroupPtr g, std::string who) {
    keep(ctx, g, who);
    return slice_last(x, g, who);
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    return {all_gather_last(grads[0], group_of(ctx), who_of(ctx), "backward all-gather (scatter)")};
  }
};

struct GatherFromRegion : autograd::Function<GatherFromRegion> {
  static Tensor forward(AutogradContext& ctx, const Tensor& x, ProcessGroupPtr g, std::string who) {
    keep(ctx, g, who);
    return all_gather_last(x, g, who, "forward all-gather (gather)");
  }
  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    return {slice_last(grads[0], group_of(ctx), who_of(ctx))};
  }
};

// Note [Vocabulary-parallel cross-entropy]
// loss_i = log Σ_v exp(l_iv - m_i) - (l_i,t_i - m_i), m_i = max_v l_iv. Each
// rank holds the columns [start, start + Vl): it reduces its part of the max
// (one Max all-reduce), then its part of Σ exp and the target's shifted logit
// (zero unless t_i is one of its columns) together, in one Sum all-reduce of
// [2, N]. The gradient (softmax_iv - [v == t_i]) / count needs only this
// rank's columns of the softmax, which forward keeps: backward communicates
// nothing.
struct VocabParallelCE : autograd::Function<VocabParallelCE> {
  static Tensor forward(AutogradContext& ctx, const Tensor& logits, const Tensor& target, ProcessGroupPtr g,
                        int64_t start, int64_t ignore_index, std::string who) {
    const int64_t N = logits.size(0), Vl = logits.size(1), V = Vl * g->size();
    Tensor lg = logits.to(kFloat32).contiguous();
    Tensor tg = target.contiguous();
    const float* l = lg.data_ptr<float>();
    const int64_t* t = tg.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i)
      KILN_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < V), IndexError, "vocab_parallel_cross_entropy ('", who,
                 "'): expected targets in [0, ", V, ") (or ignore_index ", ignore_index, "), got ", t[i],
                 " at position ", i);

    Tensor mx = kiln::empty({N}, TensorOptions(kFloat32));
    float* m = mx.data_ptr<float>();
    for (int64_t i = 0; i < N; ++i) {
      float v = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < Vl; ++j) v = std::max(v, l[i * Vl + j]);
      m[i] = v;
    }
    if (g->size() > 1) {
      dist::CollectiveLabel lab(label_for(who, "forward all-reduce of the row max (vocab-parallel cross-entropy)"));
      g->allreduce(mx, dist::ReduceOp::Max)->wait();
    }

    Tensor probs = kiln::empty({N, Vl}, TensorOptions(kFloat32));
    Tensor sums = zeros({2, N}, TensorOptions(kFloat32));
    float* p = probs.data_ptr<float>();
    float* s = sums.data_ptr<float>();
    for (int64_t i = 0; i < N; ++i) {
      float acc = 0;
      for (int64_t j = 0; j < Vl; ++j) {
        p[i * Vl + j] = std::exp(l[i * Vl + j] - m[i]);
        acc += p[i * Vl + j];
      }
      s[i] = acc;
      if (t[i] >= start && t[i] < start + Vl) s[N + i] = l[i * Vl + (t[i] - start)] - m[i];
    }
    if (g->size() > 1) {
      dist::CollectiveLabel lab(label_for(who, "forward all-reduce of the sum of exponentials and the target logit"));
      g->allreduce(sums, dist::ReduceOp::Sum)->wait();
    }

    double total = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < N; ++i) {
      const float inv = 1.0f / s[i];
      for (int64_t j = 0; j < Vl; ++j) p[i * Vl + j] *= inv;
      if (t[i] == ignore_index) continue;
      total += static_cast<double>(std::log(s[i]) - s[N + i]);
      ++count;
    }
    ctx.saved_data["probs"] = probs;
    ctx.saved_data["target"] = tg;
    ctx.saved_data["start"] = start;
    ctx.saved_data["ignore"] = ignore_index;
    ctx.saved_data["count"] = count;
    ctx.saved_data["dtype"] = logits.dtype();
    // As torch's mean over no valid target: 0 / 0.
    const double loss = count ? total / static_cast<double>(count) : std::nan("");
    return scalar_tensor(loss, TensorOptions(logits.dtype()));
  }

  static TensorList backward(AutogradContext& ctx, TensorList grads) {
    Tensor probs = ctx.saved_data.get<Tensor>("probs");
    const Tensor& tg = ctx.saved_data.get<Tensor>("target");
    const int64_t start = ctx.saved_data.get<int64_t>("start"), ignore = ctx.saved_data.get<int64_t>("ignore");
    const int64_t count = ctx.saved_data.get<int64_t>("count");
    const int64_t N = probs.size(0), Vl = probs.size(1);
    const float scale = static_cast<float>(grads[0].to(kFloat32).item<float>() / static_cast<double>(count));
    Tensor grad = probs.clone();
    float* d = grad.data_ptr<float>();
    const int64_t* t = tg.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      float* row = d + i * Vl;
      if (t[i] == ignore) {
        for (int64_t j = 0; j < Vl; ++j) row[j] = 0;
        continue;
      }
      if (t[i] >= start && t[i] < start + Vl) row[t[i] - start] -= 1.0f;
      for (int64_t j = 0; j < Vl; ++j) row[j] *= scale;
    }
    return {grad.to(ctx.saved_data.get<DType>("dtype")), Tensor()};
  }
};

}  // namespace

Tensor copy_to_tp_region(const Tensor& x, const ProcessGroupPtr& group, const std::string& label) {
  return CopyToRegion::apply(x, group, label);
}

Tensor reduce_from_tp_region(const Tensor& x, const ProcessGroupPtr& group, const std::string& label) {
  return ReduceFromRegion::apply(x, group, label);
}

Tensor scatter_to_tp_region(const Tensor& x, const ProcessGroupPtr& group, const std::string& label) {
  return ScatterToRegion::apply(x, group, label);
}

Tensor gather_from_tp_region(const Tensor& x, const ProcessGroupPtr& group, const std::string& label) {
  return GatherFromRegion::apply(x, group, label);
}

Tensor gather_from_sequence_parallel_region(const Tensor& x, const ProcessGroupPtr& group, const std::string& label) {
  return GatherSequence::apply(x, group, label);
}

Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& x, const ProcessGroupPtr& group,
                                                  const std::string& label) {
  return ReduceScatterSequence::apply(x, group, label);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& target, const ProcessGroupPtr& group,
                                    int64_t vocab_start, int64_t ignore_index, const std::string& label) {
  KILN_CHECK(logits_shard.dim() == 2, ShapeError,
             "vocab_parallel_cross_entropy: expected logits_shard [N, V / tp], got ", logits_shard.shape_string());
  KILN_CHECK(target.dim() == 1 && target.size(0) == logits_shard.size(0) && target.dtype() == kInt64, ShapeError,
             "vocab_parallel_cross_entropy: expected target [", logits_shard.size(0), "] of int64, got ",
             dtype_name(target.dtype()), " ", target.shape_string());
  KILN_CHECK(vocab_start >= 0 && vocab_start == logits_shard.size(1) * group->rank(), ValueError,
             "vocab_parallel_cross_entropy: expected vocab_start = rank x (V / tp) = ", group->rank(), " x ",
             logits_shard.size(1), ", got ", vocab_start);
  return VocabParallelCE::apply(logits_shard, target, group, vocab_start, ignore_index, label);
}

}  // namespace kiln::parallel
