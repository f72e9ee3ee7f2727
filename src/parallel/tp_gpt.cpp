// The tensor-parallel GPT: nanoGPT's model (src/nn/models_gpt.cpp, the block
// of src/nn/transformer.cpp) with its attention heads, MLP and vocabulary
// split across a tp group, the same names and the same math.
#include "kiln/parallel/tensor_parallel_gpt.h"

#include <cmath>
#include <string>
#include <utility>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/layer_norm.h"

namespace kiln::parallel {
namespace {

nn::TransformerBlockOptions resolved(nn::TransformerBlockOptions o, const dist::ProcessGroupPtr& g,
                                     const std::string& name) {
  KILN_CHECK(o.d_model > 0 && o.n_head > 0 && o.d_model % o.n_head == 0, ValueError, "tensor parallel block '", name,
             "': expected d_model > 0 divisible by n_head > 0, got d_model ", o.d_model, " and n_head ", o.n_head);
  if (o.d_ff == 0) o.d_ff = 4 * o.d_model;
  KILN_CHECK(g != nullptr && o.n_head % g->size() == 0, ShapeError, "tensor parallel block '", name,
             "': expected n_head (", o.n_head, ") to divide evenly among the ", g ? g->size() : 0,
             " ranks of the tp group (each rank computes whole heads)");
  return o;
}

// A replicated LayerNorm on this rank's sequence chunk: its weight and bias go
// through f so that their gradients sum every chunk's (equal on every rank).
Tensor sequence_parallel_layer_norm(nn::LayerNorm& ln, const Tensor& x, const dist::ProcessGroupPtr& g,
                                    const std::string& name) {
  return ops::layer_norm(x, ln.options.normalized_shape, copy_to_tp_region(ln.weight, g, name + ".weight"),
                         copy_to_tp_region(ln.bias, g, name + ".bias"), ln.options.eps);
}

}  // namespace

ParallelSelfAttention::ParallelSelfAttention(const nn::TransformerBlockOptions& o, dist::ProcessGroupPtr group,
                                             const std::string& name, TensorParallelOptions tp)
    : nn::Module("ParallelSelfAttention"),
      d_model(o.d_model),
      n_head(o.n_head),
      local_heads(o.n_head / group->size()),
      dropout(o.dropout) {
  KILN_CHECK(o.causal, ValueError, "ParallelSelfAttention '", name, "': only the causal (GPT) block is built");
  c_attn = register_module("c_attn", std::make_shared<ColumnParallelLinear>(
                                         ColumnParallelLinearOptions{.in_features = o.d_model,
                                                                     .out_features = 3 * o.d_model,
                                                                     .blocks = 3,
                                                                     .sequence_parallel = tp.sequence_parallel,
                                                                     .name = name + ".c_attn"},
                                         group));
  c_proj = register_module(
      "c_proj", std::make_shared<RowParallelLinear>(RowParallelLinearOptions{.in_features = o.d_model,
                                                                             .out_features = o.d_model,
                                                                             .input_is_parallel = true,
                                                                             .sequence_parallel = tp.sequence_parallel,
                                                                             .name = name + ".c_proj"},
                                                    group));
  resid_dropout = register_module("resid_dropout", std::make_shared<nn::Dropout>(o.dropout));
}

Tensor ParallelSelfAttention::forward(const Tensor& x) {
  KILN_CHECK(x.dim() == 3 && x.size(2) == d_model, ShapeError, "ParallelSelfAttention: expected input [B, T, ", d_model,
             "], got ", x.shape_string());
  const int64_t hs = d_model / n_head, local = local_heads * hs;
  // c_attn's shard is this rank's q, k and v rows in turn (blocks = 3), so its
  // output splits like the single-process layer's, one third per block. Under
  // sequence parallelism it has gathered the whole sequence: T is its dim 1.
  Tensor proj = (*c_attn)(x);
  const int64_t B = proj.size(0), T = proj.size(1);
  auto qkv = proj.split(local, 2);
  auto heads = [&](const Tensor& t) { return t.view({B, T, local_heads, hs}).transpose(1, 2); };
  Tensor y = nn::functional::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), {}, dropout,
                                                          /*is_causal=*/true, is_training());
  return (*resid_dropout)((*c_proj)(y.transpose(1, 2).reshape({B, T, local})));
}

