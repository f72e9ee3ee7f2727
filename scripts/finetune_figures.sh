#!/bin/bash
# The fine-tuning table of docs/finetuning.md (issue 23): trains the Moby-Dick
# GPT for 800 steps into runs/gpt_mobydick (unless it is there), fine-tunes it
# on Sherlock Holmes for 300 steps each way (full, LoRA r = 4/8/16, QLoRA r = 8,
# and the variants of the table), then prints the table
# (scripts/finetune_table.py). About an hour on 2 cores.
#   scripts/finetune_figures.sh [KILN]   (default build/release/bin/kiln)
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-build/release/bin/kiln}
run() {
  local out=$1
  shift
  [ -f "runs/$out/summary.json" ] && return 0
  echo "== $out $*"
  "$K" train "$@" --out "runs/$out" | grep -v "^step [0-9]*/"
}
run gpt_mobydick configs/gpt_mobydick.toml --set train.steps=800
L=configs/gpt_sherlock_lora.toml
# The base row: one step at lr 0 evaluates init_from's weights on the held-out text.
run sherlock_base $L --set name='"sherlock_base"' --set lora.rank=0 --set optim.lr=0 --set train.steps=1
run sherlock_full $L --set name='"sherlock_full"' --set lora.rank=0 --set optim.lr=5e-4
run sherlock_full_lr1e-3 $L --set name='"sherlock_full_lr1e-3"' --set lora.rank=0 --set optim.lr=1e-3
run sherlock_lora_r4 $L --set name='"sherlock_lora_r4"' --set lora.rank=4
run sherlock_lora_r8 $L
run sherlock_lora_r16 $L --set name='"sherlock_lora_r16"' --set lora.rank=16
run sherlock_qlora_r8 configs/gpt_sherlock_qlora.toml
run sherlock_lora_r8_attn $L --set name='"sherlock_lora_r8_attn"' --set lora.targets='"attn.c_attn"'
run sherlock_lora_r8_lr5e-3 $L --set name='"sherlock_lora_r8_lr5e-3"' --set optim.lr=5e-3
run sherlock_lora_r8_lr1e-2 $L --set name='"sherlock_lora_r8_lr1e-2"' --set optim.lr=1e-2
python3 scripts/finetune_table.py runs
