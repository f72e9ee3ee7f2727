"""The "floor, same phase" rows of scripts/bench.sh (issue 26 §3): kiln's eager
float32 step against the float32 floor measured beside it, one run.

The float32 table's floor is a step's product FLOPs at the run's best matmul
probe, and its kiln time is the median over rounds: on a shared machine the
probe's rate moves by half within minutes, so that ratio mixes spells of the
machine into the step's speed. Here each process is kiln_bench --floor ab,
which alternates blocks of eager steps with blocks of probe products (a
2048 x 2048 float32 mm, the float32 table's probe) so that both are timed in
the same spells (Note [The floor in the step's own phase] in
bench/workloads/main.cpp). Per process, step / floor is taken two ways: the
median step over the floor at the median probe rate, and the best step over
the floor at the best probe rate. The row's ratio is the median over
processes of the first. The FLOPs are the float32 table's (MATMUL_FLOPS:
gpt's counting the attention a causal kernel must do).

Each process also times a pass that reads and writes the parameters and the
optimizer's state once, after each probe block (Note [The optimizer's state in
the floor] in bench/workloads/main.cpp): memory traffic every update pays and
no FLOP count sees. Over the same floor it is the row's "state", and 1 + state
its "limit": a goal below the limit is below what the machine can do.

Goals (issue 26 §3, at 1 and 2 threads): gpt at most 1.08x its floor, mlp and
gpt_infer at most 1.05x. Times are never judged.
"""
import statistics

WORKLOADS = ["mlp", "gpt_infer", "gpt"]
STEPS = {"mlp": 100, "gpt_infer": 100, "gpt": 20}
GOAL = {"mlp": 1.05, "gpt_infer": 1.05, "gpt": 1.08}
PROBE_SIZE = 2048


def measure(run_process, env_for, command, kiln_bin, threads, workloads, pairs, quick_steps, log):
    """{threads: {workload: [kiln_bench --floor ab record of each process]}}."""
    out = {}
    warmup = 2 if quick_steps else 10
    for t in threads:
        for w in [w for w in WORKLOADS if w in workloads]:
            steps = quick_steps or STEPS[w]
            records = out.setdefault(t, {}).setdefault(w, [])
            for r in range(pairs):
                cmd = command("kiln", kiln_bin, [w], t, warmup, steps) + [
                    "--floor", "ab", "--size", str(256 if quick_steps else PROBE_SIZE)]
                recs, _ = run_process(cmd, env_for("kiln", "tunables", t))
                rec = recs[0]
                records.append(rec)
                log("[floor] threads %d %-9s process %d/%d  step %.3f ms  probe %.1f GFLOP/s (median)" % (
                    t, w, r + 1, pairs, rec["step_median_ms"], statistics.median(rec["probe_gflops"])))
    return out


def rows(results, flops):
    """flops: {workload: product FLOPs of one step} (the float32 table's count)."""
    table = []
    for t, by_w in results.items():
        for w, recs in by_w.items():
            if not recs or w not in flops:
                continue
            med, best, products, state = [], [], [], []
            for r in recs:
                probe_med, probe_best = statistics.median(r["probe_gflops"]), max(r["probe_gflops"])
                floor_ms = flops[w] / (probe_med * 1e6)
                med.append(r["step_median_ms"] / floor_ms)
                best.append(min(r["step_step_ms"]) / (flops[w] / (probe_best * 1e6)))
                if r.get("step_product_ms_per_step", 0) > 0:
                    products.append(r["step_product_ms_per_step"] / floor_ms)
                # The optimizer's state pass (Note [The optimizer's state in the floor] in
                # bench/workloads/main.cpp): 0 for inference and for records without it.
                state.append(statistics.median(r["state_pass_ms"]) / floor_ms if r.get("state_pass_ms") else 0.0)
            steps = [x for r in recs for x in r["step_step_ms"]]
            probes = [x for r in recs for x in r["probe_gflops"]]
            table.append({"workload": w, "threads": t, "goal": GOAL[w], "processes": len(recs),
                          "product_gflop": flops[w] / 1e9, "step_median_ms": statistics.median(steps),
                          "probe_size": recs[0]["probe_size"],
                          "probe_median_gflops": statistics.median(probes), "probe_best_gflops": max(probes),
                          "process_ratios": med, "ratio": statistics.median(med), "best_ratio": statistics.median(best),
                          "product_ratio": statistics.median(products) if products else None,
                          "state_bytes": recs[0].get("optimizer_state_bytes", 0),
                          "state_ratio": statistics.median(state)})
    return table


