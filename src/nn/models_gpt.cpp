// models::GPT: nanoGPT's GPT (token + position embeddings, pre-LN blocks,
// final LayerNorm, LM head tied to the token embedding). Module names and
// registration order follow the twin in tests/parity/models_twins_gpt.py, so
// state_dict() keys match torch's exactly, in order.
#include "kiln/models/gpt.h"

#include <cmath>
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/init.h"
#include "kiln/ops/factory.h"

namespace kiln::models {

void init_gpt_weights(nn::Module& model, int64_t n_layer) {
  NoGradGuard no_grad;
  for (auto* m : model.modules()) {
    if (auto* lin = dynamic_cast<nn::Linear*>(m)) {
      nn::init::normal_(lin->weight, 0.0, 0.02);
      if (lin->bias.defined()) nn::init::zeros_(lin->bias);
    } else if (auto* emb = dynamic_cast<nn::Embedding*>(m)) {
      nn::init::normal_(emb->weight, 0.0, 0.02);
    }
  }
  const double proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layer));
  for (auto& [name, p] : model.named_parameters()) {
    if (name.ends_with("c_proj.weight")) nn::init::normal_(p, 0.0, proj_std);
  }
}

GPT::GPT(GPTOptions o) : nn::Module("GPT"), options(o) {
  KILN_CHECK(o.vocab_size > 0 && o.block_size > 0 && o.n_layer > 0, ValueError,
             "GPT: expected vocab_size, block_size and n_layer > 0, got ", o.vocab_size, ", ", o.block_size, " and ",
             o.n_layer);
  KILN_CHECK(o.n_embd > 0 && o.n_head > 0 && o.n_embd % o.n_head == 0, ValueError,
             "GPT: expected n_embd > 0 divisible by n_head > 0, got n_embd ", o.n_embd, " and n_head ", o.n_head);
  transformer = register_module("transformer", std::make_shared<nn::ModuleDict>());
  wte =
      std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = o.vocab_size, .embedding_dim = o.n_embd});
  wpe =
      std::make_shared<nn::Embedding>(nn::EmbeddingOptions{.num_embeddings = o.block_size, .embedding_dim = o.n_embd});
  drop = std::make_shared<nn::Dropout>(o.dropout);
  h = std::make_shared<nn::ModuleList>();
  for (int64_t i = 0; i < o.n_layer; ++i)
    h->push_back(std::make_shared<nn::TransformerBlock>(
        nn::TransformerBlockOptions{.d_model = o.n_embd, .n_head = o.n_head, .d_ff = o.d_ff, .dropout = o.dropout}));
  ln_f = std::make_shared<nn::LayerNorm>(nn::LayerNormOptions{.normalized_shape = {o.n_embd}});
  transformer->insert("wte", wte).insert("wpe", wpe).insert("drop", drop).insert("h", h).insert("ln_f", ln_f);
  lm_head = register_module("lm_head", std::make_shared<nn::Linear>(nn::LinearOptions{
                                           .in_features = o.n_embd, .out_features = o.vocab_size, .bias = false}));

  // nanoGPT's _init_weights, then the scaled residual projections.
  init_gpt_weights(*this, o.n_layer);
  // Tie: lm_head's weight slot holds wte's tensor (one Parameter, two names in state_dict).
  lm_head->register_parameter("weight", wte->weight);
}

Tensor GPT::forward(const Tensor& idx) {
  KILN_CHECK(idx.dim() == 2 && idx.dtype() == kInt64, ShapeError, "GPT: expected idx [B, T] of int64 token ids, got ",
             dtype_name(idx.dtype()), " ", idx.shape_string());
  const int64_t T = idx.size(1);
  KILN_CHECK(T <= options.block_size, ShapeError, "GPT: cannot forward a sequence of length T = ", T,
             ", block_size is only ", options.block_size);
  Tensor pos = arange(T, TensorOptions(kInt64));
  Tensor x = (*drop)((*wte)(idx) + (*wpe)(pos));  // [B, T, C] + [T, C]
  x = nn::run_blocks(
      checkpointing, static_cast<int64_t>(h->size()),
      [this](int64_t i, const Tensor& t) { return (*(*h)[static_cast<size_t>(i)])(t); }, x, "transformer.h");
  // ln_f only feeds lm_head (LayerNorm::forward_for_product: bf16 straight out under bf16 autocast).
  return (*lm_head)(lm_head->has_forward_hooks() ? (*ln_f)(x) : ln_f->forward_for_product(x));
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets) {
  KILN_CHECK(targets.sizes() == idx.sizes(), ShapeError, "GPT::loss: expected targets of idx's shape ",
             idx.shape_string(), ", got ", targets.shape_string());
  Tensor logits = (*this)(idx);
  return nn::functional::cross_entropy(logits.reshape({-1, options.vocab_size}), targets.reshape({-1}));
}

}  // namespace kiln::models
