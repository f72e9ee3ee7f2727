#!/usr/bin/env bash
# The one test command (README, .ci/run): installs dependencies, configures,
# builds, and runs every test through CTest. Exits non-zero on any failure.
#   KILN_SKIP_SETUP=1  skip scripts/setup.sh (dependencies already present)
#   KILN_SKIP_ASAN=1   skip the AddressSanitizer+UBSan pass
#   KILN_SKIP_FUZZ=1   skip the bounded fuzzing of the readers
#   KILN_FUZZ_SECONDS  seconds per fuzz target (default 20)
set -euo pipefail
cd "$(dirname "$0")/.."

[[ ${KILN_SKIP_SETUP:-0} == 1 ]] || ./scripts/setup.sh

jobs=$(nproc)
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
# Relative paths in the cache key: a fresh clone elsewhere still hits the cache.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}

echo "== release build"
cmake --preset release >/dev/null
cmake --build build/release -j"$jobs"
./scripts/link_kiln.sh  # `kiln` on PATH (or the line that puts it there), as the README's commands expect
echo "== layer check (docs/architecture.md)"
/usr/bin/python3 scripts/check_layers.py --self-test
/usr/bin/python3 scripts/check_layers.py build/release
echo "== format check (.clang-format; tests/ lays out its tables by hand and is exempt)"
find src include tools examples bench \( -name '*.cpp' -o -name '*.h' \) -print0 \
  | xargs -0 clang-format-14 --dry-run -Werror
echo "== portable kernels: src/kernels compiles for an AVX2-only x86-64 too (docs/decisions.md, Note [Kernels without AVX-512])"
/usr/bin/python3 scripts/check_portable_kernels.py build/release
echo "== release tests"
ctest --test-dir build/release --output-on-failure

echo "== benchmarks: build, then scripts/bench.sh --quick once (proves they run; no time is asserted)"
/usr/bin/python3 bench/ddp_bench.py --self-test
/usr/bin/python3 bench/floor_bench.py --self-test
cmake --build build/release -j"$jobs" --target kiln_bench kiln_micro_bench
build/release/bench/micro/kiln_micro_bench --benchmark_list_tests >/dev/null
KILN_BENCH_BIN=build/release/bench/kiln_bench ./scripts/bench.sh --quick

echo "== install and build a find_package(kiln) consumer"
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/release --prefix "$prefix/kiln" >/dev/null
# The installed API is backend-neutral: no kernel header, no oneDNN or BLAS type or header.
if [[ -e "$prefix/kiln/include/kiln/kernels" ]] \
   || grep -rlE 'dnnl|cblas|openblas|kiln/kernels/' "$prefix/kiln/include"; then
  echo "test.sh: the installed headers expose kernels or a backend (above)" >&2
  exit 1
fi
awk '/^```cpp/{f=1;next} /^```/{if(f){exit}} f' README.md > "$prefix/readme_example.cpp"
cmake -S tests/install -B "$prefix/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix/kiln" \
  -DREADME_EXAMPLE="$prefix/readme_example.cpp" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
"$prefix/consumer/app"
"$prefix/consumer/dist_app"
"$prefix/consumer/export_app"
# kiln::kiln alone puts no MPI on a single-process program's compile or link line.
if grep '"file": ".*/main.cpp"' -B3 "$prefix/consumer/compile_commands.json" | grep -qi 'openmpi\|libmpi\|mpi_cxx' \
   || ldd "$prefix/consumer/app" | grep -qi libmpi; then
  echo "test.sh: the single-process consumer (kiln::kiln) was built or linked with MPI" >&2
  exit 1
fi
(cd "$prefix" && "$prefix/consumer/readme_example")

if [[ ${KILN_SKIP_ASAN:-0} != 1 ]]; then
  echo "== asan-ubsan build"
  cmake --preset asan-ubsan >/dev/null
  cmake --build build/asan -j"$jobs" --target test_core test_io test_autograd test_data test_export
  echo "== asan-ubsan tests (core, io, autograd)"
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build/asan --output-on-failure -R '^(core|io|autograd)$'
  # The data readers on small and hostile files (the real datasets' tests would only add time).
  echo "== asan-ubsan tests (data readers)"
  ASAN_OPTIONS=detect_leaks=1 OMP_NUM_THREADS=2 build/asan/tests/test_data \
    --gtest_filter='HostileIdx.*:HostileText.*:DataIdx.PlainAndGzipped*:DataIdx.Corrupted*:DataText.SmallFile*:DataText.TokenFile*'
  # kiln::compile replays closures that hold raw pointers recorded at capture: a pointer to a
  # freed block or a dead stack buffer (a scalar operand) shows up here.
  echo "== asan-ubsan tests (compile: capture and replay)"
  ASAN_OPTIONS=detect_leaks=1:detect_stack_use_after_return=1 OMP_NUM_THREADS=2 build/asan/tests/test_export \
    --gtest_filter='Compile.*:CompileSites.*:CompileFusion.*:CompileSplit.*:CompileRewrite.*'
fi

if [[ ${KILN_SKIP_FUZZ:-0} != 1 ]]; then
  # Each reader's libFuzzer target for a bounded time (clang build in build/fuzz); a crash fails CI.
  echo "== fuzz the readers"
  ./scripts/fuzz.sh "${KILN_FUZZ_SECONDS:-20}"
fi
