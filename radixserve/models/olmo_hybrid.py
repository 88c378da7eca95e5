"""OLMo Hybrid (`OlmoHybridForCausalLM`, AI2): Gated DeltaNet layers beside OLMo 3's attention.

The Gated DeltaNet layers are pre-norm, with q, k, v, the gate, the decay and the write
strength each projected on its own (q, k and v fused here as attention's are) and the write
strength doubled where `linear_allow_neg_eigval` says; their gated output norm keeps eps 1e-5.
The attention layers are OLMo 3's: norms after each sublayer only, q and k normed over all
heads; the released checkpoints rotate nothing (no `rope_theta`)."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .dense_families import POST_NORMS
from .hybrid import HybridCausalLM, joined_convolutions
from .layers import Linear, RMSNorm
from .qwen3_5 import GatedDeltaNet, delta_net_shard
from .recipe import LayerRecipe, RecipeAttention, RecipeLayer, all_heads_norm_share
from .recurrent_states import RecurrentStates
from .rotary import RotaryEmbedding

LINEAR_ATTENTION = re.compile(r"(model\.layers\.\d+)\.linear_attn\.(\w+)")
RELEASED_NORMS = (
    (".attention_layer_norm.", ".input_layernorm."),
    (".feedforward_layer_norm.", ".post_attention_layernorm."),
)
# the Gated DeltaNet's checkpoint names -> Qwen3.5's module names (q/k/v_proj fuse as they are)
MIXER_NAMES = {
    "g_proj": "in_proj_z",
    "a_proj": "in_proj_a",
    "b_proj": "in_proj_b",
    "o_norm": "norm",
    "o_proj": "out_proj",
}


class SeparateGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: ModelConfig, index: int, states: RecurrentStates, tp: TPGroup):
        super().__init__(cfg, index, states, tp)
        del self.in_proj_qkv
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.widths), parts=tuple(self.widths))
        self.norm = RMSNorm(self.value_dim, 1e-5)
        self.write_scale = 2.0 if cfg.hf_config.get("linear_allow_neg_eigval", True) else 1.0

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv_proj(x)


class OlmoHybridForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        rope = cfg.hf_config.get("rope_parameters") or {}
        self.rope = bool(rope.get("rope_theta") or cfg.hf_config.get("rope_theta"))
        self.attention_recipe = LayerRecipe(**POST_NORMS, qk_norm="all", rope=self.rope)
        super().__init__(cfg, max_positions, tp)

    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        return RecipeAttention(self.cfg, kv_index, self.tp, self.attention_recipe)

    def make_mixer(self, i: int) -> nn.Module:
        return SeparateGatedDeltaNet(self.cfg, i, self.states, self.tp)

    def make_decoder_layer(self, i: int, mixer: nn.Module) -> nn.Module:
        recipe = self.attention_recipe if isinstance(mixer, RecipeAttention) else LayerRecipe()
        return RecipeLayer(self.cfg, self.tp, recipe, mixer, self.make_mlp(i))

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return super().make_rotaries(max_positions) if self.rope else []

    def rename(self, name: str) -> str | None:
        """The mixer of every layer sits at `self_attn`, the Gated DeltaNet's parts by
        Qwen3.5's names; the released checkpoints' norm names as transformers renames them."""

        def ours(match: re.Match) -> str:
            layer, part = match.groups()
            return f"{layer}.self_attn.{MIXER_NAMES.get(part, part)}"

        for released, hf_name in RELEASED_NORMS:
            name = name.replace(released, hf_name)
        return LINEAR_ATTENTION.sub(ours, name)

    def tp_slice(self, module_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        shared = all_heads_norm_share(module_name, tensor, self.cfg.head_dim, self.tp)
        return super().tp_slice(module_name, kind, tensor) if shared is None else shared

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Convolutions joined, names made ours, then each rank's share of the Gated DeltaNet's
        tensors (q, k and v are sliced by the loader as attention's are)."""
        renamed = ((self.rename(name), tensor) for name, tensor in joined_convolutions(weights))
        super().load_weights(delta_net_shard(renamed, self.hf, self.tp))
