// A small MPI program that test_dist's DistJob cases launch with mpirun to
// check how jobs fail (a skipped collective, a throwing rank), and that
// measures allreduce bus bandwidth for docs/distributed.md.
//   kiln_dist_child skip-debug | skip-hang | throw | uncaught | debug-on-rank-0 | shm-off-on-rank-0 | bw [MB] [iters]
//                   | group-mismatch-debug | group-hang   (4 ranks: the subgroup [1, 3])
//                   | fsdp-die   (rank 1 dies just before an FSDP unit's all-gather)
//                   | pipeline-stall   (the last stage stalls in a forward: the first waits for gradients)
//                   | pipeline-die     (the first stage dies in a forward: the last waits for activations)
//                   | mesh-hang  (4 ranks, mesh dp=2 x tp=2: world rank 3 skips a tp allreduce)
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kiln/ops/factory.h"
#include "kiln/dist/device_mesh.h"
#include "kiln/dist/dist.h"
#include "kiln/dist/fsdp.h"
#include "kiln/nn/layers.h"
#include "kiln/parallel/pipeline.h"

using namespace kiln;

namespace {

// Two collectives every rank runs, so that the failure comes at number 3.
void warm_up(dist::ProcessGroup& pg) {
  Tensor a = full({16}, 1.0);
  pg.allreduce(a)->wait();
  Tensor b = full({8}, static_cast<double>(pg.rank()));
  pg.broadcast(b, 0)->wait();
}

// Runs `body` after the warm-up; in debug mode every rank must raise from it
// (exit 0 after printing what it raised), anything else exits 2.
int expect_raise(const std::function<void(dist::ProcessGroup&)>& body) {
  auto pg = dist::world();
  warm_up(*pg);
  try {
    body(*pg);
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "rank %d raised: %s\n", pg->rank(), e.what());
    return 0;
  }
  std::fprintf(stderr, "rank %d: no error raised\n", pg->rank());
  return 2;
}

// Rank 1 skips an allreduce and goes on to the next collective, a broadcast.
// In debug mode every rank must raise at collective 3 with the table.
int skip_debug() {
  return expect_raise([](dist::ProcessGroup& pg) {
    Tensor c = full({1000}, 2.0);
    if (pg.rank() != 1) pg.allreduce(c)->wait();  // the collective rank 1 skips
    Tensor d = full({10}, 3.0);
    pg.broadcast(d, 0)->wait();
  });
}

// The ranks allreduce [3, 4] and [4, 3]: the same bytes, a different call.
// In debug mode every rank must raise at collective 3, showing both shapes.
int transposed_debug() {
  return expect_raise([](dist::ProcessGroup& pg) {
    Tensor c = pg.rank() == 1 ? full({4, 3}, 1.0) : full({3, 4}, 1.0);
    pg.allreduce(c)->wait();
  });
}

// Rank 0 runs an allreduce while rank 1 does `rank1` instead: the watchdog
// must report and abort (exit 2 if the job ends any other way).
int hang_with_rank_1(const std::function<void(dist::ProcessGroup&)>& rank1) {
  auto pg = dist::world();
  warm_up(*pg);
  Tensor c = full({1000}, 2.0);
  if (pg->rank() != 1) {
    pg->allreduce(c)->wait();
  } else {
    rank1(*pg);
  }
  std::fprintf(stderr, "rank %d: finished, but the watchdog should have ended the job\n", pg->rank());
  return 2;
}

// Rank 1 skips the allreduce and computes (sleeps) for far longer than the timeout.
int skip_hang() {
  return hang_with_rank_1([](dist::ProcessGroup&) { std::this_thread::sleep_for(std::chrono::seconds(100)); });
}

// Rank 1 waits in a barrier where rank 0 runs an allreduce: both have "reached"
// collective 3, and the report must say that rank 1 is in another collective.
int barrier_vs_allreduce() {
  return hang_with_rank_1([](dist::ProcessGroup& pg) { pg.barrier()->wait(); });
}

// Rank 1 dies at step 7 while rank 0 waits in an allreduce: by SIGKILL, which
// it cannot report itself, or by SIGSEGV, which it reports on its way out.
int die_on_rank_1(int sig) {
  auto pg = dist::world();
  warm_up(*pg);
  dist::set_step(7);
  if (pg->rank() == 1) ::raise(sig);
  Tensor c = full({1000}, 2.0);
  pg->allreduce(c)->wait();
  std::fprintf(stderr, "rank %d: finished, but rank 1 should have died\n", pg->rank());
  return 2;
}

