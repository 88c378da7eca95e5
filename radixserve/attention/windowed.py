"""Attention for a model whose sliding-window layers keep their KV in a pool of their own
(`mem/window_kv.py`): the full-attention layers run on one backend over the main pool, the
window layers on another over the window pool, through the same step's table translated
from full slots to window slots (`full_to_window`, which each step extends with the window
slots of its new tokens). A freed token's table entry reads slot 0 or a reused slot: it lies
outside every window that reads it, so the window mask removes it."""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import PLAIN, AttentionBackend, AttentionInputs, LayerAttention


class WindowedBackend:
    def __init__(
        self,
        full: AttentionBackend,
        window: AttentionBackend,
        window_layers: list[int],
        num_layers: int,
        num_full_slots: int,
    ):
        self.full, self.window = full, window
        self.pool = full.pool
        windowed = set(window_layers)
        full_layers = [i for i in range(num_layers) if i not in windowed]
        self.route = {i: (window, window_layers.index(i)) for i in windowed}
        self.route |= {i: (full, full_layers.index(i)) for i in full_layers}
        device = full.pool.k[0].device if full.pool.k else window.pool.k[0].device
        self.full_to_window = torch.zeros(num_full_slots, dtype=torch.long, device=device)

    def map_window(self, full_slots: torch.Tensor, window_slots: torch.Tensor) -> None:
        """This step's new tokens hold these window slots."""
        self.full_to_window[full_slots] = window_slots.to(self.full_to_window.device)

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        self.full.plan(inputs)
        rows = inputs.req_to_token[inputs.rows, : inputs.max_seq_len]
        self.window.plan(
            replace(
                inputs,
                out_cache_loc=self.full_to_window[inputs.out_cache_loc],
                rows=torch.arange(len(inputs.rows), device=rows.device),
                req_to_token=self.full_to_window[rows],
            )
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        backend, index = self.route[layer]
        return backend.forward(index, q, k, v, how)
