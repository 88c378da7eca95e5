"""Paged decode attention: one query token per request, split-KV with a reduce stage, GQA-aware.

Stage 1: grid (batch, kv_heads, splits). Each program attends the query heads of one KV
group over one slice of the request's tokens, keeping an online softmax, and writes the
partial output and its log-sum-exp. Stage 2: grid (batch, heads) merges the splits.
`kv_indices` holds token slots (page_size 1) or page ids (page_size > 1).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _slots(kv_indices_ptr, start, pos, mask, PAGE_SIZE: tl.constexpr):
    if PAGE_SIZE == 1:
        slot = tl.load(kv_indices_ptr + start + pos, mask=mask, other=0)
    else:
        page = tl.load(kv_indices_ptr + start + pos // PAGE_SIZE, mask=mask, other=0)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
    return slot.to(tl.int64)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = tl.load(kv_indptr_ptr + b)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < hi
        slot = _slots(kv_indices_ptr, start, pos, n_mask, PAGE_SIZE)
        kv_offs = slot[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    has = row_sum > 0
    out = acc / tl.where(has, row_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, row_sum, 1.0)), float("-inf"))
    row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(mid_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(mid_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row)
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    parts = tl.load(mid_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :])
    out = tl.sum(weights[:, None] * parts, axis=0)
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(o_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_splits(max_seq_len: int, tokens_per_split: int = 256, max_splits: int = 16) -> int:
    """A power of two: more splits for longer contexts so small batches still fill the GPU."""
    wanted = max(1, min(max_splits, math.ceil(max_seq_len / tokens_per_split)))
    return 1 << (wanted - 1).bit_length()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[B, H, D]`; caches `[slots, kv_heads, D]`; returns `[B, H, D]`.

    Request b's slots are `kv_indices[kv_indptr[b]:][:seq_lens[b]]`; only the starts of
    `kv_indptr` are read, so a flat request-to-token table with row offsets works too.
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    splits = num_splits or choose_splits(int(seq_lens.max().item()) if batch else 1)
    block_d = triton.next_power_of_2(dim)
    out = out if out is not None else torch.empty_like(q)
    if batch == 0:
        return out
    mid_o = torch.empty(batch, heads, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        seq_lens,
        mid_o,
        mid_lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        BLOCK_N=32,
        NUM_SPLITS=splits,
        PAGE_SIZE=page_size,
        NUM_HEADS=heads,
    )
    _decode_merge_kernel[(batch, heads)](
        mid_o,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        NUM_HEADS=heads,
    )
    return out


def slots_of(kv_indices: torch.Tensor, start: int, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=kv_indices.device)
    if page_size == 1:
        return kv_indices[start : start + length]
    return kv_indices[start + pos // page_size] * page_size + pos % page_size


def decode_attention_ref(q, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, scale, page_size=1):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        slots = slots_of(kv_indices, int(kv_indptr[b]), int(seq_lens[b]), page_size)
        k = k_cache[slots].float().repeat_interleave(group, dim=1)
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
