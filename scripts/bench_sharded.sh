#!/usr/bin/env bash
# The gpt workload under DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP) on N ranks x 1
# thread (default 2): step time, per-rank peak memory by category and the time
# each step waits on communication, as a Markdown table (docs/distributed.md,
# "Figures"). Builds kiln_bench_sharded (release preset) unless KILN_BENCH_SHARDED_BIN is set.
#   scripts/bench_sharded.sh [ranks] [steps]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-2}
steps=${2:-8}
bin=${KILN_BENCH_SHARDED_BIN:-}
if [[ -z $bin ]]; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  [[ -f build/release/build.ninja ]] || cmake --preset release >/dev/null
  cmake --build build/release --target kiln_bench_sharded >&2
  bin=build/release/bench/kiln_bench_sharded
fi
# DESIGN.md §6: Open MPI needs these malloc settings here, and root needs the two ALLOW variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296
export OMP_NUM_THREADS=1
exec mpirun -np "$ranks" -x GLIBC_TUNABLES -x OMP_NUM_THREADS "$bin" "$steps"
