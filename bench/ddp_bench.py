"""DDP weak scaling on the gpt workload (issue 26 §2): the DDP table of
scripts/bench.sh (bench/compare.py; --no-ddp skips it), or on its own:

    /usr/bin/python3 bench/ddp_bench.py --bin build/release/bench/kiln_bench_ddp [--rounds 3] [--steps 20]
                                        [--cap MB ...]

Configurations, each rank one thread and the same per-rank batch, run
alternately for --rounds rounds so that drift in the machine's load hits all
alike (a shared machine: the load average is recorded beside every run):
  1x1          1 rank (the reference: no communication)
  2x1          2 ranks, the default buckets (25 MiB cap, 1 MiB first and last
               buckets, rebuilt)
  2x1 torch    2 ranks, PyTorch's layout: as 2x1 without a last-bucket cap
               (--last-bucket-mb 0), so the last bucket holds all that is left
  2x1 cap2     2 ranks, a 2 MiB bucket cap
  2x1 capMB    2 ranks, an MB MiB bucket cap, one row for each --cap MB
  2x1 mpi      2 ranks, the default buckets, all-reduced by Open MPI
               (KILN_DIST_SHM=0) instead of kiln's shared-memory all-reduce
  2x1 bf16     2 ranks, the default buckets sent as bfloat16 (DDP's
               bf16_compress hook, --comm-hook bf16_compress)
  1x1 twice    two independent 1-rank processes started together, no
               communication at all: the machine's own bound on weak scaling
               (two single-threaded trainings on its 2 cores share caches,
               memory bandwidth and clock; DDP cannot beat it)
Figures: weak-scaling efficiency = step(1 rank) / step(2 ranks) (1.0: a second
rank doing a second batch costs nothing); for "1x1 twice" the same ratio with
the slower of the two processes, the bound; "of bound" = a config's
efficiency over that bound (1.0: DDP costs nothing beyond sharing the
machine); exposed / allreduce = the tail of communication after the last
gradient over the same allreduces run alone (0: all hidden behind backward).
Medians of each round's medians. Never judged.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CONFIGS = [  # name, ranks, arguments, environment
    ("1x1", 1, [], {}),
    ("2x1", 2, [], {}),
    ("2x1 torch", 2, ["--last-bucket-mb", "0"], {}),
    ("2x1 cap2", 2, ["--bucket-mb", "2"], {}),
    ("2x1 mpi", 2, [], {"KILN_DIST_SHM": "0"}),
    ("2x1 bf16", 2, ["--comm-hook", "bf16_compress"], {}),  # DDP's bf16 compression hook (docs/ddp.md)
    ("1x1 twice", 0, [], {}),  # ranks 0: two 1-rank processes side by side
]
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:"
                      "glibc.malloc.trim_threshold=4294967296",
    "OMP_NUM_THREADS": "1",
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def unavailable(ddp_bin):
    if not ddp_bin or not os.path.exists(ddp_bin):
        return "no kiln_bench_ddp (build the target kiln_bench_ddp)"
    if not shutil.which("mpirun"):
        return "no mpirun on PATH"
    return None


def parse(cmd, p):
    if p.returncode != 0:
        # Both streams: Open MPI reports some launch failures on stdout, and an
        # empty stderr alone says nothing (CI once showed just "failed (1):").
        raise RuntimeError("%s failed (%d):\nstderr: %s\nstdout: %s" % (
            " ".join(cmd), p.returncode, p.stderr[-2000:].strip() or "(empty)", p.stdout[-2000:].strip() or "(empty)"))
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def launch_command(ddp_bin, ranks, extra, steps, warmup, env):
    """The mpirun line of one job (ranks 0: one of the two 1-rank jobs of "1x1 twice")."""
    cmd = [ddp_bin, "--steps", str(steps), "--warmup", str(warmup)] + extra
    forward = ["-x", "OMP_NUM_THREADS", "-x", "GLIBC_TUNABLES"] + (
        ["-x", "KILN_DIST_PROGRESS"] if "KILN_DIST_PROGRESS" in env else []) + (
        ["-x", "KILN_DIST_SHM"] if "KILN_DIST_SHM" in env else [])
    if ranks <= 1:
        # One rank goes through mpirun like the others rather than as an MPI
        # singleton (whose MPI_Init forks its own daemon, a path nothing else
        # here takes), unbound as a plain process would be.
        return ["mpirun", "-np", "1", "--bind-to", "none"] + forward + cmd
    return ["mpirun", "-np", str(ranks)] + forward + cmd


def run_one(ddp_bin, ranks, extra, steps, warmup, timeout=600, extra_env=None):
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.update(extra_env or {})
    cmd = launch_command(ddp_bin, ranks, extra, steps, warmup, env)
    load_before = os.getloadavg()[0]
    if ranks == 0:
        # Two 1-rank jobs at once; the result is the slower one (a step of
        # weak scaling ends when both replicas have finished theirs). Each job
        # keeps its Open MPI session directory under a tree of its own: two
        # jobs sharing /tmp/ompi.<host>.<uid> race when the first to finish
        # removes it (open-mpi/ompi#8510).
        with tempfile.TemporaryDirectory() as d0, tempfile.TemporaryDirectory() as d1:
            procs = [subprocess.Popen(cmd, env=dict(env, OMPI_MCA_orte_tmpdir_base=d), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for d in (d0, d1)]
            outs = []
            for q in procs:
                out, err = q.communicate(timeout=timeout)
                outs.append(parse(cmd, subprocess.CompletedProcess(cmd, q.returncode, out, err)))
        r = max(outs, key=lambda x: x["step_ms"])
    else:
        r = parse(cmd, subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout))
    r["load"] = (load_before + os.getloadavg()[0]) / 2
    return r


def with_caps(caps, configs=None):
    """The configurations with a "2x1 capMB" row for each cap not already there, after the 2 MiB one."""
    configs = list(CONFIGS if configs is None else configs)
    at = next(i for i, c in enumerate(configs) if c[0] == "2x1 cap2") + 1
    rows_ = []
    for mb in caps:  # a row per name: results are kept by it
        name = "2x1 cap%g" % mb
        if all(c[0] != name for c in configs + rows_):
            rows_.append((name, 2, ["--bucket-mb", "%g" % mb], {}))
    return configs[:at] + rows_ + configs[at:]


def measure(ddp_bin, rounds, steps, warmup=3, configs=None):
    """{config: [result per round]}."""
    configs = CONFIGS if configs is None else configs
    out = {name: [] for name, _, _, _ in configs}
    for k in range(rounds):
        for name, ranks, extra, extra_env in configs:
            r = run_one(ddp_bin, ranks, extra, steps, warmup, extra_env=extra_env)
            log("ddp_bench: round %d %-9s step %.1f ms  exposed %.2f ms  allreduce %.2f ms  load %.1f" %
                (k + 1, name, r["step_ms"], r["exposed_ms"], r["allreduce_ms"], r["load"]))
            out[name].append(r)
    return out


def rows(results, configs=None):
    """One row per configuration: medians over rounds, and the figures against 1x1."""
    configs = CONFIGS if configs is None else configs
    med = lambda rs, key: statistics.median(r[key] for r in rs) if rs else None
    ref = results.get("1x1") or []
    out = []
    for name, ranks, _, _ in configs:
        rs = results.get(name) or []
        if not rs:
            continue
        # Efficiency per round (adjacent runs), then the median: the load drifts between rounds.
        effs = [a["step_ms"] / b["step_ms"] for a, b in zip(ref, rs)] if ranks != 1 else []
        ratios = [r["exposed_ms"] / r["allreduce_ms"] for r in rs if r["allreduce_ms"] > 0]
        out.append({
            "config": name, "ranks": ranks, "buckets": rs[0]["buckets"], "bucket_cap_mb": rs[0]["bucket_cap_mb"],
            "rebuilt": rs[0]["rebuilt"], "progress": rs[0]["progress"], "rounds": len(rs),
            "step_ms": med(rs, "step_ms"), "backward_ms": med(rs, "backward_ms"),
            "exposed_ms": med(rs, "exposed_ms"), "allreduce_ms": med(rs, "allreduce_ms"),
            "efficiency": statistics.median(effs) if effs else None,
            "efficiencies": effs,
            "exposed_over_allreduce": statistics.median(ratios) if ratios else None,
            "load": [round(r["load"], 1) for r in rs],
            "replicas_identical": all(r["replicas_identical"] for r in rs),
        })
    # Each 2-rank config against the machine's bound, round by round (the same rounds' runs).
    bound = next((r for r in out if r["ranks"] == 0), None)
    for r in out:
        r["of_bound"] = None
        if bound and r["ranks"] > 1 and r["efficiencies"] and bound["efficiencies"]:
            r["of_bound"] = statistics.median(e / b for e, b in zip(r["efficiencies"], bound["efficiencies"]))
    return out


def markdown(table_rows, skipped=None):
    text = "\n### DDP weak scaling (gpt, 1 thread per rank, fixed per-rank batch)\n\n"
    if skipped:
        return text + "Skipped: %s.\n" % skipped
    text += ("| config | buckets | step ms | backward ms | exposed ms | allreduce alone ms | efficiency | "
             "of bound | exposed / allreduce | load averages |\n|---|---|---|---|---|---|---|---|---|---|\n")
    f = lambda v, fmt: "–" if v is None else fmt % v
    for r in table_rows:
        text += "| %s | %s | %.1f | %.1f | %s | %s | %s | %s | %s | %s |\n" % (
            r["config"], "–" if r["ranks"] == 0 else "%d%s" % (r["buckets"], " (rebuilt)" if r["rebuilt"] else ""),
            r["step_ms"], r["backward_ms"], f(r["exposed_ms"] if r["ranks"] > 1 else None, "%.2f"),
            f(r["allreduce_ms"] if r["ranks"] > 1 else None, "%.2f"),
            f(r["efficiency"], "%.3f") + (" (bound)" if r["ranks"] == 0 else ""), f(r.get("of_bound"), "%.3f"),
            f(r["exposed_over_allreduce"], "%.2f"), ", ".join("%.1f" % x for x in r["load"]))
    text += ("\nefficiency = step(1 rank) / step(2 ranks), per round then the median (goal ≥ 0.95); the bound: "
             "two independent 1-rank processes at once, the slower one's step (no communication: what sharing "
             "this machine's cores, caches and memory bandwidth alone costs); of bound = efficiency / bound, "
             "per round; exposed / allreduce: communication after the last gradient over the allreduces alone "
             "(goal ≤ 0.20).\n")
    return text


def self_test():
    """How jobs are launched and how a failed one is reported (scripts/test.sh runs this)."""
    one = launch_command("b", 1, [], 3, 1, {})
    assert one[:6] == ["mpirun", "-np", "1", "--bind-to", "none", "-x"], one
    assert one[-5:] == ["b", "--steps", "3", "--warmup", "1"], one
    two = launch_command("b", 2, ["--bucket-mb", "2"], 3, 1, {"KILN_DIST_SHM": "0"})
    assert two[:3] == ["mpirun", "-np", "2"] and "--bind-to" not in two, two
    assert two[two.index("KILN_DIST_SHM") - 1] == "-x" and two[-2:] == ["--bucket-mb", "2"], two
    assert "KILN_DIST_SHM" not in launch_command("b", 2, [], 3, 1, {}), "forwarded a variable that is not set"
    try:
        parse(["b"], subprocess.CompletedProcess(["b"], 1, "orte: launch failed\n", ""))
        raise AssertionError("a failed run parsed")
    except RuntimeError as e:
        assert "failed (1)" in str(e) and "stderr: (empty)" in str(e) and "orte: launch failed" in str(e), str(e)
    assert parse(["b"], subprocess.CompletedProcess(["b"], 0, 'x\n{"step_ms": 1}\n', ""))["step_ms"] == 1
    names = [c[0] for c in with_caps([4, 0.5])]
    assert names[names.index("2x1 cap2") + 1:names.index("2x1 cap2") + 3] == ["2x1 cap4", "2x1 cap0.5"], names
    assert with_caps([4])[names.index("2x1 cap4")][2] == ["--bucket-mb", "4"]
    assert len(with_caps([])) == len(CONFIGS)
    assert len(with_caps([2, 4, 4])) == len(CONFIGS) + 1, "a cap already in the table, or twice, is one row"
    print("ddp_bench.py: self-test passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-test", action="store_true", help="check the launch lines and failure reports, run nothing")
    ap.add_argument("--bin", default="build/release/bench/kiln_bench_ddp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows and every run here")
    ap.add_argument("--cap", type=float, action="append", default=[], metavar="MB",
                    help="also run 2 ranks with an MB MiB bucket cap (repeatable)")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    why = unavailable(a.bin)
    if why:
        print(markdown([], why), end="")
        return 1
    if any(mb <= 0 for mb in a.cap):
        ap.error("--cap expects a positive number of MiB, got %s" % ", ".join("%g" % mb for mb in a.cap))
    configs = with_caps(a.cap)
    results = measure(os.path.abspath(a.bin), a.rounds, a.steps, a.warmup, configs)
    table = rows(results, configs)
    print(markdown(table), end="")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": table, "runs": results}, f, indent=1)
            f.write("\n")
    return 0 if all(r["replicas_identical"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
