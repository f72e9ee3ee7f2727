// kiln_bench: runs benchmark workloads (workloads.h) and prints one JSON line
// per workload with every step's time, so scripts/bench.sh (bench/compare.py)
// can take medians and compare with the PyTorch twin, which prints the same
// lines (bench/torch/workloads.py).
//
//   kiln_bench --workload gpt[,mlp,...] [--threads N] [--warmup 10] [--steps 50]
//   kiln_bench --workload peak [--threads N] [--size 2048] [--steps 10]
//   kiln_bench --workload tiny --profile on   (a kiln::profiler::Profiler records the timed steps)
//   kiln_bench --workload mlp --compile on    (every step through kiln::compile: the first captures)
//   kiln_bench --workload mlp --compile split (the same, with the loss read by item() inside the step:
//                                              a graph break, so every step runs split at it)
//   kiln_bench --workload cnn --compile plain (compiled without graph rewrites: what they save)
//   kiln_bench --workload mlp --floor ab      (eager steps and matmul probes in alternating blocks:
//                                              the floor in the step's own phase, bench/floor_bench.py)
//
// "peak" is the f32 matmul ceiling probe: kiln::mm of two size x size float32
// matrices (oneDNN sgemm underneath), GFLOP/s of the best and the median call
// (with --amp bf16, of two bf16 matrices: the bf16 ceiling);
// at 2+ threads it also times an empty parallel region and a cache line's
// round trip between two threads ("fork_join_us", "core_round_trip_ns"), and a
// workload counts its multi-threaded regions per timed step
// ("parallel_regions_per_step", "dnnl_threaded_calls_per_step"): Note
// [Parallel regions].
// A workload's first step is a warm-up step and reports the loss before any
// update ("loss_first"); after the timed steps one more untimed step reports
// "loss_last". maxrss_kib is this process's peak resident set so far.
// --profile on: the timed steps run under a recording Profiler (every event
// and allocation kept, prof.step() after each step), the "profiler overhead"
// row of scripts/bench.sh (bench/profiler_overhead.py); "profile_events" is
// how many it kept.
// "product_flops_per_step": the FLOPs of the products and convolutions one
// eager step runs, as the profiler counts them on the last warm-up step (0 for
// a compiled run, whose replays the profiler does not see, or with one warm-up
// step): the float32 floor of workloads without an analytic count (cnn, resnet).
// "product_ms_per_step": the time those products and convolutions took, the
// self time of the profiler's rows that count FLOPs, median over the last
// warm-up steps (up to three; 0 where product_flops_per_step is): with a
// matmul peak it says how much of a step could go faster with faster
// products, the bf16 rows' ceiling (bench/bf16_bench.py).
// --workload peak --amp bf16 probes the bf16 matmul peak the same way.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/core/parallel.h"
#include "kiln/export/compile.h"
#include "kiln/kernels/dnnl.h"
#include "kiln/kiln.h"
#include "kiln/profiler/profiler.h"
#include "workloads.h"

namespace {

struct Args {
  std::vector<std::string> workloads;
  int threads = 0;  // 0: kiln's default (OMP_NUM_THREADS or the core count)
  int warmup = 10;
  int steps = 50;
  int64_t size = 2048;
  std::string amp = "off";      // --amp bf16: forward and loss under bf16 autocast
  bool profile = false;         // --profile on: the timed steps under a recording Profiler
  bool profile_table = false;   // --profile table: that, and its op table (self time first) on stderr
  bool profile_shapes = false;  // --profile shapes: the table with a row per op and input shapes
  bool compile = false;         // --compile on: every step through kiln::compile (the "compiled" rows)
  bool split = false;           // --compile split: that, with a graph break inside the step
  bool rewrite = true;          // --compile plain: compiled without graph rewrites
  bool compile_ab = false;      // --compile ab: eager and compiled side by side in this process
  bool floor_ab = false;        // --floor ab: the eager step and the matmul probe side by side
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "kiln_bench: " << why
            << "\nusage: kiln_bench --workload NAME[,NAME...] [--threads N] [--warmup N] [--steps N] [--size N] [--amp "
               "bf16|off|ab] [--profile on|off|table|shapes] [--compile on|off|split|plain|ab] [--floor ab]\n"
               "workloads: tiny mlp cnn resnet gpt gpt_infer, and peak (f32 matmul probe)\n";
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string part; std::getline(ss, part, ',');)
    if (!part.empty()) out.push_back(part);
  return out;
}

