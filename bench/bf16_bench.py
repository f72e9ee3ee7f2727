"""The "bf16" rows of scripts/bench.sh (issue 26, part 1): kiln's bf16 autocast
against kiln's float32 and against PyTorch's own CPU autocast, one run.

For each thread count and workload (cnn, resnet, gpt: training steps, forward
and loss under autocast, backward and the float32 optimizer step outside it)
it runs, alternately for --pairs rounds so drift in the machine's load hits
all three alike: kiln_bench --amp off, kiln_bench --amp bf16, and the PyTorch
twin with --amp bf16 (torch.autocast("cpu", dtype=torch.bfloat16), the
"tunables" environment of the main table). Medians pool every timed step.

Goals (the issue's): kiln bf16 at least 1.8x kiln float32 on gpt and 1.4x on
resnet and cnn (speedup = float32 step / bf16 step), and kiln bf16 at most 0.6x
PyTorch's bf16 step, same threads. Times are never judged; the first-step
losses of kiln bf16 and PyTorch bf16 must agree within 1e-2 relative (their
autocast op lists differ, so bf16 rounding lands on different ops), else the
two sides compute different models and the run fails.
"""
import statistics

WORKLOADS = ["cnn", "resnet", "gpt"]
STEPS = {"cnn": 60, "resnet": 60, "gpt": 30}
GOAL_SPEEDUP = {"gpt": 1.8, "resnet": 1.4, "cnn": 1.4}
GOAL_VS_TORCH = 0.6
LOSS_TOL = 1e-2
VARIANTS = ["kiln_f32", "kiln_bf16", "torch_bf16"]
LABEL = {"kiln_f32": "kiln float32", "kiln_bf16": "kiln bf16", "torch_bf16": "PyTorch bf16 autocast"}


def measure(run_process, env_for, command, kiln_bin, threads, workloads, pairs, quick_steps, log):
    """{threads: {workload: {variant: {"steps": [...], "round_medians": [...], "loss_first": x}}}}."""
    out = {}
    warmup = 1 if quick_steps else 10
    for t in threads:
        for w in [w for w in WORKLOADS if w in workloads]:
            steps = quick_steps or STEPS[w]
            cells = out.setdefault(t, {}).setdefault(w, {v: {"steps": [], "round_medians": [], "loss_first": None}
                                                         for v in VARIANTS})
            for r in range(pairs):
                for v in VARIANTS:
                    framework = "kiln" if v.startswith("kiln") else "torch"
                    cmd = command(framework, kiln_bin, [w], t, warmup, steps) + [
                        "--amp", "off" if v == "kiln_f32" else "bf16"]
                    recs, _ = run_process(cmd, env_for(framework, "tunables", t))
                    rec = recs[0]
                    c = cells[v]
                    c["steps"] += rec["step_ms"]
                    c["round_medians"].append(rec["median_ms"])
                    if c["loss_first"] is None:
                        c["loss_first"] = rec["loss_first"]
                log("[bf16] threads %d %-6s round %d/%d  %s" % (t, w, r + 1, pairs, "  ".join(
                    "%s %.2f ms" % (v, cells[v]["round_medians"][-1]) for v in VARIANTS)))
    return out


def rows(results):
    table, problems = [], []
    for t, by_w in results.items():
        for w, cells in by_w.items():
            if any(not cells[v]["steps"] for v in VARIANTS):
                continue
            row = {"workload": w, "threads": t}
            for v in VARIANTS:
                row[v] = {"median_ms": statistics.median(cells[v]["steps"]), "min_ms": min(cells[v]["steps"]),
                          "round_medians_ms": cells[v]["round_medians"], "loss_first": cells[v]["loss_first"]}
            row["speedup_bf16_vs_f32"] = row["kiln_f32"]["median_ms"] / row["kiln_bf16"]["median_ms"]
            row["ratio_kiln_to_torch_bf16"] = row["kiln_bf16"]["median_ms"] / row["torch_bf16"]["median_ms"]
            row["goal_speedup"] = GOAL_SPEEDUP[w]
            row["goal_vs_torch"] = GOAL_VS_TORCH
            a, b = row["kiln_bf16"]["loss_first"], row["torch_bf16"]["loss_first"]
            row["loss_rel_diff"] = abs(a - b) / max(abs(b), 1e-12)
            if not row["loss_rel_diff"] <= LOSS_TOL:
                problems.append("bf16 %s (threads %d): first-step loss kiln %.6g vs PyTorch %.6g" % (w, t, a, b))
            table.append(row)
    return table, problems


def markdown(table, fmt_time, quick):
    if not table:
        return ""
    out = ["", "### bf16: kiln bf16 autocast vs kiln float32 vs PyTorch bf16 autocast%s" %
           (" (QUICK: not a measurement)" if quick else ""), ""]
    out.append("Training steps with forward and loss under autocast to bf16 (kiln's AutocastGuard; PyTorch's "
               "torch.autocast(\"cpu\", dtype=torch.bfloat16)), backward and the float32 optimizer step outside; "
               "the three run alternately, medians per step over every round. speedup = kiln float32 / kiln bf16 "
               "(goal ≥ %s); vs PyTorch = kiln bf16 / PyTorch bf16 (goal ≤ %.1f); loss diff = first-step loss, "
               "kiln bf16 against PyTorch bf16 (relative)." %
               (", ".join("%s %.1f×" % (w, g) for w, g in GOAL_SPEEDUP.items()), GOAL_VS_TORCH))
    out.append("")
    out.append("| workload | threads | kiln float32 | kiln bf16 | PyTorch bf16 | speedup | vs PyTorch | "
               "best step: float32 / bf16 / PyTorch | loss diff |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        out.append("| %s | %d | %s | %s | %s | %.2f× | %.2f | %s / %s / %s | %.1e |" % (
            r["workload"], r["threads"], fmt_time(r["kiln_f32"]["median_ms"]), fmt_time(r["kiln_bf16"]["median_ms"]),
            fmt_time(r["torch_bf16"]["median_ms"]), r["speedup_bf16_vs_f32"], r["ratio_kiln_to_torch_bf16"],
            fmt_time(r["kiln_f32"]["min_ms"]), fmt_time(r["kiln_bf16"]["min_ms"]), fmt_time(r["torch_bf16"]["min_ms"]),
            r["loss_rel_diff"]))
    return "\n".join(out) + "\n"
