// DataLoader: batches from a Dataset, fetched by worker threads (DESIGN.md §5).
//
// `DataLoader<Sample, Batch>` iterates a dataset in batches chosen by a
// sampler (sequential, shuffled by (seed, epoch), or a user Sampler such as
// DistributedSampler), and collates each batch (default: kiln::stack of the
// Examples' data and targets). num_workers threads fill a bounded queue of
// num_workers * prefetch_factor batches ahead; batches come out in order and,
// because each sample's randomness comes from a Generator seeded by (seed,
// epoch, rank, index) (see sample_generator()), they are bitwise the same for
// any num_workers. An exception in get() or collate reaches the consumer with
// the sample index. Leaving the loop early (or an exception) stops and joins
// the workers. state()/load_state() save and restore (epoch, batches consumed,
// seed), so a resumed loader yields exactly the remaining batches of the
// epoch. stats() reports how long the consumer waited for data. An iterator
// must not outlive its loader, and one epoch is iterated at a time.
//
// Profiling (kiln/core/record.h): the consumer's wait for each batch is a
// DataWait scope ("DataLoader.next") and the production of each batch, on a
// worker ("loader worker N" in traces) or inline, a DataLoad scope
// ("DataLoader.batch", bytes = the batch's tensors).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "kiln/core/allocator.h"
#include "kiln/core/capture.h"
#include "kiln/core/record.h"
#include "kiln/data/dataset.h"
#include "kiln/data/epoch_iterator.h"
#include "kiln/data/sampler.h"

namespace kiln::data {

/// The default collate for Examples: {stack(data), stack(target)}.
Example collate_examples(std::vector<Example>&& samples);

/// The bytes of a batch's tensors, as profiles report them: an Example's data
/// and target, a Tensor's own; other batch types count as 0.
inline int64_t batch_bytes(const Example& b) {
  return (b.data.defined() ? b.data.nbytes() : 0) + (b.target.defined() ? b.target.nbytes() : 0);
}
inline int64_t batch_bytes(const Tensor& b) { return b.defined() ? b.nbytes() : 0; }
template <typename Batch>
int64_t batch_bytes(const Batch&) {
  return 0;
}

struct LoaderState {
  int64_t epoch = 0;     // the epoch in progress (or next)
  int64_t position = 0;  // batches of it already delivered
  uint64_t seed = 0;     // the loader's generator seed (shuffle and per-sample randomness)
  bool operator==(const LoaderState&) const = default;
};

struct LoaderStats {
  int64_t batches = 0;               // delivered since the epoch (iteration) started
  double wait_s = 0;                 // total time the consumer waited for them
  double wall_s = 0;                 // wall time since the epoch started (until its last batch)
  double wait_fraction = 0;          // wait_s / wall_s
  double batches_per_s = 0;          // batches / wall_s
  std::vector<double> batch_wait_s;  // the wait for each batch
};

namespace detail {

/// The stall accounting both loaders keep: the consumer's wait for each batch
/// and the epoch's wall time, guarded so worker threads can end the epoch.
class StallMeter {
 public:
  using Clock = std::chrono::steady_clock;
  void start_epoch() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = LoaderStats{};
    start_ = Clock::now();
    end_.reset();
  }
  void end_epoch() {
    std::lock_guard<std::mutex> lock(mu_);
    end_ = Clock::now();
  }
  void record(double wait) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.batches += 1;
    stats_.wait_s += wait;
    stats_.batch_wait_s.push_back(wait);
  }
  LoaderStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    LoaderStats s = stats_;
    s.wall_s = std::chrono::duration<double>((end_ ? *end_ : Clock::now()) - start_).count();
    if (s.wall_s > 0) {
      s.wait_fraction = s.wait_s / s.wall_s;
      s.batches_per_s = static_cast<double>(s.batches) / s.wall_s;
    }
    return s;
  }

 private:
  mutable std::mutex mu_;
  LoaderStats stats_;
  Clock::time_point start_ = Clock::now();
  std::optional<Clock::time_point> end_;
};

