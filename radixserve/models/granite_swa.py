"""Granite SWA (IBM): Granite's µP multipliers with windows where `layer_types` says so, a learnt
sink logit per head (an extra logit in each softmax's denominator, as gpt-oss's) and a rotary
base per layer (`layer_rope_theta`; 0: no rotary in that layer). Dense (`GraniteSWAForCausalLM`)
or with Granite 3 MoE's shared and routed MLPs (`GraniteMoeSWAForCausalLM`)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..attention import LayerAttention
from ..model_config import ModelConfig
from .decoder import Attention
from .dense_families import GraniteForCausalLM, layer_window_of
from .granite_hybrid import GraniteMoeHybridForCausalLM
from .recipe import LayerRecipe, with_sinks
from .rotary import RotaryEmbedding


def layer_thetas(hf: dict) -> list[float]:
    """Each layer's rotary base (0: none), `rope_theta` where no list is given."""
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return hf.get("layer_rope_theta") or [theta] * hf["num_hidden_layers"]


def rope_table_of(hf: dict, i: int) -> int | None:
    """Which rotary table layer i uses (one per distinct base, ascending), None for no rotary."""
    thetas = layer_thetas(hf)
    return sorted(set(thetas) - {0}).index(thetas[i]) if thetas[i] else None


def theta_rotaries(cfg: ModelConfig, max_positions: int) -> list[RotaryEmbedding]:
    thetas = sorted(set(layer_thetas(cfg.hf_config)) - {0})
    return [
        RotaryEmbedding(cfg.head_dim, max_positions, theta, cfg.rope_scaling_dict)
        for theta in thetas
    ]


class GraniteSWAForCausalLM(GraniteForCausalLM):
    def layer_recipe(self, i: int) -> LayerRecipe:
        table = rope_table_of(self.hf, i)
        return replace(
            super().layer_recipe(i),
            window=layer_window_of(self.hf, i),
            rope=table is not None,
            rope_table=table or 0,
        )

    def make_layer(self, i: int) -> nn.Module:
        layer = super().make_layer(i)
        with_sinks(layer.self_attn)
        return layer

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return theta_rotaries(self.cfg, max_positions)


class GraniteMoeSWAForCausalLM(GraniteMoeHybridForCausalLM):
    def make_attention(self, kv_index: int, i: int) -> nn.Module:
        hf = self.hf
        how = LayerAttention(
            scale=hf.get("attention_multiplier", 1.0), window=layer_window_of(hf, i)
        )
        bias = hf.get("attention_bias", False)
        rope = rope_table_of(hf, i)
        return with_sinks(Attention(self.cfg, kv_index, self.tp, how, bias, bias, rope=rope))

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return theta_rotaries(self.cfg, max_positions)
