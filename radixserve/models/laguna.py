"""Laguna (poolside): attention with q and k normed per head, a rotary table per layer kind
(the full layers' over part of each head), windows where `layer_types` says so, a query-head
count per layer (`num_attention_heads_per_layer`; the KV heads are the same in every layer) and
an output scaled by the softplus of the layer input's own projection (`g_proj`: one gate per
head, or per channel where `gating` is "per-element"); after dense layers, sigmoid-routed
experts (logits soft-capped where `moe_router_logit_softcapping`, chosen by score plus a
correction bias, renormalized, times `moe_routed_scaling_factor`) beside a shared MLP."""

from __future__ import annotations

from dataclasses import replace

import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .dense_families import layer_window_of
from .layers import Linear, SwiGLU
from .moe import Routing, SparseMoE
from .moe_families import MoeRecipeLM
from .recipe import LayerRecipe, RecipeAttention, RecipeLayer
from .rotary import LAYER_KINDS, RotaryEmbedding, rotaries_by_kind


class SoftplusGatedAttention(RecipeAttention):
    """Attention whose output is scaled by softplus(g_proj(x)) before o_proj: per head
    (broadcast over its dims) or per channel."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, recipe: LayerRecipe, per_head):
        super().__init__(cfg, layer, tp, recipe)
        self.per_head = per_head
        self.g_proj = Linear(cfg.hidden_size, cfg.num_heads if per_head else cfg.q_size)

    def forward(self, x, ropes, backend):
        out = self.attend(x, ropes, backend)[1]
        gate = F.softplus(self.g_proj(x).float()).to(out.dtype)
        if self.per_head:
            heads = out.view(-1, self.cfg.num_heads, self.cfg.head_dim)
            out = (heads * gate.unsqueeze(-1)).view(out.shape)
        else:
            out = out * gate.view(out.shape)
        return self.tp.all_reduce(self.o_proj(out))


class LagunaForCausalLM(MoeRecipeLM):
    def heads_of(self, i: int) -> int:
        """Layer i's query heads on this rank."""
        heads = (self.hf.get("num_attention_heads_per_layer") or [None] * (i + 1))[i]
        heads = heads or self.hf["num_attention_heads"]
        if heads % self.tp.size:
            raise ValueError(f"tp_size {self.tp.size} does not divide layer {i}'s {heads} heads")
        return heads // self.tp.size

    def layer_recipe(self, i: int) -> LayerRecipe:
        kind = (self.hf.get("layer_types") or ["full_attention"] * (i + 1))[i]
        window = layer_window_of(self.hf, i)
        return LayerRecipe(qk_norm="head", window=window, rope_table=LAYER_KINDS.index(kind))

    def make_layer(self, i: int) -> nn.Module:
        cfg, recipe = replace(self.cfg, num_heads=self.heads_of(i)), self.layer_recipe(i)
        per_head = self.hf.get("gating", True) in (True, "per-head")
        attention = SoftplusGatedAttention(cfg, i, self.tp, recipe, per_head)
        return RecipeLayer(cfg, self.tp, recipe, attention, self.make_mlp(i), self.norm_class)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (hf["num_hidden_layers"] - 1)
        if kinds[i] != "sparse":
            return super().make_mlp(i)
        routing = Routing(
            "grouped_sigmoid",
            hf["num_experts_per_tok"],
            renormalize=True,
            scaling=hf.get("moe_routed_scaling_factor", 1.0),
            softcap=hf.get("moe_router_logit_softcapping") or 0.0,
        )
        experts = self.experts(hf["num_experts"], hf["moe_intermediate_size"])
        shared = SwiGLU(hidden, hf["shared_expert_intermediate_size"] // self.tp.size)
        return SparseMoE(hidden, experts, routing, correction_bias=True, shared=shared)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return rotaries_by_kind(self.hf, self.cfg.head_dim, max_positions)

    def attention_features(self) -> frozenset[str]:
        counts = {self.heads_of(i) for i in range(self.cfg.num_layers)}
        return super().attention_features() | ({"head_counts"} if len(counts) > 1 else set())

    def tp_slice(self, module_name, kind, tensor):
        if module_name.endswith(".g_proj"):
            return self.tp.shard(tensor, 0)
        return super().tp_slice(module_name, kind, tensor)

    def rename(self, name: str) -> str | None:
        name = name.replace(".mlp.experts.e_score_correction_bias", ".mlp.e_score_correction_bias")
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
