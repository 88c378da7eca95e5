"""Llama 4 (text): no-rope layers (every `no_rope_layer_interval`-th) whose queries are scaled
up with the position (`attn_temperature_tuning`), chunked attention on the rope layers, q and k
normed per head without a weight, an interleaved rotary; MoE layers (`moe_layers`) route each
token to one expert whose input, not output, is scaled by the sigmoid of its router logit,
beside a shared expert. A multimodal checkpoint (`Llama4ForConditionalGeneration`) is served as
its language model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import swap_prefix
from .layers import SwiGLU
from .moe import Experts, unstack_experts
from .recipe import LayerRecipe, ModelRecipe, RecipeCausalLM
from .rotary import QueryTemperature

NOT_TEXT = (
    "vision_model.",
    "multi_modal_projector.",
    "model.vision_model.",
    "model.multi_modal_projector.",
)
# a multimodal checkpoint's language model, as transformers saves it (older and newer names)
LANGUAGE_MODEL = (("language_model.", ""), ("model.language_model.", "model."))


class Llama4Moe(nn.Module):
    def __init__(self, hidden: int, experts: Experts, shared: SwiGLU):
        super().__init__()
        self.gate = nn.Linear(hidden, experts.num_experts, bias=False)
        self.experts, self.shared_experts = experts, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, chosen = F.linear(x, self.gate.weight).topk(1, dim=-1)
        score = torch.sigmoid(top.float()).to(x.dtype)
        return self.experts(x * score, torch.ones_like(score), chosen) + self.shared_experts(x)


class Llama4ForCausalLM(RecipeCausalLM):
    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        if hf.get("num_local_experts") and hf.get("num_experts_per_tok", 1) != 1:
            raise ValueError("Llama 4's MoE layers route each token to one expert")
        return ModelRecipe(interleaved_rope=True)

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        rope = bool(hf.get("no_rope_layers", [1] * (i + 1))[i])
        types = hf.get("layer_types") or []
        chunked = i < len(types) and types[i] == "chunked_attention"
        bias = hf.get("attention_bias", False)
        return LayerRecipe(
            qk_norm="head_unweighted" if hf.get("use_qk_norm") and rope else None,
            qkv_bias=bias,
            o_bias=bias,
            rope=rope,
            chunk=hf.get("attention_chunk_size") if chunked else None,
            query_temperature=not rope and bool(hf.get("attn_temperature_tuning", False)),
        )

    def make_rotaries(self, max_positions: int):
        hf = self.hf
        table = QueryTemperature(hf.get("floor_scale", 8192), hf.get("attn_scale", 0.1), 1.0)
        return super().make_rotaries(max_positions) + [table]

    def make_mlp(self, i: int) -> nn.Module:
        hf, hidden, ranks = self.hf, self.cfg.hidden_size, self.tp.size
        if i not in hf.get("moe_layers", []):
            inter = hf.get("intermediate_size_mlp", hf["intermediate_size"])
            return SwiGLU(hidden, inter // ranks, hf.get("hidden_act", "silu"))
        inter = hf["intermediate_size"]  # unsharded: Experts takes this rank's share
        experts = Experts(hf["num_local_experts"], hidden, inter, self.tp)
        return Llama4Moe(hidden, experts, SwiGLU(hidden, inter // ranks))

    def rename(self, name: str) -> str | None:
        """Also a multimodal checkpoint's language model (`language_model.`); its vision tower
        and projector are not served."""
        if name.startswith(NOT_TEXT):
            return None
        name = swap_prefix(name, LANGUAGE_MODEL).replace(".feed_forward.", ".mlp.")
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights, inputs_first=True))
