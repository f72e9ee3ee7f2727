// Random numbers: a counter-based Philox4x32-10 generator (DESIGN.md §2).
//
// A Generator is (seed, offset). Every draw consumes a block of the counter
// stream and advances the offset, so a state is two integers: it saves and
// restores exactly, and a stream can be split (e.g. per data-loader sample)
// without drawing. Same seed, same calls => bitwise identical tensors,
// whatever the thread count: element i of a tensor always takes counter
// offset+i, whichever thread fills it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>

namespace kiln {

/// Philox4x32-10: 4 random 32-bit words for (key, counter).
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo);

namespace detail {
/// out[i] = a + span * u, i in [0, n), u = (w >> 8) * 2^-24 for w word i % 4
/// of philox4x32(key, 0, first_block + i / 4), with one rounding (a fused
/// multiply-add): what torch.rand's float32 values are in kiln (uniform_ and
/// rand in ops/factory.cpp, dropout's masks), sixteen counters at a time where
/// the CPU has AVX-512 (Note [Philox sixteen at a time] in generator.cpp).
void philox_uniform_floats(float* out, int64_t n, uint64_t key, uint64_t first_block, float a, float span);
}  // namespace detail

struct GeneratorState {
  uint64_t seed = 0;
  uint64_t offset = 0;  // in units of 128-bit Philox blocks
  bool operator==(const GeneratorState&) const = default;
};

class Generator {
 public:
  explicit Generator(uint64_t seed = 67280421310721ULL) : state_{seed, 0} {}
  Generator(const Generator& o) : state_(o.get_state()) {}
  Generator& operator=(const Generator& o) {
    if (this != &o) set_state(o.get_state());
    return *this;
  }

  void manual_seed(uint64_t seed);
  uint64_t initial_seed() const;
  GeneratorState get_state() const;
  void set_state(const GeneratorState& s);

  /// Reserves `blocks` consecutive Philox blocks and returns the first offset.
  /// Thread-safe: concurrent users get disjoint ranges.
  uint64_t reserve(uint64_t blocks);

 private:
  mutable std::mutex mu_;
  GeneratorState state_;
};

/// The process-wide default generator used when no Generator is passed.
Generator& default_generator();
/// Seeds the default generator (torch.manual_seed).
void manual_seed(uint64_t seed);

}  // namespace kiln
