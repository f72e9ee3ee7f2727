// Megatron-style tensor parallelism over a process group (issue 20): the
// layers of a transformer split across the ranks of a tp group so that each
// rank holds 1/tp of their weights, with one all-reduce per block half.
//
// The four conjugate operators (autograd Functions, docs/parallel.md):
//   copy_to_tp_region       f: identity forward, all-reduce(sum) of the gradient backward
//   reduce_from_tp_region   g: all-reduce(sum) forward, identity backward
//   scatter_to_tp_region    this rank's slice of the last dim forward, all-gather backward
//   gather_from_tp_region   all-gather along the last dim forward, this rank's slice backward
// A column-parallel Linear starts with f, a row-parallel one ends with g, so
// attention and the MLP each cost one all-reduce forward and one backward.
// Sequence parallelism (the layers' sequence_parallel option) replaces f and g
// by an all-gather and a reduce-scatter along dim 1, the sequence, so that the
// activations between the regions are [B, T / tp, ...] chunks.
//
// Layers (parameter shards of the matching single-process layer):
//   ColumnParallelLinear    weight rows (output features) split: [out/tp, in], bias [out/tp]
//   RowParallelLinear       weight columns (input features) split: [out, in/tp]; bias [out] whole,
//                           added once after the all-reduce
//   VocabParallelEmbedding  rows (the vocabulary) split: [V/tp, d]
//   vocab_parallel_cross_entropy: the loss of logits split along the vocabulary
//                           without any rank holding the full logits
//
// Every layer takes a group (a dist::ProcessGroupPtr, e.g. the tp dimension of
// a device mesh) and checks at construction, collectively, that every rank
// builds it from the same full shape: a rank with another layout ends in a
// ShapeError on every rank that names the layer and the ranks, not a hang in
// all-reduces of different sizes. Collectives carry a CollectiveLabel naming
// the layer ("tensor parallel 'h.0.attn.c_proj': forward all-reduce").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/dist/process_group.h"
#include "kiln/nn/module.h"
#include "kiln/ops/linalg.h"

namespace kiln::parallel {

// ---- the conjugate operators ----
// `label` names the caller in collective diagnostics.

/// f: identity forward; backward all-reduces (sums) the gradient over `group`.
Tensor copy_to_tp_region(const Tensor& x, const dist::ProcessGroupPtr& group, const std::string& label = "");
/// g: all-reduces (sums) x over `group` forward; identity backward.
Tensor reduce_from_tp_region(const Tensor& x, const dist::ProcessGroupPtr& group, const std::string& label = "");
/// This rank's 1/size() slice of the last dim (which must divide evenly); backward all-gathers.
Tensor scatter_to_tp_region(const Tensor& x, const dist::ProcessGroupPtr& group, const std::string& label = "");
/// Concatenates every rank's x along the last dim (rank order); backward keeps this rank's slice.
Tensor gather_from_tp_region(const Tensor& x, const dist::ProcessGroupPtr& group, const std::string& label = "");

// ---- sequence parallel (Megatron): activations outside the tp regions are
// [B, T / tp, ...], this rank's chunk of the sequence (dim 1) ----

/// All-gathers the sequence chunks along dim 1 ([B, T / tp, ..] -> [B, T, ..]);
/// backward reduce-scatters the gradient along dim 1 (it replaces f).
Tensor gather_from_sequence_parallel_region(const Tensor& x, const dist::ProcessGroupPtr& group,
                                            const std::string& label = "");
/// Sums x over the group and keeps this rank's chunk of dim 1 ([B, T, ..] ->
/// [B, T / tp, ..]; T must divide by size()); backward all-gathers (it replaces g).
Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& x, const dist::ProcessGroupPtr& group,
                                                  const std::string& label = "");

// ---- how parameters are split ----

