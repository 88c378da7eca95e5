#!/usr/bin/env bash
# Install SGLang's frontend language (the `sglang` PyPI package) into .sglang-frontend/,
# without its GPU runtime dependencies, so tests can run SGLang programs against radixserve.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${RADIXSERVE_VENV:-.venv}/bin/python"
TARGET=.sglang-frontend
# Importing sglang creates cache folders under $HOME: keep them inside the target folder.
probe() {
  HOME="$PWD/$TARGET/.home" XDG_CACHE_HOME="$PWD/$TARGET/.home/.cache" PYTHONPATH=$TARGET "$PY" -c "$1"
}
if probe "from sglang import RuntimeEndpoint" 2>/dev/null; then
  exit 0
fi
# The frontend imports these at module load; the rest of sglang's requirements serve its own runtime.
"$PY" -m pip install -q --no-deps --target "$TARGET" sglang==0.5.23 pybase64 pillow msgspec ipython \
  traitlets aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
probe "from sglang import RuntimeEndpoint; print('sglang frontend ready')"
