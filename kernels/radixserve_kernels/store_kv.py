"""Write this step's K and V rows into their pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, row_size, BLOCK: tl.constexpr
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    for start in range(0, row_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_size
        tl.store(
            k_cache_ptr + slot * row_size + offs,
            tl.load(k_ptr + token * row_size + offs, mask=mask),
            mask=mask,
        )
        tl.store(
            v_cache_ptr + slot * row_size + offs,
            tl.load(v_ptr + token * row_size + offs, mask=mask),
            mask=mask,
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """k, v: `[T, kv_heads, head_dim]`; caches: `[num_slots, kv_heads, head_dim]`; slots: `[T]`."""
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    block = min(triton.next_power_of_2(row), 1024)
    _store_kv_kernel[(k.shape[0],)](
        k.contiguous(), v.contiguous(), k_cache, v_cache, slots, row, BLOCK=block
    )


def store_kv_ref(k, v, k_cache, v_cache, slots) -> None:
    k_cache[slots] = k
    v_cache[slots] = v
