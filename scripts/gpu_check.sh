#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine (no package registry there: it uses what the image
# has; torch and triton are expected, flashinfer is optional). Finishes in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
# the radixserve_kernels package lives under kernels/; without installing, put that on the path
export PYTHONPATH="$PWD/kernels:$PYTHONPATH"
timeout 480 python3 scripts/gpu_check.py
