"""The "under load" rows of scripts/bench.sh: a workload at the full thread
count next to busy processes, for kiln and PyTorch, against the same workload
on the idle machine in the same run.

A training step is hundreds of short parallel loops. When another process wants
the cores, OpenMP threads that spin while they wait (libgomp spins ~3 ms by
default) burn the time slices their partners need, and each barrier waits for a
descheduled thread. kiln bounds that spin (Note [OpenMP waiting under load] in
src/core/threads.cpp); the row "kiln, runtime default spin" runs kiln with
KILN_OMP_DEFAULTS=0 to show what the bound buys.

The yardstick: with C cores, T threads of ours and K single-threaded busy
processes, a fair scheduler gives our threads T*C/(T+K) cores instead of
min(T, C), so a slowdown proportional to the cores lost is
min(T, C) / (T*C/(T+K)): 2.0 for 2 threads next to 2 busy processes on 2 cores.
"""
import os
import signal
import statistics
import subprocess
import sys

BUSY = "import signal,sys\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nwhile True: pass\n"
WORKLOAD = "mlp"
COMPETITORS = 2


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Busy:
    """K single-threaded busy processes for the duration of a with-block."""

    def __init__(self, k):
        self.k, self.procs = k, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.k)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return False


def proportional_bound(cores, threads, k):
    fair = threads * cores / (threads + k) if threads + k > cores else min(threads, cores)
    return min(threads, cores) / fair


def measure(run_process, command, env_for, kiln_bin, threads, steps, pairs, torch_config):
    """Median ms per step for each (side, idle|loaded), alternating sides; returns the row dict."""
    sides = [("kiln", "kiln", None, {}),
             ("kiln_runtime_spin", "kiln", None, {"KILN_OMP_DEFAULTS": "0"}),
             ("torch", "torch", torch_config, {})]
    times = {(name, mode): [] for name, *_ in sides for mode in ("idle", "loaded")}
    for r in range(pairs):
        for mode in ("idle", "loaded"):
            for name, fw, cfg, extra in sides:
                env = env_for(fw, cfg, threads)
                env.update(extra)
                if mode == "loaded":
                    with Busy(COMPETITORS):
                        recs, _ = run_process(command(fw, kiln_bin, [WORKLOAD], threads, 3, steps), env)
                else:
                    recs, _ = run_process(command(fw, kiln_bin, [WORKLOAD], threads, 3, steps), env)
                # The mean, not the median: under load the steps that lost the core are the point,
                # and a median of short steps hides them (a step shorter than a time slice
                # often runs whole).
                mean = statistics.fmean(recs[0]["step_ms"])
                times[(name, mode)].append(mean)
                log("[under load] %s %s round %d/%d: %.3f ms/step (mean)" % (name, mode, r + 1, pairs, mean))
    cores = os.cpu_count() or 1
    row = {"workload": WORKLOAD, "threads": threads, "competitors": COMPETITORS, "cores": cores,
           "proportional_slowdown": proportional_bound(cores, threads, COMPETITORS), "torch_config": torch_config}
    for name, *_ in sides:
        idle = statistics.median(times[(name, "idle")])
        loaded = statistics.median(times[(name, "loaded")])
        row[name] = {"idle_ms": idle, "loaded_ms": loaded, "slowdown": loaded / idle,
                     "rounds_idle_ms": times[(name, "idle")], "rounds_loaded_ms": times[(name, "loaded")]}
    return row


def markdown(row, fmt_time, config_label):
    out = ["", "Under load: %s at %d threads on %d cores, idle and next to %d busy single-threaded processes "
           "(mean ms per step, median over rounds). A slowdown proportional to the cores lost is %.2f×." %
           (row["workload"], row["threads"], row["cores"], row["competitors"], row["proportional_slowdown"]), "",
           "| side | idle | under load | slowdown | proportional |", "|---|---|---|---|---|"]
    labels = [("kiln", "kiln"), ("kiln_runtime_spin", "kiln, runtime default spin (KILN_OMP_DEFAULTS=0)"),
              ("torch", "PyTorch (%s)" % config_label[row["torch_config"]])]
    for key, label in labels:
        s = row[key]
        out.append("| %s | %s | %s | %.2f× | %.2f× |" % (label, fmt_time(s["idle_ms"]), fmt_time(s["loaded_ms"]),
                                                       s["slowdown"], row["proportional_slowdown"]))
    return "\n".join(out) + "\n"
