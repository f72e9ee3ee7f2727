#!/usr/bin/env bash
# kiln against PyTorch on the workloads of bench/ (docs/benchmarks.md): builds
# kiln_bench (release preset), then runs each workload in kiln and in its
# PyTorch twin alternately and prints a Markdown table; results also go to
# bench/results/latest.json and latest.md (--quick: quick.json and quick.md).
#
#   scripts/bench.sh [--workloads tiny,mlp,cnn,resnet,gpt,gpt_infer] [--threads 1,2]
#                    [--quick] [--pairs 3] [--torch-configs installed,tunables,avx512]
#                    [--out FILE.json] [--note TEXT]
#                    [--no-infer | --infer-only] [--infer-workloads cnn,resnet,gpt_infer]
#                    [--no-profiler-overhead] [--no-ddp] [--no-bf16] [--no-compiled] [--no-floor]
#                    [--pin-cpu N]
#
# The "profiler overhead" table (tiny and gpt with the profiler off and with a
# Profiler recording every step, alternately; bench/profiler_overhead.py)
# follows the training one.
# The inference table (kiln optimised vs kiln eager vs ONNX Runtime on the same
# exported model, issue 21) follows the training one; --infer-only runs just
# it (results in bench/results/infer.json and infer.md).
# The DDP table (gpt weak scaling under mpirun, 1 rank vs 2 ranks, exposed
# communication; bench/ddp_bench.py, kiln_bench_ddp) follows; --no-ddp skips it.
# The bf16 table (cnn, resnet, gpt: kiln bf16 autocast vs kiln float32 vs
# PyTorch's CPU bf16 autocast; bench/bf16_bench.py) follows the profiler
# overhead rows; --no-bf16 skips it. The compiled table (every workload
# through kiln::compile vs kiln eager; bench/compiled_bench.py) follows it;
# --no-compiled skips it. The same-phase floor table (mlp, gpt_infer, gpt:
# kiln's eager step beside the matmul probe in one process;
# bench/floor_bench.py) follows that; --no-floor skips it.
# --quick: one round of a few steps, every workload of a framework in one
# process, 1 thread unless --threads: proves the harness works in seconds; its
# figures are not a measurement. Benchmarks never fail on a time; the run exits
# non-zero only when something breaks or the two sides' first-step losses
# disagree (they would be computing different models).
#   KILN_BENCH_BIN=path  use this kiln_bench instead of building build/release's
#                        (kiln_bench_infer is then taken from beside it, when there)
set -euo pipefail
cd "$(dirname "$0")/.."

for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
  fi
done

bin=${KILN_BENCH_BIN:-}
if [[ -z $bin ]]; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  if [[ ! -f build/release/build.ninja ]]; then
    cmake --preset release >/dev/null
  fi
  cmake --build build/release --target kiln_bench kiln_bench_infer >&2
  # Only where MPI was found (kiln_dist); compare.py says so when it is missing.
  if [[ " $* " != *" --no-ddp "* ]]; then
    cmake --build build/release --target kiln_bench_ddp >&2 || echo "bench.sh: no kiln_bench_ddp; the DDP table is skipped" >&2
  fi
  bin=build/release/bench/kiln_bench
fi
[[ -x $bin ]] || { echo "bench.sh: no kiln_bench at $bin" >&2; exit 1; }

exec /usr/bin/python3 bench/compare.py --kiln "$bin" "$@"
