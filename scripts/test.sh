#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${RADIXSERVE_VENV:-.venv}/bin/python" -m pytest "$@"
