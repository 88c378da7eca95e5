"""Laguna (poolside): attention with q and k normed per head, a rotary table per layer kind
(the full layers' over part of each head), windows where `layer_types` says so, a query-head
count per layer (`num_attention_heads_per_layer`; the KV heads are the same in every layer) and
an output scaled by the softplus of the layer input's own projection (`g_proj`: one gate per
head, or per channel where `gating` is "per-element"); after dense layers, sigmoid-routed
experts (logits soft-capped where `moe_router_logit_softcapping`, chosen by score plus a
correction bias, renormalized, times `moe_routed_scaling_factor`) beside a shared MLP."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .dense_families import layer_window_of
from .moe import corrected_sigmoid_moe
from .moe_families import MoeRecipeLM
from .recipe import GatedOutputAttention, LayerRecipe, RecipeLayer
from .rotary import LAYER_KINDS, RotaryEmbedding, rotaries_by_kind


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
        attention = GatedOutputAttention(cfg, i, self.tp, recipe, "softplus", per_head)
        return RecipeLayer(cfg, self.tp, recipe, attention, self.make_mlp(i), self.norm_class)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (hf["num_hidden_layers"] - 1)
        if kinds[i] != "sparse":
            return super().make_mlp(i)
        experts = self.experts(hf["num_experts"], hf["moe_intermediate_size"])
        return corrected_sigmoid_moe(
            hidden,
            experts,
            self.tp,
            hf["num_experts_per_tok"],
            scaling=hf.get("moe_routed_scaling_factor", 1.0),
            shared_width=hf["shared_expert_intermediate_size"],
            softcap=hf.get("moe_router_logit_softcapping") or 0.0,
        )

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return rotaries_by_kind(self.hf, self.cfg.head_dim, max_positions)

    def attention_features(self) -> frozenset[str]:
        counts = {self.heads_of(i) for i in range(self.cfg.num_layers)}
        return super().attention_features() | ({"head_counts"} if len(counts) > 1 else set())

    def rename(self, name: str) -> str | None:
        name = name.replace(".mlp.experts.e_score_correction_bias", ".mlp.e_score_correction_bias")
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