void throw_on_rank_1() {
  auto pg = dist::world();
  warm_up(*pg);
  if (pg->rank() == 1) throw std::runtime_error("deliberate failure on rank 1");
  Tensor c = full({1000}, 2.0);
  pg->allreduce(c)->wait();  // never completes: rank 1 is gone
}

// World ranks 1 and 3 form a group (every rank makes it) and warm it up; then
// world rank 1 runs an allreduce where world rank 3 runs a broadcast. In debug
// mode both members must raise, naming the group; ranks 0 and 2 take no part.
int group_mismatch_debug() {
  auto g = dist::new_group({1, 3});
  if (!g->is_member()) return 0;
  warm_up(*g);
  try {
    Tensor c = full({1000}, 2.0);
    Tensor d = full({10}, 3.0);
    if (g->rank() == 0) {
      g->allreduce(c)->wait();
    } else {
      g->broadcast(d, 0)->wait();
    }
  } catch (const DistributedError& e) {
    std::fprintf(stderr, "world rank %d raised: %s\n", dist::rank(), e.what());
    return 0;
  }
  std::fprintf(stderr, "world rank %d: no error raised\n", dist::rank());
  return 2;
}

// In the group [1, 3], world rank 3 skips an allreduce that world rank 1 runs:
// rank 1's watchdog for that group must report and abort. The other ranks
// compute (sleep) meanwhile, as a real job would.
int group_hang() {
  auto g = dist::new_group({1, 3});
  if (g->is_member()) warm_up(*g);
  if (dist::rank() == 1) {
    Tensor c = full({1000}, 2.0);
    g->allreduce(c)->wait();
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(100));
  }
  std::fprintf(stderr, "world rank %d: finished, but the watchdog should have ended the job\n", dist::rank());
  return 2;
}

// A tp group of a DeviceMesh in which one rank never arrives: the watchdog
// must name the group by its mesh dimension.
int mesh_hang() {
  dist::DeviceMesh mesh({{"dp", 2}, {"tp", 2}});
  auto tp = mesh.group("tp");
  warm_up(*tp);
  if (dist::rank() != 3) {
    Tensor c = full({1000}, 2.0);
    tp->allreduce(c)->wait();
  }
  // Ranks 0 and 1 finished theirs; they wait here for the watchdog of rank 2 to end the job.
  std::this_thread::sleep_for(std::chrono::seconds(100));
  std::fprintf(stderr, "world rank %d: finished, but the watchdog should have ended the job\n", dist::rank());
  return 2;
}

// Bus bandwidth as nccl-tests defines it for allreduce: 2(n-1)/n x bytes / time,
// the time being the slowest rank's mean over `iters` after warm-up.
void bandwidth(double mb, int iters) {
  auto pg = dist::world();
  const int64_t n = static_cast<int64_t>(mb * 1024 * 1024 / 4);
  Tensor t = full({n}, 1.0);
  for (int i = 0; i < 3; ++i) pg->allreduce(t)->wait();
  pg->barrier()->wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) pg->allreduce(t)->wait();
  Tensor secs = full({1}, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
  pg->allreduce(secs, dist::ReduceOp::Max)->wait();
  const double s = secs.data_ptr<float>()[0];
  const double bytes = static_cast<double>(n) * 4;
  const double busbw = 2.0 * (pg->size() - 1) / pg->size() * bytes / s / 1e9;
  // The same allreduce straight through MPI on this thread: what the
  // communication thread and the Work handles cost, if anything.
  std::vector<float> raw(static_cast<size_t>(n), 1.0f);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto r0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    MPI_Allreduce(MPI_IN_PLACE, raw.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  double raw_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count() / iters;
  MPI_Allreduce(MPI_IN_PLACE, &raw_s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (pg->rank() == 0) {
    std::printf("allreduce float32 %.1f MB, %d ranks: %.2f ms per call, algbw %.2f GB/s, busbw %.2f GB/s"
                " (plain MPI_Allreduce: %.2f ms, busbw %.2f GB/s)\n",
                mb, pg->size(), s * 1e3, bytes / s / 1e9, busbw, raw_s * 1e3,
                2.0 * (pg->size() - 1) / pg->size() * bytes / raw_s / 1e9);
  }
}

// FSDP over three Linear units; at step 3 rank 1 is killed just before unit
// 'fc2' gathers its parameters, so rank 0 waits in that all-gather. `kiln
// launch` must name the dead rank and where rank 0 waited: the unit and the
// collective, not a line of FSDP's code alone.
int fsdp_die() {
  auto pg = dist::world();
  auto model = std::make_shared<nn::Sequential>();
  std::vector<std::shared_ptr<nn::Linear>> layers;
  for (int i = 0; i < 3; ++i) {
    layers.push_back(std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 8}));
    model->push_back(layers.back());
  }
  int64_t step = 0;
  // Registered before FSDP's own hook, so it runs first.
  layers[1]->register_forward_pre_hook([&](nn::Module&, const Tensor&) {
    if (pg->rank() == 1 && step == 3) ::raise(SIGKILL);
    return Tensor();
  });
  auto fsdp = std::make_shared<dist::FullyShardedDataParallel>(
      model, pg, dist::FSDPOptions{.units = {"0", "1", "2"}, .prefetch = false});
  for (step = 1; step <= 5; ++step) {
    dist::set_step(step);
    (*fsdp)(ones({4, 8})).sum().backward();
  }
  std::fprintf(stderr, "rank %d: finished, but rank 1 should have died\n", pg->rank());
  return 2;
}

