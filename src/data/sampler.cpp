#include "kiln/data/sampler.h"

#include <iostream>

#include "kiln/core/error.h"
#include "kiln/data/dataset.h"
#include "kiln/ops/factory.h"

namespace kiln::data {

namespace {

std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch) {
  Generator gen(sample_seed(seed, epoch, 0, -1));
  Tensor p = randperm(n, &gen).to(kInt64).contiguous();
  const int64_t* d = p.data_ptr<int64_t>();
  return std::vector<int64_t>(d, d + n);
}

}  // namespace

SequentialSampler::SequentialSampler(int64_t n) : n_(n) {
  KILN_CHECK(n >= 0, ValueError, "SequentialSampler: expected n >= 0, got ", n);
}

std::vector<int64_t> SequentialSampler::indices() {
  std::vector<int64_t> out(static_cast<size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) out[static_cast<size_t>(i)] = i;
  return out;
}

RandomSampler::RandomSampler(int64_t n, const Generator& generator) : n_(n), seed_(generator.initial_seed()) {
  KILN_CHECK(n >= 0, ValueError, "RandomSampler: expected n >= 0, got ", n);
}

std::vector<int64_t> RandomSampler::indices() { return permutation(n_, seed_, epoch_); }

BatchSampler::BatchSampler(std::shared_ptr<Sampler> sampler, int64_t batch_size, bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  KILN_CHECK(sampler_ != nullptr, ValueError, "BatchSampler: expected a sampler, got null");
  KILN_CHECK(batch_size_ >= 1, ValueError, "BatchSampler: expected batch_size >= 1, got ", batch_size_);
}

int64_t BatchSampler::size() const {
  int64_t n = sampler_->size();
  return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

std::vector<std::vector<int64_t>> BatchSampler::batches() {
  std::vector<int64_t> idx = sampler_->indices();
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < idx.size(); i += static_cast<size_t>(batch_size_)) {
    size_t end = std::min(idx.size(), i + static_cast<size_t>(batch_size_));
    if (drop_last_ && end - i < static_cast<size_t>(batch_size_)) break;
    out.emplace_back(idx.begin() + static_cast<std::ptrdiff_t>(i), idx.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return out;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : n_(dataset_size), options_(options) {
  KILN_CHECK(n_ >= 0, ValueError, "DistributedSampler: expected dataset_size >= 0, got ", n_);
  KILN_CHECK(options_.num_replicas >= 1, ValueError, "DistributedSampler: expected num_replicas >= 1, got ",
             options_.num_replicas);
  KILN_CHECK(options_.rank >= 0 && options_.rank < options_.num_replicas, ValueError,
             "DistributedSampler: expected rank in [0, ", options_.num_replicas, "), got ", options_.rank);
  const int64_t r = options_.num_replicas;
  num_samples_ = (options_.drop_last && n_ % r != 0) ? n_ / r : (n_ + r - 1) / r;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  epoch_set_ = true;
}

std::vector<int64_t> DistributedSampler::indices() {
  if (epochs_started_ > 0 && !epoch_set_ && options_.shuffle && !warned_) {
    warned_ = true;
    std::cerr << "kiln warning: DistributedSampler: a new epoch started without set_epoch(); every epoch "
                 "repeats the same order. Call sampler.set_epoch(epoch) before each epoch.\n";
  }
  ++epochs_started_;
  epoch_set_ = false;

  std::vector<int64_t> all;
  if (options_.shuffle) {
    all = permutation(n_, options_.seed, epoch_);
  } else {
    all.resize(static_cast<size_t>(n_));
    for (int64_t i = 0; i < n_; ++i) all[static_cast<size_t>(i)] = i;
  }
  const size_t total = static_cast<size_t>(total_size());
  if (all.size() < total && !all.empty()) {
    // Pad by repeating from the start (torch does the same).
    size_t have = all.size();
    while (all.size() < total) all.push_back(all[(all.size() - have) % have]);
  }
  all.resize(total);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(options_.rank); i < total; i += static_cast<size_t>(options_.num_replicas))
    out.push_back(all[i]);
  return out;
}

}  // namespace kiln::data