int to_int(const std::string& flag, const std::string& v, int min) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0' || x < min)
    usage(flag + " expects an integer >= " + std::to_string(min) + ", got '" + v + "'");
  return static_cast<int>(x);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("help");
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--workload")
      a.workloads = split(v);
    else if (flag == "--threads")
      a.threads = to_int(flag, v, 1);
    else if (flag == "--warmup")
      a.warmup = to_int(flag, v, 1);
    else if (flag == "--steps")
      a.steps = to_int(flag, v, 1);
    else if (flag == "--size")
      a.size = to_int(flag, v, 16);
    else if (flag == "--amp") {
      if (v != "bf16" && v != "off" && v != "ab")
        usage("--amp expects bf16, off or ab (fp16 needs a GradScaler), got '" + v + "'");
      a.amp = v;
    } else if (flag == "--profile") {
      if (v != "on" && v != "off" && v != "table" && v != "shapes")
        usage("--profile expects on, off, table or shapes, got '" + v + "'");
      a.profile = v != "off";
      a.profile_table = v == "table" || v == "shapes";
      a.profile_shapes = v == "shapes";
    } else if (flag == "--compile") {
      if (v != "on" && v != "off" && v != "split" && v != "plain" && v != "ab")
        usage("--compile expects on, off, split, plain or ab, got '" + v + "'");
      a.compile = v != "off" && v != "ab";
      a.compile_ab = v == "ab";
      a.split = v == "split";
      a.rewrite = v != "plain";
    } else if (flag == "--floor") {
      if (v != "ab") usage("--floor expects ab, got '" + v + "'");
      a.floor_ab = true;
    } else
      usage("unknown flag " + flag);
  }
  if (a.workloads.empty()) usage("--workload is required");
  // The paired runs time two copies of their own; nothing else applies to them.
  if (a.amp == "ab" && (a.compile || a.compile_ab))
    usage("--amp ab pairs eager float32 and bf16 steps: no --compile with it");
  if ((a.amp == "ab" || a.compile_ab) && a.profile)
    usage("--amp ab and --compile ab time two copies: no --profile with them");
  // The floor is float32's: under --amp bf16 autocast would turn the probe into a bf16 product.
  if (a.floor_ab && (a.amp != "off" || a.compile || a.compile_ab || a.profile))
    usage(
        "--floor ab pairs the eager float32 step with the float32 matmul probe: no --amp, --compile or --profile "
        "with it");
  return a;
}

long maxrss_kib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;  // KiB on Linux
}

