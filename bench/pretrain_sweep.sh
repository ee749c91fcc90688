#!/usr/bin/env bash
# (a) no pretraining vs (b) pretraining, each followed by the same short SFT; held-out success on 200 tasks.
# One torch thread throughout. Usage: bench/pretrain_sweep.sh OUT_DIR [PRETRAIN_STEPS] [SFT_STEPS]
set -euo pipefail
OUT=${1:-runs/pretrain_sweep}; PT=${2:-300}; SFT=${3:-150}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
run() { local name=$1; shift; local t0=$(date +%s.%N); "$@" > "$OUT/$name.log" 2>&1; echo "$name $(echo "$(date +%s.%N) - $t0" | bc)" >> "$OUT/times.txt"; }
run init_a mentorrl init-model "$OUT/base_a" --set threads=1
run init_b mentorrl init-model "$OUT/base_b" --set threads=1 --pretrain-steps "$PT" \
    --set model.pretrain.batch_size=16 --set model.pretrain.block_size=256
for v in a b; do
  run "sft_$v" mentorrl train bench/configs/pretrain_sft.yaml --set model.path="$OUT/base_$v" \
      --set run_dir="$OUT/sft_$v" --set sft.steps="$SFT"
done
