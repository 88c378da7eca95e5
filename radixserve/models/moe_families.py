"""Mixture-of-experts families that are recipes over the shared decoder (`recipe`) with sparse
MLPs (`moe`): OLMoE and FlexOlmo, GLM-4.5 and dots.llm1 (DeepSeek's MoE block under GQA
attention), MiniCPM 5 MoE (the same, its attention output gated), MiniMax-M2, PhiMoE,
ERNIE 4.5 MoE, HunYuan MoE, Hunyuan 3; and DeepSeek-V2 (DeepSeek-V3's MLA, softmax routing)
and GLM-4.7-Flash (its MLA and MoE). Those whose attention differs by layer kind are in
`kind_moe_families`."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .deepseek_v3 import DeepseekV3ForCausalLM
from .dense_families import (
    POST_NORMS,
    Ernie4_5ForCausalLM,
    HunYuanDenseV1ForCausalLM,
    layer_window_of,
)
from .layers import Linear, SwiGLU
from .llama import split_per_head
from .mixtral import mixtral_name
from .moe import Experts, Routing, SparseMoE, deepseek_moe, unstack_experts
from .recipe import (
    GatedOutputAttention,
    LayerRecipe,
    ModelRecipe,
    RecipeCausalLM,
    rotary_fraction,
)


class MoeRecipeLM(RecipeCausalLM):
    """Experts load from per-expert tensors or HF's stacked ones."""

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))

    def experts(self, count: int, inter: int) -> Experts:
        return Experts(
            count, self.cfg.hidden_size, inter, self.tp, self.hf.get("hidden_act", "silu")
        )


class OlmoeForCausalLM(MoeRecipeLM):
    """Llama's norms, q and k normed over all heads (after `clip_qkv`, where set), a softmax
    top-k router in every layer."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias, clip = self.hf.get("attention_bias", False), self.hf.get("clip_qkv")
        return LayerRecipe(qk_norm="all", qkv_bias=bias, o_bias=bias, clip_qkv=clip)

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        routing = Routing(
            "softmax_topk", hf["num_experts_per_tok"], hf.get("norm_topk_prob", False)
        )
        experts = self.experts(hf["num_experts"], hf["intermediate_size"])
        return SparseMoE(self.cfg.hidden_size, experts, routing)


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    """AI2's FlexOlmo: OLMoE's experts under OLMo 2's layer (norms after each sublayer only)."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return replace(super().layer_recipe(i), **POST_NORMS)


class Glm4MoeForCausalLM(MoeRecipeLM):
    """GQA with a q/k/v bias, q/k norms per head where `use_qk_norm`, a rotary over part of
    each head; dense MLPs in the first `first_k_dense_replace` layers, DeepSeek's MoE block
    after. Also Solar Open (`SolarOpenForCausalLM`): the MoE block in every layer."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(rotary_fraction=rotary_fraction(hf))

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        return LayerRecipe(
            qkv_bias=hf.get("attention_bias", False),
            qk_norm="head" if hf.get("use_qk_norm") else None,
        )

    def make_mlp(self, i: int) -> nn.Module:
        cfg = self.cfg
        if i < self.hf.get("first_k_dense_replace", 0):
            return SwiGLU(cfg.hidden_size, cfg.intermediate_size, self.hf.get("hidden_act", "silu"))
        return deepseek_moe(self.hf, cfg.hidden_size, self.tp)

    def rename(self, name: str) -> str | None:
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")


class MiniCPM5MoeForCausalLM(Glm4MoeForCausalLM):
    """MiniCPM 5 MoE: each head's query beside its gate in one projection (`q_gate_proj`), the
    attention output gated per channel by the gate's sigmoid; DeepSeek's MoE block where
    `mlp_layer_types` says "sparse", a dense MLP elsewhere."""

    def make_attention(self, i: int, recipe: LayerRecipe) -> nn.Module:
        return GatedOutputAttention(self.cfg, i, self.tp, recipe, "sigmoid", per_head=False)

    def make_mlp(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        if hf["mlp_layer_types"][i] == "dense":
            return SwiGLU(cfg.hidden_size, cfg.intermediate_size, hf.get("hidden_act", "silu"))
        return deepseek_moe(hf, cfg.hidden_size, self.tp)

    def load_weights(self, weights) -> None:
        super().load_weights(self._split_query_gates(weights))

    def _split_query_gates(self, weights):
        """The release's `q_proj` (transformers' `q_gate_proj`) holds each head's query rows,
        then its gate rows: as q_proj and g_proj."""
        heads = self.hf["num_attention_heads"]
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            head, _, leaf = module.rpartition(".")
            if leaf not in ("q_proj", "q_gate_proj") or not head.endswith(".self_attn"):
                yield name, tensor
                continue
            for part, rows in zip(("q_proj", "g_proj"), split_per_head(tensor, heads, 2)):
                yield f"{head}.{part}.{kind}", rows


class MiniMaxM2ForCausalLM(MoeRecipeLM):
    """q and k normed over all heads, a partial rotary, corrected-sigmoid routing in every
    layer (`block_sparse_moe`)."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(rotary_fraction=rotary_fraction(hf))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(qk_norm="all")

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        routing = Routing("grouped_sigmoid", hf["num_experts_per_tok"], renormalize=True)
        experts = self.experts(hf["num_local_experts"], hf["intermediate_size"])
        return SparseMoE(self.cfg.hidden_size, experts, routing, correction_bias=True)

    def rename(self, name: str) -> str | None:
        """Mixtral's names (`block_sparse_moe`, experts' w1/w3/w2)."""
        return mixtral_name(name)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's MLA (here without a q LoRA where `q_lora_rank` is null) and MoE block,
    with V2's softmax routing (`greedy` or `group_limited_greedy`)."""

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


