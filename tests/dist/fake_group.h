// Test only: an in-process ProcessGroup whose N ranks are N threads sharing
// memory, so DDP's bucketing, overlap and equivalence can be tested without
// MPI. A collective is asynchronous as in a real backend: the call deposits a
// copy of the rank's input and returns at once; the last rank to arrive
// computes the result; wait() blocks until it exists and copies it out.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kiln/core/error.h"
#include "kiln/core/guards.h"
#include "kiln/dist/process_group.h"

namespace kiln::test {

class FakeWorld : public std::enable_shared_from_this<FakeWorld> {
 public:
  explicit FakeWorld(int size) : size_(size) {}
  int size() const { return size_; }

  struct Slot {
    std::vector<Tensor> inputs;  // per rank, copies
    int arrived = 0;
    std::vector<Tensor> results;  // per rank, filled by the last arrival
    bool done = false;
  };

  // Deposits rank's input for collective `seq`; `combine` turns all inputs into per-rank results.
  std::shared_ptr<Slot> arrive(uint64_t seq, int rank, std::vector<Tensor> input,
                               const std::function<std::vector<Tensor>(const std::vector<std::vector<Tensor>>&)>&
                                   combine) {
    std::unique_lock lock(mu_);
    auto& entry = slots_[seq];
    if (!entry.slot) entry.slot = std::make_shared<Slot>();
    entry.per_rank.resize(size_);
    entry.per_rank[rank] = std::move(input);
    auto slot = entry.slot;
    if (++slot->arrived == size_) {
      slot->results = combine(entry.per_rank);
      slot->done = true;
      slots_.erase(seq);
      cv_.notify_all();
    }
    return slot;
  }