std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// Note [Parallel regions]
// At two or more threads every parallel region (a kiln loop, a oneDNN call)
// pays a fork and a join however fast its kernel is, and a thread that reads
// what another core wrote pays for each line crossing between the cores. The
// peak probe measures both, so that a run can say what the per-op threading
// of a step costs on its machine: fork_join_us is the median of an empty
// region over every thread, core_round_trip_ns a cache line sent from one
// thread to another and back.
double fork_join_us() {
  std::vector<double> us;
  for (int i = 0; i < 20000; ++i) {
    const auto t0 = Clock::now();
    kiln::parallel_for(kiln::get_num_threads(), 1, [](int64_t, int64_t) {});
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return median(us);
}

// Two threads of one region pass a counter back and forth; NaN when the
// region ran on one thread, or when the trips took over a second (the two
// threads share a core: each trip then waits for the scheduler).
double core_round_trip_ns() {
  constexpr int kTrips = 100000;
  alignas(64) std::atomic<int> turn{0};
  alignas(64) std::atomic<int> present{0};
  alignas(64) std::atomic<bool> stop{false};
  double ns = std::numeric_limits<double>::quiet_NaN();
  kiln::parallel_for(2, 1, [&](int64_t b, int64_t e) {
    if (e - b != 1) return;  // one thread got both halves: nothing to measure
    present.fetch_add(1);
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::seconds(1);
    while (present.load() < 2)
      if (Clock::now() > deadline) return;
    // Waits until the counter reads `want`; false once the trips are abandoned.
    const auto await = [&](int want) {
      for (int spins = 0; turn.load(std::memory_order_acquire) != want; ++spins) {
        if (stop.load(std::memory_order_relaxed)) return false;
        if ((spins & 4095) == 4095 && Clock::now() > deadline) {
          stop.store(true);
          return false;
        }
      }
      return true;
    };
    const auto start = Clock::now();
    for (int i = 0; i < kTrips; ++i) {
      if (b == 0) {
        turn.store(2 * i + 1, std::memory_order_release);
        if (!await(2 * i + 2)) return;
      } else {
        if (!await(2 * i + 1)) return;
        turn.store(2 * i + 2, std::memory_order_release);
      }
    }
    if (b == 0) ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kTrips;
  });
  return ns;
}

// GFLOP/s of `reps` products of two n x n matrices of dtype dt: the matmul probe.
std::vector<double> probe_gflops(int64_t n, kiln::DType dt, int reps) {
  kiln::Generator g(7);
  const kiln::Tensor x = kiln::randn({n, n}, kiln::kFloat32, &g).to(dt),
                     y = kiln::randn({n, n}, kiln::kFloat32, &g).to(dt);
  for (int i = 0; i < 2; ++i) kiln::mm(x, y);  // primitive creation, output blocks, first touch
  std::vector<double> gflops;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    kiln::Tensor z = kiln::mm(x, y);
    gflops.push_back(2.0 * n * n * n / (ms_since(t0) * 1e6));
  }
  return gflops;
}

void run_peak(const Args& a) {
  const int64_t n = a.size;
  const kiln::DType dt = a.amp == "bf16" ? kiln::kBFloat16 : kiln::kFloat32;
  const std::vector<double> gflops = probe_gflops(n, dt, a.steps);
  std::printf(
      "{\"framework\": \"kiln\", \"workload\": \"peak\", \"dtype\": \"%s\", \"threads\": %d, \"size\": %lld, "
      "\"gflops_best\": %s, \"gflops_median\": %s, \"fork_join_us\": %s, \"core_round_trip_ns\": %s, "
      "\"maxrss_kib\": %ld}\n",
      dt == kiln::kBFloat16 ? "bf16" : "float32", kiln::get_num_threads(), static_cast<long long>(n),
      num(*std::max_element(gflops.begin(), gflops.end())).c_str(), num(median(gflops)).c_str(),
      num(kiln::get_num_threads() > 1 ? fork_join_us() : 0.0).c_str(),
      num(kiln::get_num_threads() > 1 ? core_round_trip_ns() : std::numeric_limits<double>::quiet_NaN()).c_str(),
      maxrss_kib());
  std::fflush(stdout);
}

// The products' FLOPs and self time of one step, from the profiler's rows
// that count FLOPs (matmuls, convolutions, attention's backward).
std::pair<double, double> profiled_products(const std::function<void()>& step) {
  kiln::profiler::Profiler counter;
  counter.start();
  step();
  counter.stop();
  double flops = 0, ns = 0;
  for (const auto& row : counter.key_averages()) {
    if (row.flops <= 0) continue;
    flops += row.flops;
    ns += static_cast<double>(row.self_ns);
  }
  return {flops, ns / 1e6};
}

// Note [Two modes in one process]
// On this machine a process runs in one of two speeds for its whole life
// (docs/compile.md, "the slow state"): every kernel 10-40 % slower in the slow
// one, whatever the mode. Two processes, one per mode, then compare the
// machine's states as much as the modes. --compile ab (eager against
// compiled) and --amp ab (float32 against bf16 autocast) build the workload
// twice from the same synthetic weights and alternate blocks of steps between
// the copies, so both modes share the process's state: the ratio of one
// process is a pairing, and the harness takes the median over processes.
// The first step of each block is left out (it follows the other copy's
// block, whose data evicted this one's). Each copy's last warm-up steps
// count its products, each after a step of its own for the same reason, and
// one more step after each block times them again in that block's spell
// (the median of all of those is the copy's product_ms_per_step).