ParallelMLP::ParallelMLP(const nn::TransformerBlockOptions& o, dist::ProcessGroupPtr group, const std::string& name,
                         TensorParallelOptions tp)
    : nn::Module("ParallelMLP") {
  c_fc = register_module("c_fc", std::make_shared<ColumnParallelLinear>(
                                     ColumnParallelLinearOptions{.in_features = o.d_model,
                                                                 .out_features = o.d_ff,
                                                                 .sequence_parallel = tp.sequence_parallel,
                                                                 .name = name + ".c_fc"},
                                     group));
  c_proj = register_module(
      "c_proj", std::make_shared<RowParallelLinear>(RowParallelLinearOptions{.in_features = o.d_ff,
                                                                             .out_features = o.d_model,
                                                                             .input_is_parallel = true,
                                                                             .sequence_parallel = tp.sequence_parallel,
                                                                             .name = name + ".c_proj"},
                                                    group));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(o.dropout));
}

Tensor ParallelMLP::forward(const Tensor& x) { return (*dropout)((*c_proj)((*c_fc)(x).gelu("tanh"))); }

ParallelTransformerBlock::ParallelTransformerBlock(nn::TransformerBlockOptions o, dist::ProcessGroupPtr g,
                                                   const std::string& n, TensorParallelOptions t)
    : nn::Module("ParallelBlock"), group(std::move(g)), tp(t), name(n) {
  o = resolved(o, group, name);
  ln_1 =
      register_module("ln_1", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.d_model}}));
  attn = register_module("attn", std::make_shared<ParallelSelfAttention>(o, group, name + ".attn", tp));
  ln_2 =
      register_module("ln_2", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.d_model}}));
  mlp = register_module("mlp", std::make_shared<ParallelMLP>(o, group, name + ".mlp", tp));
}

Tensor ParallelTransformerBlock::forward(const Tensor& x) {
  if (!tp.sequence_parallel) {
    Tensor h = x + (*attn)((*ln_1)(x));
    return h + (*mlp)((*ln_2)(h));
  }
  Tensor h = x + (*attn)(sequence_parallel_layer_norm(*ln_1, x, group, name + ".ln_1"));
  return h + (*mlp)(sequence_parallel_layer_norm(*ln_2, h, group, name + ".ln_2"));
}

TensorParallelGPT::TensorParallelGPT(models::GPTOptions o, dist::ProcessGroupPtr g, TensorParallelOptions t)
    : nn::Module("TensorParallelGPT"), options(std::move(o)), group(std::move(g)), tp(t) {
  KILN_CHECK(group != nullptr && group->is_member(), DistributedError,
             "TensorParallelGPT: expected a process group this rank belongs to, got ",
             group ? group->describe() : std::string("none"));
  KILN_CHECK(options.vocab_size > 0 && options.block_size > 0 && options.n_layer > 0, ValueError,
             "TensorParallelGPT: expected vocab_size, block_size and n_layer > 0, got ", options.vocab_size, ", ",
             options.block_size, " and ", options.n_layer);
  KILN_CHECK(!options.activation_checkpointing.enabled(), ValueError,
             "TensorParallelGPT: activation checkpointing is not supported (its recomputed forward would repeat "
             "the tp all-reduces); leave GPTOptions::activation_checkpointing empty");
  transformer = register_module("transformer", std::make_shared<nn::ModuleDict>());
  wte =
      std::make_shared<VocabParallelEmbedding>(VocabParallelEmbeddingOptions{.num_embeddings = options.vocab_size,
                                                                             .embedding_dim = options.n_embd,
                                                                             .sequence_parallel = tp.sequence_parallel,
                                                                             .name = "transformer.wte"},
                                               group);
  wpe = std::make_shared<nn::Embedding>(
      nn::EmbeddingOptions{.num_embeddings = options.block_size, .embedding_dim = options.n_embd});
  drop = std::make_shared<nn::Dropout>(options.dropout);
  h = std::make_shared<nn::ModuleList>();
  for (int64_t i = 0; i < options.n_layer; ++i)
    h->push_back(std::make_shared<ParallelTransformerBlock>(
        nn::TransformerBlockOptions{
            .d_model = options.n_embd, .n_head = options.n_head, .d_ff = options.d_ff, .dropout = options.dropout},
        group, "transformer.h." + std::to_string(i), tp));
  ln_f = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {options.n_embd}});
  transformer->insert("wte", wte).insert("wpe", wpe).insert("drop", drop).insert("h", h).insert("ln_f", ln_f);

  // GPT's initialisation: every full weight drawn in the same order on every
  // rank (so seeded alike they agree), then cut to this rank's shard.
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(options.n_layer));
  NoGradGuard no_grad;
  for (auto& [prefix, m] : named_modules()) {
    auto* sharded = dynamic_cast<ShardedModule*>(m);
    const bool is_linear = dynamic_cast<ColumnParallelLinear*>(m) || dynamic_cast<RowParallelLinear*>(m);
    const bool is_embedding = dynamic_cast<VocabParallelEmbedding*>(m) || dynamic_cast<nn::Embedding*>(m);
    if (!is_linear && !is_embedding) continue;
    const bool residual_proj = prefix.size() >= 7 && prefix.compare(prefix.size() - 7, 7, ".c_proj") == 0;
    for (auto& [n, t] : m->named_parameters(false)) {
      const ShardSpec spec = sharded ? sharded->shard_spec(n) : ShardSpec{};
      Tensor whole = kiln::empty(full_shape({t.sizes().begin(), t.sizes().end()}, spec, group->size()));
      if (n == "bias")
        nn::init::zeros_(whole);
      else
        nn::init::normal_(whole, 0.0, residual_proj ? proj_std : 0.02);
      t.copy_(shard_of(whole, spec, group->rank(), group->size()));
    }
  }
}

