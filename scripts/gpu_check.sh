#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (no package registry there: it uses what the image
# has; torch and triton are expected, flashinfer is optional). Finishes in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
# radixserve_kernels maps to the kernels/ folder when installed; without installing, alias it.
mkdir -p /tmp/rs_alias && ln -sfn "$PWD/kernels" /tmp/rs_alias/radixserve_kernels
export PYTHONPATH="/tmp/rs_alias:$PYTHONPATH"
timeout 480 python3 scripts/gpu_check.py
