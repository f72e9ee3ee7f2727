// Data-parallel training of the gpt workload (bench/WORKLOADS.md) with
// DistributedDataParallel, and the figures of docs/ddp.md: step time, when
// the first allreduce starts against the end of backward, and how much of the
// communication backward does not hide.
//
//   mpirun -np 2 -x OMP_NUM_THREADS=1 build/release/examples/ddp_gpt --steps 30
//   OMP_NUM_THREADS=2 build/release/examples/ddp_gpt --steps 30      (one rank)
//
// Options: --steps N (timed, after --warmup W), --batch B (global, split
// evenly over the ranks), --bucket-mb M.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kiln/core/generator.h"
#include "kiln/core/threads.h"
#include "kiln/dist/ddp.h"
#include "kiln/dist/dist.h"
#include "kiln/models/gpt.h"
#include "kiln/nn/functional.h"
#include "kiln/ops/factory.h"
#include "kiln/optim/optimizer.h"

using namespace kiln;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 30, warmup = 5, batch = 16;
  double bucket_mb = 25;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps")
      steps = std::atoi(argv[i + 1]);
    else if (a == "--warmup")
      warmup = std::atoi(argv[i + 1]);
    else if (a == "--batch")
      batch = std::atoi(argv[i + 1]);
    else if (a == "--bucket-mb")
      bucket_mb = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "ddp_gpt: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  return dist::run_or_abort([&] {
    dist::init();
    auto pg = dist::world();
    const int n = pg->size(), rank = pg->rank();
    KILN_CHECK(batch % n == 0, ValueError, "ddp_gpt: --batch ", batch, " does not split evenly over ", n, " ranks");
    const int64_t B = batch / n, T = 128;

    manual_seed(1234 + rank);  // ranks start apart: DDP's broadcast makes them equal
    auto model = std::make_shared<models::GPT>(models::GPTOptions{});
    dist::DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = bucket_mb});
    optim::AdamW opt(model->named_parameters(), {.lr = 3e-4, .weight_decay = 0.1});
    // Synthetic tokens from a fixed seed: each rank its own B sequences of the global batch.
    manual_seed(7 + rank);
    Tensor tokens = randint(0, 256, {B, T + 1}, kInt64);
    Tensor x = tokens.narrow(1, 0, T).contiguous();
    Tensor y = tokens.narrow(1, 1, T).contiguous();

    std::vector<double> step_s, backward_s, first_start_s, tail_s;
    double loss_value = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      pg->barrier()->wait();  // every rank's step starts together
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      Tensor logits = ddp(x);
      Tensor loss = nn::functional::cross_entropy(logits.view({B * T, 256}), y.view({B * T}));
      loss.backward();
      opt.step();
      const double dt = seconds_since(t0);
      loss_value = loss.item<float>();
      if (s < warmup) continue;
      const auto& st = ddp.stats();
      step_s.push_back(dt);
      backward_s.push_back(st.last_gradient_ready);
      first_start_s.push_back(st.first_allreduce_start);
      // From the last gradient to every gradient averaged: the communication
      // (and the bucket's division) that backward's compute did not cover.
      tail_s.push_back(st.backward_end + st.exposed_comm_seconds - st.last_gradient_ready);
    }

    // The same buckets' allreduces alone, one after another: the communication
    // a step would spend if nothing of it were hidden.
    std::vector<double> comm_s;
    if (n > 1) {
      std::vector<Tensor> flats;
      for (const auto& b : ddp.buckets()) flats.push_back(zeros({b.bytes / 4}));
      for (int s = 0; s < warmup + steps; ++s) {
        pg->barrier()->wait();
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& f : flats) pg->allreduce(f)->wait();
        if (s >= warmup) comm_s.push_back(seconds_since(t0));
      }
    }
    // The rank that reaches the last allreduce last waits only for the
    // communication; the others also wait for it (skew, large on a busy machine).
    Tensor lo = full({1}, median(tail_s)), hi = full({1}, median(tail_s));
    pg->allreduce(lo, dist::ReduceOp::Min)->wait();
    pg->allreduce(hi, dist::ReduceOp::Max)->wait();
    // The replicas must still be identical after training: compare a checksum.
    Tensor sum_lo = zeros({1}), sum_hi;
    for (const Tensor& p : model->parameters()) sum_lo.add_(p.abs().sum().view({1}));
    sum_hi = sum_lo.clone();
    pg->allreduce(sum_lo, dist::ReduceOp::Min)->wait();
    pg->allreduce(sum_hi, dist::ReduceOp::Max)->wait();
    const bool identical = sum_lo.item<float>() == sum_hi.item<float>();
    if (rank == 0) {
      const double comm = median(comm_s), tail = lo.item<float>(), with_skew = hi.item<float>();
      std::printf("ranks %d  threads/rank %d  batch/rank %lld  buckets %zu (cap %.1f MB)  params %lld\n", n,
                  get_num_threads(), static_cast<long long>(B), ddp.buckets().size(), bucket_mb,
                  static_cast<long long>(model->num_parameters()));
      std::printf(
          "step_ms %.1f  backward_compute_ms %.1f  first_allreduce_start_ms %.1f  tail_ms %.2f "
          "(with skew %.2f)  comm_alone_ms %.2f  not_hidden %.2f  loss %.4f  replicas_identical %s\n",
          1e3 * median(step_s), 1e3 * median(backward_s), 1e3 * median(first_start_s), 1e3 * tail, 1e3 * with_skew,
          1e3 * comm, comm > 0 ? tail / comm : 0.0, loss_value, identical ? "yes" : "NO");
    }
  });
}
