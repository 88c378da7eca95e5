"""Attention through FlashInfer's paged wrappers (plan once per step, run per layer).

The pool is token-granular, so it is handed to FlashInfer as pages of one slot:
`[num_slots, 1, kv_heads, head_dim]` (NHD), with every last page full. Needs the
optional `flashinfer-python` package and a CUDA device.

For CUDA graphs each captured batch size gets its own decode wrapper in graph mode
(FlashInfer fixes the batch size of such a wrapper); they share one indices buffer
and the workspace, since only one step runs at a time.
"""

from __future__ import annotations

import torch

from ..mem.kv_pool import KVPool
from .base import PLAIN, AttentionInputs, LayerAttention

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend:
    supports_cuda_graph = True

    def __init__(
        self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, device=None, **_
    ):
        import flashinfer

        import radixserve_kernels as kernels

        self.flashinfer = flashinfer
        self.kernels = kernels
        self.pool = pool
        self.device = device
        self.shape = (num_heads, num_kv_heads, head_dim, 1)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.graph_wrappers: dict[int, object] = {}

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        if inputs.is_decode:
            self._plan_decode(self.decode, inputs)
            return
        indptr, indices, last_page_len = self._page_table(inputs)
        qo_indptr = torch.zeros(len(inputs.rows) + 1, dtype=torch.int32, device=indices.device)
        qo_indptr[1:] = torch.cumsum(inputs.extend_lens, 0)
        dtype = self.pool.k[0].dtype
        self.prefill.plan(
            qo_indptr,
            indptr,
            indices,
            last_page_len,
            *self.shape,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        self.wrapper = self.prefill

    def init_graph_buffers(self, max_bs: int, max_context_len: int) -> None:
        self.graph_indices = torch.zeros(
            max_bs * max_context_len, dtype=torch.int32, device=self.device
        )

    def plan_graph(self, bs: int, inputs: AttentionInputs) -> None:
        if bs not in self.graph_wrappers:
            int32 = dict(dtype=torch.int32, device=self.device)
            self.graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, **int32),
                paged_kv_indices_buffer=self.graph_indices,
                paged_kv_last_page_len_buffer=torch.ones(bs, **int32),
            )
        self.inputs = inputs
        self._plan_decode(self.graph_wrappers[bs], inputs)

    def _plan_decode(self, wrapper, inputs: AttentionInputs) -> None:
        indptr, indices, last_page_len = self._page_table(inputs)
        dtype = self.pool.k[0].dtype
        wrapper.plan(
            indptr,
            indices,
            last_page_len,
            *self.shape,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        self.wrapper = wrapper

    def _page_table(
        self, inputs: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indptr, indices = self.kernels.build_kv_indices(
            inputs.req_to_token, inputs.rows, inputs.seq_lens
        )
        last_page_len = torch.ones(len(inputs.rows), dtype=torch.int32, device=indices.device)
        return indptr.to(torch.int32), indices.to(torch.int32), last_page_len

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        self.kernels.store_kv(k, v, k_cache, v_cache, self.inputs.out_cache_loc)
        paged = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
        return self.wrapper.run(q.contiguous(), paged).flatten(1)
