"""Mixture-of-experts MLP on GPUs: the step's (token, choice) pairs sorted by expert and padded
to whole blocks, then one grouped GEMM launch for every expert's gate-up projection and one for
the down projection (which also applies the routing weight). `fused_moe_ref` is the same in
plain torch, expert by expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    weights_ptr,
    num_pairs,
    n_cols,
    k_dim,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    rows_per_a: tl.constexpr,
    apply_weight: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[pair] = A[pair // rows_per_a] @ W[expert]^T for the pairs of one block (all of one
    expert); padding pairs (id >= num_pairs) are neither read nor written."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + offs_m)
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + block)
    rows = pairs // rows_per_a
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < k_dim),
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < n_cols) & (offs_k[:, None] < k_dim),
            other=0.0,
        )
        acc += tl.dot(a, w)
    if apply_weight:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < n_cols),
    )


def align_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (`token * k + choice`) sorted by expert, each expert's run padded to a whole
    number of blocks with the id `num_pairs`; and each block's expert."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    firsts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(flat), device=flat.device) - firsts[flat[order]]
    pair_ids = torch.full((int(padded.sum()),), len(flat), dtype=torch.long, device=flat.device)
    pair_ids[starts[flat[order]] + rank] = order
    block_experts = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device), padded // block_m
    )
    return pair_ids, block_experts


def _grouped_gemm(a, w, pair_ids, block_experts, num_pairs, rows_per_a, weights, block_m):
    n_cols, k_dim = w.shape[1], w.shape[2]
    out = a.new_empty(num_pairs, n_cols)
    block_n, block_k = 32, 32
    grid = (len(block_experts), triton.cdiv(n_cols, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        pair_ids,
        block_experts,
        weights if weights is not None else a,
        num_pairs,
        n_cols,
        k_dim,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        rows_per_a=rows_per_a,
        apply_weight=weights is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    block_m: int = 16,
) -> torch.Tensor:
    """x `[T, hidden]`; `w13 [E, 2 * inter, hidden]` (gate rows, then up rows), `w2 [E, hidden,
    inter]` (nn.Linear's layout); each token's `experts [T, k]` and `weights [T, k]`. SiLU
    gates."""
    tokens, k = experts.shape
    pairs = tokens * k
    pair_ids, block_experts = align_pairs(experts, w13.shape[0], block_m)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    gate_up = _grouped_gemm(x, w13, pair_ids, block_experts, pairs, k, None, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()
    flat_weights = weights.flatten().to(torch.float32).contiguous()
    down = _grouped_gemm(hidden, w2, pair_ids, block_experts, pairs, 1, flat_weights, block_m)
    return down.view(tokens, k, -1).sum(dim=1)


def fused_moe_ref(x, w13, w2, weights, experts) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w13.shape[0]):
        token, choice = (experts == e).nonzero(as_tuple=True)
        if len(token) == 0:
            continue
        gate, up = (x[token].float() @ w13[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].float().t()
        out.index_add_(0, token, y * weights[token, choice, None].float())
    return out.to(x.dtype)
