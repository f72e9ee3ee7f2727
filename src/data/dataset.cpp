#include "kiln/data/dataset.h"

#include "kiln/core/error.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {
thread_local Generator* tls_sample_generator = nullptr;
}

uint64_t sample_seed(uint64_t seed, int64_t epoch, int64_t rank, int64_t index) {
  // Key: the seed; counter: (epoch, rank) high, index low. Distinct tuples hit
  // distinct Philox counters, hence independent words.
  uint64_t hi = (static_cast<uint64_t>(epoch) << 24) ^ static_cast<uint64_t>(rank);
  auto w = philox4x32(seed, hi, static_cast<uint64_t>(index));
  return (static_cast<uint64_t>(w[1]) << 32) | w[0];
}

uint64_t draw_seed(Generator& gen) {
  const uint64_t key = gen.get_state().seed;
  const auto w = philox4x32(key, 0, gen.reserve(1));
  return (static_cast<uint64_t>(w[1]) << 32) | w[0];
}

Generator& sample_generator() { return tls_sample_generator ? *tls_sample_generator : default_generator(); }

SampleGeneratorGuard::SampleGeneratorGuard(Generator* gen) : prev_(tls_sample_generator) { tls_sample_generator = gen; }
SampleGeneratorGuard::~SampleGeneratorGuard() { tls_sample_generator = prev_; }

TensorDataset::TensorDataset(Tensor data, Tensor target) : data_(std::move(data)), target_(std::move(target)) {
  KILN_CHECK(data_.defined() && target_.defined(), ValueError, "TensorDataset: expected two defined tensors");
  KILN_CHECK(data_.dim() >= 1 && target_.dim() >= 1, ShapeError,
             "TensorDataset: expected tensors with at least one dim, got ", data_.shape_string(), " and ",
             target_.shape_string());
  KILN_CHECK(data_.size(0) == target_.size(0), ShapeError,
             "TensorDataset: expected data and target of the same size along dim 0, got ", data_.size(0), " and ",
             target_.size(0));
}

Example TensorDataset::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), IndexError, "TensorDataset: index ", index, " out of range [0, ", size(),
             ")");
  return {data_.select(0, index), target_.select(0, index)};
}

SyntheticDataset::SyntheticDataset(SyntheticOptions options) : options_(std::move(options)) {
  KILN_CHECK(options_.size >= 0, ValueError, "SyntheticDataset: expected size >= 0, got ", options_.size);
  KILN_CHECK(options_.num_classes >= 1, ValueError, "SyntheticDataset: expected num_classes >= 1, got ",
             options_.num_classes);
}

Example SyntheticDataset::get(int64_t index) const {
  KILN_CHECK(index >= 0 && index < size(), IndexError, "SyntheticDataset: index ", index, " out of range [0, ", size(),
             ")");
  Generator gen(sample_seed(options_.seed, 0, 0, index));
  Tensor x = randn(options_.sample_shape, TensorOptions().dtype(kFloat32), &gen);
  Tensor y = randint(0, options_.num_classes, {}, TensorOptions().dtype(kInt64), &gen);
  return {x, y};
}

}  // namespace kiln::data