/// A loader's seed: the one the options gave, or one drawn at construction.
/// load_state() of a drawn seed adopts the saved one (a resumed run continues
/// the saved order whatever the global RNG did before); an explicit seed must
/// match the saved one.
class LoaderSeed {
 public:
  explicit LoaderSeed(std::optional<uint64_t> given) : value_(given ? *given : draw_seed()), drawn_(!given) {}
  uint64_t value() const { return value_; }
  /// True when `saved` was taken over (the caller then rebuilds what depends on the seed).
  bool restore(uint64_t saved, const char* loader) {
    KILN_CHECK(drawn_ || saved == value_, ValueError, loader, ": load_state expected seed ", value_,
               " (the loader's options.seed), got ", saved,
               "; hint: build the loader with the seed of the run that saved the state, or leave options.seed "
               "unset to take the saved one");
    const bool changed = saved != value_;
    value_ = saved;
    return changed;
  }

 private:
  uint64_t value_;
  bool drawn_;
};

}  // namespace detail

template <typename Sample = Example, typename Batch = Example>
struct LoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;
  /// A custom sampler (e.g. DistributedSampler); then `shuffle` must be false
  /// and the caller calls sampler->set_epoch. Null: sequential or shuffled.
  std::shared_ptr<Sampler> sampler = nullptr;
  int64_t num_workers = 0;
  int64_t prefetch_factor = 2;
  bool drop_last = false;
  /// Seeds the shuffle order and per-sample randomness. Unset: drawn from the
  /// default generator when the loader is built (torch's base seed), so
  /// manual_seed decides the order; set it for an order independent of
  /// the global RNG (the CLI passes its config seed).
  std::optional<uint64_t> seed = std::nullopt;
  /// Rank mixed into per-sample seeds (distributed training).
  int64_t rank = 0;
  /// Keep the worker threads between epochs instead of starting them per epoch.
  bool persistent_workers = false;
  /// Null: collate_examples (Sample = Batch = Example only).
  std::function<Batch(std::vector<Sample>&&)> collate = nullptr;
};

namespace detail {

/// The worker threads and the in-order result queue, independent of the
/// sample and batch types: a job runs tasks 0..n-1 as fn(task).
class WorkerPool {
 public:
  explicit WorkerPool(int64_t num_workers);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Starts tasks 0..num_tasks-1, at most `window` ahead of the consumer.
  void start(int64_t num_tasks, int64_t window, std::function<std::shared_ptr<void>(int64_t)> fn);
  /// Waits for task `k` (called with k = 0, 1, 2, ... in order); rethrows its exception.
  std::shared_ptr<void> take(int64_t k);
  /// Stops the current job and waits until no worker runs one of its tasks.
  void stop();

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  bool shutdown_ = false;
  bool active_ = false;
  int64_t num_tasks_ = 0, window_ = 0, next_ = 0, consumed_ = 0, running_ = 0;
  std::function<std::shared_ptr<void>(int64_t)> fn_;
  std::map<int64_t, std::pair<std::shared_ptr<void>, std::exception_ptr>> done_;
};

/// Rethrows the exception being handled with `what` prefixed to its message:
/// kiln's Index/Value/Shape/DType/Format/IOError keep their type, anything else becomes kiln::Error.
[[noreturn]] void rethrow_with_context(const std::string& what);

}  // namespace detail

template <typename Sample = Example, typename Batch = Example>
class DataLoader {
  using Clock = std::chrono::steady_clock;

 public:
  using Options = LoaderOptions<Sample, Batch>;

