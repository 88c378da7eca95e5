"""Decode step time of the model runner vs batch size, against the weight-streaming floor.

    python bench/decode_step.py [--model MODEL] [--batch 1 8 32] [--context 256]

The floor is measured on the machine: the bytes of weights a decode step must read (every
linear layer and the LM head; the embedding is only indexed) over the memory read bandwidth
of a large sum. The bandwidth is probed right before and right after each batch size's steps
and the higher reading sets that row's floor: on shared machines it wanders (31-60 GB/s within
an hour on one), so a floor probed once at start can be far from the one the steps ran under.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from radixserve.config import EngineArgs
from radixserve.messages import ForwardBatch, ForwardMode, SamplingBatch
from radixserve.models.source import resolve_model
from radixserve.worker.model_runner import ModelRunner


def decode_batch(batch: int, context: int) -> ForwardBatch:
    seq = context + 1
    rows = list(range(batch))
    writes = [(r, 0, list(range(1 + r * seq, 1 + r * seq + context))) for r in rows]
    return ForwardBatch(
        ForwardMode.DECODE,
        [42] * batch,
        [context] * batch,
        [1 + r * seq + context for r in rows],
        rows,
        [seq] * batch,
        [1] * batch,
        writes,
        SamplingBatch.greedy(batch),
        [None] * batch,
    )


def time_steps(runner: ModelRunner, fb: ForwardBatch, steps: int) -> float:
    runner.forward(fb)
    fb.row_writes = []
    sync(runner)
    start = time.perf_counter()
    for _ in range(steps):
        runner.forward(fb)
    sync(runner)
    return (time.perf_counter() - start) / steps


def make_runner(
    model: str | None,
    max_batch: int,
    context: int,
    dtype: str = "auto",
    backend: str = "auto",
    quantization: str | None = None,
    **engine_args,
) -> ModelRunner:
    slots = max_batch * (context + 1) + 8
    return ModelRunner(
        resolve_model(model),
        EngineArgs(
            max_total_tokens=slots,
            max_running_requests=max_batch,
            dtype=dtype,
            attention_backend=backend,
            quantization=quantization,
            **engine_args,
        ),
    )


def sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step streams: the weights of every linear layer, LM head included."""
    from radixserve.models.layers import Linear

    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    tensors = [t for m in linears for t in list(m.parameters()) + list(m.buffers())]
    quantized = sum(m.quantized.nbytes for m in linears if m.quantized is not None)
    return quantized + sum(t.numel() * t.element_size() for t in tensors if t.dim() > 1)


def read_bandwidth(device: torch.device, mb: int = 512) -> float:
    """Bytes per second of a sum over a buffer far larger than the caches (best of 5)."""
    data = torch.ones(mb * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum().item()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--enable-torch-compile", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    runner = make_runner(
        a.model,
        max(a.batch),
        a.context,
        a.dtype,
        a.attention_backend,
        a.quantization,
        disable_cuda_graph=a.disable_cuda_graph,
        enable_torch_compile=a.enable_torch_compile,
    )
    streamed = weight_bytes(runner)
    print(f"weights streamed per step: {streamed / 1e6:.0f} MB ({runner.dtype})")
    rows = []
    for b in a.batch:
        before = read_bandwidth(runner.device)
        ms = time_steps(runner, decode_batch(b, a.context), a.steps) * 1000
        bandwidth = max(before, read_bandwidth(runner.device))
        floor_ms = streamed / bandwidth * 1000
        rows.append(
            {
                "batch": b,
                "context": a.context,
                "step_ms": round(ms, 2),
                "tok_per_s": round(b / ms * 1000, 1),
                "bandwidth_gb_s": round(bandwidth / 1e9, 2),
                "floor_ms": round(floor_ms, 2),
                "x_floor": round(ms / floor_ms, 2),
            }
        )
        print(
            f"batch {b:3d}  context {a.context}  step {ms:7.2f} ms  {b / ms * 1000:8.1f} tok/s  "
            f"floor {floor_ms:5.2f} ms ({bandwidth / 1e9:.1f} GB/s)  {ms / floor_ms:4.2f}x the "
            "floor"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
