"""Qwen3-Next: Qwen3.5-MoE's layers (Gated DeltaNet and gated attention, sparse experts with a
gated shared expert) with the Gated DeltaNet's projections fused per key head: `in_proj_qkvz`
holds, for each key head, its q, k, and its value heads' v and z; `in_proj_ba` its value
heads' b and a. They are regrouped into Qwen3.5's projections as the checkpoint loads."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from .qwen3_5 import Qwen3_5MoeForCausalLM

FUSED = re.compile(r"(.*\.linear_attn)\.in_proj_(qkvz|ba)\.weight")


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self.regroup(weights))

    def regroup(self, weights):
        hf = self.hf
        key_heads, key_dim = hf["linear_num_key_heads"], hf["linear_key_head_dim"]
        per_key = hf["linear_num_value_heads"] // key_heads
        value_width = per_key * hf["linear_value_head_dim"]
        for name, tensor in weights:
            match = FUSED.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, kind = match.groups()
            grouped = tensor.view(key_heads, -1, tensor.shape[-1])
            if kind == "qkvz":
                q, k, v, z = grouped.split([key_dim, key_dim, value_width, value_width], dim=1)
                flat = [t.reshape(-1, tensor.shape[-1]) for t in (q, k, v, z)]
                yield f"{prefix}.in_proj_qkv.weight", torch.cat(flat[:3])
                yield f"{prefix}.in_proj_z.weight", flat[3]
            else:
                b, a = grouped.split([per_key, per_key], dim=1)
                yield f"{prefix}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
                yield f"{prefix}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
