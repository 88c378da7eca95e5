"""Sparse latent attention (DeepSeek-V3.2 and GLM-5's DSA) on GPUs: each query attends only to
the pool rows its indexer selected. A row is one token's MLA latent, whose first `value_dim`
columns are also its value. One program per (query, block of heads) walks the selected rows in
tiles with an online softmax. The CPU kernel of the same op is `sparse_latent_attention` in
cpu_sparse_attention.cpp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_mla_ref import sparse_latent_attention_ref

__all__ = ["sparse_latent_attention", "sparse_latent_attention_ref"]


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    rows_ptr,
    slots_ptr,
    out_ptr,
    scale,
    heads,
    width,
    value_dim,
    topk,
    row_stride,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    query = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_V)
    h_ok, c_ok, d_ok = h < heads, c < width, d < value_dim
    q = tl.load(
        q_ptr + (query * heads + h[:, None]) * width + c[None, :],
        mask=h_ok[:, None] & c_ok[None, :],
        other=0.0,
    )
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for start in range(0, topk, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        slot = tl.load(slots_ptr + query * topk + j, mask=j < topk, other=-1).to(tl.int64)
        chosen = slot >= 0
        slot = tl.where(chosen, slot, 0)
        keys = tl.load(
            rows_ptr + slot[:, None] * row_stride + c[None, :],
            mask=chosen[:, None] & c_ok[None, :],
            other=0.0,
        )
        scores = tl.dot(q.to(keys.dtype), tl.trans(keys)) * scale
        scores = tl.where(chosen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        p = tl.exp(scores - new_best[:, None])
        fade = tl.exp(best - new_best)
        total = total * fade + tl.sum(p, 1)
        values = tl.load(
            rows_ptr + slot[:, None] * row_stride + d[None, :],
            mask=chosen[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * fade[:, None] + tl.dot(p.to(values.dtype), values)
        best = new_best
    out = acc / total[:, None]
    tl.store(
        out_ptr + (query * heads + h[:, None]) * value_dim + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & d_ok[None, :],
    )


def sparse_latent_attention(
    q: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: float, value_dim: int
) -> torch.Tensor:
    """q `[n, heads, width]` over the `rows [S, row width]` (width <= row width) each query
    selected (`slots [n, topk]`, -1 for none; each query selects at least one, first) ->
    `[n, heads, value_dim]`."""
    n, heads, width = q.shape
    out = q.new_empty(n, heads, value_dim)
    if n == 0:
        return out
    block_h = 16
    grid = (n, triton.cdiv(heads, block_h))
    _sparse_mla_kernel[grid](
        q.contiguous(),
        rows,
        slots.contiguous(),
        out,
        scale,
        heads,
        width,
        value_dim,
        slots.shape[1],
        rows.stride(0),
        BLOCK_H=block_h,
        BLOCK_C=max(triton.next_power_of_2(width), 16),
        BLOCK_V=max(triton.next_power_of_2(value_dim), 16),
        BLOCK_K=16,
    )
    return out
