#!/usr/bin/env bash
# The main job. Until the `kiln` command exists (issue 7), it builds the
# library and runs two programs written against the C++ API:
#   examples/tour.cpp          tensors, views, ops, oneDNN, the allocator, safetensors, errors
#   examples/train_fashion.cpp the WORKLOADS.md CNN trained on Fashion-MNIST (DataLoader with
#                              worker threads, Adam, cross-entropy), then its test accuracy
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j"$(nproc)" --target tour train_fashion
./build/release/examples/tour
echo
echo "== training the CNN on Fashion-MNIST"
./build/release/examples/train_fashion "${KILN_DEMO_EPOCHS:-5}"