// Note [The floor in the step's own phase]
// A float32 floor is a step's product FLOPs at the matmul probe's rate, and
// on a shared machine that rate moves by half within minutes (2026-12-07, an
// Intel Xeon VM: 1-thread probes 118-166 GFLOP/s, 2-thread 166-320 in one
// run), so a step timed in one spell over a probe taken in another measures
// the spells. --floor ab alternates blocks of steps with blocks of probe
// products (a --size square float32 mm each), the scheme of the two modes
// above, so that the step's times and the probe's rates come from the same
// spells; bench/floor_bench.py divides medians by medians and bests by bests.

// One copy of a workload in a paired run: its step and what it measured.
struct Side {
  explicit Side(std::function<double(bool)> f) : step(std::move(f)) {}
  std::function<double(bool)> step;  // one step; the loss when asked
  std::function<void()> after;       // run after each timed step, outside its time (the floor's state pass)
  double loss_first = 0, loss_last = 0, first_ms = 0;
  double product_flops = 0;
  std::vector<double> product_ms, ms;
};

std::string list(const std::vector<double>& v) {
  std::ostringstream o;
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << num(v[i]);
  return o.str();
}

// Warm-up (the last steps counting products) and a.steps timed steps of each
// side in alternating blocks; returns the block length.
int run_paired(const Args& a, Side& x, Side& y) {
  for (Side* s : {&x, &y}) {
    const auto t0 = Clock::now();
    s->loss_first = s->step(true);
    s->first_ms = ms_since(t0);
  }
  const int counted = std::min(3, a.warmup - 1);
  for (int i = 1; i + counted < a.warmup; ++i)
    for (Side* s : {&x, &y}) s->step(false);
  for (int i = 0; i < counted; ++i)
    for (Side* s : {&x, &y}) {
      // After one step of its own, as a timed step runs after the one its
      // block leaves out: the other side's step has evicted this one's data.
      s->step(false);
      const auto [flops, ms] = profiled_products([&] { s->step(false); });
      s->product_flops = flops;
      s->product_ms.push_back(ms);
    }
  const int block = std::clamp(a.steps / 8, 2, 10);
  while (static_cast<int>(y.ms.size()) < a.steps)
    for (Side* s : {&x, &y}) {
      for (int i = 0; i < block + 1; ++i) {
        const auto t0 = Clock::now();
        s->step(false);
        if (i > 0 && static_cast<int>(s->ms.size()) < a.steps) {
          s->ms.push_back(ms_since(t0));
          if (s->after) s->after();
        }
      }
      // One more step, profiled: its products' time in the spell its block was timed in.
      s->product_ms.push_back(profiled_products([&] { s->step(false); }).second);
    }
  for (Side* s : {&x, &y}) s->loss_last = s->step(true);
  return block;
}

// A side's fields of the JSON line, each key prefixed (`eager_median_ms`).
std::string side_json(const std::string& prefix, const Side& s) {
  return "\"" + prefix + "_median_ms\": " + num(median(s.ms)) + ", \"" + prefix +
         "_loss_first\": " + num(s.loss_first) + ", \"" + prefix + "_loss_last\": " + num(s.loss_last) + ", \"" +
         prefix + "_product_ms_per_step\": " + num(s.product_ms.empty() ? 0.0 : median(s.product_ms)) + ", \"" +
         prefix + "_step_ms\": [" + list(s.ms) + "], ";
}

