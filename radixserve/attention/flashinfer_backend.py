"""Attention through FlashInfer's paged wrappers (plan once per step, run per layer).

The pool is token-granular, so it is handed to FlashInfer as pages of one slot:
`[num_slots, 1, kv_heads, head_dim]` (NHD), with every last page full. Needs the
optional `flashinfer-python` package and a CUDA device.
"""
from __future__ import annotations

import torch

from ..mem.kv_pool import KVPool
from .base import AttentionInputs

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend:
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device=None, **_):
        import flashinfer
        import radixserve_kernels as kernels

        self.kernels = kernels
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        indptr, indices = self.kernels.build_kv_indices(inputs.req_to_token, inputs.rows, inputs.seq_lens)
        indptr, indices = indptr.to(torch.int32), indices.to(torch.int32)
        last_page_len = torch.ones(len(inputs.rows), dtype=torch.int32, device=indices.device)
        dtype = self.pool.k[0].dtype
        shape = (self.num_heads, self.num_kv_heads, self.head_dim, 1)
        if inputs.is_decode:
            self.decode.plan(indptr, indices, last_page_len, *shape, pos_encoding_mode="NONE",
                             q_data_type=dtype, kv_data_type=dtype)
            return
        qo_indptr = torch.zeros(len(inputs.rows) + 1, dtype=torch.int32, device=indices.device)
        qo_indptr[1:] = torch.cumsum(inputs.extend_lens, 0)
        self.prefill.plan(qo_indptr, indptr, indices, last_page_len, *shape, causal=True,
                          q_data_type=dtype, kv_data_type=dtype)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        self.kernels.store_kv(k, v, k_cache, v_cache, self.inputs.out_cache_loc)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
        wrapper = self.decode if self.inputs.is_decode else self.prefill
        return wrapper.run(q.contiguous(), paged).flatten(1)
