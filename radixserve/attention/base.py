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


class AttentionBackend(Protocol):
    pool: KVPool

    def plan(self, inputs: AttentionInputs) -> None:
        """Prepare per-step metadata once; every layer's `forward` reuses it."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's k/v into the pool, attend; q `[T, H, D]` -> `[T, H*D]`."""


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