// --compile ab: eager against compiled (Note [Two modes in one process]), with
// the process's own float32 matmul peak for the floor.
void run_compile_ab(const std::string& name, const Args& a) {
  auto we = kiln_bench::make_workload(name), wc = kiln_bench::make_workload(name);
  kiln::CompiledFunction compiled = kiln::compile(wc->step_fn(), {.name = name, .modules = {wc->module()}});
  Side eager([&](bool want_loss) { return we->step(want_loss); });
  Side comp([&](bool want_loss) {
    const kiln::Tensor out = compiled()[0];
    return want_loss ? wc->loss_of(out) : std::numeric_limits<double>::quiet_NaN();
  });
  const int block = run_paired(a, eager, comp);
  const std::vector<double> peak = probe_gflops(a.size, kiln::kFloat32, 10);
  const auto& st = compiled.stats();
  std::printf(
      "{\"framework\": \"kiln\", \"workload\": \"%s\", \"amp\": \"%s\", \"threads\": %d, \"warmup\": %d, "
      "\"steps\": %d, \"ab\": \"compile\", \"block\": %d, %s%s\"compile_ms\": %s, \"replays\": %lld, "
      "\"graph_breaks\": %zu, \"rewrites\": %lld, \"product_flops_per_step\": %s, \"f32_peak_gflops\": %s, "
      "\"maxrss_kib\": %ld}\n",
      name.c_str(), a.amp.c_str(), kiln::get_num_threads(), a.warmup, a.steps, block, side_json("eager", eager).c_str(),
      side_json("compiled", comp).c_str(), num(comp.first_ms).c_str(), static_cast<long long>(st.replays),
      st.graph_breaks.size(), static_cast<long long>(st.rewrites), num(eager.product_flops).c_str(),
      num(*std::max_element(peak.begin(), peak.end())).c_str(), maxrss_kib());
  std::fflush(stdout);
}

// --amp ab: float32 against bf16 autocast (Note [Two modes in one process]);
// the workloads read the autocast setting at each step, so each side sets it.
void run_amp_ab(const std::string& name, const Args& a) {
  auto w32 = kiln_bench::make_workload(name), w16 = kiln_bench::make_workload(name);
  Side f32([&](bool want_loss) {
    kiln_bench::set_autocast(std::nullopt);
    return w32->step(want_loss);
  });
  Side bf16([&](bool want_loss) {
    kiln_bench::set_autocast(kiln::kBFloat16);
    return w16->step(want_loss);
  });
  const int block = run_paired(a, f32, bf16);
  // Where bf16's products ran (Note [bf16 products where bf16 is slow]), so a table can say why
  // bf16 is or is not faster on this CPU.
  const char* path = kiln::kernels::bf16_products_on_dnnl() ? "onednn_bf16" : "float32";
  std::printf(
      "{\"framework\": \"kiln\", \"workload\": \"%s\", \"threads\": %d, \"warmup\": %d, \"steps\": %d, "
      "\"ab\": \"amp\", \"block\": %d, %s%s\"product_flops_per_step\": %s, \"bf16_products\": \"%s\", "
      "\"bf16_dot_vs_fma\": %s, \"bf16_native_from\": %s, \"maxrss_kib\": %ld}\n",
      name.c_str(), kiln::get_num_threads(), a.warmup, a.steps, block, side_json("f32", f32).c_str(),
      side_json("bf16", bf16).c_str(), num(f32.product_flops).c_str(), path,
      num(kiln::kernels::bf16_products_decision_rate()).c_str(), num(kiln::kernels::kBf16NativeRate).c_str(),
      maxrss_kib());
  std::fflush(stdout);
}

