#!/usr/bin/env bash
# Builds the fuzz preset (clang + libFuzzer, ASan+UBSan; build/fuzz) and runs
# each reader's fuzz target (tests/fuzz) for a bounded time, then prints the
# executions per target. Exits non-zero if any target finds a crash, a leak, a
# sanitizer report or an over-budget allocation; the input is kept under
# build/fuzz/crashes/<target>/ (add it to tests/fuzz/corpus/<target>/ and to a
# unit test once fixed).
#   scripts/fuzz.sh [SECONDS] [TARGET...]   SECONDS per target (default 20);
#                                           targets: safetensors idx text checkpoint config npy image csv
#                                           shard_index onnx
#   KILN_FUZZ_RUNS=N   also stop a target after N inputs
#   KILN_FUZZ_JOBS=N   build parallelism (default: nproc)
# Inputs start from three corpora: build/fuzz/corpus/<target> (what earlier runs
# found; grows), the seeds kiln_fuzz_seeds writes with kiln's own writers, and
# the committed regressions in tests/fuzz/corpus/<target>.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-20}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(safetensors idx text checkpoint config npy image csv shard_index onnx)
declare -A max_len=([safetensors]=8192 [idx]=4096 [text]=2048 [checkpoint]=8192 [config]=4096 [npy]=4096 [image]=8192 [csv]=4096 [shard_index]=8192 [onnx]=16384)

export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
cmake --preset fuzz >/dev/null
cmake --build build/fuzz -j"${KILN_FUZZ_JOBS:-$(nproc)}" --target kiln_fuzzers

out=build/fuzz
rm -rf "$out/seeds"
"$out/fuzz/kiln_fuzz_seeds" "$out/seeds"

export OMP_NUM_THREADS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=()
summary=()
for t in "${targets[@]}"; do
  [[ -n ${max_len[$t]:-} ]] || { echo "fuzz.sh: unknown target '$t'" >&2; exit 2; }
  mkdir -p "$out/corpus/$t" "$out/crashes/$t" "$out/seeds/$t"
  corpora=("$out/corpus/$t" "$out/seeds/$t")
  [[ -d tests/fuzz/corpus/$t ]] && corpora+=("tests/fuzz/corpus/$t")
  # The shipped run configs are the config target's seeds.
  [[ $t == config ]] && corpora+=(configs)
  log="$out/fuzz-$t.log"
  echo "== fuzz $t: ${secs}s"
  rc=0
  "$out/fuzz/fuzz_$t" -max_total_time="$secs" ${KILN_FUZZ_RUNS:+-runs=$KILN_FUZZ_RUNS} -timeout=20 \
    -max_len="${max_len[$t]}" -rss_limit_mb=2048 -malloc_limit_mb=512 -print_final_stats=1 \
    -artifact_prefix="$out/crashes/$t/" "${corpora[@]}" >"$log" 2>&1 || rc=$?
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -n1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n1 | awk '{print $2}')
  summary+=("$(printf '%-12s %10s executions  %6s edges  %s' "$t" "${execs:-?}" "${cov:-?}" \
    "$([[ $rc == 0 ]] && echo ok || echo "FAILED (rc $rc)")")")
  if [[ $rc != 0 ]]; then
    failed+=("$t")
    tail -n 40 "$log"
    echo "fuzz.sh: $t failed; the input is in $out/crashes/$t/ and the log in $log" >&2
  fi
done
echo "== fuzz summary (${secs}s per target)"
printf '%s\n' "${summary[@]}"
((${#failed[@]} == 0)) || { echo "fuzz.sh: crashes in: ${failed[*]}" >&2; exit 1; }