Tensor TensorParallelGPT::forward(const Tensor& idx) {
  KILN_CHECK(idx.dim() == 2 && idx.dtype() == kInt64, ShapeError,
             "TensorParallelGPT: expected idx [B, T] of int64 token ids, got ", dtype_name(idx.dtype()), " ",
             idx.shape_string());
  const int64_t T = idx.size(1);
  KILN_CHECK(T <= options.block_size, ShapeError, "TensorParallelGPT: cannot forward a sequence of length T = ", T,
             ", block_size is only ", options.block_size);
  if (!tp.sequence_parallel) {
    Tensor pos = arange(T, TensorOptions(kInt64));
    Tensor x = (*drop)((*wte)(idx) + (*wpe)(pos));
    for (size_t i = 0; i < h->size(); ++i) x = (*(*h)[i])(x);
    // lm_head, tied to wte: this rank's vocabulary rows give its slice of the
    // logits. f in front, so that backward sums the ranks' input gradients.
    return linear(copy_to_tp_region((*ln_f)(x), group, "lm_head"), wte->weight);
  }
  KILN_CHECK(T % group->size() == 0, ShapeError,
             "TensorParallelGPT (sequence parallel): expected the sequence length (", T,
             ") to divide evenly across the ", group->size(), " ranks of ", group->describe());
  // This rank's chunk of the sequence: its positions, with wpe through f (each
  // rank's gradient covers its positions only).
  const int64_t chunk = T / group->size();
  Tensor pos = arange(chunk * group->rank(), chunk * (group->rank() + 1), 1, TensorOptions(kInt64));
  Tensor x = (*drop)((*wte)(idx) + embedding(copy_to_tp_region(wpe->weight, group, "transformer.wpe"), pos));
  for (size_t i = 0; i < h->size(); ++i) x = (*(*h)[i])(x);
  x = sequence_parallel_layer_norm(*ln_f, x, group, "transformer.ln_f");
  // The whole sequence for the vocabulary-parallel head (backward: a reduce-scatter, in place of f).
  return linear(gather_from_sequence_parallel_region(x, group, "lm_head"), wte->weight);
}

Tensor TensorParallelGPT::full_logits(const Tensor& idx) {
  return gather_from_tp_region((*this)(idx), group, "lm_head");
}

Tensor TensorParallelGPT::loss(const Tensor& idx, const Tensor& targets) {
  KILN_CHECK(targets.sizes() == idx.sizes(), ShapeError, "TensorParallelGPT::loss: expected targets of idx's shape ",
             idx.shape_string(), ", got ", targets.shape_string());
  Tensor logits = (*this)(idx);
  return vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(2)}), targets.reshape({-1}), group, vocab_start(),
                                      -100, "lm_head cross-entropy");
}

void TensorParallelGPT::load_from_full(const nn::NamedTensors& state_dict) {
  parallel::load_from_full(*this, state_dict, group);
}

nn::NamedTensors TensorParallelGPT::full_state_dict() {
  nn::NamedTensors out = parallel::full_state_dict(*this, group);
  // GPT's state_dict lists the tied weight under both names, as torch does.
  Tensor tied;
  for (const auto& [n, t] : out)
    if (n == "transformer.wte.weight") tied = t;
  out.emplace_back("lm_head.weight", tied);
  return out;
}

}  // namespace kiln::parallel
