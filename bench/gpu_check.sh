#!/usr/bin/env bash
# The GPU check of the vLLM rollout backend (issue 19): a ~0.5B random-init Qwen2 (Qwen2-0.5B's shape, the
# project's tokenizer) built locally, rolled out on held-out orders tasks by the project's engine and by vLLM
# on the GPU, side by side; prints policy tokens/s of each, the log-prob gap against the learner's
# recomputation, vLLM's start time and its weight-sync time per update. Nothing is downloaded: the model is
# built here. Needs a CUDA machine with torch (CUDA build), vllm and this package installed
# (`pip install -e ".[vllm-gpu]"`); writes $OUT/gpu_check.json (or ./gpu_check.json) and the log.
#
#   bash bench/gpu_check.sh                 # defaults: 64 tasks, 3 alternating repeats
#   TASKS=16 REPEATS=1 bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)
import vllm
print("vllm", vllm.__version__)
PY
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
python bench/rollout_backends.py --size 0.5b --device cuda --tasks "${TASKS:-64}" --repeats "${REPEATS:-3}" \
  --threads 4 --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
