"""kiln against PyTorch, workload by workload, in one run (scripts/bench.sh calls this).

For each thread count and workload it runs kiln_bench and the PyTorch twin
(bench/torch/workloads.py) alternately, kiln then each PyTorch configuration,
for --pairs rounds (A B A B ...), so drift in the machine's load hits both
alike. Medians pool every timed step of every round. Peak RSS is the child's
own (wait4's ru_maxrss), so it includes `import torch` for PyTorch.

PyTorch runs in the three configurations of WORKLOADS.md and the ratio is
against the fastest:
  installed  the environment as given
  tunables   + GLIBC_TUNABLES that spare glibc malloc's fresh-page faults
  avx512     + tunables, and OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE unset for
             that command only (OpenBLAS then picks its AVX-512 kernels)
kiln always runs in the environment as given (OMP_NUM_THREADS set to the
thread count, nothing else). The f32 matmul peak (kiln_bench --workload peak,
oneDNN sgemm) is measured per thread count before and after the workloads and
before every gpt round; the highest figure is the machine's ceiling for the gpt
row (a busy machine can only lower a sample, never raise it).

The profiler overhead rows (bench/profiler_overhead.py: tiny and gpt with the
profiler off and recording, alternately) follow the training table;
--no-profiler-overhead skips them.

The bf16 rows (bench/bf16_bench.py: cnn, resnet and gpt as kiln float32, kiln
bf16 autocast and PyTorch's bf16 autocast, alternately) follow; --no-bf16 skips
them.

The DDP rows (bench/ddp_bench.py: gpt weak scaling, 1 rank against 2 ranks
with the default and a 2 MiB bucket cap, exposed communication) follow;
--no-ddp skips them.

The inference rows (bench/infer_bench.py: kiln optimised vs kiln eager vs ONNX
Runtime on cnn, resnet and gpt_infer) follow the training rows in their own
table and under "infer_rows" in the JSON; --no-infer skips them, --infer-only
runs only them.

Both sides start from the same synthetic weights and batch (workloads.h), so
their first-step losses must agree: a disagreement beyond 1e-3 relative means
the two sides compute different models, and the run exits 1 (times are never
judged).
"""
import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile

import bf16_bench
import compiled_bench
import floor_bench
import ddp_bench
import infer_bench
import profiler_overhead
import under_load

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TWIN = os.path.join(HERE, "torch", "workloads.py")
WORKLOADS = ["tiny", "mlp", "cnn", "resnet", "gpt", "gpt_infer"]
# Timed steps per process (after 10 warm-up steps); at least 50, more where a step is short.
STEPS = {"tiny": 500, "mlp": 100, "cnn": 60, "resnet": 60, "gpt": 50, "gpt_infer": 100}
QUICK_STEPS = 3  # per workload, all in one process per framework
TARGETS = {"tiny": 0.2, "mlp": 0.7, "cnn": 0.6, "resnet": 0.6, "gpt": 0.55, "gpt_infer": 0.5}
GPT_PEAK_TARGET = 0.65


def _mlp_matmul_flops(batch, sizes):
    # forward and weight gradients of every layer; input gradients of all but the first
    # (the batch needs none)
    pairs = list(zip(sizes[:-1], sizes[1:]))
    fwd = sum(2 * batch * i * o for i, o in pairs)
    return 2 * fwd + sum(2 * batch * i * o for i, o in pairs[1:])


def _gpt_forward_matmul_flops(tokens, seq, layers=4, d=256, d_ff=1024, vocab=256):
    # per layer: qkv, attention projection, the MLP's two linears; then the LM head; attention
    # QK^T and AV over the full T x T (as credited; a causal kernel skips about half)
    linears = 2 * tokens * (d * 3 * d + d * d + 2 * d * d_ff)
    attention = 2 * 2 * tokens * seq * d
    return layers * (linears + attention) + 2 * tokens * d * vocab


