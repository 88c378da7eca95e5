"""Extend (prefill) attention: each request has a cached prefix in the pool plus new tokens.

Grid (batch, heads, query blocks). The new tokens' K/V are already stored in the pool, so
a program walks the request's slots once, with the causal rule `key_pos <= prefix + q_pos`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _slots, slots_of


@triton.jit
def _extend_kernel(
    q_ptr,
    o_ptr,
    k_cache_ptr,
    v_cache_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.program_id(2)
    extend = tl.load(extend_lens_ptr + b)
    if block * BLOCK_M < extend:
        prefix = tl.load(prefix_lens_ptr + b)
        q_start = tl.load(qo_indptr_ptr + b)
        kv_start = tl.load(kv_indptr_ptr + b)
        kv_head = h // GROUP
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < extend
        d_mask = offs_d < HEAD_DIM
        q_offs = (
            (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :]
        )
        q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = tl.minimum(prefix + (block + 1) * BLOCK_M, prefix + extend)
        for n0 in range(0, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_mask = pos < hi
            slot = _slots(kv_indices_ptr, kv_start, pos, n_mask, PAGE_SIZE)
            kv_offs = slot[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            allowed = (pos[None, :] <= (prefix + offs_m)[:, None]) & n_mask[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / row_sum[:, None]
        tl.store(
            o_ptr + q_offs, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    max_extend: int,
    scale: float,
    page_size: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[T, H, D]` (requests' new tokens back to back; any view, such as a slice of a fused QKV
    projection, is made contiguous: the kernel writes `out` with q's strides); returns `[T, H,
    D]`."""
    q = q.contiguous()
    tokens, heads, dim = q.shape
    out = out if out is not None else torch.empty_like(q)
    if tokens == 0:
        return out
    block_m = 32 if max_extend > 16 else 16
    grid = (len(extend_lens), heads, triton.cdiv(max_extend, block_m))
    _extend_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        qo_indptr,
        kv_indptr,
        kv_indices,
        prefix_lens,
        extend_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=heads // k_cache.shape[1],
        HEAD_DIM=dim,
        BLOCK_D=max(triton.next_power_of_2(dim), 16),
        BLOCK_M=block_m,
        BLOCK_N=32,
        PAGE_SIZE=page_size,
        IEEE=q.dtype == torch.float32,
    )
    return out


def extend_attention_ref(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    prefix_lens,
    extend_lens,
    scale,
    page_size=1,
):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(extend_lens)):
        prefix, extend = int(prefix_lens[b]), int(extend_lens[b])
        q0 = int(qo_indptr[b])
        slots = slots_of(kv_indices, int(kv_indptr[b]), prefix + extend, page_size)
        k = k_cache[slots].float().repeat_interleave(group, dim=1)
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q[q0 : q0 + extend].float(), k) * scale
        allowed = torch.arange(prefix + extend)[None, :] <= (prefix + torch.arange(extend))[:, None]
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out[q0 : q0 + extend] = torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v).to(q.dtype)
    return out