  DataLoader(std::shared_ptr<const Dataset<Sample>> dataset, Options options)
      : dataset_(std::move(dataset)), options_(std::move(options)), seed_(options_.seed) {
    KILN_CHECK(dataset_ != nullptr, ValueError, "DataLoader: expected a dataset, got null");
    KILN_CHECK(options_.num_workers >= 0, ValueError, "DataLoader: expected num_workers >= 0, got ",
               options_.num_workers);
    KILN_CHECK(options_.prefetch_factor >= 1, ValueError, "DataLoader: expected prefetch_factor >= 1, got ",
               options_.prefetch_factor);
    KILN_CHECK(!(options_.sampler && options_.shuffle), ValueError,
               "DataLoader: expected either a sampler or shuffle=true, got both");
    owns_sampler_ = (options_.sampler == nullptr);
    make_batch_sampler();
    if (!options_.collate) {
      if constexpr (std::is_same_v<Sample, Example> && std::is_same_v<Batch, Example>) {
        options_.collate = collate_examples;
      } else {
        KILN_CHECK(false, ValueError, "DataLoader: a custom Sample or Batch type needs options.collate");
      }
    }
  }
  ~DataLoader() = default;
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  /// Movable between epochs (into a member, out of a factory); moving while an
  /// iterator of an epoch is alive is a ValueError, since that epoch refers to
  /// this loader. The stall statistics start afresh.
  DataLoader(DataLoader&& o)
      : dataset_((o.check_movable(), std::move(o.dataset_))),
        options_(std::move(o.options_)),
        seed_(o.seed_),
        owns_sampler_(o.owns_sampler_),
        batch_sampler_(std::move(o.batch_sampler_)),
        pool_(std::move(o.pool_)),
        epoch_(o.epoch_),
        position_(o.position_),
        started_(o.started_) {}
  DataLoader& operator=(DataLoader&& o) {
    if (this == &o) return *this;
    check_movable();
    o.check_movable();
    dataset_ = std::move(o.dataset_);
    options_ = std::move(o.options_);
    seed_ = o.seed_;
    owns_sampler_ = o.owns_sampler_;
    batch_sampler_ = std::move(o.batch_sampler_);
    pool_ = std::move(o.pool_);
    epoch_ = o.epoch_;
    position_ = o.position_;
    started_ = o.started_;
    return *this;
  }

  /// Batches per epoch.
  int64_t size() const { return batch_sampler_->size(); }

  /// The live iteration of one epoch; shared by iterator copies. It refers to
  /// its loader, which must outlive it (and not move while it lives).
  class Epoch {
   public:
    Epoch(DataLoader* loader, std::vector<std::vector<int64_t>> batches, int64_t epoch, int64_t start)
        : loader_(loader), batches_(std::move(batches)), epoch_(epoch), next_(start), start_(start) {
      const int64_t n = static_cast<int64_t>(batches_.size()) - start_;
      if (loader_->options_.num_workers > 0 && n > 0) {
        auto& pool = loader_->pool_;
        if (!pool) pool = std::make_unique<detail::WorkerPool>(loader_->options_.num_workers);
        pool->start(n, loader_->options_.num_workers * loader_->options_.prefetch_factor, [this](int64_t k) {
          return std::static_pointer_cast<void>(std::make_shared<Batch>(fetch(start_ + k)));
        });
        pooled_ = true;
      }
    }
    ~Epoch() {
      if (pooled_) {
        loader_->pool_->stop();
        if (!loader_->options_.persistent_workers) loader_->pool_.reset();
      }
    }
    /// Fetches the next batch into `current`; false at the end.
    bool advance() {
      capture::graph_break_if_recording("data loader");  // host code a replay would not run
      current_.reset();
      if (next_ >= static_cast<int64_t>(batches_.size())) return false;
      record::Scope wait(record::Kind::DataWait, "DataLoader.next");
      auto t0 = Clock::now();
      if (pooled_) {
        current_ = std::static_pointer_cast<Batch>(loader_->pool_->take(next_ - start_));
      } else {
        current_ = std::make_shared<Batch>(fetch(next_));
      }
      loader_->record(std::chrono::duration<double>(Clock::now() - t0).count());
      ++next_;
      loader_->delivered(epoch_, next_, next_ == static_cast<int64_t>(batches_.size()));
      return true;
    }
    Batch& current() { return *current_; }