# Multiply-add FLOPs of the matmuls one step does: the float32 floor is these at the
# run's measured matmul peak. A target below its floor cannot be met in float32.
MATMUL_FLOPS = {
    "mlp": _mlp_matmul_flops(128, [784, 512, 512, 10]),
    "gpt": 3 * _gpt_forward_matmul_flops(16 * 128, 128),
    "gpt_infer": _gpt_forward_matmul_flops(128, 128),
}
# Workloads whose floor counts the products kiln's profiler saw on a warm-up step (kiln_bench's
# product_flops_per_step): their convolutions have no analytic count here.
PROFILED_FLOPS = ("cnn", "resnet")
TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:"
            "glibc.malloc.trim_threshold=4294967296")
TORCH_CONFIGS = ["installed", "tunables", "avx512"]
CONFIG_LABEL = {"installed": "as installed", "tunables": "+tunables", "avx512": "+tunables, AVX-512 BLAS"}
LOSS_RTOL = 1e-3


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def env_for(framework, config, threads):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if framework == "torch":
        env["OPENBLAS_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
        if config in ("tunables", "avx512"):
            env["GLIBC_TUNABLES"] = TUNABLES
        if config == "avx512":
            env.pop("OPENBLAS_CORETYPE", None)
            env.pop("OPENBLAS_L2_SIZE", None)
    return env


def interrupt(signum, frame):
    raise KeyboardInterrupt


# Note [One CPU for one-thread runs]
# On this 2-vCPU machine the same one-thread step ran 5-10 % slower on cpu0
# than on cpu1 in 12 of 12 pinned pairs (cnn 10.9-11.3 against 10.0-10.7 ms,
# mlp 2.57-2.68 against 2.41-2.43; cpu0 takes more of the machine's
# interrupts), and an unpinned process stays where it lands: one source of
# the per-process "slow state" (docs/compile.md). So every one-thread process
# of the harness, kiln's and PyTorch's alike, runs pinned to one CPU
# (--pin-cpu, by default the last the harness may use; -1 pins nothing).
# Runs of two threads or more keep every CPU.
PIN = {"cpu": None}


def run_process(cmd, env):
    """Runs cmd, returns (JSON records it printed, peak RSS in KiB from wait4)."""
    cpu = PIN["cpu"] if env.get("OMP_NUM_THREADS") == "1" else None
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, preexec_fn=pin)
        try:
            out = p.stdout.read()
            p.stdout.close()
            _, status, ru = os.wait4(p.pid, 0)
        except BaseException:
            p.kill()  # interrupted: the child must not outlive the run
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            raise SystemExit("compare.py: %s exited %d\n%s" % (" ".join(cmd), p.returncode, tail))
    records = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return records, ru.ru_maxrss


def command(framework, kiln_bin, workloads, threads, warmup, steps):
    args = ["--workload", ",".join(workloads), "--threads", str(threads), "--warmup", str(warmup),
            "--steps", str(steps)]
    if framework == "kiln":
        return [kiln_bin] + args
    return ["/usr/bin/python3", TWIN] + args


class Cell:
    """Every timed step of one (framework/config, workload, threads) over all rounds."""

    def __init__(self):
        self.steps, self.round_medians, self.rss_kib = [], [], 0
        self.loss_first = self.loss_last = None
        self.params = 0
        self.flops = 0.0
        self.product_flops = 0.0
        self.regions = self.dnnl_calls = None

    def add(self, rec, rss_kib):
        self.steps += rec["step_ms"]
        self.round_medians.append(rec["median_ms"])
        self.rss_kib = max(self.rss_kib, rss_kib)
        if self.loss_first is None:
            self.loss_first = rec["loss_first"]
        self.loss_last = rec["loss_last"]
        self.params = rec["params"]
        self.flops = rec["flops_per_step"] or 0.0
        self.product_flops = rec.get("product_flops_per_step") or self.product_flops
        if rec.get("parallel_regions_per_step") is not None:
            self.regions = rec["parallel_regions_per_step"]
            self.dnnl_calls = rec.get("dnnl_threaded_calls_per_step")

    def median(self):
        return statistics.median(self.steps)

    def summary(self):
        q = statistics.quantiles(self.steps, n=4) if len(self.steps) > 1 else [self.steps[0]] * 3
        return {"median_ms": self.median(), "p25_ms": q[0], "p75_ms": q[2], "timed_steps": len(self.steps),
                "round_medians_ms": self.round_medians, "peak_rss_mib": self.rss_kib / 1024.0,
                "loss_first": self.loss_first, "loss_last": self.loss_last, "params": self.params}


