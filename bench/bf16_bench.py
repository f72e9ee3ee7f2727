"""The "bf16" rows of scripts/bench.sh (issue 26, part 1): kiln's bf16 autocast
against kiln's float32 and against PyTorch's own CPU autocast, one run.

For each thread count and workload (cnn, resnet, gpt: training steps, forward
and loss under autocast, backward and the float32 optimizer step outside it)
it runs, alternately for --pairs rounds so drift in the machine's load hits
both alike: kiln_bench --amp ab, and the PyTorch twin with --amp bf16
(torch.autocast("cpu", dtype=torch.bfloat16), the "tunables" environment of
the main table). --amp ab builds the workload twice and alternates blocks of
float32 and bf16 steps in one process (Note [Two modes in one process] in
bench/workloads/main.cpp): a whole process runs fast or slow on this machine,
so the speedup is taken within each process (float32 median over bf16
median) and the row reads the median over processes. Medians pool every
timed step.

Goals (the issue's): kiln bf16 at least 1.8x kiln float32 on gpt and 1.4x on
resnet and cnn (speedup = float32 step / bf16 step), and kiln bf16 at most 0.6x
PyTorch's bf16 step, same threads.

The ceiling: bf16 autocast speeds up the products (matmuls, convolutions,
attention's products) and keeps the rest in float32, as PyTorch's does (layer
norm, the residual adds, the loss, the optimizer). So the speedup cannot pass
float32 step / (the float32 step's rest + the products' FLOPs at the bf16
matmul peak), where the rest is the float32 step less its products' time
(kiln_bench's product_ms_per_step: the profiler's rows that count FLOPs on the
last warm-up steps) and the bf16 peak is the best of kiln_bench --workload
peak --amp bf16, probed before each workload and after each of its rounds (a
busy machine only lowers a probe). A goal above the ceiling cannot be met by
faster bf16 kernels: it needs the float32 rest to shrink too.

Times are never judged; the first-step losses of kiln bf16 and PyTorch bf16
must agree within 1e-2 relative (their autocast op lists differ, so bf16
rounding lands on different ops), else the two sides compute different models
and the run fails.
"""
import statistics

WORKLOADS = ["cnn", "resnet", "gpt"]
STEPS = {"cnn": 60, "resnet": 60, "gpt": 30}
GOAL_SPEEDUP = {"gpt": 1.8, "resnet": 1.4, "cnn": 1.4}
GOAL_VS_TORCH = 0.6
LOSS_TOL = 1e-2
VARIANTS = ["kiln_f32", "kiln_bf16", "torch_bf16"]
LABEL = {"kiln_f32": "kiln float32", "kiln_bf16": "kiln bf16", "torch_bf16": "PyTorch bf16 autocast"}


def probe_peaks(run_process, env_for, kiln_bin, threads, quick_steps, peaks):
    """Appends kiln's matmul probes (best GFLOP/s) to peaks["bf16"] and peaks["float32"]."""
    for dtype in ("bf16", "float32"):
        cmd = [kiln_bin, "--workload", "peak", "--threads", str(threads), "--steps", "3" if quick_steps else "10",
               "--amp", "bf16" if dtype == "bf16" else "off"]
        if quick_steps:
            cmd += ["--size", "512"]
        recs, _ = run_process(cmd, env_for("kiln", "installed", threads))
        peaks[dtype].append(recs[0]["gflops_best"])


