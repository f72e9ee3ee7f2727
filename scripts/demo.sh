#!/usr/bin/env bash
# The main job. Until the `kiln` CLI exists (issue 7), it builds the library
# and runs examples/tour.cpp, which exercises tensors, views, ops, oneDNN
# matmul/conv and safetensors end to end and prints what it did.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j"$(nproc)" --target tour
./build/release/examples/tour
