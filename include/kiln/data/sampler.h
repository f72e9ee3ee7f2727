// Samplers: the order in which a DataLoader visits dataset indices (torch.utils.data).
//
// A Sampler yields, per epoch, a list of indices; set_epoch(e) selects the
// epoch. SequentialSampler is 0..n-1; RandomSampler is a permutation that
// depends only on (seed, epoch); BatchSampler groups a sampler's indices into
// batches (drop_last drops a short final batch); DistributedSampler gives
// rank r of world size R its own share (padded by repeating indices, or
// dropped, to equal lengths), shuffled by (seed, epoch).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kiln/core/generator.h"

namespace kiln::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices per epoch.
  virtual int64_t size() const = 0;
  /// The indices of the current epoch.
  virtual std::vector<int64_t> indices() = 0;
  virtual void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

 protected:
  int64_t epoch_ = 0;
};

class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t n);
  int64_t size() const override { return n_; }
  std::vector<int64_t> indices() override;

 private:
  int64_t n_;
};

/// A random permutation of 0..n-1 drawn from a Generator seeded by
/// (generator.initial_seed(), epoch): the same seed and epoch give the same order.
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t n, const Generator& generator);
  int64_t size() const override { return n_; }
  std::vector<int64_t> indices() override;

 private:
  int64_t n_;
  uint64_t seed_;
};

/// Groups the indices of `sampler` into batches of `batch_size`.
class BatchSampler {
 public:
  BatchSampler(std::shared_ptr<Sampler> sampler, int64_t batch_size, bool drop_last);
  /// Number of batches per epoch.
  int64_t size() const;
  /// The current epoch's batches.
  std::vector<std::vector<int64_t>> batches();
  Sampler& sampler() { return *sampler_; }

 private:
  std::shared_ptr<Sampler> sampler_;
  int64_t batch_size_;
  bool drop_last_;
};

struct DistributedSamplerOptions {
  int64_t num_replicas = 1;
  int64_t rank = 0;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

/// torch.utils.data.DistributedSampler over a dataset of `dataset_size`
/// samples. Shuffled runs must call set_epoch(e) before each epoch; a second
/// epoch without it would repeat the first order, and is warned about once on stderr.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options);
  int64_t size() const override { return num_samples_; }
  std::vector<int64_t> indices() override;
  void set_epoch(int64_t epoch) override;
  /// Samples across all ranks after padding or dropping.
  int64_t total_size() const { return num_samples_ * options_.num_replicas; }

 private:
  int64_t n_;
  DistributedSamplerOptions options_;
  int64_t num_samples_;
  int64_t epochs_started_ = 0;
  bool epoch_set_ = false;
  bool warned_ = false;
};

}  // namespace kiln::data
