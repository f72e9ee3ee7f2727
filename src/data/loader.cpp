#include "kiln/data/loader.h"

#include "kiln/core/error.h"
#include "kiln/core/record.h"
#include "kiln/ops/index.h"

namespace kiln::data {

Example collate_examples(std::vector<Example>&& samples) {
  KILN_CHECK(!samples.empty(), ValueError, "collate_examples: expected at least one sample, got none");
  std::vector<Tensor> data, target;
  data.reserve(samples.size());
  target.reserve(samples.size());
  for (auto& s : samples) {
    data.push_back(std::move(s.data));
    target.push_back(std::move(s.target));
  }
  return {stack(data), stack(target)};
}

namespace detail {

void rethrow_with_context(const std::string& what) {
  try {
    throw;
  } catch (const IndexError& e) {
    throw IndexError(what + ": " + e.what());
  } catch (const ValueError& e) {
    throw ValueError(what + ": " + e.what());
  } catch (const ShapeError& e) {
    throw ShapeError(what + ": " + e.what());
  } catch (const DTypeError& e) {
    throw DTypeError(what + ": " + e.what());
  } catch (const FormatError& e) {
    throw FormatError(what + ": " + e.what());
  } catch (const IOError& e) {
    throw IOError(what + ": " + e.what());
  } catch (const std::exception& e) {
    throw Error(what + ": " + e.what());
  } catch (...) {
    throw Error(what + ": unknown exception");
  }
}

WorkerPool::WorkerPool(int64_t num_workers) {
  threads_.reserve(static_cast<size_t>(num_workers));
  for (int64_t i = 0; i < num_workers; ++i)
    threads_.emplace_back([this, i] {
      record::set_thread_name("loader worker " + std::to_string(i));
      loop();
    });
}

WorkerPool::~WorkerPool() {
  stop();
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::start(int64_t num_tasks, int64_t window, std::function<std::shared_ptr<void>(int64_t)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    KILN_ASSERT(!active_ && running_ == 0, "WorkerPool::start while a job is active");
    num_tasks_ = num_tasks;
    window_ = window;
    next_ = consumed_ = 0;
    fn_ = std::move(fn);
    done_.clear();
    active_ = true;
  }
  cv_.notify_all();
}

std::shared_ptr<void> WorkerPool::take(int64_t k) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_.count(k) != 0; });
  auto node = done_.extract(k);
  consumed_ = k + 1;
  lock.unlock();
  cv_.notify_all();
  if (node.mapped().second) std::rethrow_exception(node.mapped().second);
  return std::move(node.mapped().first);
}

void WorkerPool::stop() {
  std::unique_lock<std::mutex> lock(mu_);
  active_ = false;
  cv_.notify_all();
  cv_.wait(lock, [&] { return running_ == 0; });
  done_.clear();
  fn_ = nullptr;
}

void WorkerPool::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return shutdown_ || (active_ && next_ < num_tasks_ && next_ < consumed_ + window_); });
    if (shutdown_) return;
    int64_t k = next_++;
    ++running_;
    auto fn = fn_;
    lock.unlock();
    std::shared_ptr<void> result;
    std::exception_ptr error;
    try {
      result = fn(k);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    --running_;
    if (active_) done_.emplace(k, std::make_pair(std::move(result), error));
    cv_.notify_all();
  }
}

}  // namespace detail
}  // namespace kiln::data
