// The zoo GPT cut into pipeline stages by layer ranges (parallel::GPTStage).
//
// Note [Tied weights across stages]
// models::GPT ties lm_head.weight to transformer.wte.weight: one tensor used
// twice, by the embedding lookup on the first stage and by the head on the
// last, whose gradient is the sum of both uses'. Two stages cannot share a
// tensor, so the last stage holds a copy (equal at the start: both come from
// the same GPT, and Pipeline broadcasts the first stage's values to make
// sure). After each step's backward each end holds only its own use's part;
// Pipeline sums the two over the two-rank group of the ends (as Megatron's
// "embedding group"), so both hold the one-process gradient, every optimizer
// takes the same elementwise update on both copies, and they stay equal. A
// clipping norm must then count the weight once (the first stage's copy).
#include <string>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/parallel/pipeline.h"

namespace kiln::parallel {

std::vector<std::pair<int64_t, int64_t>> balanced_layer_ranges(int64_t n_layer, int num_stages) {
  KILN_CHECK(num_stages >= 1 && n_layer >= 0, ValueError,
             "parallel::balanced_layer_ranges: expected n_layer >= 0 and num_stages >= 1, got ", n_layer, " and ",
             num_stages);
  std::vector<std::pair<int64_t, int64_t>> r;
  const int64_t base = n_layer / num_stages, extra = n_layer % num_stages;
  int64_t at = 0;
  for (int s = 0; s < num_stages; ++s) {
    const int64_t n = base + (s < extra ? 1 : 0);
    r.emplace_back(at, at + n);
    at += n;
  }
  return r;
}

GPTStage::GPTStage(models::GPT& full, int stage_, int num_stages_, std::pair<int64_t, int64_t> layers_)
    : nn::Module("GPTStage"), options(full.options), stage(stage_), num_stages(num_stages_), layers(layers_) {
  KILN_CHECK(num_stages >= 1 && stage >= 0 && stage < num_stages, ValueError,
             "parallel::GPTStage: expected 0 <= stage < num_stages, got stage ", stage, " of ", num_stages);
  KILN_CHECK(layers.first >= 0 && layers.first <= layers.second && layers.second <= options.n_layer, ValueError,
             "parallel::GPTStage: expected a layer range within [0, ", options.n_layer, "), got [", layers.first, ", ",
             layers.second, ")");
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
    lm_head = register_module("lm_head", full.lm_head);
    if (!first) {
      // Note [Tied weights across stages]: this stage's own copy.
      NoGradGuard no_grad;
      lm_head->register_parameter("weight", full.wte->weight.detach().clone());
    }
  }
}

Tensor GPTStage::forward(const Tensor& in) {
  Tensor x = in;
  if (stage == 0) {
    KILN_CHECK(in.dim() == 2 && in.dtype() == kInt64, ShapeError,
               "GPTStage 0: expected idx [B, T] of int64 token ids, got ", dtype_name(in.dtype()), " ",
               in.shape_string());
    const int64_t T = in.size(1);
    KILN_CHECK(T <= options.block_size, ShapeError, "GPTStage 0: cannot forward a sequence of length T = ", T,
               ", block_size is only ", options.block_size);
    x = (*drop)((*wte)(in) + (*wpe)(arange(T, TensorOptions(kInt64))));  // [b, T, C] + [T, C]
  } else {
    KILN_CHECK(in.dim() == 3 && in.size(2) == options.n_embd, ShapeError, "GPTStage ", stage,
               ": expected hidden states [b, T, ", options.n_embd, "] from stage ", stage - 1, ", got ",
               in.shape_string());
  }
  for (int64_t i = layers.first; i < layers.second; ++i) x = (*(*h)[std::to_string(i)])(x);
  if (stage == num_stages - 1) x = (*lm_head)((*ln_f)(x));
  return x;
}

std::vector<Tensor> GPTStage::tied_parameters() const {
  if (num_stages == 1) return {};
  if (stage == 0) return {wte->weight};
  if (stage == num_stages - 1) return {lm_head->weight};
  return {};
}

std::shared_ptr<GPTStage> make_gpt_stage(const models::GPTOptions& options, int stage, int num_stages,
                                         std::vector<std::pair<int64_t, int64_t>> layers) {
  if (layers.empty()) layers = balanced_layer_ranges(options.n_layer, num_stages);
  KILN_CHECK(static_cast<int>(layers.size()) == num_stages, ValueError, "parallel::make_gpt_stage: expected ",
             num_stages, " layer ranges (one per stage), got ", layers.size());
  int64_t at = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    KILN_CHECK(layers[i].first == at && layers[i].second >= at, ValueError, "parallel::make_gpt_stage: stage ", i,
               "'s layers [", layers[i].first, ", ", layers[i].second,
               ") do not start where the previous stage's end (", at,
               "); the ranges must cover transformer.h in order");
    at = layers[i].second;
  }
  KILN_CHECK(at == options.n_layer, ValueError, "parallel::make_gpt_stage: the layer ranges cover ", at,
             " layers, the GPT has n_layer = ", options.n_layer);
  // The whole GPT is built (and initialised from the default generator, as
  // one process's), then only this stage's modules are kept.
  models::GPT full(options);
  return std::make_shared<GPTStage>(full, stage, num_stages, layers[static_cast<size_t>(stage)]);
}

Pipeline::LossFn gpt_loss(const models::GPTOptions& options) {
  const int64_t V = options.vocab_size;
  return [V](const Tensor& logits, const Tensor& targets) {
    return nn::functional::cross_entropy(logits.reshape({-1, V}), targets.reshape({-1}));
  };
}

}  // namespace kiln::parallel
