// kiln_bench_ddp: DDP weak scaling on the gpt workload (bench/WORKLOADS.md),
// the figures of docs/ddp.md's "Hiding the communication" section and of
// bench/ddp_bench.py's table (scripts/bench.sh).
//
// Every rank trains on its own batch of fixed size (weak scaling: 2 ranks do
// twice the work of 1 in, ideally, the same step time). Rank 0 prints one JSON
// line of medians over the timed steps:
//   step_ms          zero_grad + forward + loss + backward + AdamW step
//   backward_ms      forward end to the last gradient ready (backward's compute)
//   exposed_ms       the tail: last gradient ready to every gradient averaged,
//                    i.e. communication backward did not hide (for the rank
//                    with the smallest tail; exposed_max_ms includes the skew)
//   allreduce_ms     the same buckets' allreduces run alone, back to back
//
//   mpirun -np 2 -x OMP_NUM_THREADS=1 build/release/bench/kiln_bench_ddp --steps 20
//   OMP_NUM_THREADS=1 build/release/bench/kiln_bench_ddp --steps 20      (one rank)
//
// Options: --steps N --warmup W --batch-per-rank B --bucket-mb M --first-bucket-mb M --last-bucket-mb M
//          --no-rebuild (keep the registration-order buckets)
//          --comm-hook allreduce|bf16_compress|fp16_compress|powersgd (DDP's communication
//          hook; the allreduces alone then run compressed as well, except under powersgd,
//          whose exchanges are not one allreduce: there they are the float32 ones)
//          --powersgd-rank R (powersgd's matrix_approximation_rank, 1 by default; it
//          compresses from the first step here, start_powerSGD_iter 0)
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

