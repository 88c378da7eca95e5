"""Mixture-of-experts families whose attention layers differ by kind (windows, a rotary per
kind or on the window layers only, output gates), as recipes over the shared decoder: K-EXAONE,
Kolibri, Flint, AFMoE, Command A MoE, Mellum."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .dense_families import Cohere2ForCausalLM, layer_window_of
from .layers import SwiGLU
from .moe import Routing, SparseMoE, corrected_sigmoid_moe, deepseek_moe
from .moe_families import MoeRecipeLM
from .recipe import GatedOutputAttention, LayerRecipe, ModelRecipe, with_sinks
from .rotary import LAYER_KINDS, RotaryEmbedding, rotaries_by_kind


class ExaoneMoeForCausalLM(MoeRecipeLM):
    """K-EXAONE: EXAONE 4's attention (q and k normed per head; with sliding windows only the
    window layers rotate) under Llama's norms, DeepSeek's MoE block where `mlp_layer_types`
    says "sparse"."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        window = layer_window_of(self.hf, i)
        rope = window is not None or not self.hf.get("sliding_window")
        return LayerRecipe(qk_norm="head", rope=rope, window=window)

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        if hf["mlp_layer_types"][i] != "sparse":
            return super().make_mlp(i)
        names = dict(
            n_routed_experts=hf["num_experts"], n_shared_experts=hf.get("num_shared_experts")
        )
        return deepseek_moe({**hf, **names}, self.cfg.hidden_size, self.tp)

    def rename(self, name: str) -> str | None:
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")


