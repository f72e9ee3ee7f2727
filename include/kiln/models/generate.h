// Text generation with models::GPT: sampling one token at a time, with a
// per-layer key/value cache (issue 21) so that each new token costs one
// position's forward instead of the whole window's.
//
//   models::GenerateOptions o{.max_new_tokens = 256, .temperature = 0.8, .top_k = 20, .seed = 1};
//   std::vector<int64_t> out = models::generate(gpt, prompt_ids, o);   // the new tokens
//
// Why a cache helps: position t's keys and values at every layer depend only
// on tokens 0..t, so while the sequence fits the context (block_size) they
// never change; a step computes the new token's q, k, v, appends k and v, and
// attends over the cached ones (no mask needed: every cached position is in
// the past). Once the sequence outgrows block_size the window slides, every
// position's learned embedding (wpe) changes and with it every cached key and
// value, so the cache is rebuilt from the new window each step, which costs
// what the recompute path costs (docs/inference.md). The tokens equal the
// recompute path's up to float32 rounding of the logits (same sampler, same
// random stream).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kiln/models/gpt.h"

namespace kiln::models {

struct GenerateOptions {
  int64_t max_new_tokens = 100;
  double temperature = 1.0;  // 0: greedy (argmax)
  int64_t top_k = 0;         // > 0: sample among the k most likely tokens only
  uint64_t seed = 0;         // the sampler's own stream (the default generator is not touched)
  bool use_kv_cache = true;  // false: recompute the whole window for every token (nanoGPT's loop)
};

/// Per-layer keys and values of the positions decoded so far, [1, n_head,
/// t, head_size] each, in buffers of block_size positions allocated once.
class KVCache {
 public:
  explicit KVCache(GPT& gpt);
  /// Positions held (0 .. block_size).
  int64_t size() const { return length_; }
  void clear() { length_ = 0; }
  /// Runs `ids` (positions size() .. size() + n - 1, all within block_size)
  /// through the GPT, appending their keys and values; returns the logits of
  /// the last one, [vocab_size]. Under NoGradGuard; the GPT must be in eval
  /// mode (dropout off).
  Tensor forward(const std::vector<int64_t>& ids);

 private:
  GPT& gpt_;
  std::vector<Tensor> keys_, values_;  // per layer: [1, n_head, block_size, head_size]
  int64_t length_ = 0;
};

/// The logits of the token after `ids` (their last block_size), [vocab_size],
/// from a forward of the whole window: the path without a cache.
Tensor next_token_logits(GPT& gpt, const std::vector<int64_t>& ids);

/// Samples max_new_tokens tokens after `prompt` (at least one id) and returns
/// them; `on_token`, if given, sees each as it is chosen (for streaming). The
/// GPT is put in eval mode for the call and its mode restored after.
std::vector<int64_t> generate(GPT& gpt, const std::vector<int64_t>& prompt, const GenerateOptions& options,
                              const std::function<void(int64_t)>& on_token = {});

}  // namespace kiln::models
