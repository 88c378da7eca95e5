"""Pure-torch attention over the paged KV pool: one padded, masked SDPA per layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mem.kv_pool import KVPool
from .base import AttentionInputs


class TorchNativeBackend:
    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, **_):
        self.pool = pool
        self.num_heads = num_heads
        self.scale = head_dim ** -0.5

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        batch, max_len = len(inputs.rows), inputs.max_seq_len
        self.kv_indices = inputs.req_to_token[inputs.rows, :max_len].flatten()
        self.kv_shape = (batch, max_len)
        key_pos = torch.arange(max_len).view(1, 1, max_len)
        if inputs.is_decode:
            self.mask = (key_pos < inputs.seq_lens.view(-1, 1, 1)).unsqueeze(1)
            return
        q_pos = torch.arange(inputs.max_extend_len).view(1, -1, 1)
        limit = inputs.prefix_lens.view(-1, 1, 1) + q_pos
        self.mask = ((key_pos <= limit) & (key_pos < inputs.seq_lens.view(-1, 1, 1))).unsqueeze(1)
        req_of_token = torch.repeat_interleave(torch.arange(batch), inputs.extend_lens)
        starts = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
        self.token_req = req_of_token
        self.token_offset = torch.arange(len(req_of_token)) - starts[req_of_token]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.store(layer, self.inputs.out_cache_loc, k, v)
        keys = self._gather(self.pool.k[layer])
        values = self._gather(self.pool.v[layer])
        queries = self._pad(q).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask,
                                             scale=self.scale, enable_gqa=True)
        return self._unpad(out.transpose(1, 2)).flatten(1)

    def _gather(self, cache: torch.Tensor) -> torch.Tensor:
        """`[B, kv_heads, L, D]` view of each request's keys (index_select beats fancy indexing)."""
        return cache.index_select(0, self.kv_indices).view(*self.kv_shape, *cache.shape[1:]).transpose(1, 2)

    def _pad(self, q: torch.Tensor) -> torch.Tensor:
        if self.inputs.is_decode:
            return q.unsqueeze(1)
        padded = q.new_zeros(len(self.inputs.rows), self.inputs.max_extend_len, *q.shape[1:])
        padded[self.token_req, self.token_offset] = q
        return padded

    def _unpad(self, out: torch.Tensor) -> torch.Tensor:
        if self.inputs.is_decode:
            return out.squeeze(1)
        return out[self.token_req, self.token_offset]