// A two-stage pipeline of Linear layers (a stage per rank), M = 4. At step 3
// stage `victim` reaches the forward of micro-batch 2 and stalls there (60 s,
// far past KILN_DIST_TIMEOUT) or dies by SIGKILL: the watchdog or `kiln
// launch` must name the stage, the micro-batch and the direction the other
// stage waited for. GPipe for the dying first stage, so that the last stage's
// only operation then is that receive (under 1F1B it could be finishing a
// send at the same moment, and the report would name that instead).
int pipeline_fault(bool die) {
  auto groups = parallel::make_pipeline_groups({{0, 1}});
  const int victim = die ? 0 : 1;
  auto stage = std::make_shared<nn::Linear>(nn::LinearOptions{.in_features = 8, .out_features = 8});
  int64_t step = 0, micro = 0;
  stage->register_forward_pre_hook([&](nn::Module&, const Tensor&) {
    if (groups.stage == victim && step == 3 && micro++ == 2) {
      if (die) {
        // Sends are queued to the group's thread: give micro-batches 0 and 1
        // time to leave, so that the other stage waits for 2, not for them.
        std::this_thread::sleep_for(std::chrono::seconds(1));
        ::raise(SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    return Tensor();
  });
  parallel::Pipeline pipe(stage, groups,
                          {.micro_batches = 4, .schedule = die ? parallel::Schedule::GPipe : parallel::Schedule::OneFOneB},
                          [](const Tensor& y, const Tensor& t) { return ((y - t) * (y - t)).mean(); });
  for (step = 1; step <= 5; ++step) {
    dist::set_step(step);
    micro = 0;
    pipe.step(ones({8, 8}), zeros({8, 8}));
  }
  std::fprintf(stderr, "rank %d: finished, but stage %d should have %s\n", dist::rank(), victim,
               die ? "died" : "stalled");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "debug-on-rank-0") {
    // Debug mode on one rank only: init() must refuse on every rank.
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    if (r && std::string(r) == "0") ::setenv("KILN_DIST_DEBUG", "1", 1);
    dist::init();
    return 2;
  }
  if (mode == "shm-off-on-rank-0") {
    // The shared-memory all-reduce off on one rank only: its allreduces would never meet the others'.
    const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
    if (r && std::string(r) == "0") ::setenv("KILN_DIST_SHM", "0", 1);
    dist::init();
    return 2;
  }
  dist::init();
  if (mode == "skip-debug") return skip_debug();
  if (mode == "skip-hang") return skip_hang();
  if (mode == "transposed-debug") return transposed_debug();
  if (mode == "barrier-vs-allreduce") return barrier_vs_allreduce();
  if (mode == "group-mismatch-debug") return group_mismatch_debug();
  if (mode == "group-hang") return group_hang();
  if (mode == "mesh-hang") return mesh_hang();
  if (mode == "sigkill") return die_on_rank_1(SIGKILL);
  if (mode == "sigsegv") return die_on_rank_1(SIGSEGV);
  if (mode == "fsdp-die") return fsdp_die();
  if (mode == "pipeline-stall") return pipeline_fault(false);
  if (mode == "pipeline-die") return pipeline_fault(true);
  if (mode == "throw") return dist::run_or_abort(throw_on_rank_1);
  if (mode == "uncaught") {
    throw_on_rank_1();  // std::terminate -> dist's handler
    return 0;
  }
  if (mode == "bw") {
    return dist::run_or_abort([&] { bandwidth(argc > 2 ? std::atof(argv[2]) : 32, argc > 3 ? std::atoi(argv[3]) : 20); });
  }
  std::fprintf(stderr, "usage: kiln_dist_child skip-debug|skip-hang|throw|uncaught|bw [MB] [iters]\n");
  return 64;
}
