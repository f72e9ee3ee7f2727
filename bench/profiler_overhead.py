"""The "profiler overhead" rows of scripts/bench.sh (issue 17).

kiln's profiler is compiled in always: with no Profiler recording, each op,
backward node, loader wait and collective costs one flag test. These rows time
kiln_bench's tiny and gpt workloads with the profiler off and with a
kiln::profiler::Profiler recording every timed step (`kiln_bench --profile
on`: every event, shape and allocation kept, prof.step() per step), off and on
alternately for the same rounds as the main table, so drift in the machine's
load hits both alike. Goal: the gpt step within 10% of its unprofiled time
while recording. (Off against a build without the record hook, the 2% goal of
the tiny workload, needs two builds and is measured apart.)
"""
import statistics

WORKLOADS = ["tiny", "gpt"]
STEPS = {"tiny": 500, "gpt": 50}
GOAL = {"gpt": 0.10}  # recording may add at most this fraction to the step


def measure(run_process, env_for, kiln_bin, workloads, threads, quick_steps, pairs, log):
    """{"threads": t, "cells": {workload: {"off": [step ms...], "on": [...], ...}}} for those of
    `workloads` that have a row here; quick_steps > 0: that many timed steps after 1 warm-up step."""
    out = {}
    for w in [w for w in WORKLOADS if w in workloads]:
        cell = {"off": [], "on": [], "round_off": [], "round_on": [], "events": 0}
        steps = quick_steps if quick_steps else STEPS[w]
        warmup = 1 if quick_steps else 10
        for r in range(pairs):
            for mode in ("off", "on"):
                recs, _ = run_process([kiln_bin, "--workload", w, "--threads", str(threads), "--warmup", str(warmup),
                                       "--steps", str(steps), "--profile", mode], env_for("kiln", None, threads))
                rec = recs[0]
                cell[mode] += rec["step_ms"]
                cell["round_" + mode].append(rec["median_ms"])
                if mode == "on":
                    cell["events"] = max(cell["events"], rec.get("profile_events", 0))
                log("[profiler overhead] %-4s round %d/%d  profiler %-3s %9.3f ms/step" %
                    (w, r + 1, pairs, mode, rec["median_ms"]))
        out[w] = cell
    return {"threads": threads, "cells": out}


def rows(result):
    out = []
    if not result:
        return out
    for w, c in result["cells"].items():
        if not c["off"] or not c["on"]:
            continue
        off, on = statistics.median(c["off"]), statistics.median(c["on"])
        row = {"workload": w, "threads": result["threads"], "off_ms": off, "on_ms": on, "overhead": on / off - 1,
               "round_off_ms": c["round_off"], "round_on_ms": c["round_on"],
               "events_per_step": c["events"] / max(1, len(c["on"]) // max(1, len(c["round_on"])))}
        if w in GOAL:
            row["goal"] = GOAL[w]
        out.append(row)
    return out


def markdown(result_rows, fmt_time, quick):
    if not result_rows:
        return ""
    out = ["", "### profiler overhead%s" % (" (QUICK: not a measurement)" if quick else ""), "",
           "Median step with the profiler compiled in and off, and with a Profiler recording every step "
           "(events, shapes, allocations; `kiln_bench --profile on`), run alternately.", "",
           "| workload | threads | profiler off | recording | overhead | goal | events per step |",
           "|---|---|---|---|---|---|---|"]
    for r in result_rows:
        out.append("| %s | %d | %s | %s | %+.1f%% | %s | %.0f |" % (
            r["workload"], r["threads"], fmt_time(r["off_ms"]), fmt_time(r["on_ms"]), 100 * r["overhead"],
            "≤ %.0f%%" % (100 * r["goal"]) if "goal" in r else "", r["events_per_step"]))
    return "\n".join(out) + "\n"
