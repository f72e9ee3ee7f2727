// Datasets for the data pipeline (DESIGN.md §5).
//
// A map-style `data::Dataset<Sample>` has size() and get(index); get is const
// and may be called from several loader worker threads at once, so datasets
// hold immutable data. `Example{data, target}` is the default sample.
// Per-sample randomness (random transforms, synthetic data) draws from
// `sample_generator()`: the DataLoader installs, for the duration of each
// get(), a Generator seeded from (seed, epoch, rank, sample index), so results
// do not depend on the number of workers or on thread scheduling. Outside a
// loader it is the process-wide default generator.
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/core/tensor.h"

namespace kiln::data {

/// The default sample: an input and its target (label, next tokens, ...).
struct Example {
  Tensor data;
  Tensor target;
};

/// A map-style dataset: samples 0 .. size()-1, each fetched by get(index).
template <typename Sample = Example>
class Dataset {
 public:
  using sample_type = Sample;
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  /// Must be safe to call concurrently from several threads.
  virtual Sample get(int64_t index) const = 0;
};

/// The seed of sample `index`'s generator for (seed, epoch, rank): a Philox
/// hash, so neighbouring indices get unrelated streams.
uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t rank, int64_t index);

/// A fresh 64-bit seed drawn from `gen` (one Philox block), as torch draws a
/// loader's base seed with torch.empty((), dtype=int64).random_(): it follows
/// manual_seed and advances the generator.
uint64_t draw_seed(Generator& gen = default_generator());

/// The generator of the sample being fetched on this thread (set by the
/// DataLoader, see SampleGeneratorGuard); the default generator otherwise.
Generator& sample_generator();

/// Installs `gen` as this thread's sample generator until destruction.
class SampleGeneratorGuard {
 public:
  explicit SampleGeneratorGuard(Generator* gen);
  ~SampleGeneratorGuard();
  SampleGeneratorGuard(const SampleGeneratorGuard&) = delete;
  SampleGeneratorGuard& operator=(const SampleGeneratorGuard&) = delete;

 private:
  Generator* prev_;
};

/// torch.utils.data.TensorDataset for an (input, target) pair: sample i is
/// {data[i], target[i]} (views). Both must have the same size along dim 0.
class TensorDataset : public Dataset<Example> {
 public:
  TensorDataset(Tensor data, Tensor target);
  int64_t size() const override { return data_.size(0); }
  Example get(int64_t index) const override;

 private:
  Tensor data_, target_;
};

struct SyntheticOptions {
  int64_t size = 1024;
  std::vector<int64_t> sample_shape = {1, 28, 28};
  int64_t num_classes = 10;
  uint64_t seed = 0;
};

/// Synthetic classification data for tests and benchmarks: sample i is a
/// float32 tensor of `sample_shape` drawn from N(0, 1) and an int64 label in
/// [0, num_classes), both a pure function of (seed, i).
class SyntheticDataset : public Dataset<Example> {
 public:
  explicit SyntheticDataset(SyntheticOptions options = {});
  int64_t size() const override { return options_.size; }
  Example get(int64_t index) const override;

 private:
  SyntheticOptions options_;
};

}  // namespace kiln::data
