"""The attention backend interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..mem.kv_pool import KVPool


@dataclass
class AttentionInputs:
    """Per-step tensors every backend plans from.

    Request b attends over `req_to_token[rows[b], :seq_lens[b]]`; its last
    `extend_lens[b]` tokens are this step's queries, causal among themselves.
    """

    is_decode: bool
    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    req_to_token: torch.Tensor
    max_seq_len: int
    max_extend_len: int

    @property
    def prefix_lens(self) -> torch.Tensor:
        return self.seq_lens - self.extend_lens


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, beyond causal softmax(q k^T / sqrt(head_dim)) v over all keys.

    `window`: a sliding window, the last `window` keys (the query's own included), as HF masks
    it; `chunk`: keys only from the query's own chunk (Llama 4). `softcap`: scores become
    `softcap * tanh(scores / softcap)` (Gemma 2). `sinks`: one
    learnt logit per head for a key whose value is zero (gpt-oss). `value_dim`: a latent pool
    (MLA), whose values are the first `value_dim` channels of each stored key."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    value_dim: int | None = None
    chunk: int | None = None  # keys only from the query's own chunk of this many tokens

    def features(self) -> set[str]:
        """What a backend must implement to run this layer."""
        named = {"scale": self.scale, "window": self.window, "softcap": self.softcap}
        named["chunk"] = self.chunk
        named |= {"sinks": self.sinks, "latent": self.value_dim}
        return {name for name, value in named.items() if value is not None}


PLAIN = LayerAttention()


class AttentionBackend(Protocol):
    pool: KVPool

    def plan(self, inputs: AttentionInputs) -> None:
        """Prepare per-step metadata once; every layer's `forward` reuses it."""

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        """Store this step's k/v into the pool, attend; q `[T, H, D]` -> `[T, H*Dv]`."""


class GraphBackend(AttentionBackend, Protocol):
    """A backend whose decode steps can be captured in a CUDA graph.

    A captured kernel reads its metadata from fixed addresses, so the backend keeps static
    buffers for it. `plan_graph` runs outside the graph, before capture and before every
    replay, and must leave everything `forward` reads in those buffers; `inputs` are views
    of the graph runner's own static buffers.
    """

    supports_cuda_graph: bool

    def init_graph_buffers(self, max_bs: int, max_context_len: int) -> None:
        """Allocate the static metadata buffers for batches of up to `max_bs` requests."""

    def plan_graph(self, bs: int, inputs: AttentionInputs) -> None:
        """Plan a (padded) decode step of exactly `bs` requests into the static buffers."""