def measure(run_process, env_for, command, kiln_bin, threads, workloads, pairs, quick_steps, log):
    """{threads: {workload: {variant: {"steps": [...], "round_medians": [...], "loss_first": x,
    "product_ms": [...], "product_flops": x}, "peaks": {"bf16": [...], "float32": [...]}}}}."""
    out = {}
    warmup = 2 if quick_steps else 10  # quick: one warm-up step still counts the products (the ceiling's code runs)
    for t in threads:
        for w in [w for w in WORKLOADS if w in workloads]:
            steps = quick_steps or STEPS[w]
            cells = out.setdefault(t, {}).setdefault(w, {v: {"steps": [], "round_medians": [], "loss_first": None,
                                                             "product_ms": [], "product_flops": 0.0}
                                                         for v in VARIANTS})
            peaks = cells.setdefault("peaks", {"bf16": [], "float32": []})
            probe_peaks(run_process, env_for, kiln_bin, t, quick_steps, peaks)
            speedups = cells.setdefault("process_speedups", [])
            for r in range(pairs):
                recs, _ = run_process(command("kiln", kiln_bin, [w], t, warmup, steps) + ["--amp", "ab"],
                                      env_for("kiln", "tunables", t))
                rec = recs[0]
                for v, side in (("kiln_f32", "f32"), ("kiln_bf16", "bf16")):
                    c = cells[v]
                    c["steps"] += rec[side + "_step_ms"]
                    c["round_medians"].append(rec[side + "_median_ms"])
                    if c["loss_first"] is None:
                        c["loss_first"] = rec[side + "_loss_first"]
                    if rec.get(side + "_product_ms_per_step"):
                        c["product_ms"].append(rec[side + "_product_ms_per_step"])
                        c["product_flops"] = rec["product_flops_per_step"]
                speedups.append(rec["f32_median_ms"] / rec["bf16_median_ms"])
                if "bf16_products" in rec:
                    cells["bf16_products"] = rec["bf16_products"]
                    cells["bf16_native_from"] = rec.get("bf16_native_from")
                    cells.setdefault("bf16_dot_vs_fma", []).append(rec.get("bf16_dot_vs_fma", 0))
                recs, _ = run_process(command("torch", kiln_bin, [w], t, warmup, steps) + ["--amp", "bf16"],
                                      env_for("torch", "tunables", t))
                rec = recs[0]
                c = cells["torch_bf16"]
                c["steps"] += rec["step_ms"]
                c["round_medians"].append(rec["median_ms"])
                if c["loss_first"] is None:
                    c["loss_first"] = rec["loss_first"]
                probe_peaks(run_process, env_for, kiln_bin, t, quick_steps, peaks)
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
            row["process_speedups"] = cells.get("process_speedups", [])
            if "bf16_products" in cells:
                row["bf16_products"] = cells["bf16_products"]
                row["bf16_native_from"] = cells["bf16_native_from"]
                row["bf16_dot_vs_fma"] = cells["bf16_dot_vs_fma"]
            row["speedup_bf16_vs_f32"] = statistics.median(row["process_speedups"])
            row["ratio_kiln_to_torch_bf16"] = row["kiln_bf16"]["median_ms"] / row["torch_bf16"]["median_ms"]
            row["goal_speedup"] = GOAL_SPEEDUP[w]
            row["goal_vs_torch"] = GOAL_VS_TORCH
            a, b = row["kiln_bf16"]["loss_first"], row["torch_bf16"]["loss_first"]
            row["loss_rel_diff"] = abs(a - b) / max(abs(b), 1e-12)
            row.update(ceiling(cells))
            if not row["loss_rel_diff"] <= LOSS_TOL:
                problems.append("bf16 %s (threads %d): first-step loss kiln %.6g vs PyTorch %.6g" % (w, t, a, b))
            table.append(row)
    return table, problems


def ceiling(cells):
    """The ceiling's figures for one row (module docstring); {} without a product count or a probe."""
    f32, bf16, peaks = cells["kiln_f32"], cells["kiln_bf16"], cells.get("peaks", {})
    if not f32["product_ms"] or not bf16["product_ms"] or not f32["product_flops"] or not peaks.get("bf16"):
        return {}
    t32 = statistics.median(f32["steps"])
    t16 = statistics.median(bf16["steps"])
    p32 = statistics.median(f32["product_ms"])
    p16 = statistics.median(bf16["product_ms"])
    if p32 >= t32 or p16 >= t16:  # products timed on steps slower than the timed ones (a quick run's first)
        return {}
    flops = f32["product_flops"]
    peak16, peak32 = max(peaks["bf16"]), max(peaks["float32"])
    at_peak16 = flops / (peak16 * 1e6)  # ms
    return {"bf16_peak_gflops": peak16, "f32_peak_gflops": peak32, "product_gflop_per_step": flops / 1e9,
            "f32_product_ms": p32, "f32_rest_ms": t32 - p32, "bf16_product_ms": p16, "bf16_rest_ms": t16 - p16,
            "f32_products_fraction_of_peak": flops / (p32 * 1e6) / peak32,
            "bf16_products_fraction_of_peak": flops / (p16 * 1e6) / peak16,
            "bf16_products_at_peak_ms": at_peak16, "ceiling_speedup": t32 / (t32 - p32 + at_peak16)}


