#!/bin/bash
# The fine-tuning table of docs/finetuning.md (issue 23): trains the Moby-Dick
# GPT (configs/gpt_mobydick.toml: its 2,500-step schedule, stopped at step 2,000)
# into runs/gpt_mobydick unless it is there, then fine-tunes it on Sherlock
# Holmes for 300 steps every way the table lists, and prints the table
# (scripts/finetune_table.py).
#
# Every fine-tune has the same steps and schedule (300 steps of 32 x 128 bytes,
# 20 warm-up steps, cosine down to lr/20); only the learning rate differs, and
# each method is run at several, so that each is compared at its own best.
#   scripts/finetune_figures.sh [KILN]   (default build/release/bin/kiln)
#   JOBS=2 scripts/finetune_figures.sh   runs two fine-tunes at a time
#   THREADS=1                            kiln's threads per run (0: kiln's default)
# About 1.5 hours with JOBS=2 THREADS=1 on 2 shared cores (December 2026).
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-build/release/bin/kiln}
JOBS=${JOBS:-1}
THREADS=${THREADS:-0}
mkdir -p runs
run() {
  local out=$1
  shift
  [ -f "runs/$out/summary.json" ] && return 0
  echo "== $out $*"
  "$K" train "$@" --set threads="$THREADS" --set name="\"$out\"" --out "runs/$out" >"runs/$out.log" 2>&1 ||
    { echo "$out failed: see runs/$out.log"; return 1; }
}
# Starts run "$@" in the background once fewer than JOBS are running.
queue() {
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run "$@" &
}
# The base: the 2,500-step schedule of configs/gpt_mobydick.toml, stopped at
# step 2,000 (train.max_steps) for time; its lr is near the schedule's floor there.
[ -f runs/gpt_mobydick/checkpoints/ckpt-00002000.safetensors ] ||
  run gpt_mobydick configs/gpt_mobydick.toml --set train.eval_every=250 --set train.max_steps=2000
L=configs/gpt_sherlock_lora.toml
Q=configs/gpt_sherlock_qlora.toml
# One fine-tune: NAME LR CONFIG [--set ...]. The schedule's floor is lr/20 for every run.
ft() {
  local name=$1 lr=$2 config=$3
  shift 3
  queue "sherlock_${name}_lr$lr" "$config" --set optim.lr="$lr" --set schedule.min_lr="$(python3 -c "print($lr / 20)")" "$@"
}
# The base row: one step at lr 0 evaluates init_from's weights on the held-out text.
queue sherlock_base $L --set lora.rank=0 --set optim.lr=0 --set schedule.min_lr=0 --set train.steps=1
# Full fine-tuning, the reference: its best lr, bracketed.
for lr in 1e-3 3e-3 1e-2; do ft full $lr $L --set lora.rank=0; done
# LoRA r = 8 on every block Linear (7.2 % trainable), and r = 2 / r = 1 + biases, the
# largest that fit in 2 % (1.9 %, 1.6 %); each at several lrs.
for lr in 3e-3 1e-2 3e-2; do ft r8_all $lr $L; done
for lr in 3e-3 1e-2 3e-2; do ft r2_all $lr $L --set lora.rank=2; done
for lr in 3e-3 1e-2 3e-2; do ft r1_all_biasall $lr $L --set lora.rank=1 --set lora.bias='"all"'; done
# The issue's rows: r = 4 and 16, and QLoRA r = 8, at r = 8's best lr.
ft r4_all 1e-2 $L --set lora.rank=4
ft r16_all 1e-2 $L --set lora.rank=16
ft qlora_r8_all 1e-2 $Q
# Other placements at about 2 %.
ft r8_cattn 1e-2 $L --set lora.targets='"attn.c_attn"'
ft r2_all_biasall 1e-2 $L --set lora.rank=2 --set lora.bias='"all"'
ft r1_all 1e-2 $L --set lora.rank=1
ft r4_attn 1e-2 $L --set lora.rank=4 --set lora.targets='"attn.c_attn,attn.c_proj"'
wait
python3 scripts/finetune_table.py runs
