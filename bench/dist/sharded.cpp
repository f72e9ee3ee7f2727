// kiln_bench_sharded: the gpt workload (bench/WORKLOADS.md: 4 layers, d_model
// 256, vocab 256, context 128, global batch 16, AdamW) trained data-parallel
// under each strategy — DDP, ZeRO-1, ZeRO-2 (ZeroRedundancyOptimizer, and FSDP
// without resharding after forward), ZeRO-3 (FSDP) — for the figures of
// docs/distributed.md: step time, per-rank peak memory by category (allocator
// counters) and the time each step spends waiting on communication. Run it
// under MPI with one thread per rank (scripts/bench_sharded.sh):
//   mpirun -np 2 kiln_bench_sharded [steps]
// Rank 0 prints a Markdown table. Not a test: no figure is asserted.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kiln/kiln.h"

using namespace kiln;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Figures {
  std::string name;
  double step_ms = 0, comm_ms = 0, opt_ms = 0;
  std::array<int64_t, kNumMemoryCategories> peak{};
  int64_t states_live = 0;  // parameters + gradients + optimizer state live after the last step
  double loss = 0;
};

Figures run(const std::string& strategy, int steps, const dist::ProcessGroupPtr& pg) {
  memory::empty_cache();
  manual_seed(1);
  auto gpt = std::make_shared<models::GPT>(models::GPTOptions{});
  const int64_t batch = 16 / pg->size(), seq = 128;
  Generator g(7);
  Tensor idx = randint(0, 256, {16, seq}, kInt64, &g), tgt = randint(0, 256, {16, seq}, kInt64, &g);
  idx = idx.narrow(0, pg->rank() * batch, batch);
  tgt = tgt.narrow(0, pg->rank() * batch, batch);
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  std::shared_ptr<dist::FullyShardedDataParallel> fsdp;
  std::unique_ptr<dist::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::Optimizer> opt;
  const optim::AdamWOptions adamw{.lr = 3e-4, .weight_decay = 0.1};
  nn::Module* model = gpt.get();
  if (strategy == "zero3" || strategy == "fsdp-grad-op") {
    // fsdp-grad-op: FSDP without resharding after forward (torch's SHARD_GRAD_OP),
    // that is ZeRO-2 with per-unit reduce-scatters that overlap backward.
    fsdp = std::make_shared<dist::FullyShardedDataParallel>(
        gpt, pg,
        dist::FSDPOptions{.units = dist::modules_of_type(*gpt, "Block"), .reshard_after_forward = strategy == "zero3"});
    opt = std::make_unique<optim::AdamW>(fsdp->named_parameters(), adamw);
    model = fsdp.get();
  } else {
    if (strategy != "zero2") {
      ddp = std::make_shared<dist::DistributedDataParallel>(gpt, pg);
      model = ddp.get();
    }
    if (strategy == "ddp") {
      opt = std::make_unique<optim::AdamW>(gpt->named_parameters(), adamw);
    } else {
      zero = std::make_unique<dist::ZeroRedundancyOptimizer>(gpt->named_parameters(), pg,
                                                             dist::optimizer_factory<optim::AdamW>(adamw),
                                                             dist::ZeroOptions{.stage = strategy == "zero1" ? 1 : 2});
    }
  }
  Figures f{strategy};
  std::vector<double> times, comm, opt_times;
  for (int s = 0; s < steps + 2; ++s) {
    if (s == 2) memory::reset_peak_stats();  // the first steps create the optimizer state
    pg->barrier()->wait();
    const double t0 = now();
    Tensor logits = (*model)(idx);
    Tensor loss = nn::functional::cross_entropy(logits.reshape({-1, 256}), tgt.reshape({-1}));
    loss.backward();
    double wait = ddp ? ddp->stats().exposed_comm_seconds : fsdp ? fsdp->stats().exposed_comm_seconds : 0;
    const double t1 = now();
    if (zero && zero->stage() == 2) zero->reduce_gradients();  // blocking: all of it is exposed
    wait += now() - t1;
    const double t2 = now();
    // zero_grad(false) keeps the gradient buffers, so that the figures after
    // the last step count them as a training loop that reuses them holds them.
    if (zero) {
      zero->step();  // the local step, then the parameters' all-gather
      zero->zero_grad(false);
    } else {
      opt->step();
      opt->zero_grad(false);
    }
    const double t3 = now();
    if (s >= 2) {
      times.push_back(t3 - t0);
      comm.push_back(wait);
      opt_times.push_back(t3 - t2);
      f.loss = loss.item<double>();
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2] * 1e3;
  };
  f.step_ms = median(times);
  f.comm_ms = median(comm);
  f.opt_ms = median(opt_times);
  const auto st = memory::stats();
  for (int c = 0; c < kNumMemoryCategories; ++c) f.peak[c] = st[static_cast<MemoryCategory>(c)].peak_bytes;
  f.states_live = st[MemoryCategory::Parameter].live_bytes + st[MemoryCategory::Gradient].live_bytes +
                  st[MemoryCategory::OptimizerState].live_bytes;
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  return dist::run_or_abort([&] {
    dist::init();
    set_num_threads(1);
    auto pg = dist::world();
    const int steps = argc > 1 ? std::atoi(argv[1]) : 8;
    std::vector<Figures> all;
    for (const char* s : {"ddp", "zero1", "zero2", "fsdp-grad-op", "zero3"}) all.push_back(run(s, steps, pg));
    if (pg->rank() != 0) return;
    auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
    std::printf("gpt workload, %d ranks x 1 thread, global batch 16 x 128, AdamW; rank 0, median of %d steps\n\n",
                pg->size(), steps);
    std::printf(
        "Allocator counters (bytes reserved; blocks over the large-allocation threshold round up to\n"
        "2 MiB pages): peaks over the measured steps by category, and the model states (parameters +\n"
        "gradients + optimizer state) live after the last step.\n\n");
    std::printf(
        "| strategy | step ms | comm wait ms | optimizer step ms | parameter MiB | gradient MiB | "
        "optimizer state MiB | activation MiB | workspace MiB | states after step MiB | last loss |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const auto& f : all) {
      std::printf("| %s | %.1f | %.1f | %.1f | %.2f | %.2f | %.2f | %.1f | %.2f | %.2f | %.4f |\n", f.name.c_str(),
                  f.step_ms, f.comm_ms, f.opt_ms, mib(f.peak[static_cast<int>(MemoryCategory::Parameter)]),
                  mib(f.peak[static_cast<int>(MemoryCategory::Gradient)]),
                  mib(f.peak[static_cast<int>(MemoryCategory::OptimizerState)]),
                  mib(f.peak[static_cast<int>(MemoryCategory::Activation)]),
                  mib(f.peak[static_cast<int>(MemoryCategory::Workspace)]), mib(f.states_live), f.loss);
    }
  });
}
