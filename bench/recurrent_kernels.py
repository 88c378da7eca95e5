"""Hybrid models' recurrent decode steps: the torch path against the C++ kernels.

    python bench/recurrent_kernels.py [--out results/recurrent_kernels.json]

One decode step of one layer, for 8 running requests whose states sit in a pool of 64 + 256
slots, at real models' shapes: a Qwen3.5-9B Gated DeltaNet layer (32 value heads over 16 key
heads, key and value dims 128) and a Nemotron-H 8B Mamba2 layer (128 heads of 64, state 128,
8 groups). The torch path gathers the requests' rows, steps them and scatters them back
(`models/recurrent.each_request`); the kernels (`cpu_recurrent.cpp`) update the rows in place.
Median of 50 steps after 5 warm-up steps, float32, on this machine's threads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.models.mamba2 import mamba2_step
from radixserve.models.recurrent import delta_step_in_place, gated_delta_rule_step
from radixserve_kernels.cpu_ops import load

BATCH, SLOTS = 8, 64 + 256


def median_ms(fn, steps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def torch_step(states, rows, step, *tensors):
    picked = states[rows]
    out = step(*tensors, picked)
    states[rows] = picked
    return out


def delta_case(kernels) -> dict:
    heads, key_heads, dim = 32, 16, 128
    states = torch.zeros(SLOTS, heads, dim, dim)
    rows = torch.arange(3, 3 + BATCH)
    q, k = torch.randn(BATCH, key_heads, dim), torch.randn(BATCH, key_heads, dim)
    v = torch.randn(BATCH, heads, dim)
    g, beta = -F.softplus(torch.randn(BATCH, heads)), torch.rand(BATCH, heads)
    return {
        "layer": "Qwen3.5-9B Gated DeltaNet",
        "torch_ms": median_ms(
            lambda: torch_step(states, rows, gated_delta_rule_step, q, k, v, g, beta)
        ),
        "kernel_ms": median_ms(
            lambda: delta_step_in_place(kernels, states, rows, q, k, v, g, beta)
        ),
    }


def mamba_case(kernels) -> dict:
    heads, dim, size, groups = 128, 64, 128, 8
    states = torch.zeros(SLOTS, heads, dim, size)
    rows = torch.arange(3, 3 + BATCH)
    x, dt = torch.randn(BATCH, heads, dim), F.softplus(torch.randn(BATCH, heads))
    b, c = torch.randn(BATCH, groups, size), torch.randn(BATCH, groups, size)
    a, d = -torch.rand(heads), torch.randn(heads)
    return {
        "layer": "Nemotron-H 8B Mamba2",
        "torch_ms": median_ms(
            lambda: torch_step(
                states, rows, lambda *t: mamba2_step(*t[:2], a, *t[2:4], d, t[4]), x, dt, b, c
            )
        ),
        "kernel_ms": median_ms(lambda: kernels.mamba2_step(states, rows, x, dt, a, b, c, d)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "recurrent_kernels.json")
    )
    args = ap.parse_args()
    kernels = load()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built here")
    rows = [delta_case(kernels), mamba_case(kernels)]
    for row in rows:
        print(
            f"{row['layer']:28s} torch {row['torch_ms']:.2f} ms  kernel {row['kernel_ms']:.2f} ms  "
            f"({row['torch_ms'] / row['kernel_ms']:.1f}x)"
        )
    Path(args.out).write_text(
        json.dumps({"batch": BATCH, "threads": torch.get_num_threads(), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