def markdown(table, fmt_time, quick):
    if not table:
        return ""
    out = ["", "### float32 floor, same phase: kiln eager vs the matmul probe beside it%s" % (
        " (QUICK: not a measurement)" if quick else ""), ""]
    out.append("Each process alternates blocks of kiln's eager float32 step with blocks of the float32 matmul probe "
               "(kiln_bench --floor ab; a %d² float32 mm), so both are timed in the same spells of the machine. "
               "floor = the step's product GFLOP at the probe's rate; ratio = median step / floor at the median "
               "probe rate, the median over processes (each process's beside it); best = best step / floor at the "
               "best probe rate (median over processes); products = the step's products alone, as the profiler "
               "times them on one step after each timed block (and the last warm-up steps: matmuls, convolutions and "
               "the attention rows that count FLOPs), "
               "over the same floor: what the kernels deliver on this step's shapes, so ratio − products is what the "
               "rest of the step adds. state = one pass reading and writing the parameters and the optimizer's state "
               "once (their bytes beside it), timed after each probe block, over the same floor: the memory traffic "
               "an update cannot avoid, which no product FLOP count sees; limit = 1 + state, the floor with it. "
               "A goal below its limit is below what this machine can do. "
               "Goal (issue 26 §3): gpt ≤ 1.08, mlp and gpt_infer ≤ 1.05."
               % table[0]["probe_size"])
    out.append("")
    out.append("| workload | threads | product GFLOP | step | probe GFLOP/s (median / best) | ratio | per process "
               "| best | products | state (MB) | limit | goal |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        state = r.get("state_ratio", 0.0)
        limit = 1.0 + state
        out.append("| %s | %d | %.3f | %s | %.0f / %.0f | %.3f | %s | %.3f | %s | %s | %s | ≤ %.2f%s |" % (
            r["workload"], r["threads"], r["product_gflop"], fmt_time(r["step_median_ms"]),
            r["probe_median_gflops"], r["probe_best_gflops"], r["ratio"],
            " ".join("%.3f" % x for x in r["process_ratios"]), r["best_ratio"],
            "—" if r["product_ratio"] is None else "%.3f" % r["product_ratio"],
            "%.3f (%.1f)" % (state, r.get("state_bytes", 0) / 1e6) if state > 0 else "—",
            "%.3f" % limit, r["goal"], " (below the limit)" if limit > r["goal"] else ""))
    return "\n".join(out) + "\n"


def self_test():
    """The ratios from synthetic records (scripts/test.sh runs this)."""
    rec = {"probe_size": 2048, "step_median_ms": 11.0, "step_step_ms": [10.0, 12.0, 11.0],
           "probe_gflops": [100.0, 200.0, 150.0], "step_product_ms_per_step": 8.0}
    slow = dict(rec, step_median_ms=22.0, step_step_ms=[20.0, 24.0, 22.0], probe_gflops=[50.0, 100.0, 75.0])
    table = rows({1: {"mlp": [rec, slow, rec]}}, {"mlp": 1e9})
    assert len(table) == 1, table
    r = table[0]
    # 1 GFLOP at the median probe rate of 150 GFLOP/s: a 6.67 ms floor under an 11 ms step.
    assert abs(r["process_ratios"][0] - 11.0 / (1e9 / 150e9 * 1e3)) < 1e-12, r
    # A process whose machine ran at half speed, step and probe alike, reads the same ratio.
    assert abs(r["process_ratios"][1] - r["process_ratios"][0]) < 1e-12, r
    # best: the best step over the floor at the best probe rate, 10 ms over 5 ms.
    assert abs(r["best_ratio"] - 2.0) < 1e-12, r
    assert r["goal"] == GOAL["mlp"] and r["processes"] == 3 and r["probe_size"] == 2048, r
    # products: 8 ms of products over the 6.67 ms floor (the slow process: 16 ms over 13.3 ms, the same).
    slow["step_product_ms_per_step"] = 16.0
    assert abs(rows({1: {"mlp": [rec, slow, rec]}}, {"mlp": 1e9})[0]["product_ratio"] - 1.2) < 1e-12
    assert rows({1: {"mlp": [dict(rec, step_product_ms_per_step=0)]}}, {"mlp": 1e9})[0]["product_ratio"] is None
    assert rows({1: {"tiny": [rec]}}, {"mlp": 1e9}) == [], "a workload without a FLOP count has no row"
    text = markdown(table, lambda ms: "%.2f ms" % ms, False)
    assert "| mlp | 1 | 1.000 | 12.00 ms | 100 / 200 | 1.650 | 1.650 1.650 1.650 | 2.000 | 1.200 | — | 1.000 | ≤ 1.05 |" \
        in text, text
    # state: the median state pass over the floor, 0.6 ms over 6.67 ms (the slow process: 1.2 over 13.3);
    # with it the limit, 1.09, is above the goal.
    timed = dict(rec, state_pass_ms=[0.5, 0.6, 0.7], optimizer_state_bytes=5357648)
    table = rows({1: {"mlp": [timed, dict(slow, state_pass_ms=[1.2]), timed]}}, {"mlp": 1e9})
    assert abs(table[0]["state_ratio"] - 0.09) < 1e-12, table
    text = markdown(table, lambda ms: "%.2f ms" % ms, False)
    assert "| 0.090 (5.4) | 1.090 | ≤ 1.05 (below the limit) |" in text, text
    print("floor_bench.py: self-test passed")
    return 0


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--self-test"]:
        sys.exit("usage: floor_bench.py --self-test (the table itself runs inside scripts/bench.sh)")
    sys.exit(self_test())
