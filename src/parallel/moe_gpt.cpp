// parallel::MoEBlock and parallel::MoEGPT: the zoo GPT with MoE feed-forwards,
// composed from nn's pieces under models::GPT's names (see moe.h for why).
#include <cmath>
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"
#include "kiln/parallel/moe.h"

namespace kiln::parallel {

MoEBlock::MoEBlock(const nn::TransformerBlockOptions& o, MoEOptions moe, dist::ProcessGroupPtr group)
    : nn::Module("MoEBlock") {
  ln_1 =
      register_module("ln_1", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.d_model}}));
  attn = register_module("attn", std::make_shared<nn::CausalSelfAttention>(o));
  ln_2 =
      register_module("ln_2", std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.d_model}}));
  mlp = register_module("mlp", std::make_shared<MoE>(std::move(moe), std::move(group)));
}

Tensor MoEBlock::forward(const Tensor& x) {
  const Tensor h = x + (*attn)((*ln_1)(x));
  return h + (*mlp)((*ln_2)(h));
}

MoEGPT::MoEGPT(MoEGPTOptions o, dist::ProcessGroupPtr group) : nn::Module("MoEGPT"), options(o) {
  const auto& g = o.gpt;
  KILN_CHECK(g.vocab_size > 0 && g.block_size > 0 && g.n_layer > 0, ValueError,
             "MoEGPT: expected vocab_size, block_size and n_layer > 0, got ", g.vocab_size, ", ", g.block_size, " and ",
             g.n_layer);
  KILN_CHECK(g.n_embd > 0 && g.n_head > 0 && g.n_embd % g.n_head == 0, ValueError,
             "MoEGPT: expected n_embd > 0 divisible by n_head > 0, got n_embd ", g.n_embd, " and n_head ", g.n_head);
  KILN_CHECK(o.moe_layers.empty() || static_cast<int64_t>(o.moe_layers.size()) == g.n_layer, ValueError,
             "MoEGPT: expected moe_layers empty or one flag per layer (", g.n_layer, "), got ", o.moe_layers.size());
  transformer = register_module("transformer", std::make_shared<nn::ModuleDict>());
  wte =
      std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = g.vocab_size, .embedding_dim = g.n_embd});
  wpe =
      std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = g.block_size, .embedding_dim = g.n_embd});
  auto drop = std::make_shared<nn::Dropout>(g.dropout);
  h = std::make_shared<nn::ModuleList>();
  const nn::TransformerBlockOptions bo{.d_model = g.n_embd, .n_head = g.n_head, .d_ff = g.d_ff, .dropout = g.dropout};
  for (int64_t i = 0; i < g.n_layer; ++i) {
    if (o.moe_layers.empty() || o.moe_layers[static_cast<size_t>(i)]) {
      h->push_back(std::make_shared<MoEBlock>(bo,
                                              MoEOptions{.d_model = g.n_embd,
                                                         .d_ff = g.d_ff,
                                                         .num_experts = o.num_experts,
                                                         .top_k = o.top_k,
                                                         .capacity_factor = o.capacity_factor,
                                                         .dropout = g.dropout,
                                                         .name = "transformer.h." + std::to_string(i) + ".mlp"},
                                              group));
    } else {
      h->push_back(std::make_shared<nn::TransformerBlock>(bo));
    }
  }
  ln_f = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {g.n_embd}});
  transformer->insert("wte", wte).insert("wpe", wpe).insert("drop", drop).insert("h", h).insert("ln_f", ln_f);
  lm_head = register_module("lm_head", std::make_shared<nn::Linear>(nn::LinearOptions{
                                           .in_features = g.n_embd, .out_features = g.vocab_size, .bias = false}));

  // nanoGPT's init, as models::GPT's (every expert's c_proj is a residual projection too).
  models::init_gpt_weights(*this, g.n_layer);
  lm_head->register_parameter("weight", wte->weight);
}

std::vector<std::shared_ptr<MoE>> MoEGPT::moe_layers() const {
  std::vector<std::shared_ptr<MoE>> out;
  for (size_t i = 0; i < h->size(); ++i)
    if (auto b = std::dynamic_pointer_cast<MoEBlock>((*h)[i])) out.push_back(b->mlp);
  return out;
}

Tensor MoEGPT::forward(const Tensor& idx) {
  KILN_CHECK(idx.dim() == 2 && idx.dtype() == kInt64, ShapeError,
             "MoEGPT: expected idx [B, T] of int64 token ids, got ", dtype_name(idx.dtype()), " ", idx.shape_string());
  const int64_t T = idx.size(1);
  KILN_CHECK(T <= options.gpt.block_size, ShapeError, "MoEGPT: cannot forward a sequence of length T = ", T,
             ", block_size is only ", options.gpt.block_size);
  Tensor x = (*(*transformer)["drop"])((*wte)(idx) + (*wpe)(arange(T, TensorOptions(kInt64))));
  for (size_t i = 0; i < h->size(); ++i) x = (*(*h)[i])(x);
  return (*lm_head)((*ln_f)(x));
}

Tensor MoEGPT::loss(const Tensor& idx, const Tensor& targets) {
  KILN_CHECK(targets.sizes() == idx.sizes(), ShapeError, "MoEGPT::loss: expected targets of idx's shape ",
             idx.shape_string(), ", got ", targets.shape_string());
  Tensor logits = (*this)(idx);
  Tensor loss = nn::functional::cross_entropy(logits.reshape({-1, options.gpt.vocab_size}), targets.reshape({-1}));
  for (const auto& m : moe_layers()) loss = loss + m->aux_loss() * options.aux_loss_coef;
  return loss;
}

}  // namespace kiln::parallel
