"""DeepSeek-V3.2's sparse attention on CPU: one layer's attention over the latent pool, each
query over its `index_topk` (2,048) selected rows through the CPU kernel
(`cpu_sparse_attention.cpp`), against the dense attention over every earlier row that the
sparse path replaced (the rows gathered, scored and summed with torch's bf16 matmuls).

    python bench/dsa.py [--heads 16] [--runs 5] [--out results/dsa.json]

Shapes: V3.2's latent (512) and rotary (64) widths, its indexer key (128) behind them in the
pool row, bf16 rows; `--heads` query heads (128 in V3.2, so 16 is one of eight TP ranks).
Decode: 8 queries, each at the end of its own context. Prefill: a 256-token chunk at the end of
one context. The indexer's scoring (which stays dense, it picks the rows) is not timed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from recurrent_kernels import median_ms

from radixserve_kernels.cpu_ops import load

RANK, ROPE, INDEX, TOPK = 512, 64, 128, 2048


def dense(q: torch.Tensor, rows: torch.Tensor, contexts: list[int], scale: float) -> torch.Tensor:
    """Each request's queries (the last ones of its context) over all its rows, causal."""
    out, start = [], 0
    for length, n in contexts:
        keys = rows[1 : length + 1, : RANK + ROPE]
        scores = torch.einsum("nhc,lc->nhl", q[start : start + n], keys).float() * scale
        causal = torch.arange(length).unsqueeze(0) <= torch.arange(length - n, length).unsqueeze(1)
        probs = scores.masked_fill(~causal.unsqueeze(1), float("-inf")).softmax(-1)
        out.append(torch.einsum("nhl,lc->nhc", probs.to(rows.dtype), keys[:, :RANK]))
        start += n
    return torch.cat(out)


def selection(contexts: list[tuple[int, int]], gen) -> torch.Tensor:
    """`index_topk` rows among each query's earlier ones (what the indexer would pick)."""
    picked = []
    for length, n in contexts:
        for p in range(length - n, length):
            picked.append(torch.randperm(p + 1, generator=gen)[:TOPK] + 1)
    return torch.stack(picked)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kernels = load()
    gen = torch.Generator().manual_seed(0)
    scale = (128 + ROPE) ** -0.5
    results = []
    for context in (4096, 16384):
        for step, contexts in (
            ("decode x8", [(context, 1)] * 8),
            ("prefill 256", [(context, 256)]),
        ):
            rows = torch.randn(context + 1, RANK + ROPE + INDEX, generator=gen).bfloat16()
            queries = sum(n for _, n in contexts)
            q = torch.randn(queries, args.heads, RANK + ROPE, generator=gen) * 0.05
            slots = selection(contexts, gen)
            dense_ms = median_ms(lambda: dense(q.bfloat16(), rows, contexts, scale), args.runs)
            sparse_ms = median_ms(
                lambda: kernels.sparse_latent_attention(q, rows, slots, scale, RANK), args.runs
            )
            row = {
                "context": context,
                "step": step,
                "dense_ms": round(dense_ms, 2),
                "sparse_ms": round(sparse_ms, 2),
                "speedup": round(dense_ms / sparse_ms, 2),
            }
            print(row)
            results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"heads": args.heads, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
