// A pipeline stage of the tensor-parallel GPT (parallel::TensorParallelGPTStage):
// parallel::GPTStage's cut (pipeline_gpt.cpp) applied to TensorParallelGPT's
// modules (tp_gpt.cpp), so that dp x tp x pp runs compose the two.
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/ops/factory.h"
#include "kiln/ops/index.h"
#include "kiln/ops/layer_norm.h"
#include "kiln/ops/linalg.h"
#include "kiln/parallel/mesh_gpt.h"

namespace kiln::parallel {

TensorParallelGPTStage::TensorParallelGPTStage(TensorParallelGPT& full, int stage_, int num_stages_,
                                               std::pair<int64_t, int64_t> layers_)
    : nn::Module("TensorParallelGPTStage"),
      options(full.options),
      group(full.group),
      tp(full.tp),
      stage(stage_),
      num_stages(num_stages_),
      layers(layers_) {
  KILN_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, ValueError,
             "parallel::TensorParallelGPTStage: expected 0 <= stage < num_stages, got stage ", stage, " of ",
             num_stages);
  KILN_CHECK(layers.first >= 0 && layers.first <= layers.second && layers.second <= options.n_layer, ValueError,
             "parallel::TensorParallelGPTStage: expected a layer range within [0, ", options.n_layer, "), got [",
             layers.first, ", ", layers.second, ")");
  const bool first = stage == 0, last = stage == num_stages - 1;
  auto transformer = register_module("transformer", std::make_shared<nn::ModuleDict>());
  if (first) {
    wte = full.wte, wpe = full.wpe, drop = full.drop;
    transformer->insert("wte", wte).insert("wpe", wpe).insert("drop", drop);
  }
  h = std::make_shared<nn::ModuleDict>();
  for (int64_t i = layers.first; i < layers.second; ++i)
    h->insert(std::to_string(i), (*full.h)[static_cast<size_t>(i)]);
  transformer->insert("h", h);
  if (last) {
    ln_f = full.ln_f;
    transformer->insert("ln_f", ln_f);
    if (!first) {
      // Note [Tied weights across stages] (pipeline_gpt.cpp): this stage's own
      // copy of its tp rank's rows of the embedding, split as the embedding is.
      lm_head = register_module("lm_head", std::make_shared<VocabParallelEmbedding>(
                                               VocabParallelEmbeddingOptions{.num_embeddings = options.vocab_size,
                                                                             .embedding_dim = options.n_embd,
                                                                             .sequence_parallel = tp.sequence_parallel,
                                                                             .name = "lm_head"},
                                               group));
      NoGradGuard no_grad;
      lm_head->weight.copy_(full.wte->weight);
    }
  }
}

Tensor TensorParallelGPTStage::forward(const Tensor& in) {
  const int parts = group->size();
  Tensor x = in;
  if (stage == 0) {
    KILN_CHECK(in.dim() == 2 && in.dtype() == kInt64, ShapeError,
               "TensorParallelGPTStage 0: expected idx [b, T] of int64 token ids, got ", dtype_name(in.dtype()), " ",
               in.shape_string());
    const int64_t T = in.size(1);
    KILN_CHECK(T <= options.block_size, ShapeError,
               "TensorParallelGPTStage 0: cannot forward a sequence of length T = ", T, ", block_size is only ",
               options.block_size);
    if (!tp.sequence_parallel) {
      x = (*drop)((*wte)(in) + (*wpe)(arange(T, TensorOptions(kInt64))));
    } else {
      KILN_CHECK(T % parts == 0, ShapeError, "TensorParallelGPTStage 0 (sequence parallel): expected the sequence ",
                 "length (", T, ") to divide evenly across the ", parts, " ranks of ", group->describe());
      // This rank's chunk of the positions; wpe through f, as TensorParallelGPT does.
      const int64_t chunk = T / parts;
      Tensor pos = arange(chunk * group->rank(), chunk * (group->rank() + 1), 1, TensorOptions(kInt64));
      x = (*drop)((*wte)(in) + embedding(copy_to_tp_region(wpe->weight, group, "transformer.wpe"), pos));
    }
  } else {
    KILN_CHECK(in.dim() == 3 && in.size(2) == options.n_embd, ShapeError, "TensorParallelGPTStage ", stage,
               ": expected hidden states [b, T", tp.sequence_parallel ? " / tp" : "", ", ", options.n_embd,
               "] from stage ", stage - 1, ", got ", in.shape_string());
  }
  for (int64_t i = layers.first; i < layers.second; ++i) x = (*(*h)[std::to_string(i)])(x);
  if (stage != num_stages - 1) return x;
  const Tensor& head = lm_head ? lm_head->weight : wte->weight;
  if (!tp.sequence_parallel) return linear(copy_to_tp_region((*ln_f)(x), group, "lm_head"), head);
  // ln_f on the chunk, its weights through f; then the whole sequence for the vocabulary-parallel head.
  x = ops::layer_norm(x, ln_f->options.normalized_shape,
                      copy_to_tp_region(ln_f->weight, group, "transformer.ln_f.weight"),
                      copy_to_tp_region(ln_f->bias, group, "transformer.ln_f.bias"), ln_f->options.eps);
  return linear(gather_from_sequence_parallel_region(x, group, "lm_head"), head);
}

std::vector<Tensor> TensorParallelGPTStage::tied_parameters() const {
  if (num_stages == 1) return {};
  if (stage == 0) return {wte->weight};
  if (stage == num_stages - 1) return {lm_head->weight};
  return {};
}

bool TensorParallelGPTStage::is_tied_copy(const std::string& name) const {
  return lm_head != nullptr && name == "lm_head.weight";
}

Pipeline::LossFn TensorParallelGPTStage::loss_fn() const {
  if (stage != num_stages - 1) return {};
  const int64_t vocab_start = lm_head ? lm_head->vocab_start : wte->vocab_start;
  dist::ProcessGroupPtr g = group;
  return [g, vocab_start](const Tensor& logits, const Tensor& targets) {
    return vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(2)}), targets.reshape({-1}), g, vocab_start,
                                        -100, "lm_head cross-entropy");
  };
}

}  // namespace kiln::parallel