/// The layout of one parameter of a tensor-parallel module across the group.
struct ShardSpec {
  enum class Kind {
    Replicated,  // every rank holds the whole tensor (LayerNorms, a row-parallel bias)
    Rows,        // dim 0 split: rank r holds rows [r n / tp, (r + 1) n / tp) of each block
    Columns,     // dim 1 split
  };
  Kind kind = Kind::Replicated;
  /// Rows only: dim 0 is `blocks` equal blocks (attention's q, k, v), each
  /// split across the ranks; a shard is this rank's part of every block, in order.
  int64_t blocks = 1;
};

/// Implemented by modules whose own (non-recursive) parameters are shards.
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  /// The layout of the parameter registered under `name` on this module.
  virtual ShardSpec shard_spec(const std::string& name) const = 0;
};

/// The layout of every parameter of `module` by its dotted name (parameters
/// of modules that are not ShardedModule are Replicated).
std::map<std::string, ShardSpec> shard_specs(nn::Module& module);
/// The shape of the full tensor of which `local` is one of `parts` shards.
std::vector<int64_t> full_shape(const std::vector<int64_t>& local, const ShardSpec& spec, int parts);
/// Rank `rank`'s shard of `full` (a contiguous copy; `full` itself when Replicated).
Tensor shard_of(const Tensor& full, const ShardSpec& spec, int rank, int parts);
/// The full tensor from every rank's `local` (a collective over `group`; each
/// rank gets it). Replicated tensors are returned as they are.
Tensor merge_shards(const Tensor& local, const ShardSpec& spec, const dist::ProcessGroupPtr& group);

/// Copies this rank's shard of each parameter (and persistent buffer) of
/// `module` from `full`, a single-process state dict with the same names
/// (extra keys are ignored; a missing key or a full tensor of the wrong shape
/// is an error). Collective: every rank learns whether any rank failed and
/// throws together, the failing rank with what was expected and got.
void load_from_full(nn::Module& module, const nn::NamedTensors& full, const dist::ProcessGroupPtr& group);
/// The single-process state dict (names, shapes, order of state_dict()) from
/// every rank's shards; a collective, every rank gets all of it.
nn::NamedTensors full_state_dict(nn::Module& module, const dist::ProcessGroupPtr& group);

/// This rank's shard of `full` (a single-process parameter or gradient), to
/// compare a tensor-parallel model's tensors with one process's.
inline Tensor local_part(const Tensor& full, const ShardSpec& spec, const dist::ProcessGroupPtr& group) {
  return shard_of(full, spec, group->rank(), group->size());
}

// ---- layers ----

struct ColumnParallelLinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;  // the full layer's; must divide by blocks x tp
  bool bias = true;
  /// Gather the output shards so every rank returns [.., out_features];
  /// otherwise each returns its [.., out_features / tp] (the input of a
  /// RowParallelLinear with input_is_parallel).
  bool gather_output = false;
  /// The output is `blocks` equal blocks split separately (3 for a fused q, k, v projection).
  int64_t blocks = 1;
  /// The input is this rank's sequence chunk [B, T / tp, in]: forward
  /// all-gathers it along dim 1 in place of f (backward: a reduce-scatter).
  bool sequence_parallel = false;
  std::string name = "ColumnParallelLinear";  // in errors and collective labels
};

