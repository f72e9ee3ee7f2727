// Iterable (stream) datasets and their loader (DESIGN.md §5).
//
// `data::IterableDataset<Sample>` is torch.utils.data.IterableDataset: a
// stream read front to back with next() (std::nullopt at its end), restarted
// for each epoch with reset(epoch). It cannot be indexed, so it cannot be
// shuffled by a sampler or split among workers by index.
//
// `IterableDataLoader<Sample, Batch>` batches a stream in stream order
// (batch_size samples each; a short last batch unless drop_last). With
// num_workers == 0 the training thread reads the stream; with num_workers > 0
// a single producer thread reads and collates into a bounded queue of
// num_workers * prefetch_factor batches (streams cannot be split by index, so
// more workers only deepen the queue). Per-sample randomness comes from the
// Generator installed as sample_generator() during each next(), seeded by
// (seed, epoch, rank, running sample index), so batches are bitwise the same
// for any num_workers. An exception in reset(), next() or collate reaches the
// consumer with the running sample index; leaving the loop early (or an
// exception) stops and joins the producer.
//
// state()/load_state() save and restore (epoch, samples consumed, seed). A
// stream has no random access, so resuming calls reset(epoch) and then reads
// and discards the samples already consumed (with their per-sample generators
// installed, as the first pass had them) before delivering the next batch:
// the resumed run sees exactly the batches it would have seen, provided the
// stream yields the same samples after the same reset(epoch). The cost of a
// resume is re-reading the consumed part of the epoch.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kiln/core/capture.h"
#include "kiln/data/epoch_iterator.h"
#include "kiln/data/loader.h"

namespace kiln::data {

/// A stream of samples. next() and reset() are called from one thread at a
/// time (the loader's producer), never concurrently.
template <typename Sample = Example>
class IterableDataset {
 public:
  using sample_type = Sample;
  virtual ~IterableDataset() = default;
  /// Restarts the stream at its beginning for `epoch` (the loader calls it
  /// before every epoch, including a resumed one).
  virtual void reset(int64_t epoch) = 0;
  /// The next sample, or std::nullopt once the stream is exhausted.
  virtual std::optional<Sample> next() = 0;
};

/// The state of an IterableDataLoader: the epoch in progress (or next), the
/// samples of it already delivered in batches, and the seed.
struct StreamLoaderState {
  int64_t epoch = 0;
  int64_t samples = 0;
  uint64_t seed = 0;
  bool operator==(const StreamLoaderState&) const = default;
};

/// The loader of an IterableDataset. Takes the DataLoader's options;
/// shuffle, sampler and persistent_workers do not apply to a stream and are
/// rejected with ValueError.
template <typename Sample = Example, typename Batch = Example>
class IterableDataLoader {
  using Clock = std::chrono::steady_clock;

 public:
  using Options = LoaderOptions<Sample, Batch>;

  IterableDataLoader(std::shared_ptr<IterableDataset<Sample>> dataset, Options options)
      : dataset_(std::move(dataset)), options_(std::move(options)), seed_(options_.seed) {
    KILN_CHECK(dataset_ != nullptr, ValueError, "IterableDataLoader: expected a dataset, got null");
    KILN_CHECK(options_.batch_size >= 1, ValueError, "IterableDataLoader: expected batch_size >= 1, got ",
               options_.batch_size);
    KILN_CHECK(options_.num_workers >= 0, ValueError, "IterableDataLoader: expected num_workers >= 0, got ",
               options_.num_workers);
    KILN_CHECK(options_.prefetch_factor >= 1, ValueError, "IterableDataLoader: expected prefetch_factor >= 1, got ",
               options_.prefetch_factor);
    KILN_CHECK(!options_.shuffle && options_.sampler == nullptr, ValueError,
               "IterableDataLoader: expected shuffle=false and no sampler (a stream is read in order; shuffle "
               "inside the stream), got ",
               options_.shuffle ? "shuffle=true" : "a sampler");
    KILN_CHECK(!options_.persistent_workers, ValueError,
               "IterableDataLoader: expected persistent_workers=false (one producer thread per epoch), got true");
    if (!options_.collate) {
      if constexpr (std::is_same_v<Sample, Example> && std::is_same_v<Batch, Example>) {
        options_.collate = collate_examples;
      } else {
        KILN_CHECK(false, ValueError, "IterableDataLoader: a custom Sample or Batch type needs options.collate");
      }
    }
  }
  IterableDataLoader(const IterableDataLoader&) = delete;
  IterableDataLoader& operator=(const IterableDataLoader&) = delete;

