"""The inference rows of scripts/bench.sh (issue 21's figures): cnn, resnet and
gpt_infer as kiln's optimised inference model (infer::optimize), kiln's eager
eval forward (InferenceMode) and ONNX Runtime (onnxruntime-node), at each
thread count, on the same exported model and input, in one run.

kiln_bench_infer builds each workload's model (the training workloads'
synthetic weights and batch), writes it as ONNX with its input, times eager and
optimised, and writes the eager output; bench/infer/ort_bench.js then times ONNX
Runtime on those files (intra-op threads = the thread count, one inter-op
thread, all graph optimisations) and checks its output against kiln's. The two
alternate for --pairs rounds (kiln, ORT, kiln, ORT, ...) so machine drift hits
both; medians pool every timed batch of every round. Times are never judged;
an output that disagrees with kiln's eager output by more than 1e-4 (relative
to its scale) fails the run, since then the sides compute different models.
"""
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ["cnn", "resnet", "gpt_infer"]
STEPS = {"cnn": 60, "resnet": 60, "gpt_infer": 100}
QUICK_STEPS = 3
NPM = "/usr/local/share/kiln/npm/node_modules"
ORT_SCRIPT = os.path.join(HERE, "infer", "ort_bench.js")
DIFF_TOL = 1e-4
VARIANTS = ["kiln_optimised", "kiln_eager", "onnxruntime"]
LABEL = {"kiln_optimised": "kiln optimised", "kiln_eager": "kiln eager", "onnxruntime": "ONNX Runtime"}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def unavailable(infer_bin):
    """Why the rows cannot run here, or None."""
    if not infer_bin or not os.path.exists(infer_bin):
        return "no kiln_bench_infer (build the target kiln_bench_infer)"
    if not shutil.which("node") or not os.path.isdir(os.path.join(NPM, "onnxruntime-node")):
        return "no node or onnxruntime-node under %s (scripts/setup.sh installs them)" % NPM
    return None


def measure(run_process, env_for, infer_bin, threads, workloads, pairs, quick):
    """{threads: {workload: {variant: {"steps": [...], "records": [...]}}}}."""
    warmup = 1 if quick else 10
    out = {}
    with tempfile.TemporaryDirectory(prefix="kiln_infer_bench_") as d:
        for t in threads:
            env = env_for("kiln", None, t)
            ort_env = dict(env, NODE_PATH=NPM)
            res = out.setdefault(t, {})
            groups = [workloads] if quick else [[w] for w in workloads]
            for group in groups:
                steps = QUICK_STEPS if quick else STEPS[group[0]]
                for r in range(1 if quick else pairs):
                    recs, _ = run_process([infer_bin, "--workload", ",".join(group), "--dir", d, "--threads",
                                           str(t), "--warmup", str(warmup), "--steps", str(steps)], env)
                    ort, _ = run_process(["node", ORT_SCRIPT, d, ",".join(group), str(t), str(warmup), str(steps)],
                                         ort_env)
                    for rec in recs + ort:
                        cell = res.setdefault(rec["workload"], {}).setdefault(rec["framework"],
                                                                               {"steps": [], "records": []})
                        cell["steps"] += rec["step_ms"]
                        cell["records"].append({k: v for k, v in rec.items() if k != "step_ms"})
                    for w in group:
                        log("[threads %d] infer %-9s round %d  %s" % (t, w, r + 1, "  ".join(
                            "%s %.3f ms" % (v, res[w][v]["records"][-1]["median_ms"]) for v in VARIANTS)))
    return out


def rows(results):
    table, problems = [], []
    for t, by_w in results.items():
        for w, cells in by_w.items():
            row = {"workload": w, "threads": t}
            for v in VARIANTS:
                s = cells[v]["steps"]
                q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
                row[v] = {"median_ms": statistics.median(s), "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(s),
                          "timed_batches": len(s),
                          "round_medians_ms": [rec["median_ms"] for rec in cells[v]["records"]]}
            last = cells["kiln_optimised"]["records"][-1]
            row["nodes_captured"] = last["nodes_before"]
            row["nodes_optimised"] = last["nodes_after"]
            row["optimised_vs_eager"] = max(rec["max_rel_diff_vs_eager"] for rec in cells["kiln_optimised"]["records"])
            row["ort_vs_eager"] = max(rec["max_rel_diff_vs_eager"] for rec in cells["onnxruntime"]["records"])
            row["ort_version"] = cells["onnxruntime"]["records"][-1].get("ort_version")
            row["ratio_optimised_to_ort"] = row["kiln_optimised"]["median_ms"] / row["onnxruntime"]["median_ms"]
            row["ratio_optimised_to_eager"] = row["kiln_optimised"]["median_ms"] / row["kiln_eager"]["median_ms"]
            for what in ("optimised_vs_eager", "ort_vs_eager"):
                if not row[what] <= DIFF_TOL:
                    problems.append("%s (threads %d): %s differs by %.3g (relative to the output's scale)" %
                                    (w, t, what.replace("_", " "), row[what]))
            table.append(row)
    return table, problems


def markdown(table, fmt_time, quick, skipped=None):
    out = ["", "### Inference: kiln optimised vs kiln eager vs ONNX Runtime", ""]
    if skipped:
        out.append("Not run: %s." % skipped)
        return "\n".join(out) + "\n"
    out.append("Same exported model and input for all three (cnn: batch 64 of 1×28×28; resnet: batch 32 of 3×32×32; "
               "gpt_infer: one sequence of 128 tokens); medians per batch over every timed batch of every round%s. "
               "kiln optimised = infer::optimize (BatchNorm folded, Conv/Linear fused with bias, residual and "
               "ReLU/GELU as oneDNN post-ops, weights pre-packed, attention as one kernel); best batch = the fastest timed "
               "batch (what an idle machine gives; the medians carry any load); ONNX Runtime = onnxruntime-node, all graph "
               "optimisations, intra-op threads = threads. ratio = kiln optimised / ONNX Runtime (goal ≤ 1); "
               "diff = max |y − eager| / max |eager|." % (" (QUICK: not a measurement)" if quick else ""))
    out.append("")
    out.append("| workload | threads | kiln optimised | kiln eager | ONNX Runtime | ratio | best batch: optimised / eager / "
               "ORT | nodes captured → optimised | diff optimised / ORT |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        out.append("| %s | %d | %s | %s | %s | %.2f | %s / %s / %s | %d → %d | %.1e / %.1e |" % (
            r["workload"], r["threads"], fmt_time(r["kiln_optimised"]["median_ms"]),
            fmt_time(r["kiln_eager"]["median_ms"]), fmt_time(r["onnxruntime"]["median_ms"]),
            r["ratio_optimised_to_ort"], fmt_time(r["kiln_optimised"]["min_ms"]), fmt_time(r["kiln_eager"]["min_ms"]),
            fmt_time(r["onnxruntime"]["min_ms"]), r["nodes_captured"], r["nodes_optimised"], r["optimised_vs_eager"],
            r["ort_vs_eager"]))
    return "\n".join(out) + "\n"
