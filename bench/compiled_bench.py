"""The "compiled" rows of scripts/bench.sh (issue 25): kiln::compile against
kiln's eager step, one run.

For each thread count and training workload (tiny, mlp, cnn, resnet, gpt) and
gpt_infer, it runs --pairs processes of kiln_bench --compile ab: each builds
the workload twice from the same synthetic weights, compiles one copy, and
alternates blocks of steps between the two (Note [Two modes in one
process] in bench/workloads/main.cpp). On this machine a whole process runs
fast or slow, eager and replayed alike, so a ratio of two processes mixes the
machine's states into the modes; within one process both modes share its
state. The ratio is the median of the processes' ratios (compiled median over
eager median); the times pool every timed step. The compiled copy's first step
captures (its time is the compile time, reported).

Each process also probes its own float32 matmul peak, so floor / eager (the
step's product FLOPs at that peak, over the eager step) is a pairing too: no
replay or fusion runs the same products faster, so a goal below it is below
the physical limit.

Goals (the issue's, at 1 thread): tiny at most 0.5x kiln eager; mlp, cnn,
resnet, gpt at least 10% faster (at most 0.9x). Times are never judged. A
replay must compute what the eager step does: the first- and last-step losses
of the two copies must be equal in every process, else the run fails.
"""
import statistics

WORKLOADS = ["tiny", "mlp", "cnn", "resnet", "gpt", "gpt_infer"]
STEPS = {"tiny": 500, "mlp": 100, "cnn": 60, "resnet": 60, "gpt": 30, "gpt_infer": 100}
GOAL = {"tiny": 0.5, "mlp": 0.9, "cnn": 0.9, "resnet": 0.9, "gpt": 0.9}


def measure(run_process, env_for, command, kiln_bin, threads, workloads, pairs, quick_steps, log):
    """{threads: {workload: [kiln_bench --compile ab record of each process]}}."""
    out = {}
    warmup = 1 if quick_steps else 10
    for t in threads:
        for w in [w for w in WORKLOADS if w in workloads]:
            steps = quick_steps or STEPS[w]
            records = out.setdefault(t, {}).setdefault(w, [])
            for r in range(pairs):
                cmd = command("kiln", kiln_bin, [w], t, warmup, steps) + ["--compile", "ab"]
                recs, _ = run_process(cmd, env_for("kiln", "tunables", t))
                rec = recs[0]
                records.append(rec)
                if rec.get("graph_breaks"):
                    log("[compiled] %s: %d graph breaks (the step ran split)" % (w, rec["graph_breaks"]))
                log("[compiled] threads %d %-9s process %d/%d  eager %.3f ms  compiled %.3f ms  ratio %.3f" % (
                    t, w, r + 1, pairs, rec["eager_median_ms"], rec["compiled_median_ms"],
                    rec["compiled_median_ms"] / rec["eager_median_ms"]))
    return out


def floor_ms(rec):
    """The step's product FLOPs at the process's own float32 peak (None without products)."""
    if not rec.get("product_flops_per_step") or not rec.get("f32_peak_gflops"):
        return None
    return rec["product_flops_per_step"] / (rec["f32_peak_gflops"] * 1e6)


def rows(results):
    table, problems = [], []
    for t, by_w in results.items():
        for w, recs in by_w.items():
            if not recs:
                continue
            eager = [x for r in recs for x in r["eager_step_ms"]]
            compiled = [x for r in recs for x in r["compiled_step_ms"]]
            ratios = [r["compiled_median_ms"] / r["eager_median_ms"] for r in recs]
            row = {"workload": w, "threads": t, "goal": GOAL.get(w), "processes": len(recs),
                   "eager": {"median_ms": statistics.median(eager), "min_ms": min(eager),
                             "process_medians_ms": [r["eager_median_ms"] for r in recs]},
                   "compiled": {"median_ms": statistics.median(compiled), "min_ms": min(compiled),
                                "process_medians_ms": [r["compiled_median_ms"] for r in recs]},
                   "process_ratios": ratios, "ratio": statistics.median(ratios),
                   "compile_ms": statistics.median(r["compile_ms"] for r in recs)}
            floors = [floor_ms(r) / r["eager_median_ms"] for r in recs if floor_ms(r)]
            if floors:
                row["floor_ratio"] = statistics.median(floors)
                row["f32_peak_gflops"] = [r["f32_peak_gflops"] for r in recs]
            row["losses_equal"] = all(r["eager_loss_first"] == r["compiled_loss_first"] and
                                      r["eager_loss_last"] == r["compiled_loss_last"] for r in recs)
            if not row["losses_equal"]:
                problems.append("compiled %s (threads %d): the compiled copy's losses differ from eager's: %s" % (
                    w, t, "; ".join("%r/%r vs %r/%r" % (r["eager_loss_first"], r["eager_loss_last"],
                                                        r["compiled_loss_first"], r["compiled_loss_last"])
                                    for r in recs)))
            table.append(row)
    return table, problems


def markdown(table, fmt_time, quick):
    if not table:
        return ""
    out = ["", "### compiled: kiln::compile vs kiln eager%s" % (" (QUICK: not a measurement)" if quick else ""), ""]
    out.append("The same step through kiln::compile and eagerly, in one process (kiln_bench --compile ab: the "
               "workload built twice from the same weights, blocks of steps alternating between the copies, so "
               "both share the process's speed); one process per round. ratio = the median over processes of "
               "compiled / eager (goal at 1 thread: tiny ≤ 0.5, mlp, cnn, resnet, gpt ≤ 0.9), beside each "
               "process's; eager and compiled = medians of every timed step; compile = the capturing step; "
               "losses = first and last step of both copies, which must be equal; floor / eager = the step's "
               "product FLOPs at the process's own float32 matmul peak over its eager step (median over "
               "processes): no replay or fusion runs the same products faster, so a goal under it is below the "
               "physical limit.")
    out.append("")
    out.append("| workload | threads | eager | compiled | ratio | per process | goal | floor / eager | compile | "
               "losses |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        out.append("| %s | %d | %s | %s | %.2f | %s | %s | %s | %s | %s |" % (
            r["workload"], r["threads"], fmt_time(r["eager"]["median_ms"]), fmt_time(r["compiled"]["median_ms"]),
            r["ratio"], " ".join("%.2f" % x for x in r["process_ratios"]),
            "≤ %.1f" % r["goal"] if r["goal"] and r["threads"] == 1 else "—",
            "%.2f" % r["floor_ratio"] if "floor_ratio" in r else "—", fmt_time(r["compile_ms"]),
            "equal" if r["losses_equal"] else "DIFFER"))
    return "\n".join(out) + "\n"
