#!/usr/bin/env bash
# Set everything up on a fresh machine (first run only) and serve the bundled model
# on 127.0.0.1:30000. Extra flags go to `radixserve serve` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${RADIXSERVE_VENV:-.venv}/bin/radixserve" serve --host 127.0.0.1 --port 30000 "$@"