  /// The live iteration of one epoch; shared by iterator copies.
  class Epoch {
   public:
    Epoch(IterableDataLoader* loader, int64_t epoch, int64_t skip)
        : loader_(loader), epoch_(epoch), skip_(skip), delivered_(skip) {
      if (loader_->options_.num_workers > 0) {
        capacity_ = static_cast<size_t>(loader_->options_.num_workers * loader_->options_.prefetch_factor);
        producer_ = std::thread([this] { produce_all(); });
      }
    }
    ~Epoch() {
      if (producer_.joinable()) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          stop_ = true;
        }
        cv_.notify_all();
        producer_.join();
      }
    }
    Epoch(const Epoch&) = delete;
    Epoch& operator=(const Epoch&) = delete;

    /// Fetches the next batch into `current`; false at the end of the stream.
    bool advance() {
      capture::graph_break_if_recording("data loader");  // host code a replay would not run
      current_.reset();
      if (finished_) return false;
      record::Scope wait(record::Kind::DataWait, "DataLoader.next");
      auto t0 = Clock::now();
      Item item;
      if (producer_.joinable()) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        item = std::move(queue_.front());
        queue_.pop_front();
        lock.unlock();
        cv_.notify_all();
      } else {
        try {
          item = produce_one();
        } catch (...) {
          item.error = std::current_exception();
        }
      }
      if (item.error) {
        finished_ = true;
        std::rethrow_exception(item.error);
      }
      if (!item.batch) {
        finished_ = true;
        loader_->finished(epoch_);
        return false;
      }
      loader_->record(std::chrono::duration<double>(Clock::now() - t0).count());
      current_ = std::move(item.batch);
      delivered_ += item.count;
      loader_->delivered(epoch_, delivered_);
      return true;
    }
    Batch& current() { return *current_; }

   private:
    struct Item {
      std::shared_ptr<Batch> batch;  // null with no error: the end of the stream
      int64_t count = 0;
      std::exception_ptr error;
    };

    /// The next sample with its per-sample generator installed; nullopt at the end.
    std::optional<Sample> read() {
      if (ended_) return std::nullopt;
      const auto& o = loader_->options_;
      Generator gen(sample_seed(loader_->seed_.value(), epoch_, o.rank, index_));
      SampleGeneratorGuard guard(&gen);
      std::optional<Sample> s;
      try {
        s = loader_->dataset_->next();
      } catch (...) {
        detail::rethrow_with_context("IterableDataLoader: reading sample " + std::to_string(index_) +
                                     " of the stream (epoch " + std::to_string(epoch_) + ")");
      }
      if (s)
        ++index_;
      else
        ended_ = true;
      return s;
    }

    /// reset(epoch) and, when resuming, the samples already consumed.
    void prepare() {
      prepared_ = true;
      try {
        loader_->dataset_->reset(epoch_);
      } catch (...) {
        detail::rethrow_with_context("IterableDataLoader: reset(" + std::to_string(epoch_) + ")");
      }
      while (index_ < skip_) {
        KILN_CHECK(read().has_value(), ValueError, "IterableDataLoader: resume position of ", skip_,
                   " samples is past the end of epoch ", epoch_, "'s stream (", index_, " samples)");
      }
    }

    /// One batch (null at the end of the stream); throws what reading or collating threw.
    Item produce_one() {
      if (!prepared_) prepare();
      record::Scope load(record::Kind::DataLoad, "DataLoader.batch");
      const auto& o = loader_->options_;
      const int64_t first = index_;
      std::vector<Sample> samples;
      samples.reserve(static_cast<size_t>(o.batch_size));
      while (static_cast<int64_t>(samples.size()) < o.batch_size) {
        std::optional<Sample> s = read();
        if (!s) break;
        samples.push_back(std::move(*s));
      }
      const auto n = static_cast<int64_t>(samples.size());
      if (n == 0 || (n < o.batch_size && o.drop_last)) return {};
      try {
        auto batch = std::make_shared<Batch>(o.collate(std::move(samples)));
        if (load.recording()) load.set_bytes(batch_bytes(*batch));
        return {std::move(batch), n, nullptr};
      } catch (...) {
        detail::rethrow_with_context("IterableDataLoader: collating the batch of samples " + std::to_string(first) +
                                     ".." + std::to_string(first + n - 1));
      }
    }

    /// The producer thread: batches into the queue until the end, an error or stop.
    void produce_all() {
      record::set_thread_name("loader worker 0");
      for (;;) {
        Item item;
        try {
          item = produce_one();
        } catch (...) {
          item.error = std::current_exception();
        }
        const bool last = !item.batch;
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || queue_.size() < capacity_; });
        if (stop_) return;
        queue_.push_back(std::move(item));
        lock.unlock();
        cv_.notify_all();
        if (last) return;
      }
    }

    IterableDataLoader* loader_;
    int64_t epoch_, skip_, delivered_;
    int64_t index_ = 0;  // samples read from the stream this epoch
    bool prepared_ = false, ended_ = false, finished_ = false;
    std::shared_ptr<Batch> current_;
    std::thread producer_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Item> queue_;
    size_t capacity_ = 0;
    bool stop_ = false;
  };

  using Iterator = detail::EpochIterator<Epoch, Batch>;

  /// Starts an epoch: the next one, or the rest of the one a load_state() named.
  /// Only one epoch may be iterated at a time.
  Iterator begin() {
    KILN_CHECK(live_.expired(), ValueError,
               "IterableDataLoader: expected one epoch at a time, got begin() while an iterator of the previous "
               "epoch is still alive (destroy it, or finish or break out of its loop, first)");
    if (started_) {
      ++epoch_;
      samples_ = 0;
    }
    started_ = true;
    meter_.start_epoch();
    auto live = std::make_shared<Epoch>(this, epoch_, samples_);
    live_ = live;
    return Iterator(std::move(live));
  }
  Iterator end() { return Iterator(); }

  /// The seed in use: options.seed, or the one drawn at construction (or adopted by load_state).
  uint64_t seed() const { return seed_.value(); }

  StreamLoaderState state() const { return {epoch_, samples_, seed_.value()}; }
  /// Restores a state(): the next begin() resets the stream to that epoch,
  /// skips the samples consumed, and yields the epoch's remaining batches.
  void load_state(const StreamLoaderState& s) {
    KILN_CHECK(s.epoch >= 0 && s.samples >= 0, ValueError,
               "IterableDataLoader: load_state expected epoch, samples >= 0, got ", s.epoch, ", ", s.samples);
    KILN_CHECK(live_.expired(), ValueError, "IterableDataLoader: load_state while an epoch is being iterated");
    seed_.restore(s.seed, "IterableDataLoader");
    epoch_ = s.epoch;
    samples_ = s.samples;
    started_ = false;
  }

  /// As DataLoader::stats(): the consumer's waits in the current epoch.
  LoaderStats stats() const { return meter_.stats(); }

 private:
  void record(double wait) { meter_.record(wait); }
  void delivered(int64_t epoch, int64_t samples) {
    if (epoch == epoch_) samples_ = samples;
  }
  void finished(int64_t epoch) {
    meter_.end_epoch();
    if (epoch != epoch_) return;
    epoch_ = epoch + 1;
    samples_ = 0;
    started_ = false;
  }

  std::shared_ptr<IterableDataset<Sample>> dataset_;
  Options options_;
  detail::LoaderSeed seed_;
  std::weak_ptr<Epoch> live_;
  int64_t epoch_ = 0, samples_ = 0;
  bool started_ = false;
  detail::StallMeter meter_;
};

}  // namespace kiln::data