class PhimoeForCausalLM(MoeRecipeLM):
    """LayerNorms with a bias, biased attention projections, two experts a token chosen by
    the sparse mixer; Mixtral's names."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias")

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("attention_bias", False)
        return LayerRecipe(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        if hf.get("num_experts_per_tok", 2) != 2:
            raise ValueError("PhiMoE's sparse mixer routes each token to 2 experts")
        routing = Routing("sparsemixer", 2, jitter=hf.get("router_jitter_noise", 0.01))
        experts = self.experts(hf["num_local_experts"], hf["intermediate_size"])
        return SparseMoE(self.cfg.hidden_size, experts, routing)

    def rename(self, name: str) -> str | None:
        return mixtral_name(name)


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's MLA and MoE block (corrected-sigmoid routing), its dense
    and sparse layers named by `mlp_layer_types`."""


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    """ERNIE 4.5's attention (an interleaved rotary, `use_bias`) over sparse blocks in the layers
    from `moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`-th: softmax
    scores, experts chosen by score plus a correction bias, beside shared experts; the LM head
    has a bias where `use_bias`."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.lm_head = Linear(
            self.cfg.hidden_size, self.cfg.vocab_size, bias=self.hf.get("use_bias", False)
        )

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        last = hf.get("moe_layer_end_index", -1)
        last = hf["num_hidden_layers"] - 1 if last == -1 else last
        start, every = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_interval", 1)
        if not (start <= i <= last and (i + 1) % every == 0):
            return super().make_mlp(i)
        top_k = hf.get("moe_k", hf.get("num_experts_per_tok"))
        routing = Routing("grouped_softmax", top_k, renormalize=True)
        count = hf.get("moe_num_experts", hf.get("num_experts"))
        experts = Experts(count, hidden, hf["moe_intermediate_size"], self.tp)
        width = hf["moe_intermediate_size"] * hf.get("moe_num_shared_experts", 0)
        shared = (
            SwiGLU(hidden, width // self.tp.size, bias=hf.get("use_bias", False)) if width else None
        )
        return SparseMoE(hidden, experts, routing, correction_bias=True, shared=shared)

    def rename(self, name: str) -> str | None:
        """The router's correction bias, saved under `gate.moe_statics` or `moe_statics`."""
        return name.replace(".gate.moe_statics.", ".").replace(".moe_statics.", ".")

    def load_weights(self, weights) -> None:
        super().load_weights(
            (n, t.reshape(-1) if n.endswith("e_score_correction_bias") else t)
            for n, t in unstack_experts(weights)
        )


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    """HunYuan's attention over a sparse block in every layer: softmax top-k, renormalized,
    beside a shared MLP (`shared_mlp`); expert counts and top-k may be given per layer."""

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        count, top_k = (
            v if isinstance(v, int) else v[i] for v in (hf["num_experts"], hf["moe_topk"])
        )
        routing = Routing("softmax_topk", top_k, renormalize=True)
        experts = Experts(count, hidden, hf["intermediate_size"], self.tp)
        shared = SwiGLU(hidden, hf["intermediate_size"] // self.tp.size)
        return SparseMoE(hidden, experts, routing, shared=shared)

    def rename(self, name: str) -> str | None:
        name = super().rename(name).replace(".mlp.gate.wg.", ".mlp.gate.")
        return name.replace(".mlp.shared_mlp.", ".mlp.shared_experts.")

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


class HYV3ForCausalLM(MoeRecipeLM):
    """Tencent's Hunyuan 3: q and k normed per head, DeepSeek's MoE block (corrected sigmoid
    scores in one group, renormalized, times `router_scaling_factor`) where `mlp_layer_types`
    says "sparse"; the release's router names (`router.gate`, `expert_bias`, `shared_mlp`)."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("attention_bias", False)
        return LayerRecipe(qkv_bias=bias, o_bias=bias, qk_norm="head")

    def make_mlp(self, i: int) -> nn.Module:
        hf = self.hf
        if hf["mlp_layer_types"][i] != "sparse":
            return super().make_mlp(i)
        names = dict(
            n_routed_experts=hf["num_experts"],
            n_shared_experts=hf.get("num_shared_experts"),
            routed_scaling_factor=hf.get("router_scaling_factor", 1.0),
            norm_topk_prob=True,
        )
        return deepseek_moe({**hf, **names}, self.cfg.hidden_size, self.tp)

    def rename(self, name: str) -> str | None:
        name = name.replace(".mlp.router.gate.", ".mlp.gate.")
        name = name.replace(".mlp.expert_bias", ".mlp.e_score_correction_bias")
        return name.replace(".mlp.shared_mlp.", ".mlp.shared_experts.")


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """rednote's dots.llm1: Qwen 3's attention (q and k normed per head, biases where
    `attention_bias`, windows where `layer_types` says so) over DeepSeek-V3's MoE block after
    `first_k_dense_replace` dense layers."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe()

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("attention_bias", False)
        window = layer_window_of(self.hf, i)
        return LayerRecipe(qkv_bias=bias, o_bias=bias, qk_norm="head", window=window)