def logit_sigmoid_moe(lm: MoeRecipeLM, count: int, renormalize: bool, correction: bool):
    """`count` experts chosen by their top-k logits (plus a correction bias where `correction`),
    each weighted by its logit's sigmoid, beside a shared MLP `shared_expert_intermediate_size`
    wide added whole (Kolibri, Flint)."""
    hf, hidden = lm.hf, lm.cfg.hidden_size
    routing = Routing("topk_sigmoid", hf["num_experts_per_tok"], renormalize=renormalize)
    experts = lm.experts(count, hf["moe_intermediate_size"])
    width = hf["shared_expert_intermediate_size"]
    shared = SwiGLU(hidden, width // lm.tp.size, hf.get("hidden_act", "silu"))
    return SparseMoE(hidden, experts, routing, correction_bias=correction, shared=shared)


# the release's names and transformers' own (as it holds them) -> ours
KOLIBRI_NAMES = (
    (".moe.router.expert_bias", ".mlp.e_score_correction_bias"),
    (".post_self_attn_layernorm.", ".post_attn_norm."),
    (".post_mlp_layernorm.", ".post_ffn_norm."),
)


class Kolibri1ForCausalLM(ExaoneMoeForCausalLM):
    """Aleph Alpha's Kolibri: EXAONE 4's attention under GLM-4's norms before and after each
    sublayer; in every layer experts chosen by logit plus a correction bias, each weighted by
    its logit's sigmoid (renormalized where `norm_topk_prob`), beside a shared MLP."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        post = dict(post_attn="post_attn_norm", post_mlp="post_ffn_norm")  # the release's names
        return replace(super().layer_recipe(i), **post)

    def rename(self, name: str) -> str | None:
        for theirs, ours in KOLIBRI_NAMES:
            name = name.replace(theirs, ours)
        return super().rename(name)

    def make_mlp(self, i: int) -> nn.Module:
        count = self.hf.get("num_experts") or self.hf["num_local_experts"]  # as transformers saves
        return logit_sigmoid_moe(self, count, self.hf.get("norm_topk_prob", False), True)


class FlintForCausalLM(MoeRecipeLM):
    """Flint: Qwen3-MoE's attention (q and k normed per head) with a learnt sink logit per head,
    windows by `layer_types` and the rotary on the window layers only; dense MLPs in
    `mlp_only_layers`, elsewhere sigmoid-scored experts (renormalized where `norm_topk_prob`)
    plus a shared MLP added whole."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        window = layer_window_of(self.hf, i)
        return LayerRecipe(qk_norm="head", rope=window is not None, window=window)

    def make_attention(self, i: int, recipe: LayerRecipe) -> nn.Module:
        return with_sinks(super().make_attention(i, recipe))

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        if i in (hf.get("mlp_only_layers") or ()):
            return super().make_mlp(i)
        return logit_sigmoid_moe(self, hf["num_experts"], hf.get("norm_topk_prob", True), False)

    def rename(self, name: str) -> str | None:
        name = name.replace(".self_attn.softmax_offset", ".self_attn.sinks")  # the release's
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


class AfmoeForCausalLM(MoeRecipeLM):
    """Arcee's AFMoE (Trinity): norms before and after each sublayer, q and k normed per head,
    the rotary on the sliding-window layers only, attention gated by its own projection; after
    `num_dense_layers` dense layers, sigmoid-routed experts (chosen by score plus
    `expert_bias`, renormalized, times `route_scale`) beside shared experts; µP scales the
    embedding by sqrt(hidden) where `mup_enabled`."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(embed_scale=hf["hidden_size"] ** 0.5 if hf.get("mup_enabled") else None)

    def layer_recipe(self, i: int) -> LayerRecipe:
        window = layer_window_of(self.hf, i)
        return LayerRecipe(
            post_attn="post_attention_layernorm",
            pre_mlp="pre_mlp_layernorm",
            post_mlp="post_mlp_layernorm",
            qk_norm="head",
            rope=window is not None,
            window=window,
        )

    def make_attention(self, i: int, recipe: LayerRecipe) -> nn.Module:
        return GatedOutputAttention(self.cfg, i, self.tp, recipe, "sigmoid", per_head=False)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        if i < hf.get("num_dense_layers", 1):
            return super().make_mlp(i)
        width = hf["moe_intermediate_size"] * hf.get("num_shared_experts", 0)
        experts = self.experts(hf["num_experts"], hf["moe_intermediate_size"])
        top_k, scale = hf["num_experts_per_tok"], hf.get("route_scale", 1.0)
        return corrected_sigmoid_moe(hidden, experts, self.tp, top_k, scale, width)

    def rename(self, name: str) -> str | None:
        name = name.replace(".mlp.router.gate.", ".mlp.gate.")
        name = name.replace(".self_attn.gate_proj.", ".self_attn.g_proj.")
        return name.replace(".mlp.expert_bias", ".mlp.e_score_correction_bias")


class Cohere2MoeForCausalLM(MoeRecipeLM, Cohere2ForCausalLM):
    """Command A MoE: Command A's parallel block (an RMS norm where `rms_norm_eps` is set) over
    dense MLPs (`prefix_dense_intermediate_size`; rotated in every layer where
    `prefix_dense_sliding_window_pattern` is 1) and then experts chosen by their top-k logits
    (a softmax over them, or each one's sigmoid), beside shared experts summed or averaged
    (`shared_expert_combination_strategy`)."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        norm = "rms" if hf.get("rms_norm_eps") is not None else "layer"
        return replace(super().model_recipe_of(hf), norm=norm)

    def dense(self, i: int) -> bool:
        return self.hf["mlp_layer_types"][i] == "dense"

    def layer_recipe(self, i: int) -> LayerRecipe:
        recipe = super().layer_recipe(i)
        always = self.dense(i) and self.hf.get("prefix_dense_sliding_window_pattern", 1) == 1
        return replace(recipe, rope=recipe.rope or always)

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden, act = self.hf, self.cfg.hidden_size, self.hf.get("hidden_act", "silu")
        if self.dense(i):
            return SwiGLU(hidden, hf["prefix_dense_intermediate_size"] // self.tp.size, act)
        sigmoid = hf.get("expert_selection_fn", "softmax") == "sigmoid"
        routing = Routing(
            "topk_sigmoid" if sigmoid else "topk_softmax",
            hf["num_experts_per_tok"],
            renormalize=sigmoid and hf.get("norm_topk_prob", True),
        )
        experts = self.experts(hf["num_experts"], hf["intermediate_size"])
        width = hf["intermediate_size"] * (hf.get("num_shared_experts") or 0)
        shared = SwiGLU(hidden, width // self.tp.size) if width else None
        average = width and hf.get("shared_expert_combination_strategy", "average") == "average"
        scale = 0.5 if average else 1.0
        return SparseMoE(hidden, experts, routing, shared=shared, output_scale=scale)


class MellumForCausalLM(MoeRecipeLM):
    """JetBrains' Mellum: Qwen3-MoE's attention with windows by `layer_types`, a rotary table
    per layer kind, dense or softmax top-k sparse MLPs by `mlp_layer_types`; its
    multi-token-prediction layer (`mtp.*`) is not served."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf, bias = self.hf, self.hf.get("attention_bias", False)
        kind = hf["layer_types"][i]
        window, table = layer_window_of(hf, i), LAYER_KINDS.index(kind)
        return LayerRecipe(
            qkv_bias=bias, o_bias=bias, qk_norm="head", window=window, rope_table=table
        )

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        if hf["mlp_layer_types"][i] != "sparse":
            return super().make_mlp(i)
        routing = Routing("softmax_topk", hf["num_experts_per_tok"], hf.get("norm_topk_prob", True))
        count = hf.get("num_local_experts", hf.get("num_experts"))
        experts = self.experts(count, hf["moe_intermediate_size"])
        return SparseMoE(self.cfg.hidden_size, experts, routing)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return rotaries_by_kind(self.hf, self.cfg.head_dim, max_positions)

    def rename(self, name: str) -> str | None:
        return None if name.startswith("mtp.") else name
