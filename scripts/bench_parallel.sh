#!/usr/bin/env bash
# Model parallelism's costs (issue 20, docs/parallel.md "Figures"): the gpt
# workload (configs/gpt_mobydick.toml: 4 layers, d 128, context 128, global
# batch 32, dropout off) trained for a few steps by `kiln train` on one
# process and under each layout of [parallel] (dp x tp x pp, sequence
# parallel, both pipeline schedules), one thread per rank. Prints a Markdown
# table of rank 0's figures from metrics.jsonl: step time, peak memory by
# category, and the bytes each step handed to communication (dist/traffic.h).
# Every layout also prints its last loss, which must equal one process's
# within float32 rounding (dp layouts: the 2-rank ddp run's batches).
#   scripts/bench_parallel.sh [steps]      (default 12; the figures average the second half)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
half=$((steps / 2))
kiln=${KILN_BIN:-build/release/bin/kiln}
if [[ -z ${KILN_BIN:-} ]]; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  [[ -f build/release/build.ninja ]] || cmake --preset release >/dev/null
  cmake --build build/release --target kiln_cmd >&2
fi
# DESIGN.md §6: Open MPI needs these malloc settings here, and root needs the two ALLOW variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296
export OMP_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common="--set model.dropout=0.0 --set train.steps=$steps --set train.log_every=$half --set train.eval_every=0
        --set train.ckpt_every=0 --set data.num_workers=1 --set threads=1"
# name | ranks | --set arguments
layouts=(
  "one process|1|"
  "ddp (dp 2)|2|--set data.batch_size=16"
  "tp 2|2|--set parallel.tp=2"
  "tp 2 + SP|2|--set parallel.tp=2 --set parallel.sequence_parallel=true"
  "pp 2, 1F1B, M 4|2|--set parallel.pp=2 --set parallel.micro_batches=4"
  "pp 2, GPipe, M 4|2|--set parallel.pp=2 --set parallel.micro_batches=4 --set parallel.schedule=gpipe"
  "tp 4|4|--set parallel.tp=4"
  "pp 4, 1F1B, M 8|4|--set parallel.pp=4 --set parallel.micro_batches=8"
  "tp 2 x pp 2, M 4|4|--set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=4"
  "dp 2 x tp 2|4|--set parallel.tp=2 --set data.batch_size=16"
  "dp 2 x tp 2 x pp 2, M 4|8|--set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=4 --set data.batch_size=16"
  "same, SP + ZeRO-1|8|--set parallel.tp=2 --set parallel.pp=2 --set parallel.micro_batches=4 --set data.batch_size=16 --set parallel.sequence_parallel=true --set dist.strategy=zero1"
)
i=0
for l in "${layouts[@]}"; do
  IFS='|' read -r name ranks sets <<<"$l"
  dir="$out/run$i"
  # shellcheck disable=SC2086
  if [[ $ranks == 1 ]]; then
    "$kiln" train configs/gpt_mobydick.toml --out "$dir" $common $sets >"$out/log$i" 2>&1
  else
    "$kiln" launch -n "$ranks" -- kiln train configs/gpt_mobydick.toml --out "$dir" $common $sets >"$out/log$i" 2>&1
  fi || { echo "$name failed:" >&2; tail -20 "$out/log$i" >&2; exit 1; }
  echo "$name|$ranks|$dir" >>"$out/index"
  i=$((i + 1))
done
/usr/bin/python3 - "$out/index" <<'PY'
import json, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1])]
MB = 1e6
print("| layout | ranks | step ms | parameters MB | gradients MB | optimizer MB | activations MB | comm MB/step | last loss |")
print("|---|---|---|---|---|---|---|---|---|")
base = None
for name, ranks, d in rows:
    lines = [json.loads(x) for x in open(d + "/metrics.jsonl") if '"kind":"train"' in x]
    last = lines[-1]
    step_ms = 1000 * 32 / last["samples_per_s"]
    m = last["memory"]
    comm = last.get("comm_bytes_per_step", 0) / MB
    print(f"| {name} | {ranks} | {step_ms:.0f} | {m['parameter']/MB:.2f} | {m['gradient']/MB:.2f} | "
          f"{m['optimizer_state']/MB:.2f} | {m['activation']/MB:.2f} | {comm:.1f} | {last['loss']:.6f} |")
PY
