"""Segmented LoRA matmuls on GPUs (SGMV, as in Punica and S-LoRA): one step's tokens come in
runs of consecutive rows on one adapter slot, and `out[run] += x[run] A[slot]^T B[slot]^T`.

Two kernels, each launched once for all runs: `shrink` computes `h = x A^T` (rank columns, in
float32), `expand` adds `h B^T` to the output. A program handles one run's block of rows (and,
in expand, a block of output columns); programs past the end of a shorter run exit at once, so
the grid is sized by the longest run. `lora_sgmv_ref` is the same in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_of_run(starts_ptr, ends_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """This program's run (axis 0) and block of its rows (axis 1): the block's first row, the
    run's end and its adapter slot."""
    run = tl.program_id(0)
    start, end = tl.load(starts_ptr + run), tl.load(ends_ptr + run)
    slot = tl.load(slots_ptr + run).to(tl.int64)
    return start + tl.program_id(1) * BLOCK_M, end, slot


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, starts_ptr, ends_ptr, slots_ptr, k_dim, rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    first, end, slot = _block_of_run(starts_ptr, ends_ptr, slots_ptr, BLOCK_M)
    if first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * k_dim + offs_k[None, :],
            mask=(offs_m[:, None] < end) & (offs_k[None, :] < k_dim),
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * rank * k_dim + offs_r[None, :] * k_dim + offs_k[:, None],
            mask=(offs_r[None, :] < rank) & (offs_k[:, None] < k_dim),
            other=0.0,
        )
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    tl.store(
        h_ptr + offs_m[:, None] * rank + offs_r[None, :],
        acc,
        mask=(offs_m[:, None] < end) & (offs_r[None, :] < rank),
    )


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, starts_ptr, ends_ptr, slots_ptr, n_cols, rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    first, end, slot = _block_of_run(starts_ptr, ends_ptr, slots_ptr, BLOCK_M)
    if first >= end:
        return
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    h = tl.load(
        h_ptr + offs_m[:, None] * rank + offs_r[None, :],
        mask=(offs_m[:, None] < end) & (offs_r[None, :] < rank),
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * n_cols * rank + offs_n[None, :] * rank + offs_r[:, None],
        mask=(offs_n[None, :] < n_cols) & (offs_r[:, None] < rank),
        other=0.0,
    )
    delta = tl.dot(h, b.to(tl.float32))
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < n_cols)
    where = out_ptr + offs_m[:, None] * n_cols + offs_n[None, :]
    current = tl.load(where, mask=mask, other=0.0)
    tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=mask)


def lora_sgmv(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    runs: list[tuple[int, int, int]],
    out: torch.Tensor,
) -> torch.Tensor:
    """`x [T, in]`, `a [slots, R, in]`, `b [slots, out, R]`, `runs` of (start, end, slot);
    adds each run's delta to `out [T, out]` in place and returns it."""
    if not runs:
        return out
    x = x.contiguous()
    rank, k_dim, n_cols = a.shape[1], a.shape[2], b.shape[1]
    starts, ends, slots = (
        torch.tensor(col, dtype=torch.int32, device=x.device) for col in zip(*runs)
    )
    longest = max(end - start for start, end, _ in runs)
    block_m, block_r = 16, max(16, triton.next_power_of_2(rank))
    h = torch.empty(x.shape[0], rank, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(longest, block_m)
    _shrink_kernel[(len(runs), m_blocks)](
        x, a, h, starts, ends, slots, k_dim, rank,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(len(runs), m_blocks, triton.cdiv(n_cols, block_n))](
        h, b, out, starts, ends, slots, n_cols, rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return out


def lora_sgmv_ref(x, a, b, runs, out):
    for start, end, slot in runs:
        rows = x[start:end].float()
        out[start:end] += ((rows @ a[slot].float().t()) @ b[slot].float().t()).to(out.dtype)
    return out