// --floor ab: the eager step against the float32 matmul probe (Note [The floor
// in the step's own phase]).
void run_floor_ab(const std::string& name, const Args& a) {
  auto w = kiln_bench::make_workload(name);
  kiln::Generator g(7);
  const kiln::Tensor x = kiln::randn({a.size, a.size}, kiln::kFloat32, &g),
                     y = kiln::randn({a.size, a.size}, kiln::kFloat32, &g);
  Side step([&](bool want_loss) { return w->step(want_loss); });
  Side probe([&](bool) {
    kiln::Tensor z = kiln::mm(x, y);
    return std::numeric_limits<double>::quiet_NaN();
  });
  // Note [The optimizer's state in the floor]
  // An optimizer step reads every parameter and state tensor and writes it
  // back, bytes no product FLOP count sees: mlp's 0.67 M parameters and
  // momenta are 5.4 MB, past L2 (2 MB a core here), so each step brings them
  // from L3 at least. After each timed probe, a buffer of that many bytes is
  // passed over twice (x *= -1, split across threads as kiln's elementwise
  // ops and optimizers split): the first brings it from wherever the probe's
  // 48 MB of matrices left it, the second, timed, reads and writes each byte
  // once from L3. That is the least the update can cost in that spell, its
  // gradients aside: momentum SGD's own pass, which reads them too, took
  // 311 us a step at 1 thread (--profile table) against 292 for this pass.
  // bench/floor_bench.py adds it to the floor as the table's limit.
  kiln::Tensor state;
  std::vector<double> state_ms;
  probe.after = [&] {
    if (!state.defined()) {
      const int64_t bytes = w->optimizer_state_bytes();
      if (bytes == 0) return;
      state = kiln::ones({bytes / 4});
    }
    state.mul_(-1.0);  // brings it in from wherever the probe left it
    const auto t0 = Clock::now();
    state.mul_(-1.0);
    state_ms.push_back(ms_since(t0));
  };
  const int block = run_paired(a, step, probe);
  std::vector<double> gflops;
  const double n = static_cast<double>(a.size);
  for (double ms : probe.ms) gflops.push_back(2.0 * n * n * n / (ms * 1e6));
  std::printf(
      "{\"framework\": \"kiln\", \"workload\": \"%s\", \"amp\": \"%s\", \"threads\": %d, \"warmup\": %d, "
      "\"steps\": %d, \"ab\": \"floor\", \"block\": %d, %s\"product_flops_per_step\": %s, \"probe_size\": %lld, "
      "\"probe_gflops\": [%s], \"optimizer_state_bytes\": %lld, \"state_pass_ms\": [%s], \"maxrss_kib\": %ld}\n",
      name.c_str(), a.amp.c_str(), kiln::get_num_threads(), a.warmup, a.steps, block, side_json("step", step).c_str(),
      num(step.product_flops).c_str(), static_cast<long long>(a.size), list(gflops).c_str(),
      static_cast<long long>(w->optimizer_state_bytes()), list(state_ms).c_str(), maxrss_kib());
  std::fflush(stdout);
}

