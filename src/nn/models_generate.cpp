// models::generate and its key/value cache (include/kiln/models/generate.h).
#include "kiln/models/generate.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "kiln/core/capture.h"
#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"

namespace kiln::models {
namespace {

nn::TransformerBlock& block(GPT& gpt, size_t i) {
  auto* b = dynamic_cast<nn::TransformerBlock*>((*gpt.h)[i].get());
  KILN_ASSERT(b != nullptr, "GPT block ", i, " is not an nn::TransformerBlock");
  return *b;
}

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The next token from `logits` [V]: argmax at temperature 0, else a draw
/// from softmax(logits / T) restricted to the top k, by inverse CDF on one
/// uniform double of the sampler's stream.
int64_t choose(const Tensor& logits, const GenerateOptions& o, uint64_t& rng, std::vector<double>& p) {
  capture::graph_break_if_recording("generate's token choice reads the logits on the host");
  const Tensor l64 = logits.to(kFloat64).contiguous();
  const double* l = l64.data_ptr<double>();
  const int64_t vocab = l64.numel();
  if (o.temperature == 0) return std::max_element(l, l + vocab) - l;
  double cutoff = -INFINITY;
  if (o.top_k > 0 && o.top_k < vocab) {
    std::vector<double> sorted(l, l + vocab);
    std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(), std::greater<>());
    cutoff = sorted[static_cast<size_t>(o.top_k - 1)];
  }
  const double mx = *std::max_element(l, l + vocab);
  p.assign(static_cast<size_t>(vocab), 0.0);
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    p[static_cast<size_t>(v)] = l[v] < cutoff ? 0 : std::exp((l[v] - mx) / o.temperature);
    sum += p[static_cast<size_t>(v)];
  }
  double u = static_cast<double>(splitmix64(rng) >> 11) * 0x1.0p-53 * sum;
  for (int64_t v = 0; v < vocab; ++v) {
    u -= p[static_cast<size_t>(v)];
    if (u < 0 && p[static_cast<size_t>(v)] > 0) return v;
  }
  return vocab - 1;
}

}  // namespace

KVCache::KVCache(GPT& gpt) : gpt_(gpt) {
  const auto& o = gpt.options;
  const int64_t hs = o.n_embd / o.n_head;
  for (int64_t l = 0; l < o.n_layer; ++l) {
    keys_.push_back(zeros({1, o.n_head, o.block_size, hs}));
    values_.push_back(zeros({1, o.n_head, o.block_size, hs}));
  }
}

Tensor KVCache::forward(const std::vector<int64_t>& ids) {
  const auto& o = gpt_.options;
  const auto n = static_cast<int64_t>(ids.size());
  KILN_CHECK(n >= 1 && length_ + n <= o.block_size, ShapeError, "KVCache::forward: expected 1 to ",
             o.block_size - length_, " new positions (the cache holds ", length_, " of block_size ", o.block_size,
             "), got ", n);
  // Several positions at once only into an empty cache: the causal mask of a
  // [n, length + n] attention is not the square one scaled_dot_product_attention draws.
  KILN_CHECK(n == 1 || length_ == 0, ValueError, "KVCache::forward: a prefill of ", n,
             " positions needs an empty cache, this one holds ", length_, "; feed one position at a time");
  NoGradGuard no_grad;
  const int64_t C = o.n_embd, nh = o.n_head, hs = C / nh;
  Tensor x = (*gpt_.wte)(tensor(ids, {1, n})) + (*gpt_.wpe)(arange(length_, length_ + n, 1, TensorOptions(kInt64)));
  for (size_t l = 0; l < keys_.size(); ++l) {
    nn::TransformerBlock& b = block(gpt_, l);
    auto qkv = (*b.attn->c_attn)((*b.ln_1)(x)).split(C, 2);
    auto heads = [&](const Tensor& t) { return t.view({1, n, nh, hs}).transpose(1, 2); };  // [1, nh, n, hs]
    keys_[l].narrow(2, length_, n).copy_(heads(qkv[1]));
    values_[l].narrow(2, length_, n).copy_(heads(qkv[2]));
    Tensor y = nn::functional::scaled_dot_product_attention(heads(qkv[0]), keys_[l].narrow(2, 0, length_ + n),
                                                            values_[l].narrow(2, 0, length_ + n), {}, 0.0,
                                                            /*is_causal=*/n > 1, /*training=*/false);
    x = x + (*b.attn->c_proj)(y.transpose(1, 2).reshape({1, n, C}));
    x = x + (*b.mlp)((*b.ln_2)(x));
  }
  length_ += n;
  return (*gpt_.lm_head)((*gpt_.ln_f)(x.narrow(1, n - 1, 1))).reshape({o.vocab_size});
}

Tensor next_token_logits(GPT& gpt, const std::vector<int64_t>& ids) {
  KILN_CHECK(!ids.empty(), ValueError, "models::next_token_logits: expected at least one token id, got none");
  NoGradGuard no_grad;
  const auto block = static_cast<size_t>(gpt.options.block_size);
  const size_t from = ids.size() > block ? ids.size() - block : 0;
  std::vector<int64_t> window(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end());
  const auto len = static_cast<int64_t>(window.size());
  return gpt(tensor(window, {1, len})).select(1, len - 1).reshape({gpt.options.vocab_size});
}

std::vector<int64_t> generate(GPT& gpt, const std::vector<int64_t>& prompt, const GenerateOptions& o,
                              const std::function<void(int64_t)>& on_token) {
  KILN_CHECK(!prompt.empty(), ValueError, "models::generate: expected a prompt of at least one token id, got none");
  KILN_CHECK(o.max_new_tokens >= 0 && o.temperature >= 0, ValueError,
             "models::generate: expected max_new_tokens >= 0 and temperature >= 0, got ", o.max_new_tokens, " and ",
             o.temperature);
  for (int64_t id : prompt)
    KILN_CHECK(id >= 0 && id < gpt.options.vocab_size, ValueError, "models::generate: prompt token ", id,
               " is outside the vocabulary [0, ", gpt.options.vocab_size, ")");
  struct ModeRestore {
    GPT& m;
    bool was;
    ~ModeRestore() { m.train(was); }
  } restore{gpt, gpt.is_training()};
  gpt.eval();
  NoGradGuard no_grad;
  const auto block = static_cast<size_t>(gpt.options.block_size);
  std::vector<int64_t> ids = prompt, out;
  std::optional<KVCache> cache;
  if (o.use_kv_cache) cache.emplace(gpt);
  uint64_t rng = o.seed;
  std::vector<double> p;
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    Tensor logits;
    if (!cache) {
      logits = next_token_logits(gpt, ids);
    } else if (ids.size() <= block && cache->size() > 0) {
      logits = cache->forward({ids.back()});
    } else {
      // The first step, or the window slid (every position's embedding changed): refill from the window.
      cache->clear();
      const size_t from = ids.size() > block ? ids.size() - block : 0;
      logits = cache->forward(std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end()));
    }
    const int64_t next = choose(logits, o, rng, p);
    ids.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  return out;
}

}  // namespace kiln::models
