#!/usr/bin/env bash
# The one test command (README, .ci/run): installs dependencies, configures,
# builds, and runs every test through CTest. Exits non-zero on any failure.
#   KILN_SKIP_SETUP=1  skip scripts/setup.sh (dependencies already present)
#   KILN_SKIP_ASAN=1   skip the AddressSanitizer+UBSan pass
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
echo "== release tests"
ctest --test-dir build/release --output-on-failure

echo "== benchmarks: build, then scripts/bench.sh --quick once (proves they run; no time is asserted)"
cmake --build build/release -j"$jobs" --target kiln_bench kiln_micro_bench
build/release/bench/micro/kiln_micro_bench --benchmark_list_tests >/dev/null
KILN_BENCH_BIN=build/release/bench/kiln_bench ./scripts/bench.sh --quick

echo "== install and build a find_package(kiln) consumer"
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install build/release --prefix "$prefix/kiln" >/dev/null
awk '/^```cpp/{f=1;next} /^```/{if(f){exit}} f' README.md > "$prefix/readme_example.cpp"
cmake -S tests/install -B "$prefix/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix/kiln" \
  -DREADME_EXAMPLE="$prefix/readme_example.cpp" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
"$prefix/consumer/app"
(cd "$prefix" && "$prefix/consumer/readme_example")

if [[ ${KILN_SKIP_ASAN:-0} != 1 ]]; then
  echo "== asan-ubsan build"
  cmake --preset asan-ubsan >/dev/null
  cmake --build build/asan -j"$jobs" --target test_core test_io test_autograd
  echo "== asan-ubsan tests (core, io, autograd)"
  ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build/asan --output-on-failure -R '^(core|io|autograd)$'
fi