def markdown(table, fmt_time, quick):
    if not table:
        return ""
    out = ["", "### bf16: kiln bf16 autocast vs kiln float32 vs PyTorch bf16 autocast%s" %
           (" (QUICK: not a measurement)" if quick else ""), ""]
    out.append("Training steps with forward and loss under autocast to bf16 (kiln's AutocastGuard; PyTorch's "
               "torch.autocast(\"cpu\", dtype=torch.bfloat16)), backward and the float32 optimizer step outside; "
               "kiln's float32 and bf16 copies in one process (kiln_bench --amp ab, blocks of steps in turn) and "
               "PyTorch's run alternately, medians per step over every round. speedup = kiln float32 / kiln bf16 "
               "within each process, the median over processes, each process's beside it "
               "(goal ≥ %s); vs PyTorch = kiln bf16 / PyTorch bf16 (goal ≤ %.1f); loss diff = first-step loss, "
               "kiln bf16 against PyTorch bf16 (relative)." %
               (", ".join("%s %.1f×" % (w, g) for w, g in GOAL_SPEEDUP.items()), GOAL_VS_TORCH))
    out.append("")
    out.append("| workload | threads | kiln float32 | kiln bf16 | PyTorch bf16 | speedup | per process | vs PyTorch | "
               "best step: float32 / bf16 / PyTorch | loss diff |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        out.append("| %s | %d | %s | %s | %s | %.3f× | %s | %.2f | %s / %s / %s | %.1e |" % (
            r["workload"], r["threads"], fmt_time(r["kiln_f32"]["median_ms"]), fmt_time(r["kiln_bf16"]["median_ms"]),
            fmt_time(r["torch_bf16"]["median_ms"]), r["speedup_bf16_vs_f32"],
            " ".join("%.3f" % x for x in r["process_speedups"]), r["ratio_kiln_to_torch_bf16"],
            fmt_time(r["kiln_f32"]["min_ms"]), fmt_time(r["kiln_bf16"]["min_ms"]), fmt_time(r["torch_bf16"]["min_ms"]),
            r["loss_rel_diff"]))
    paths = sorted({r["bf16_products"] for r in table if "bf16_products" in r})
    if paths:
        rates = [x for r in table for x in r.get("bf16_dot_vs_fma", []) if x > 0]
        where = {"onednn_bf16": "on oneDNN's bf16 kernels", "float32": "through float32 (operands widened, "
                 "the float32 product, one rounding)"}
        line = {r["bf16_native_from"] for r in table if r.get("bf16_native_from") is not None}
        out += ["", "kiln's bf16 products ran %s (Note [bf16 products where bf16 is slow]: native with AMX, or where "
                "the CPU's bf16 dot product does at least %s of float32's flops per second)%s." % (
                    " and ".join(where.get(p, p) for p in paths), "/".join("%g" % x for x in sorted(line)) or "?",
                    "; this CPU's vdpbf16ps / vfmadd231ps flop rate %.2f–%.2f" % (min(rates), max(rates))
                    if rates else "; this CPU has no AVX512_BF16 instruction")]
    ceil = [r for r in table if "ceiling_speedup" in r]
    if ceil:
        out += ["", "Ceiling: bf16 speeds up the products and autocast keeps the rest in float32, so speedup ≤ "
                "float32 step / (float32 rest + the products' FLOPs at the bf16 matmul peak). products = the "
                "profiler's rows that count FLOPs (matmuls, convolutions, attention's backward), median of the "
                "last three warm-up steps of each run; rest = step median − products; % of peak = the products' "
                "GFLOP/s over kiln's matmul probe of that dtype in this run (best of the probes before the "
                "workload and after each round).", "",
                "| workload | threads | product GFLOP / step | peak f32 / bf16 GFLOP/s | float32: products + rest | "
                "bf16: products + rest | products % of peak f32 / bf16 | bf16 products at peak | ceiling | "
                "speedup | goal |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ceil:
            goal = r["goal_speedup"]
            out.append("| %s | %d | %.2f | %.0f / %.0f | %s + %s | %s + %s | %.0f%% / %.0f%% | %s | %.2f× | %.2f× | "
                       "%s%s |" % (
                           r["workload"], r["threads"], r["product_gflop_per_step"], r["f32_peak_gflops"],
                           r["bf16_peak_gflops"], fmt_time(r["f32_product_ms"]), fmt_time(r["f32_rest_ms"]),
                           fmt_time(r["bf16_product_ms"]), fmt_time(r["bf16_rest_ms"]),
                           100 * r["f32_products_fraction_of_peak"], 100 * r["bf16_products_fraction_of_peak"],
                           fmt_time(r["bf16_products_at_peak_ms"]), r["ceiling_speedup"], r["speedup_bf16_vs_f32"],
                           "≥ %.1f×" % goal, " (above the ceiling)" if goal > r["ceiling_speedup"] else ""))
    return "\n".join(out) + "\n"