   private:
    Batch fetch(int64_t b) const {
      // Samples and the batch are the input pipeline's memory until the model
      // computes on them, on a worker thread or on this one.
      MemoryCategoryGuard data_memory(MemoryCategory::Data);
      record::Scope load(record::Kind::DataLoad, "DataLoader.batch");
      const auto& idx = batches_[static_cast<size_t>(b)];
      std::vector<Sample> samples;
      samples.reserve(idx.size());
      for (int64_t i : idx) {
        Generator gen(sample_seed(loader_->seed_.value(), epoch_, loader_->options_.rank, i));
        SampleGeneratorGuard guard(&gen);
        try {
          samples.push_back(loader_->dataset_->get(i));
        } catch (...) {
          detail::rethrow_with_context("DataLoader: fetching sample " + std::to_string(i) + " (epoch " +
                                       std::to_string(epoch_) + ", batch " + std::to_string(b) + ")");
        }
      }
      try {
        Batch batch = loader_->options_.collate(std::move(samples));
        if (load.recording()) load.set_bytes(batch_bytes(batch));
        return batch;
      } catch (...) {
        detail::rethrow_with_context("DataLoader: collating batch " + std::to_string(b) + " (samples " +
                                     std::to_string(idx.empty() ? -1 : idx.front()) + "..)");
      }
    }

    DataLoader* loader_;
    std::vector<std::vector<int64_t>> batches_;
    int64_t epoch_, next_, start_;
    bool pooled_ = false;
    std::shared_ptr<Batch> current_;
  };

  using Iterator = detail::EpochIterator<Epoch, Batch>;

  /// Starts an epoch: the next one, or the rest of the one a load_state() named.
  /// Only one epoch may be iterated at a time.
  Iterator begin() {
    KILN_CHECK(live_.expired(), ValueError,
               "DataLoader: expected one epoch at a time, got begin() while an iterator of the previous epoch "
               "is still alive (destroy it, or finish or break out of its loop, first)");
    if (started_) {
      ++epoch_;
      position_ = 0;
    }
    started_ = true;
    if (owns_sampler_) batch_sampler_->sampler().set_epoch(epoch_);
    auto batches = batch_sampler_->batches();
    KILN_CHECK(position_ <= static_cast<int64_t>(batches.size()), ValueError, "DataLoader: resume position ", position_,
               " is past the epoch's ", batches.size(), " batches");
    meter_.start_epoch();
    auto live = std::make_shared<Epoch>(this, std::move(batches), epoch_, position_);
    live_ = live;
    return Iterator(std::move(live));
  }
  Iterator end() { return Iterator(); }

  /// The seed in use: options.seed, or the one drawn at construction (or adopted by load_state).
  uint64_t seed() const { return seed_.value(); }

  LoaderState state() const { return {epoch_, position_, seed_.value()}; }
  /// Restores a state(): the next begin() yields that epoch's remaining batches.
  void load_state(const LoaderState& s) {
    KILN_CHECK(s.epoch >= 0 && s.position >= 0, ValueError,
               "DataLoader: load_state expected epoch, position >= 0, got ", s.epoch, ", ", s.position);
    if (seed_.restore(s.seed, "DataLoader")) make_batch_sampler();
    epoch_ = s.epoch;
    position_ = s.position;
    started_ = false;
  }

  LoaderStats stats() const { return meter_.stats(); }

 private:
  void check_movable() const {
    KILN_CHECK(live_.expired(), ValueError,
               "DataLoader: cannot move a loader while an iterator of its epoch is alive (finish or leave the "
               "loop first)");
  }
  void make_batch_sampler() {
    std::shared_ptr<Sampler> s = options_.sampler;
    if (!s) {
      if (options_.shuffle)
        s = std::make_shared<RandomSampler>(dataset_->size(), Generator(seed_.value()));
      else
        s = std::make_shared<SequentialSampler>(dataset_->size());
    }
    batch_sampler_ = std::make_unique<BatchSampler>(s, options_.batch_size, options_.drop_last);
  }
  void record(double wait) { meter_.record(wait); }
  void delivered(int64_t epoch, int64_t position, bool last) {
    if (last) meter_.end_epoch();
    if (epoch != epoch_) return;
    if (last) {
      epoch_ = epoch + 1;
      position_ = 0;
      started_ = false;
    } else {
      position_ = position;
    }
  }

  std::shared_ptr<const Dataset<Sample>> dataset_;
  Options options_;
  detail::LoaderSeed seed_;
  bool owns_sampler_ = true;
  std::unique_ptr<BatchSampler> batch_sampler_;
  std::unique_ptr<detail::WorkerPool> pool_;
  std::weak_ptr<Epoch> live_;
  int64_t epoch_ = 0, position_ = 0;
  bool started_ = false;
  detail::StallMeter meter_;
};

}  // namespace kiln::data
