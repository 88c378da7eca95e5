"""Attention with the features the paged kernels lack (sliding windows, chunks, soft-capping,
sinks, a latent KV), in plain torch on any device: each request's keys are gathered from the
pool and scored explicitly, as HF's eager attention does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mem.kv_pool import KVPool
from .base import AttentionInputs, LayerAttention


@dataclass
class ReferencePlan:
    """A step's requests padded to `[B, max_q]` queries over `[B, max_len]` keys."""

    kv_indices: torch.Tensor  # `[B * max_len]` pool slots (slot 0 pads)
    batch: int
    max_len: int
    max_q: int
    q_req: torch.Tensor  # each step token's request and place among its new tokens
    q_pos: torch.Tensor
    q_abs: torch.Tensor  # `[B, 1, max_q, 1]` absolute position of each padded query
    key_pos: torch.Tensor  # `[1, 1, 1, max_len]`
    causal: torch.Tensor  # `[B, 1, max_q, max_len]` key <= query and key < length
    windows: dict[tuple, torch.Tensor]  # (window, chunk) -> its mask, made on first use

    def mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        if window is None and chunk is None:
            return self.causal
        if (window, chunk) not in self.windows:
            mask = self.causal
            if window is not None:
                mask = mask & (self.key_pos > self.q_abs - window)
            if chunk is not None:
                mask = mask & (self.key_pos // chunk == self.q_abs // chunk)
            self.windows[(window, chunk)] = mask
        return self.windows[(window, chunk)]


def plan_reference(inputs: AttentionInputs) -> ReferencePlan:
    seq_lens, ext = inputs.seq_lens, inputs.extend_lens
    batch, max_len, max_q = len(seq_lens), int(seq_lens.max()), int(ext.max())
    device = seq_lens.device
    kv_indices = inputs.req_to_token[inputs.rows, :max_len].flatten()
    q_req = torch.repeat_interleave(torch.arange(batch, device=device), ext)
    q_pos = torch.arange(len(q_req), device=device) - (torch.cumsum(ext, 0) - ext)[q_req]
    q_abs = (seq_lens - ext).view(-1, 1, 1, 1) + torch.arange(max_q, device=device).view(
        1, 1, -1, 1
    )
    key_pos = torch.arange(max_len, device=device).view(1, 1, 1, -1)
    causal = (key_pos <= q_abs) & (key_pos < seq_lens.view(-1, 1, 1, 1))
    return ReferencePlan(
        kv_indices, batch, max_len, max_q, q_req, q_pos, q_abs, key_pos, causal, {}
    )


def reference_attention(
    plan: ReferencePlan, q: torch.Tensor, pool: KVPool, layer: int, how: LayerAttention
) -> torch.Tensor:
    """q `[T, H, D]` (this step's tokens) over layer `layer` of the pool -> `[T, H * Dv]`."""
    heads = q.shape[1]
    queries = q.new_zeros(plan.batch, plan.max_q, heads, q.shape[2])
    queries[plan.q_req, plan.q_pos] = q
    keys = pool.read(_gather(plan, pool.k[layer]), pool.k_scale[layer], q.dtype)
    if how.value_dim is not None:
        values = keys[..., : how.value_dim]
    else:
        values = pool.read(_gather(plan, pool.v[layer]), pool.v_scale[layer], q.dtype)
    groups = heads // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scale = q.shape[2] ** -0.5 if how.scale is None else how.scale
    scores = torch.matmul(queries.transpose(1, 2), keys.transpose(2, 3)) * scale
    if how.softcap is not None:
        scores = torch.tanh(scores / how.softcap) * how.softcap
    scores = scores.masked_fill(~plan.mask(how.window, how.chunk), float("-inf"))
    if how.sinks is not None:
        sinks = how.sinks.to(scores.dtype).view(1, heads, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if how.sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, values).transpose(1, 2)  # [B, max_q, H, Dv]
    return out[plan.q_req, plan.q_pos].flatten(1)


def _gather(plan: ReferencePlan, cache: torch.Tensor) -> torch.Tensor:
    """`[B, kv_heads, max_len, D]` of the pool's rows."""
    return (
        cache.index_select(0, plan.kv_indices)
        .view(plan.batch, plan.max_len, *cache.shape[1:])
        .transpose(1, 2)
    )
