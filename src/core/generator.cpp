#include "kiln/core/generator.h"

#include "kiln/core/capture.h"

namespace kiln {

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

void Generator::manual_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = {seed, 0};
}

uint64_t Generator::initial_seed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_.seed;
}

GeneratorState Generator::get_state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

void Generator::set_state(const GeneratorState& s) {
  std::lock_guard<std::mutex> lock(mu_);
  state_ = s;
}

uint64_t Generator::reserve(uint64_t blocks) {
  // Every draw comes through here. The tensor fills (rand, randn, randint,
  // randperm, dropout's mask) reserve inside a recorded host write, which a
  // replay runs again: it reserves anew, as the eager step would. A draw made
  // anywhere else would repeat the capture's numbers on replay and leave the
  // offset where it was, so it is a graph break.
  if (blocks > 0) capture::graph_break_if_recording("random numbers (dropout, rand, randn, randperm...)");
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t first = state_.offset;
  state_.offset += blocks;
  return first;
}

Generator& default_generator() {
  static Generator g;
  return g;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

}  // namespace kiln
