"""The "compiled" rows of scripts/bench.sh (issue 25): kiln::compile against
kiln's eager step, one run.

For each thread count and training workload (tiny, mlp, cnn, resnet, gpt) and
gpt_infer, it runs kiln_bench --compile off and --compile on alternately for
--pairs rounds, so drift in the machine's load hits both alike. The compiled
run's first step captures (its time is the compile time, reported); the timed
steps replay. Medians pool every timed step.

Goals (the issue's, at 1 thread): tiny at most 0.5x kiln eager; mlp, cnn,
resnet, gpt at least 10% faster (at most 0.9x). Times are never judged. A
replay must compute what the eager step does: the first- and last-step losses
of the two runs must be equal (both start from the same synthetic weights and
batch), else the run fails.
"""
import statistics

WORKLOADS = ["tiny", "mlp", "cnn", "resnet", "gpt", "gpt_infer"]
STEPS = {"tiny": 500, "mlp": 100, "cnn": 60, "resnet": 60, "gpt": 30, "gpt_infer": 100}
GOAL = {"tiny": 0.5, "mlp": 0.9, "cnn": 0.9, "resnet": 0.9, "gpt": 0.9}
VARIANTS = ["eager", "compiled"]


def measure(run_process, env_for, command, kiln_bin, threads, workloads, pairs, quick_steps, log):
    """{threads: {workload: {variant: {"steps", "round_medians", "loss_first", "loss_last", "compile_ms"}}}}."""
    out = {}
    warmup = 1 if quick_steps else 10
    for t in threads:
        for w in [w for w in WORKLOADS if w in workloads]:
            steps = quick_steps or STEPS[w]
            cells = out.setdefault(t, {}).setdefault(w, {v: {"steps": [], "round_medians": [], "loss_first": None,
                                                             "loss_last": None, "compile_ms": []}
                                                         for v in VARIANTS})
            for r in range(pairs):
                for v in VARIANTS:
                    cmd = command("kiln", kiln_bin, [w], t, warmup, steps) + [
                        "--compile", "on" if v == "compiled" else "off"]
                    recs, _ = run_process(cmd, env_for("kiln", "tunables", t))
                    rec = recs[0]
                    c = cells[v]
                    c["steps"] += rec["step_ms"]
                    c["round_medians"].append(rec["median_ms"])
                    if c["loss_first"] is None:
                        c["loss_first"], c["loss_last"] = rec["loss_first"], rec["loss_last"]
                    if v == "compiled":
                        c["compile_ms"].append(rec["compile_ms"])
                        if rec.get("graph_breaks"):
                            log("[compiled] %s: %d graph breaks (the step ran eagerly)" % (w, rec["graph_breaks"]))
                log("[compiled] threads %d %-9s round %d/%d  %s" % (t, w, r + 1, pairs, "  ".join(
                    "%s %.3f ms" % (v, cells[v]["round_medians"][-1]) for v in VARIANTS)))
    return out


def rows(results, floors=None):
    """floors: {(workload, threads): f32 floor ms} from the main table, where its products are known."""
    table, problems = [], []
    for t, by_w in results.items():
        for w, cells in by_w.items():
            if any(not cells[v]["steps"] for v in VARIANTS):
                continue
            row = {"workload": w, "threads": t, "goal": GOAL.get(w)}
            for v in VARIANTS:
                row[v] = {"median_ms": statistics.median(cells[v]["steps"]), "min_ms": min(cells[v]["steps"]),
                          "round_medians_ms": cells[v]["round_medians"], "loss_first": cells[v]["loss_first"],
                          "loss_last": cells[v]["loss_last"]}
            row["compile_ms"] = statistics.median(cells["compiled"]["compile_ms"])
            row["ratio"] = row["compiled"]["median_ms"] / row["eager"]["median_ms"]
            floor = (floors or {}).get((w, t))
            if floor:
                # The best ratio any capture could reach in float32: the products alone at peak.
                row["f32_floor_ms"] = floor
                row["floor_ratio"] = floor / row["eager"]["median_ms"]
            e, c = row["eager"], row["compiled"]
            row["losses_equal"] = e["loss_first"] == c["loss_first"] and e["loss_last"] == c["loss_last"]
            if not row["losses_equal"]:
                problems.append("compiled %s (threads %d): losses eager %r/%r vs compiled %r/%r" % (
                    w, t, e["loss_first"], e["loss_last"], c["loss_first"], c["loss_last"]))
            table.append(row)
    return table, problems


def markdown(table, fmt_time, quick):
    if not table:
        return ""
    out = ["", "### compiled: kiln::compile vs kiln eager%s" % (" (QUICK: not a measurement)" if quick else ""), ""]
    out.append("The same step through kiln::compile (kiln_bench --compile on: the first step captures, the timed "
               "steps replay) and eagerly, alternately; medians per step over every round. ratio = compiled / "
               "eager (goal at 1 thread: tiny ≤ 0.5, mlp, cnn, resnet, gpt ≤ 0.9); compile = the capturing "
               "step; losses = first and last step of both runs, which must be equal; floor / eager = the "
               "float32 floor of the main table (the step's product FLOPs at this run's measured peak) over the "
               "eager step: no replay or fusion gets below it, so a goal under it is below the physical limit.")
    out.append("")
    out.append("| workload | threads | eager | compiled | ratio | goal | floor / eager | compile | "
               "best step: eager / compiled | losses |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        out.append("| %s | %d | %s | %s | %.2f | %s | %s | %s | %s / %s | %s |" % (
            r["workload"], r["threads"], fmt_time(r["eager"]["median_ms"]), fmt_time(r["compiled"]["median_ms"]),
            r["ratio"], "≤ %.1f" % r["goal"] if r["goal"] and r["threads"] == 1 else "—",
            "%.2f" % r["floor_ratio"] if "floor_ratio" in r else "—", fmt_time(r["compile_ms"]),
            fmt_time(r["eager"]["min_ms"]), fmt_time(r["compiled"]["min_ms"]),
            "equal" if r["losses_equal"] else "DIFFER"))
    return "\n".join(out) + "\n"
