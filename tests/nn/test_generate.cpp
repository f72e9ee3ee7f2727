// models::generate with and without its key/value cache (issue 21): the
// cached logits equal the recompute path's within float32 rounding at every
// step, below block_size and after the window slides; the tokens are the same
// (greedy and sampled, same seed); bad prompts are refused.
//
// Tolerance: the cached step computes one position's products where the
// recompute path computes the window's (other shapes, other summation
// blocking), so logits differ by float32 rounding: |d| <= 1e-5 + 1e-5 |want|.
#include <gtest/gtest.h>

#include <cmath>

#include "kiln/core/generator.h"
#include "kiln/core/guards.h"
#include "kiln/models/generate.h"
#include "kiln/ops/factory.h"

namespace kiln {
namespace {

models::GPTOptions tiny() {
  models::GPTOptions o;
  o.vocab_size = 40;
  o.block_size = 12;
  o.n_layer = 2;
  o.n_head = 2;
  o.n_embd = 16;
  return o;
}

TEST(Generate, CachedLogitsEqualTheRecomputedWindowsBeforeAndAfterItSlides) {
  manual_seed(3);
  models::GPT gpt(tiny());
  gpt.eval();
  NoGradGuard no_grad;
  std::vector<int64_t> ids = {1, 7, 3};
  models::KVCache cache(gpt);
  Tensor got = cache.forward(ids);
  double worst = 0;
  Generator g(9);
  for (int step = 0; step < 25; ++step) {
    const Tensor want = models::next_token_logits(gpt, ids);
    ASSERT_EQ(got.sizes(), want.sizes());
    const Tensor d = (got - want).abs(), bound = want.abs() * 1e-5 + 1e-5;
    worst = std::max(worst, d.max().item<double>());
    EXPECT_TRUE(d.le(bound).all().item<bool>()) << "step " << step << ": max |d| " << d.max().item<double>();
    ids.push_back(randint(0, 40, {1}, kInt64, &g).item<int64_t>());
    if (ids.size() <= 12) {
      got = cache.forward({ids.back()});
    } else {  // the window slid: positions changed, the cache is refilled
      cache.clear();
      got = cache.forward(std::vector<int64_t>(ids.end() - 12, ids.end()));
    }
  }
  std::printf("  cached vs recomputed logits: max |d| %.2e\n", worst);
}

TEST(Generate, TheSameTokensWithAndWithoutTheCache) {
  manual_seed(4);
  models::GPT gpt(tiny());
  const std::vector<int64_t> prompt = {5, 9, 2, 11};
  for (double temperature : {0.0, 0.8, 1.5}) {
    SCOPED_TRACE(temperature);
    models::GenerateOptions o{.max_new_tokens = 30, .temperature = temperature, .top_k = 0, .seed = 17};
    const auto cached = models::generate(gpt, prompt, o);
    o.use_kv_cache = false;
    const auto recomputed = models::generate(gpt, prompt, o);
    ASSERT_EQ(cached.size(), 30u);
    EXPECT_EQ(cached, recomputed);
    for (int64_t t : cached) EXPECT_TRUE(t >= 0 && t < 40);
  }
  // top-k restricts the draws to the k most likely tokens: with k = 1 every draw is the argmax.
  const auto greedy = models::generate(gpt, prompt, {.max_new_tokens = 20, .temperature = 0.0});
  const auto top1 = models::generate(gpt, prompt, {.max_new_tokens = 20, .temperature = 1.0, .top_k = 1, .seed = 5});
  EXPECT_EQ(greedy, top1);
  EXPECT_TRUE(gpt.is_training()) << "generate restores the module's mode";
}

TEST(Generate, RefusesBadPromptsAndOverfullCaches) {
  manual_seed(5);
  models::GPT gpt(tiny());
  EXPECT_THROW(models::generate(gpt, {}, {}), ValueError);
  try {
    models::generate(gpt, {3, 40}, {});
    FAIL() << "expected a ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("prompt token 40 is outside the vocabulary [0, 40)"), std::string::npos)
        << e.what();
  }
  gpt.eval();
  models::KVCache cache(gpt);
  cache.forward({1, 2, 3});
  EXPECT_THROW(cache.forward({4, 5}), ValueError);  // a second prefill would need an offset causal mask
  EXPECT_THROW(cache.forward(std::vector<int64_t>(10, 1)), ShapeError);  // 3 + 10 > block_size 12
}

}  // namespace
}  // namespace kiln
