"""Attention through our Triton kernels (`kernels/`): paged decode with split-KV, extend with
prefixes.

Decode reads slots straight from the request-to-token table: the flat table is the
`kv_indices` array and request b starts at `rows[b] * row_stride`, so a decode step
gathers nothing. That also makes it graph-safe: only the start offsets change per step.
"""

from __future__ import annotations

import torch

from ..mem.kv_pool import KVPool
from .base import PLAIN, AttentionInputs, LayerAttention


class TritonBackend:
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, **_):
        import radixserve_kernels as kernels

        self.kernels = kernels
        self.pool = pool
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = head_dim**-0.5

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        if inputs.is_decode:
            table = inputs.req_to_token
            self.kv_starts, self.kv_indices = inputs.rows * table.stride(0), table.view(-1)
            self.num_splits = self.kernels.choose_splits(inputs.max_seq_len)
            return
        self.kv_indptr, self.kv_indices = self.kernels.build_kv_indices(
            inputs.req_to_token, inputs.rows, inputs.seq_lens
        )
        self.qo_indptr = torch.zeros(
            len(inputs.rows) + 1, dtype=torch.long, device=inputs.rows.device
        )
        self.qo_indptr[1:] = torch.cumsum(inputs.extend_lens, 0)
        self.prefix_lens = inputs.prefix_lens

    def init_graph_buffers(self, max_bs: int, max_context_len: int) -> None:
        self.graph_kv_starts = torch.zeros(max_bs, dtype=torch.long, device=self.pool.k[0].device)
        self.graph_splits = self.kernels.choose_splits(max_context_len)

    def plan_graph(self, bs: int, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        table = inputs.req_to_token
        torch.mul(inputs.rows, table.stride(0), out=self.graph_kv_starts[:bs])
        self.kv_starts, self.kv_indices = self.graph_kv_starts[:bs], table.view(-1)
        self.num_splits = self.graph_splits

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        scale = self.scale if how.scale is None else how.scale
        self.kernels.store_kv(k, v, k_cache, v_cache, self.inputs.out_cache_loc)
        if self.inputs.is_decode:
            out = self.kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                self.kv_starts,
                self.kv_indices,
                self.inputs.seq_lens,
                scale,
                num_splits=self.num_splits,
            )
        else:
            out = self.kernels.extend_attention(
                q,
                k_cache,
                v_cache,
                self.qo_indptr,
                self.kv_indptr,
                self.kv_indices,
                self.prefix_lens,
                self.inputs.extend_lens,
                self.inputs.max_extend_len,
                scale,
            )
        return out.flatten(1)