def measure(a, kiln_bin, results, on_progress):
    """Fills results = {threads: {"peak": [GFLOP/s...], "cells": {workload: {config: Cell}}}}; a
    workload's cells appear once all its rounds are done, and on_progress() runs after each."""
    warmup = 1 if a.quick else 10
    for t in a.threads:
        res = {"peak": [], "cells": {}, "fork_join_us": [], "core_round_trip_ns": []}
        results[t] = res

        def peak(when):
            recs, _ = run_process([kiln_bin, "--workload", "peak", "--threads", str(t), "--steps",
                                   "3" if a.quick else "10", "--size", "1024" if a.quick else "2048"],
                                  env_for("kiln", None, t))
            res["peak"].append(recs[0]["gflops_best"])
            if t > 1:  # Note [Parallel regions] in bench/workloads/main.cpp
                if recs[0].get("fork_join_us"):
                    res["fork_join_us"].append(recs[0]["fork_join_us"])
                if recs[0].get("core_round_trip_ns"):
                    res["core_round_trip_ns"].append(recs[0]["core_round_trip_ns"])
            log("[threads %d] f32 matmul peak (%s): %.1f GFLOP/s" % (t, when, recs[0]["gflops_best"]))

        peak("before")
        if a.quick:
            # One process per framework/config runs every workload: a smoke test of the whole
            # pipeline in seconds (peak RSS is then that process's, over all workloads).
            for fw, cfg in [("kiln", None)] + [("torch", c) for c in a.torch_configs]:
                recs, rss = run_process(command(fw, kiln_bin, a.workloads, t, warmup, QUICK_STEPS),
                                        env_for(fw, cfg, t))
                for rec in recs:
                    res["cells"].setdefault(rec["workload"], {}).setdefault(cfg or "kiln", Cell()).add(rec, rss)
                log("[threads %d] %s done" % (t, cfg or "kiln"))
        else:
            for w in a.workloads:
                cells = {}
                for r in range(a.pairs):
                    if w == "gpt":
                        peak("gpt round %d" % (r + 1))  # the ceiling sampled next to what it judges
                    for fw, cfg in [("kiln", None)] + [("torch", c) for c in a.torch_configs]:
                        recs, rss = run_process(command(fw, kiln_bin, [w], t, warmup, STEPS[w]),
                                                env_for(fw, cfg, t))
                        cells.setdefault(cfg or "kiln", Cell()).add(recs[0], rss)
                        log("[threads %d] %-9s round %d/%d  %-9s %9.3f ms/step" %
                            (t, w, r + 1, a.pairs, cfg or "kiln", recs[0]["median_ms"]))
                res["cells"][w] = cells
                on_progress()
        peak("after")
        on_progress()


def fmt_time(ms):
    return "%.1f µs" % (ms * 1e3) if ms < 1 else "%.2f ms" % ms