void run_workload(const std::string& name, const Args& a) {
  if (a.floor_ab) return run_floor_ab(name, a);
  if (a.compile_ab) return run_compile_ab(name, a);
  if (a.amp == "ab") return run_amp_ab(name, a);
  auto w = kiln_bench::make_workload(name);
  // --compile on: the first step captures (its time is compile_ms), the rest replay.
  std::optional<kiln::CompiledFunction> compiled;
  std::function<kiln::Tensor()> fn = w->step_fn();
  if (a.split)
    fn = [f = std::move(fn)] {
      kiln::Tensor loss = f();
      (void)loss.item<float>();  // a training loop's logging: the graph break
      return loss;
    };
  if (a.compile)
    compiled.emplace(kiln::compile(std::move(fn), {.name = name, .modules = {w->module()}, .rewrite = a.rewrite}));
  auto step = [&](bool want_loss) {
    if (!compiled) return w->step(want_loss);
    const kiln::Tensor out = (*compiled)()[0];
    return want_loss ? w->loss_of(out) : std::numeric_limits<double>::quiet_NaN();
  };
  const auto tc = Clock::now();
  const double loss_first = step(true);
  const double first_ms = ms_since(tc);
  // The last warm-up steps (up to three) count the products' FLOPs and time.
  const int counted = compiled ? 0 : std::min(3, a.warmup - 1);
  for (int i = 1; i + counted < a.warmup; ++i) step(false);
  double product_flops = 0;
  std::vector<double> product_ms;
  for (int i = 0; i < counted; ++i) {
    const auto [flops, ms] = profiled_products([&] { step(false); });
    product_flops = flops;
    product_ms.push_back(ms);
  }
  std::vector<double> ms;
  ms.reserve(static_cast<size_t>(a.steps));
  std::unique_ptr<kiln::profiler::Profiler> prof;
  if (a.profile) {
    prof = std::make_unique<kiln::profiler::Profiler>();
    prof->start();
  }
  const int64_t regions_before = kiln::parallel_regions(), dnnl_before = kiln::kernels::dnnl_threaded_calls();
  for (int i = 0; i < a.steps; ++i) {
    const auto t0 = Clock::now();
    step(false);
    if (prof) prof->step();
    ms.push_back(ms_since(t0));
  }
  const double regions_per_step = static_cast<double>(kiln::parallel_regions() - regions_before) / a.steps;
  const double dnnl_per_step = static_cast<double>(kiln::kernels::dnnl_threaded_calls() - dnnl_before) / a.steps;
  size_t events = 0;
  if (prof) {
    prof->stop();
    events = prof->num_events();
    if (a.profile_table)
      std::fprintf(stderr, "%s, %d steps:\n%s\n", name.c_str(), a.steps,
                   prof->table("self", a.profile_shapes ? 60 : 25, a.profile_shapes).c_str());
    prof.reset();
  }
  const double loss_last = step(true);
  std::string compile_info;
  if (compiled) {
    const auto& st = compiled->stats();
    compile_info =
        "\"compiled\": true, \"compile_ms\": " + num(first_ms) + ", \"replays\": " + std::to_string(st.replays) +
        ", \"eager_calls\": " + std::to_string(st.eager_calls) +
        ", \"split_calls\": " + std::to_string(st.split_calls) +
        ", \"graph_breaks\": " + std::to_string(st.graph_breaks.size()) +
        ", \"kernels\": " + std::to_string(st.kernels) + ", \"fused_kernels\": " + std::to_string(st.fused_kernels) +
        ", \"rewrites\": " + std::to_string(st.rewrites) +
        ", \"unwritten_bytes\": " + std::to_string(st.unwritten_bytes) + ", ";
    if (!st.graph_breaks.empty() || !st.replay_ms.empty()) std::fprintf(stderr, "%s", compiled->explain().c_str());
  }
  std::ostringstream steps;
  for (size_t i = 0; i < ms.size(); ++i) steps << (i ? ", " : "") << num(ms[i]);
  std::printf(
      "{\"framework\": \"kiln\", \"workload\": \"%s\", \"amp\": \"%s\", \"threads\": %d, \"warmup\": %d, \"steps\": "
      "%d, "
      "\"median_ms\": %s, \"loss_first\": %s, \"loss_last\": %s, \"params\": %lld, \"flops_per_step\": %s, "
      "\"product_flops_per_step\": %s, \"product_ms_per_step\": %s, \"parallel_regions_per_step\": %s, "
      "\"dnnl_threaded_calls_per_step\": %s, "
      "\"maxrss_kib\": %ld, \"profile\": %s, \"profile_events\": %zu, %s\"step_ms\": "
      "[%s]}\n",
      name.c_str(), a.amp.c_str(), kiln::get_num_threads(), a.warmup, a.steps, num(median(ms)).c_str(),
      num(loss_first).c_str(), num(loss_last).c_str(), static_cast<long long>(w->num_parameters()),
      num(w->flops_per_step()).c_str(), num(product_flops).c_str(),
      num(product_ms.empty() ? 0.0 : median(product_ms)).c_str(), num(regions_per_step).c_str(),
      num(dnnl_per_step).c_str(), maxrss_kib(), a.profile ? "true" : "false", events, compile_info.c_str(),
      steps.str().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.threads > 0) kiln::set_num_threads(a.threads);
  if (a.amp == "bf16") kiln_bench::set_autocast(kiln::kBFloat16);
  try {
    for (const auto& name : a.workloads) {
      if (name == "peak")
        run_peak(a);
      else
        run_workload(name, a);
    }
  } catch (const kiln::Error& e) {
    std::cerr << "kiln_bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