struct Args {
  int steps = 20, warmup = 3, batch = 8;
  dist::DDPOptions ddp;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--no-rebuild") {
      a.ddp.rebuild_buckets = false;
      continue;
    }
    KILN_CHECK(i + 1 < argc, ValueError, "kiln_bench_ddp: ", k, " expects a value");
    const char* v = argv[++i];
    if (k == "--steps") {
      a.steps = std::atoi(v);
    } else if (k == "--warmup") {
      a.warmup = std::atoi(v);
    } else if (k == "--batch-per-rank") {
      a.batch = std::atoi(v);
    } else if (k == "--bucket-mb") {
      a.ddp.bucket_cap_mb = std::atof(v);
    } else if (k == "--first-bucket-mb") {
      a.ddp.first_bucket_cap_mb = std::atof(v);
    } else if (k == "--last-bucket-mb") {
      a.ddp.last_bucket_cap_mb = std::atof(v);
    } else if (k == "--comm-hook") {
      const std::string h = v;
      bool known = false;
      for (auto hook : {dist::CommHook::Allreduce, dist::CommHook::Bf16Compress, dist::CommHook::Fp16Compress,
                        dist::CommHook::PowerSGD}) {
        if (h == dist::comm_hook_name(hook)) a.ddp.comm_hook = hook, known = true;
      }
      KILN_CHECK(known, ValueError, "kiln_bench_ddp: --comm-hook ", h,
                 ": expected allreduce, bf16_compress, fp16_compress or powersgd");
    } else if (k == "--powersgd-rank") {
      a.ddp.powersgd.matrix_approximation_rank = std::atoll(v);
    } else {
      throw ValueError("kiln_bench_ddp: unknown option " + k +
                       " (expected --steps, --warmup, --batch-per-rank, --bucket-mb, --first-bucket-mb, "
                       "--last-bucket-mb, --comm-hook, --powersgd-rank, --no-rebuild)");
    }
  }
  KILN_CHECK(a.steps > 0 && a.warmup >= 0 && a.batch > 0, ValueError,
             "kiln_bench_ddp: --steps and --batch-per-rank must be > 0 and --warmup >= 0");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return dist::run_or_abort([&] {
    dist::init();
    auto pg = dist::world();
    const int n = pg->size(), rank = pg->rank();
    const int64_t B = a.batch, T = 128;
    manual_seed(1234 + rank);  // ranks start apart: DDP's broadcast makes them equal
    auto model = std::make_shared<models::GPT>(models::GPTOptions{});
    if (a.ddp.comm_hook == dist::CommHook::PowerSGD) a.ddp.powersgd.start_powerSGD_iter = 0;
    dist::DistributedDataParallel ddp(model, pg, a.ddp);
    optim::AdamW opt(model->named_parameters(), {.lr = 3e-4, .weight_decay = 0.1});
    manual_seed(7 + rank);
    Tensor tokens = randint(0, 256, {B, T + 1}, kInt64);
    Tensor x = tokens.narrow(1, 0, T).contiguous();
    Tensor y = tokens.narrow(1, 1, T).contiguous();

    std::vector<double> step_s, backward_s, first_start_s, tail_s;
    for (int s = 0; s < a.warmup + a.steps; ++s) {
      pg->barrier()->wait();  // every rank's step starts together
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      Tensor logits = ddp(x);
      Tensor loss = nn::functional::cross_entropy(logits.view({B * T, 256}), y.view({B * T}));
      loss.backward();
      opt.step();
      const double dt = seconds_since(t0);
      if (s < a.warmup) continue;
      const auto& st = ddp.stats();
      step_s.push_back(dt);
      backward_s.push_back(st.last_gradient_ready);
      first_start_s.push_back(st.first_allreduce_start);
      tail_s.push_back(n > 1 ? st.backward_end + st.exposed_comm_seconds - st.last_gradient_ready : 0.0);
    }
    // The buckets' allreduces alone, as DDP issues them (Avg, in bucket order):
    // what a step would spend on communication if none of it were hidden.
    std::vector<double> comm_s;
    if (n > 1) {
      std::vector<Tensor> flats;
      for (const auto& b : ddp.buckets()) flats.push_back(zeros({b.bytes / 4}));
      for (int s = 0; s < a.warmup + a.steps; ++s) {
        pg->barrier()->wait();
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<dist::WorkPtr> works;
        for (auto& f : flats) {
          if (a.ddp.comm_hook == dist::CommHook::Allreduce || a.ddp.comm_hook == dist::CommHook::PowerSGD) {
            works.push_back(pg->allreduce(f, dist::ReduceOp::Avg));
          } else {
            const DType wire = a.ddp.comm_hook == dist::CommHook::Bf16Compress ? kBFloat16 : kFloat16;
            works.push_back(pg->allreduce_compressed(f, wire, dist::ReduceOp::Avg));
          }
        }
        for (auto& w : works) w->wait();
        if (s >= a.warmup) comm_s.push_back(seconds_since(t0));
      }
    }
    Tensor lo = full({1}, median(tail_s)), hi = full({1}, median(tail_s)), step_hi = full({1}, median(step_s));
    pg->allreduce(lo, dist::ReduceOp::Min)->wait();
    pg->allreduce(hi, dist::ReduceOp::Max)->wait();
    pg->allreduce(step_hi, dist::ReduceOp::Max)->wait();
    Tensor sum_lo = zeros({1});
    for (const Tensor& p : model->parameters()) sum_lo.add_(p.abs().sum().view({1}));
    Tensor sum_hi = sum_lo.clone();
    pg->allreduce(sum_lo, dist::ReduceOp::Min)->wait();
    pg->allreduce(sum_hi, dist::ReduceOp::Max)->wait();
    if (rank != 0) return;
    const char* progress = std::getenv("KILN_DIST_PROGRESS");
    std::printf(
        "{\"ranks\": %d, \"threads\": %d, \"batch_per_rank\": %lld, \"bucket_cap_mb\": %g, "
        "\"first_bucket_cap_mb\": %g, \"last_bucket_cap_mb\": %g, \"buckets\": %zu, \"rebuilt\": %s, \"progress\": "
        "\"%s\", \"comm_hook\": \"%s\", \"wire_bytes\": %lld, "
        "\"step_ms\": %.3f, \"step_max_rank_ms\": %.3f, \"backward_ms\": %.3f, \"first_allreduce_ms\": %.3f, "
        "\"exposed_ms\": %.3f, \"exposed_max_ms\": %.3f, \"allreduce_ms\": %.3f, \"replicas_identical\": %s}\n",
        n, get_num_threads(), static_cast<long long>(B), a.ddp.bucket_cap_mb, a.ddp.first_bucket_cap_mb,
        a.ddp.last_bucket_cap_mb, ddp.buckets().size(), ddp.buckets_rebuilt() ? "true" : "false",
        progress && *progress ? progress : "backoff", dist::comm_hook_name(a.ddp.comm_hook),
        static_cast<long long>(ddp.stats().wire_bytes), 1e3 * median(step_s), 1e3 * step_hi.item<float>(),
        1e3 * median(backward_s), 1e3 * median(first_start_s), 1e3 * lo.item<float>(), 1e3 * hi.item<float>(),
        1e3 * median(comm_s), sum_lo.item<float>() == sum_hi.item<float>() ? "true" : "false");
    std::fflush(stdout);
  });
}
