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

cnn_int8 and resnet_int8 (batch 64) give the "Inference int8" table: the
float model eager and optimised, its PTQ int8 model eager and in kiln's runtime
(the QDQ ONNX graph, each pattern fused into an int8 kernel with its ReLU and
residual add, uint8 between int8 layers), and ONNX Runtime on the same QDQ
file. kiln's runtime must equal the int8 eager model within 1e-3 (a requantized
activation may land one code away);
ONNX Runtime rewrites the QDQ nodes into its own int8 ops, rounding biases to
int32 and requantizing between layers, so it is held to 5e-2 of the output's
scale (docs/quantization.md, "QDQ export and int8 inference"); to 0.5 on a CPU
without VNNI, where its kernels saturate.

gpt_infer_int8 gives the "Inference int8, gpt" table: the gpt_infer model and
sequence as float32 eager and optimised, then with the blocks' linears made
quant::DynamicInt8Linear (per-token int8 activations, GELU and residual adds in
the int8 layers' epilogue), timed eager. kiln only: dynamic int8 is not
exported to ONNX. Its difference from float32 is reported; the accuracy that
matters (bits per character of a trained model) is in docs/quantization.md.
"""
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ["cnn", "resnet", "gpt_infer", "cnn_int8", "resnet_int8", "gpt_infer_int8"]
STEPS = {"cnn": 60, "resnet": 60, "gpt_infer": 100, "cnn_int8": 40, "resnet_int8": 40, "gpt_infer_int8": 100}
QUICK_STEPS = 3
NPM = "/usr/local/share/kiln/npm/node_modules"
ORT_SCRIPT = os.path.join(HERE, "infer", "ort_bench.js")
DIFF_TOL = 1e-4
VARIANTS = ["kiln_optimised", "kiln_eager", "onnxruntime"]
LABEL = {"kiln_optimised": "kiln optimised", "kiln_eager": "kiln eager", "onnxruntime": "ONNX Runtime"}
INT8_VARIANTS = ["kiln_int8_runtime", "kiln_int8_eager", "kiln_optimised", "kiln_eager", "onnxruntime"]
GPT_INT8_VARIANTS = ["kiln_int8_eager", "kiln_optimised", "kiln_eager"]
GPT_INT8 = "gpt_infer_int8"
# kiln's runtime passes uint8 between int8 layers (requantized in the producer's epilogue), which may put
# an activation one code away from the eager model's (SessionOptions::uint8_between_layers).
INT8_RUNTIME_TOL = 1e-3
INT8_ORT_TOL = 5e-2


def cpu_has_vnni():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True
    return "avx512_vnni" in flags or "avx_vnni" in flags


# Without VNNI ONNX Runtime's u8 x s8 kernels add pairs of products in a saturating int16 (its quantization
# docs advise reduce_range there): its cnn_int8 output was 0.20 of the scale off on an AVX2 EPYC, where
# kiln's runtime stayed within 1e-3 of its eager model (docs/decisions.md, Note [Kernels without AVX-512]).
if not cpu_has_vnni():
    INT8_ORT_TOL = 0.5


def is_int8(workload):
    return workload.endswith("_int8")


def variants(workload):
    if workload == GPT_INT8:
        return GPT_INT8_VARIANTS
    return INT8_VARIANTS if is_int8(workload) else VARIANTS


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
                    ort_group = [w for w in group if w != GPT_INT8]
                    ort = run_process(["node", ORT_SCRIPT, d, ",".join(ort_group), str(t), str(warmup), str(steps)],
                                      ort_env)[0] if ort_group else []
                    for rec in recs + ort:
                        cell = res.setdefault(rec["workload"], {}).setdefault(rec["framework"],
                                                                               {"steps": [], "records": []})
                        cell["steps"] += rec["step_ms"]
                        cell["records"].append({k: v for k, v in rec.items() if k != "step_ms"})
                    for w in group:
                        log("[threads %d] infer %-9s round %d  %s" % (t, w, r + 1, "  ".join(
                            "%s %.3f ms" % (v, res[w][v]["records"][-1]["median_ms"]) for v in variants(w))))
    return out


def rows(results):
    table, problems = [], []
    for t, by_w in results.items():
        for w, cells in by_w.items():
            row = {"workload": w, "threads": t}
            for v in variants(w):
                s = cells[v]["steps"]
                q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
                row[v] = {"median_ms": statistics.median(s), "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(s),
                          "timed_batches": len(s),
                          "round_medians_ms": [rec["median_ms"] for rec in cells[v]["records"]]}
            if w == GPT_INT8:
                row["gpt_int8"] = True
                row["int8_linears"] = cells["kiln_int8_eager"]["records"][-1]["int8_linears"]
                row["int8_vs_float"] = max(rec["max_rel_diff_vs_float"] for rec in cells["kiln_int8_eager"]["records"])
                for v in ("kiln_eager", "kiln_optimised"):
                    row["speedup_int8_vs_" + v] = row[v]["median_ms"] / row["kiln_int8_eager"]["median_ms"]
                table.append(row)
                continue
            if is_int8(w):
                table.append(int8_row(row, cells, problems))
                continue
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


def int8_row(row, cells, problems):
    row["int8"] = True
    row["quantize_linear"] = cells["kiln_int8_runtime"]["records"][-1]["quantize_linear"]
    row["int8_runtime_vs_eager"] = max(rec["max_rel_diff_vs_eager"] for rec in cells["kiln_int8_runtime"]["records"])
    row["ort_vs_eager"] = max(rec["max_rel_diff_vs_eager"] for rec in cells["onnxruntime"]["records"])
    row["ort_version"] = cells["onnxruntime"]["records"][-1].get("ort_version")
    row["speedup_int8_runtime_vs_float_optimised"] = (row["kiln_optimised"]["median_ms"] /
                                                      row["kiln_int8_runtime"]["median_ms"])
    row["speedup_int8_eager_vs_float_eager"] = row["kiln_eager"]["median_ms"] / row["kiln_int8_eager"]["median_ms"]
    for what, tol in (("int8_runtime_vs_eager", INT8_RUNTIME_TOL), ("ort_vs_eager", INT8_ORT_TOL)):
        if not row[what] <= tol:
            problems.append("%s (threads %d): %s differs by %.3g (relative to the output's scale)" %
                            (row["workload"], row["threads"], what.replace("_", " "), row[what]))
    return row


def gpt_int8_markdown(table, fmt_time, quick):
    rows = [r for r in table if r.get("gpt_int8")]
    if not rows:
        return ""
    out = ["", "### Inference int8, gpt: dynamic int8 linears vs float32", ""]
    out.append("gpt_infer's model and sequence (synthetic weights, 1 × 128 tokens); medians per batch%s. kiln int8 = "
               "the blocks' %d linears as quant::DynamicInt8Linear (int8 weights per channel, each token's "
               "activations quantized at run time, GELU and residual adds in the int8 epilogue; lm_head float); "
               "float32 = the same model before. speedup = float32 / int8; diff = max |int8 − float32| / "
               "max |float32| of the logits (goal for the speedup: ≥ 2× at 1 thread)." %
               (" (QUICK: not a measurement)" if quick else "", rows[0]["int8_linears"]))
    out.append("")
    out.append("| threads | kiln int8 eager | kiln float32 eager | kiln float32 optimised | speedup vs eager / "
               "optimised | best batch: int8 / float32 eager / optimised | diff |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        out.append("| %d | %s | %s | %s | %.2f× / %.2f× | %s / %s / %s | %.1e |" % (
            r["threads"], fmt_time(r["kiln_int8_eager"]["median_ms"]), fmt_time(r["kiln_eager"]["median_ms"]),
            fmt_time(r["kiln_optimised"]["median_ms"]), r["speedup_int8_vs_kiln_eager"],
            r["speedup_int8_vs_kiln_optimised"], fmt_time(r["kiln_int8_eager"]["min_ms"]),
            fmt_time(r["kiln_eager"]["min_ms"]), fmt_time(r["kiln_optimised"]["min_ms"]), r["int8_vs_float"]))
    return "\n".join(out) + "\n"


def int8_markdown(table, fmt_time, quick):
    rows = [r for r in table if r.get("int8") and not r.get("gpt_int8")]
    if not rows:
        return ""
    out = ["", "### Inference int8: kiln int8 vs kiln float32 vs ONNX Runtime int8", ""]
    out.append("The training workloads' cnn and resnet (synthetic weights), batch 64, quantized with PTQ (minmax "
               "observer, four synthetic calibration batches; resnet's BatchNorms folded) and exported as ONNX in "
               "QDQ form; medians per batch%s. kiln int8 runtime = kiln's Session on the QDQ graph (each "
               "Q→DQ→Conv/Gemm fused into oneDNN's int8 kernel with the ReLU and residual add after it, uint8 passed "
               "between int8 layers); kiln int8 eager = the quantized model's "
               "forward; float32 rows = the same model before quantization; ONNX Runtime int8 = onnxruntime-node "
               "on the QDQ file, all graph optimisations. speedup = float32 / int8 (optimised vs runtime, eager vs "
               "eager); diff = max |y − int8 eager| / max |int8 eager|." %
               (" (QUICK: not a measurement)" if quick else ""))
    out.append("")
    out.append("| workload | threads | kiln int8 runtime | kiln int8 eager | kiln float32 optimised | kiln float32 eager "
               "| ONNX Runtime int8 | speedup optimised / eager | best batch: int8 runtime / float32 optimised / ORT "
               "| diff kiln runtime / ORT |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        out.append("| %s | %d | %s | %s | %s | %s | %s | %.2f× / %.2f× | %s / %s / %s | %.1e / %.1e |" % (
            r["workload"], r["threads"], fmt_time(r["kiln_int8_runtime"]["median_ms"]),
            fmt_time(r["kiln_int8_eager"]["median_ms"]), fmt_time(r["kiln_optimised"]["median_ms"]),
            fmt_time(r["kiln_eager"]["median_ms"]), fmt_time(r["onnxruntime"]["median_ms"]),
            r["speedup_int8_runtime_vs_float_optimised"], r["speedup_int8_eager_vs_float_eager"],
            fmt_time(r["kiln_int8_runtime"]["min_ms"]), fmt_time(r["kiln_optimised"]["min_ms"]),
            fmt_time(r["onnxruntime"]["min_ms"]), r["int8_runtime_vs_eager"], r["ort_vs_eager"]))
    return "\n".join(out) + "\n"


def markdown(table, fmt_time, quick, skipped=None):
    float_rows = [r for r in table if not r.get("int8") and not r.get("gpt_int8")]
    text = float_markdown(float_rows, fmt_time, quick, skipped) if float_rows or skipped else ""
    return text if skipped else text + int8_markdown(table, fmt_time, quick) + gpt_int8_markdown(table, fmt_time, quick)


def float_markdown(table, fmt_time, quick, skipped=None):
    out = ["", "### Inference: kiln optimised vs kiln eager vs ONNX Runtime", ""]
    if skipped:
        out.append("Not run: %s." % skipped)
        return "\n".join(out) + "\n"
    out.append("Same exported model and input for all three (cnn: batch 64 of 1×28×28; resnet: batch 32 of 3×32×32; "
               "gpt_infer: one sequence of 128 tokens); medians per batch over every timed batch of every round%s. "
               "kiln optimised = infer::optimize (BatchNorm folded, Conv/Linear fused with bias, residual and "
               "ReLU/GELU as oneDNN post-ops (a linear's tanh GELU right after its product), weights pre-packed, "
               "attention as one kernel); best batch = the fastest timed "
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