  void wait(const std::shared_ptr<Slot>& slot) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return slot->done; });
  }
  bool done(const std::shared_ptr<Slot>& slot) {
    std::lock_guard lock(mu_);
    return slot->done;
  }

  /// Runs fn(rank) on `size` threads; rethrows the first exception.
  void run(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(size_);
    for (int r = 0; r < size_; ++r) {
      threads.emplace_back([&, r] {
        try {
          fn(r);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }

 private:
  struct Entry {
    std::shared_ptr<Slot> slot;
    std::vector<std::vector<Tensor>> per_rank;
  };
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> slots_;
};

class FakeGroup : public dist::ProcessGroup {
 public:
  FakeGroup(std::shared_ptr<FakeWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::string backend() const override { return "fake"; }

  /// Every collective issued on this rank, in order ("allreduce", "broadcast" ...).
  std::vector<std::string> log;

  dist::WorkPtr allreduce(Tensor& t, dist::ReduceOp op, Loc) override {
    KILN_CHECK(op == dist::ReduceOp::Sum || op == dist::ReduceOp::Avg, ValueError, "fake allreduce: Sum and Avg only");
    const int n = size();
    return issue("allreduce", {t}, {t}, [op, n](const std::vector<std::vector<Tensor>>& in) {
      Tensor acc = in[0][0].clone();
      for (size_t r = 1; r < in.size(); ++r) acc.add_(in[r][0]);
      if (op == dist::ReduceOp::Avg) acc.div_(static_cast<double>(n));
      return std::vector<Tensor>(in.size(), acc);
    });
  }
  dist::WorkPtr broadcast(Tensor& t, int root, Loc) override {
    return issue("broadcast", {t}, {t}, [root](const std::vector<std::vector<Tensor>>& in) {
      return std::vector<Tensor>(in.size(), in[root][0]);
    });
  }
  dist::WorkPtr allgather(std::vector<Tensor>& out, const Tensor& in, Loc) override {
    KILN_CHECK(static_cast<int>(out.size()) == size(), ValueError, "fake allgather: need ", size(), " outputs");
    return issue_multi("allgather", {in}, out, [](const std::vector<std::vector<Tensor>>& in) {
      std::vector<Tensor> all;
      for (auto& r : in) all.push_back(r[0]);
      return all;
    }, /*all_to_each=*/true);
  }
  dist::WorkPtr reduce_scatter(Tensor& out, const std::vector<Tensor>& in, dist::ReduceOp op, Loc) override {
    KILN_CHECK(op == dist::ReduceOp::Sum, ValueError, "fake reduce_scatter: Sum only");
    return issue("reduce_scatter", in, {out}, [](const std::vector<std::vector<Tensor>>& in) {
      std::vector<Tensor> res;
      for (size_t dst = 0; dst < in.size(); ++dst) {
        Tensor acc = in[0][dst].clone();
        for (size_t r = 1; r < in.size(); ++r) acc.add_(in[r][dst]);
        res.push_back(acc);
      }
      return res;
    });
  }
  dist::WorkPtr barrier(Loc) override {
    return issue("barrier", {}, {}, [](const std::vector<std::vector<Tensor>>& in) {
      return std::vector<Tensor>(in.size());
    });
  }
  dist::WorkPtr allgather_into_tensor(Tensor&, const Tensor&, Loc) override { not_provided(); }
  dist::WorkPtr reduce_scatter_tensor(Tensor&, const Tensor&, dist::ReduceOp, Loc) override { not_provided(); }
  dist::WorkPtr alltoall(Tensor&, const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&,
                         Loc) override {
    not_provided();
  }
  dist::WorkPtr send(const Tensor&, int, int, Loc) override {
    throw ValueError("fake group: send/recv are not used by DDP and not provided by the test group");
  }
  dist::WorkPtr recv(Tensor&, int, int, Loc) override {
    throw ValueError("fake group: send/recv are not used by DDP and not provided by the test group");
  }

 private:
  [[noreturn]] static void not_provided() {
    throw ValueError("fake group: the flat-tensor collectives are not used by DDP and not provided by the test group");
  }
  using Combine = std::function<std::vector<Tensor>(const std::vector<std::vector<Tensor>>&)>;

  class FakeWork : public dist::Work {
   public:
    // `outs` are handles sharing the callers' storage, so copying into them writes the callers' tensors.
    FakeWork(std::shared_ptr<FakeWorld> w, std::shared_ptr<FakeWorld::Slot> s, std::vector<Tensor> outs,
             int rank, bool all_to_each, uint64_t seq)
        : world_(std::move(w)), slot_(std::move(s)), outs_(std::move(outs)), rank_(rank),
          all_to_each_(all_to_each), seq_(seq) {}
    void wait() override {
      if (copied_) return;
      world_->wait(slot_);
      NoGradGuard no_grad;
      if (all_to_each_) {
        for (size_t i = 0; i < outs_.size(); ++i) outs_[i].copy_(slot_->results[i]);
      } else if (!outs_.empty()) {
        outs_[0].copy_(slot_->results[rank_]);
      }
      copied_ = true;
    }
    bool is_completed() override { return copied_ || world_->done(slot_); }
    uint64_t sequence() const override { return seq_; }

   private:
    std::shared_ptr<FakeWorld> world_;
    std::shared_ptr<FakeWorld::Slot> slot_;
    std::vector<Tensor> outs_;
    int rank_;
    bool all_to_each_;
    uint64_t seq_;
    bool copied_ = false;
  };

  dist::WorkPtr issue(const std::string& what, std::vector<Tensor> in, std::vector<Tensor> out_handles,
                      Combine combine) {
    return issue_multi(what, std::move(in), std::move(out_handles), std::move(combine), false);
  }

  dist::WorkPtr issue_multi(const std::string& what, std::vector<Tensor> in, std::vector<Tensor> outs,
                            Combine combine, bool all_to_each) {
    const uint64_t seq = ++seq_;
    log.push_back(what);
    std::vector<Tensor> copies;
    {
      NoGradGuard no_grad;
      for (auto& t : in) copies.push_back(t.detach().clone());
    }
    auto slot = world_->arrive(seq, rank_, std::move(copies), combine);
    return std::make_shared<FakeWork>(world_, slot, std::move(outs), rank_, all_to_each, seq);
  }

  std::shared_ptr<FakeWorld> world_;
  int rank_;
  uint64_t seq_ = 0;
};

}  // namespace kiln::test
