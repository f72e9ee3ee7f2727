#!/usr/bin/env bash
# The main job: installs dependencies, builds, runs the tour of the C++ API
# (examples/tour.cpp), then trains the CNN of configs/fashion_cnn.toml on
# Fashion-MNIST with the `kiln` command — progress bar, periodic evaluation,
# checkpoints — and points at the run's report.
#   KILN_DEMO_EPOCHS=N   train N epochs instead of the config's 8
set -euo pipefail
cd "$(dirname "$0")/.."
# No OpenMP setting here: kiln bounds the spin of idle OpenMP threads itself
# (docs/decisions.md), so the demo runs as any user's `kiln train` does.
./scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j"$(nproc)" --target tour kiln_cmd
./scripts/link_kiln.sh  # `kiln` on PATH (or the line that puts it there)
export PATH="$PWD/build/release/bin:$PATH"  # for the rest of this script either way
./build/release/examples/tour
echo
echo "== kiln train configs/fashion_cnn.toml"
run_dir=runs/fashion_cnn
rm -rf "$run_dir"  # a fresh run each time (`kiln train` refuses to overwrite one)
extra=()
if [[ -n "${KILN_DEMO_EPOCHS:-}" ]]; then extra=(--set "train.epochs=$KILN_DEMO_EPOCHS"); fi
kiln train configs/fashion_cnn.toml --out "$run_dir" "${extra[@]}"
echo
/usr/bin/python3 - "$run_dir/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
f = s["final"]
acc = f"test accuracy {100 * f['accuracy']:.2f}% (loss {f['eval_loss']:.4f}), " if "accuracy" in f else ""
print(f"demo: {s['name']} {s['status']}, {s['steps']} steps in {s['wall_s']:.0f} s, "
      f"{acc}{f.get('samples_per_s', 0):.0f} samples/s")
PY
echo "report: $PWD/$run_dir/report.html (self-contained: open it in any browser, e.g. xdg-open, or copy it off the machine)"
echo "more:   kiln inspect $run_dir   |   kiln eval $run_dir   |   kiln --help"