/// y = x Wᵀ + b with W's rows (output features) split across the group.
/// forward: f (copy_to_tp_region), the local product, then gather_output's all-gather.
class ColumnParallelLinear : public nn::Module, public ShardedModule {
 public:
  ColumnParallelLinear(ColumnParallelLinearOptions o, dist::ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;
  ShardSpec shard_spec(const std::string& name) const override;
  std::string extra_repr() const override;
  /// Takes this rank's shard of a single-process nn::Linear's weight [out, in] (and bias [out]).
  void load_from_full(const Tensor& weight, const Tensor& bias = {});
  const ColumnParallelLinearOptions options;
  const dist::ProcessGroupPtr group;
  Tensor& weight;  // [out / tp, in]
  Tensor& bias;    // [out / tp]; undefined without bias
};

struct RowParallelLinearOptions {
  int64_t in_features = 0;  // the full layer's; must divide by tp
  int64_t out_features = 0;
  bool bias = true;
  /// The input is already this rank's [.., in / tp] (a ColumnParallelLinear's
  /// output); otherwise forward takes the full input and keeps its slice.
  bool input_is_parallel = true;
  /// The output is reduce-scattered along dim 1 (the sequence) in place of
  /// g's all-reduce: each rank returns [B, T / tp, out]. The bias, added to
  /// the chunk, goes through f so that its gradient sums every chunk's.
  bool sequence_parallel = false;
  std::string name = "RowParallelLinear";
};

/// y = x Wᵀ + b with W's columns (input features) split: every rank computes
/// its partial product, g (reduce_from_tp_region) sums them, and the whole
/// bias is added once after the sum (not once per rank).
class RowParallelLinear : public nn::Module, public ShardedModule {
 public:
  RowParallelLinear(RowParallelLinearOptions o, dist::ProcessGroupPtr group);
  Tensor forward(const Tensor& x) override;
  ShardSpec shard_spec(const std::string& name) const override;
  std::string extra_repr() const override;
  void load_from_full(const Tensor& weight, const Tensor& bias = {});
  const RowParallelLinearOptions options;
  const dist::ProcessGroupPtr group;
  Tensor& weight;  // [out, in / tp]
  Tensor& bias;    // [out], the same on every rank
};

struct VocabParallelEmbeddingOptions {
  int64_t num_embeddings = 0;  // the vocabulary; must divide by tp
  int64_t embedding_dim = 0;
  /// Reduce-scatter the rows along dim 1 (the sequence) instead of all-reducing
  /// them: ids [B, T] -> this rank's [B, T / tp, d].
  bool sequence_parallel = false;
  std::string name = "VocabParallelEmbedding";
};

/// nn::Embedding with the vocabulary split: rank r holds rows [vocab_start,
/// vocab_end). forward looks up the ids in this range, zeroes the others'
/// rows, and all-reduces, so every rank returns the full [*idx, d].
class VocabParallelEmbedding : public nn::Module, public ShardedModule {
 public:
  VocabParallelEmbedding(VocabParallelEmbeddingOptions o, dist::ProcessGroupPtr group);
  Tensor forward(const Tensor& idx) override;
  ShardSpec shard_spec(const std::string& name) const override;
  std::string extra_repr() const override;
  void load_from_full(const Tensor& weight);
  const VocabParallelEmbeddingOptions options;
  const dist::ProcessGroupPtr group;
  const int64_t vocab_start, vocab_end;
  Tensor& weight;  // [num_embeddings / tp, embedding_dim]
};

/// Mean cross-entropy of logits split along the vocabulary, equal to
/// nn::functional::cross_entropy(full_logits, target) with the default
/// options: logits_shard [N, V / tp] holds classes [vocab_start, vocab_start
/// + V / tp) on this rank, target [N] int64 is the same on every rank
/// (ignore_index entries count for nothing). No rank forms the full logits:
/// the row max is all-reduced (max), then the sum of exponentials and the
/// target's logit together (one sum all-reduce). The gradient is exact
/// (softmax - one_hot) / count, computed locally. Float32 math (other dtypes
/// are converted; the gradient returns in the logits' dtype).
Tensor vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& target,
                                    const dist::ProcessGroupPtr& group, int64_t vocab_start,
                                    int64_t ignore_index = -100, const std::string& label = "");

namespace detail {
/// Every rank of `group` calls it with the same `layer` and the layer's full
/// dims: the dims are gathered and compared, and a difference throws the same
/// ShapeError on every rank naming the layer and the ranks' shapes.
void check_same_layout(const dist::ProcessGroupPtr& group, const std::string& layer, const std::string& kind,
                       const std::vector<int64_t>& dims);
}  // namespace detail

}  // namespace kiln::parallel