def machine():
    model, family, number = "unknown CPU", "?", "?"
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and model == "unknown CPU":
                model = value
            elif key == "cpu family" and family == "?":
                family = value
            elif key == "model" and number == "?":
                number = value
        model = "%s (family %s, model %s)" % (model, family, number)
        mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    flags = open("/proc/cpuinfo").read()
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if (" %s " % x) in flags]
    torch_version = subprocess.run(["/usr/bin/python3", "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "memory_gib": round(mem / 2**20, 1),
            "kernel": platform.release(), "torch": torch_version, "kiln_commit": commit,
            "loadavg_start": os.getloadavg()}


def build_report(a, results, info):
    rows, mismatches = [], []
    for t in a.threads:
        res = results.get(t)
        if not res or not res["peak"]:
            continue
        peak = max(res["peak"])
        for w in a.workloads:
            if w not in res["cells"]:
                continue
            cells = res["cells"][w]
            kiln = cells["kiln"]
            torch = {c: cells[c] for c in a.torch_configs}
            best = min(torch, key=lambda c: torch[c].median())
            ratio = kiln.median() / torch[best].median()
            row = {"workload": w, "threads": t, "kiln": kiln.summary(),
                   "torch": {c: torch[c].summary() for c in torch}, "torch_best": best, "ratio": ratio,
                   "target_ratio": TARGETS[w], "f32_matmul_peak_gflops": peak}
            if kiln.flops:
                row["flops_per_step"] = kiln.flops
                row["kiln_gflops"] = kiln.flops / kiln.median() / 1e6
                row["torch_gflops"] = kiln.flops / torch[best].median() / 1e6
                row["kiln_fraction_of_peak"] = row["kiln_gflops"] / peak
                row["torch_fraction_of_peak"] = row["torch_gflops"] / peak
            # The convolutional workloads' products as kiln's profiler counts them on a warm-up
            # step (convolutions and matmuls, forward and backward); the others' analytically.
            product_flops = MATMUL_FLOPS.get(w) or (kiln.product_flops if w in PROFILED_FLOPS else 0)
            if product_flops:
                row["matmul_flops_per_step"] = product_flops
                row["f32_floor_ms"] = product_flops / peak / 1e6
                row["target_ms"] = TARGETS[w] * torch[best].median()
                if t > 1 and res.get("fork_join_us") and kiln.regions is not None:
                    # What forking alone costs the step: kiln's own regions at least, every
                    # threaded oneDNN call at most (oneDNN runs small problems on one thread).
                    fj = min(res["fork_join_us"])
                    row["fork_join_us"] = fj
                    row["parallel_regions_per_step"] = kiln.regions
                    row["dnnl_threaded_calls_per_step"] = kiln.dnnl_calls or 0
                    row["forks_ms"] = [kiln.regions * fj / 1e3, (kiln.regions + (kiln.dnnl_calls or 0)) * fj / 1e3]
            lk, lt = kiln.loss_first, torch[best].loss_first
            row["loss_first_agree"] = abs(lk - lt) <= LOSS_RTOL * max(abs(lt), 1e-6)
            if not row["loss_first_agree"]:
                mismatches.append("%s (threads %d): kiln %.6g, torch %.6g" % (w, t, lk, lt))
            rows.append(row)
    info["loadavg_end"] = os.getloadavg()
    return rows, mismatches


def markdown(a, rows, results, info):
    out = []
    mode = ("QUICK (smoke test: 1 warm-up step, %d timed steps, one process per framework for all "
            "workloads, one round; not a measurement)" % QUICK_STEPS
            if a.quick else
            "full: %d rounds of kiln then PyTorch per workload, 10 warm-up steps, timed steps per process %s"
            % (a.pairs, ", ".join("%s %d" % (w, STEPS[w]) for w in a.workloads)))
    out.append("## kiln vs PyTorch — %s" % info["date"])
    out.append("")
    out.append("Machine: %s, %d cores (%s), %.1f GiB, Linux %s; PyTorch %s; kiln %s; load average %.2f at start, "
               "%.2f at end." % (info["cpu"], info["cores"], " ".join(info["isa"]), info["memory_gib"],
                                 info["kernel"], info["torch"], info["kiln_commit"], info["loadavg_start"][0],
                                 info["loadavg_end"][0]))
    out.append("Mode: %s." % mode)
    if PIN["cpu"] is not None:
        out.append("One-thread processes, kiln's and PyTorch's, ran pinned to cpu%d (Note [One CPU for one-thread "
                   "runs] in bench/compare.py)." % PIN["cpu"])
    if a.note:
        out.append("Note: %s" % a.note)
    done = {(r["workload"], r["threads"]) for r in rows}
    missing = ["%s/%d" % (w, t) for t in a.threads for w in a.workloads if (w, t) not in done]
    if missing:
        out.append("PARTIAL: the run %s before these workload/threads finished: %s." %
                   ("was interrupted" if info.get("interrupted") else "is still going", ", ".join(missing)))
    out.append("")
    out.append("Medians per step; ratio = kiln / fastest PyTorch configuration (lower is better); "
               "RSS = peak resident set of the process (PyTorch's includes ~230 MiB of `import torch`)%s." %
               ("; quick mode ran every workload in one process, so RSS is that process's peak over all of them"
                if a.quick else ""))
    out.append("")
    out.append("| workload | threads | kiln | PyTorch (best) | best config | ratio | target | kiln RSS MiB | "
               "PyTorch RSS MiB | first loss kiln / PyTorch |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["torch"][r["torch_best"]]
        out.append("| %s | %d | %s | %s | %s | %.2f | ≤ %.2f | %.0f | %.0f | %.5f / %.5f%s |" % (
            r["workload"], r["threads"], fmt_time(r["kiln"]["median_ms"]), fmt_time(best["median_ms"]),
            CONFIG_LABEL[r["torch_best"]], r["ratio"], r["target_ratio"], r["kiln"]["peak_rss_mib"],
            best["peak_rss_mib"], r["kiln"]["loss_first"], best["loss_first"],
            "" if r["loss_first_agree"] else " **MISMATCH**"))
    out.append("")
    out.append("PyTorch per configuration (median per step):")
    out.append("")
    out.append("| workload | threads | " + " | ".join(CONFIG_LABEL[c] for c in a.torch_configs) + " |")
    out.append("|---|---|" + "---|" * len(a.torch_configs))
    for r in rows:
        out.append("| %s | %d | %s |" % (r["workload"], r["threads"],
                                         " | ".join(fmt_time(r["torch"][c]["median_ms"]) for c in a.torch_configs)))
    gpt = [r for r in rows if "kiln_gflops" in r]
    if gpt:
        out.append("")
        out.append("gpt model FLOPs: %.2f GFLOP per step (6 × %d parameters × %d tokens + attention "
                   "12 × 4 layers × 128² × 256 × 16 sequences); peak = kiln's f32 matmul probe in this run "
                   "(target: kiln ≥ %d%% of peak)." % (gpt[0]["flops_per_step"] / 1e9, gpt[0]["kiln"]["params"],
                                                       16 * 128, GPT_PEAK_TARGET * 100))
        out.append("")
        out.append("| threads | f32 matmul peak GFLOP/s | kiln GFLOP/s | kiln % of peak | PyTorch GFLOP/s | "
                   "PyTorch % of peak |")
        out.append("|---|---|---|---|---|---|")
        for r in gpt:
            out.append("| %d | %.1f | %.1f | %.0f%% | %.1f | %.0f%% |" % (
                r["threads"], r["f32_matmul_peak_gflops"], r["kiln_gflops"], 100 * r["kiln_fraction_of_peak"],
                r["torch_gflops"], 100 * r["torch_fraction_of_peak"]))
    floor = [r for r in rows if "f32_floor_ms" in r]
    if floor:
        out.append("")
        out.append("float32 floor: the time the product FLOPs of a step (matmuls; for cnn and resnet also the "
                   "convolutions, as kiln's profiler counts them on a warm-up step) take at this run's measured "
                   "f32 matmul peak (a float32 step cannot be much faster); target time = target ratio × "
                   "PyTorch's best.")
        out.append("")
        out.append("| workload | threads | product GFLOP / step | f32 floor | target time | kiln | kiln / floor |")
        out.append("|---|---|---|---|---|---|---|")
        for r in floor:
            out.append("| %s | %d | %.3f | %s | %s%s | %s | %.2f |" % (
                r["workload"], r["threads"], r["matmul_flops_per_step"] / 1e9, fmt_time(r["f32_floor_ms"]),
                fmt_time(r["target_ms"]), " (below the floor)" if r["target_ms"] < r["f32_floor_ms"] else "",
                fmt_time(r["kiln"]["median_ms"]), r["kiln"]["median_ms"] / r["f32_floor_ms"]))
        forks = [r for r in floor if "forks_ms" in r]
        if forks:
            trips = [x for t in a.threads if t in results for x in results[t].get("core_round_trip_ns", [])]
            out.append("")
            out.append("Parallel regions at %s threads (Note [Parallel regions]): an empty region (fork + join) "
                       "took %.2f µs in this run%s. Each of kiln's multi-threaded loops pays it, and each oneDNN "
                       "call that splits its work; floor + forks = the floor plus that price for kiln's regions "
                       "alone, and for those and every threaded oneDNN call (oneDNN runs small problems on one "
                       "thread, so the truth lies between)." % (
                           "/".join(str(t) for t in sorted({r["threads"] for r in forks})),
                           min(r["fork_join_us"] for r in forks),
                           (", and a cache line's round trip between two cores %.0f ns" % min(trips)) if trips else ""))
            out.append("")
            out.append("| workload | threads | kiln regions / step | threaded oneDNN calls / step | forks | "
                       "floor + forks | kiln / (floor + forks) |")
            out.append("|---|---|---|---|---|---|---|")
            for r in forks:
                lo, hi = r["forks_ms"]
                out.append("| %s | %d | %.0f | %.0f | %s–%s | %s–%s | %.2f–%.2f |" % (
                    r["workload"], r["threads"], r["parallel_regions_per_step"], r["dnnl_threaded_calls_per_step"],
                    fmt_time(lo), fmt_time(hi), fmt_time(r["f32_floor_ms"] + lo), fmt_time(r["f32_floor_ms"] + hi),
                    r["kiln"]["median_ms"] / (r["f32_floor_ms"] + hi), r["kiln"]["median_ms"] / (r["f32_floor_ms"] + lo)))
    if not gpt:
        out.append("")
        out.append("f32 matmul peak (kiln sgemm probe): " + ", ".join(
            "%.1f GFLOP/s at %d thread(s)" % (max(results[t]["peak"]), t) for t in a.threads
            if t in results and results[t]["peak"]))
    text = "\n".join(out) + "\n"
    if "under_load" in info:
        text += under_load.markdown(info["under_load"], fmt_time, CONFIG_LABEL)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln", required=True, help="path to kiln_bench")
    ap.add_argument("--kiln-infer", default=None,
                    help="path to kiln_bench_infer (default: beside kiln_bench); the inference rows")
    ap.add_argument("--infer-workloads", default=",".join(infer_bench.WORKLOADS))
    ap.add_argument("--no-infer", action="store_true", help="skip the inference rows")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP weak-scaling rows (kiln_bench_ddp, mpirun)")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 rows (kiln bf16 vs float32 vs PyTorch bf16)")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled rows (kiln::compile vs kiln eager)")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip the same-phase floor rows (kiln eager vs the matmul probe, alternating)")
    ap.add_argument("--kiln-ddp", default=None,
                    help="path to kiln_bench_ddp (default: beside kiln_bench)")
    ap.add_argument("--infer-only", action="store_true", help="only the inference rows")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="a few steps, one round: proves the harness works")
    ap.add_argument("--pairs", type=int, default=3, help="rounds of kiln then PyTorch (at least 3 unless --quick)")
    ap.add_argument("--torch-configs", default=",".join(TORCH_CONFIGS))
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/latest.json; "
                                                "--quick: bench/results/quick.json)")
    ap.add_argument("--note", default="", help="a line printed under the machine line (e.g. 'busy machine')")
    ap.add_argument("--under-load-only", action="store_true", help="only the under-load rows")
    ap.add_argument("--no-profiler-overhead", action="store_true",
                    help="skip the profiler overhead rows (tiny and gpt, profiler off vs recording)")
    ap.add_argument("--no-under-load", action="store_true",
                    help="skip the under-load rows (mlp at 2+ threads next to busy processes)")
    ap.add_argument("--pin-cpu", type=int, default=max(os.sched_getaffinity(0)),
                    help="the CPU every one-thread process runs on (Note [One CPU for one-thread runs]); -1: none")
    a = ap.parse_args()
    if a.pin_cpu >= 0 and a.pin_cpu not in os.sched_getaffinity(0):
        ap.error("--pin-cpu %d is not among the CPUs this process may use (%s)" % (
            a.pin_cpu, ",".join(map(str, sorted(os.sched_getaffinity(0))))))
    PIN["cpu"] = a.pin_cpu if a.pin_cpu >= 0 else None
    a.workloads = [w for w in a.workloads.split(",") if w]
    unknown = [w for w in a.workloads if w not in WORKLOADS]
    if unknown:
        ap.error("unknown workload(s) %s; expected some of %s" % (", ".join(unknown), ", ".join(WORKLOADS)))
    a.threads = [int(x) for x in (a.threads or ("1" if a.quick else "1,2")).split(",") if x]
    if not a.threads or min(a.threads) < 1:
        ap.error("--threads expects positive integers")
    a.infer_workloads = [w for w in a.infer_workloads.split(",") if w]
    if any(w not in infer_bench.WORKLOADS for w in a.infer_workloads):
        ap.error("--infer-workloads expects some of %s" % ", ".join(infer_bench.WORKLOADS))
    if a.kiln_ddp is None:
        a.kiln_ddp = os.path.join(os.path.dirname(os.path.abspath(a.kiln)), "kiln_bench_ddp")
    if a.kiln_infer is None:
        a.kiln_infer = os.path.join(os.path.dirname(os.path.abspath(a.kiln)), "kiln_bench_infer")
    a.torch_configs = [c for c in a.torch_configs.split(",") if c]
    if not a.torch_configs or any(c not in TORCH_CONFIGS for c in a.torch_configs):
        ap.error("--torch-configs expects some of %s" % ", ".join(TORCH_CONFIGS))
    if a.quick:
        a.pairs = 1
    elif a.pairs < 3:
        ap.error("--pairs must be at least 3 for a measurement (use --quick for a smoke test)")
    out_path = a.out or os.path.join(HERE, "results", "quick.json" if a.quick else
                                     ("infer.json" if a.infer_only else "latest.json"))

    info = machine()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    results = {}
    infer_results = {}
    overhead = {}
    ddp_results = {}
    bf16_results = {}
    compiled_results = {}
    floor_results = {}

    def save(final):
        """Writes the JSON and the table for what has finished (all of it when final)."""
        rows, mismatches = build_report(a, results, info)
        text = markdown(a, rows, results, info) if not a.infer_only else (
            "## kiln inference — %s\n\nMachine: %s, %d cores, Linux %s; kiln %s; load average %.2f at start.\n"
            % (info["date"], info["cpu"], info["cores"], info["kernel"], info["kiln_commit"], info["loadavg_start"][0]))
        overhead_rows = profiler_overhead.rows(overhead)
        if not a.infer_only:
            text += profiler_overhead.markdown(overhead_rows, fmt_time, a.quick)
        bf16_rows, bf16_problems = bf16_bench.rows(bf16_results)
        if not a.infer_only and not a.no_bf16:
            text += bf16_bench.markdown(bf16_rows, fmt_time, a.quick)
        compiled_rows, compiled_problems = compiled_bench.rows(compiled_results)
        if not a.infer_only and not a.no_compiled:
            text += compiled_bench.markdown(compiled_rows, fmt_time, a.quick)
        floor_rows = floor_bench.rows(floor_results, MATMUL_FLOPS)
        if not a.infer_only and not a.no_floor:
            text += floor_bench.markdown(floor_rows, fmt_time, a.quick)
        infer_rows, infer_problems = infer_bench.rows(infer_results)
        if not a.no_infer:
            text += infer_bench.markdown(infer_rows, fmt_time, a.quick, info.get("infer_skipped"))
        ddp_rows = ddp_bench.rows(ddp_results)
        if not a.no_ddp and not a.infer_only:
            text += ddp_bench.markdown(ddp_rows, info.get("ddp_skipped"))
        mismatches = mismatches + infer_problems + bf16_problems + compiled_problems
        if info.get("ddp_failed"):
            mismatches = mismatches + ["kiln_bench_ddp: " + info["ddp_failed"]]
        mismatches = mismatches + ["kiln_bench_ddp %s: replicas differ after training" % r["config"]
                                   for r in ddp_rows if not r["replicas_identical"]]
        with open(out_path, "w") as f:
            json.dump({"machine": info, "quick": a.quick, "pairs": a.pairs, "threads": a.threads, "pin_cpu": PIN["cpu"],
                       "complete": final and not info.get("interrupted"),
                       "torch_configs": {c: CONFIG_LABEL[c] for c in a.torch_configs},
                       "f32_matmul_peak_gflops": {str(t): max(r["peak"]) for t, r in results.items() if r["peak"]},
                       "note": a.note, "rows": rows, "profiler_overhead_rows": overhead_rows,
                       "infer_rows": infer_rows, "ddp_rows": ddp_rows, "bf16_rows": bf16_rows,
                       "compiled_rows": compiled_rows, "floor_rows": floor_rows,
                       "infer_skipped": info.get("infer_skipped")}, f, indent=1)
            f.write("\n")
        with open(os.path.splitext(out_path)[0] + ".md", "w") as f:
            f.write(text)
        return text, mismatches

    # A long run stopped with Ctrl-C or SIGTERM still leaves every finished workload on disk.
    signal.signal(signal.SIGTERM, interrupt)
    try:
        if not a.under_load_only and not a.infer_only:
            measure(a, os.path.abspath(a.kiln), results, lambda: save(False))
        if not a.no_profiler_overhead and not a.under_load_only and not a.infer_only:
            overhead.update(profiler_overhead.measure(run_process, env_for, os.path.abspath(a.kiln), a.workloads,
                                                      a.threads[0], QUICK_STEPS if a.quick else 0, a.pairs, log))
            save(False)
        if not a.no_bf16 and not a.under_load_only and not a.infer_only:
            bf16_results.update(bf16_bench.measure(run_process, env_for, command, os.path.abspath(a.kiln), a.threads,
                                                   a.workloads, a.pairs, QUICK_STEPS if a.quick else 0, log))
            save(False)
        if not a.no_compiled and not a.under_load_only and not a.infer_only:
            compiled_results.update(compiled_bench.measure(run_process, env_for, command, os.path.abspath(a.kiln),
                                                           a.threads, a.workloads, a.pairs,
                                                           QUICK_STEPS if a.quick else 0, log))
            save(False)
        if not a.no_floor and not a.under_load_only and not a.infer_only:
            floor_results.update(floor_bench.measure(run_process, env_for, command, os.path.abspath(a.kiln),
                                                     a.threads, a.workloads, a.pairs,
                                                     QUICK_STEPS if a.quick else 0, log))
            save(False)
        if not a.no_infer and not a.under_load_only:
            why = infer_bench.unavailable(a.kiln_infer)
            if why:
                info["infer_skipped"] = why
                log("compare.py: inference rows skipped: " + why)
            else:
                infer_results.update(infer_bench.measure(run_process, env_for, os.path.abspath(a.kiln_infer),
                                                         a.threads, a.infer_workloads, a.pairs, a.quick))
        if not a.no_ddp and not a.infer_only and not a.under_load_only:
            why = ddp_bench.unavailable(a.kiln_ddp)
            if why:
                info["ddp_skipped"] = why
                log("compare.py: DDP rows skipped: " + why)
            else:
                try:
                    ddp_results.update(ddp_bench.measure(a.kiln_ddp, a.pairs, QUICK_STEPS if a.quick else 20,
                                                         1 if a.quick else 3))
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    # Something broke (not a slow time): say so in the table and fail the run at the end.
                    info["ddp_skipped"] = "a run failed: %s" % str(e).splitlines()[0]
                    info["ddp_failed"] = str(e)
                    log("compare.py: DDP rows: " + str(e))
            save(False)
        if not a.no_under_load and not a.infer_only:
            threads = max(2, max(a.threads))
            cfg = "tunables" if "tunables" in a.torch_configs else a.torch_configs[0]
            info["under_load"] = under_load.measure(
                run_process, command, env_for, os.path.abspath(a.kiln), threads,
                QUICK_STEPS if a.quick else STEPS[under_load.WORKLOAD], 1 if a.quick else a.pairs, cfg)
    except KeyboardInterrupt:
        info["interrupted"] = True
        log("compare.py: interrupted; writing what finished")
    text, mismatches = save(True)
    print(text, end="")
    log("wrote %s and %s" % (out_path, os.path.splitext(out_path)[0] + ".md"))
    if info.get("interrupted"):
        return 130
    if mismatches:
        log("compare.py: first-step losses or inference outputs disagree (the sides compute different models), "
            "or a DDP run failed:\n  " +
            "\n  ".join(mismatches))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
