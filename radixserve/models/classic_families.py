"""Dense families of LayerNorms with a bias, as recipes over the shared decoder: Phi-2
(attention and MLP side by side on one norm, a partial rotary, a biased LM head), StarCoder2
(biases everywhere, a window), Nemotron (Nemotron-4, Minitron: `1 + w` LayerNorms, a partial
rotary, a squared-ReLU MLP), Jais 2 (Llama's biases, a squared-ReLU MLP), all with MLPs without
a gate; StableLM (a partial rotary, Llama's gated MLP, attention and MLP side by side where
`use_parallel_residual`); and GPT-NeoX (Pythia: a partial rotary, q, k and v fused head by head,
attention and MLP side by side on norms of their own where `use_parallel_residual`)."""

from __future__ import annotations

import re

from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .layers import Linear, PlainMLP
from .llama import split_per_head
from .recipe import LayerRecipe, ModelRecipe, RecipeCausalLM, llama_biases, rotary_fraction

GATELESS_NAMES = {".mlp.fc1.": ".mlp.up_proj.", ".mlp.fc2.": ".mlp.down_proj.",
                  ".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."}  # fmt: skip


class GatelessRecipeLM(RecipeCausalLM):
    """An MLP of `up_proj`, the activation and `down_proj` (checkpoints' fc1/fc2 or c_fc/c_proj),
    biased where `mlp_bias`."""

    def make_mlp(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        bias = self.layer_recipe(i).mlp_bias
        return PlainMLP(cfg.hidden_size, cfg.intermediate_size, hf.get("hidden_act"), bias=bias)

    def rename(self, name: str) -> str | None:
        for theirs, ours in GATELESS_NAMES.items():
            name = name.replace(theirs, ours)
        return name


class PhiForCausalLM(GatelessRecipeLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        if cfg.hf_config.get("qk_layernorm"):
            raise ValueError("config.json: qk_layernorm is not implemented for Phi")
        super().__init__(cfg, max_positions, tp)
        self.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=True)

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias", rotary_fraction=rotary_fraction(hf, 0.5))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(pre_mlp=None, parallel=True, qkv_bias=True, o_bias=True, mlp_bias=True)

    def rename(self, name: str) -> str | None:
        name = super().rename(name).replace(".self_attn.dense.", ".self_attn.o_proj.")
        return name.replace("model.final_layernorm.", "model.norm.")


class Starcoder2ForCausalLM(GatelessRecipeLM):
    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias")

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("use_bias", True)
        window = self.hf.get("sliding_window")
        return LayerRecipe(qkv_bias=bias, o_bias=bias, mlp_bias=bias, window=window)


class NemotronForCausalLM(GatelessRecipeLM):
    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_1p", rotary_fraction=rotary_fraction(hf, 0.5))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf))


class StableLmForCausalLM(RecipeCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        if cfg.hf_config.get("qk_layernorm"):
            raise ValueError("config.json: qk_layernorm is not implemented for StableLM")
        super().__init__(cfg, max_positions, tp)

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias", rotary_fraction=rotary_fraction(hf, 0.25))

    def layer_recipe(self, i: int) -> LayerRecipe:
        parallel = self.hf.get("use_parallel_residual", False)
        return LayerRecipe(
            pre_mlp=None if parallel else "post_attention_layernorm",
            parallel=parallel,
            qkv_bias=self.hf.get("use_qkv_bias", False),
        )


class Jais2ForCausalLM(GatelessRecipeLM):
    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias")

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf))


NEOX_NAMES = (
    (re.compile(r"^gpt_neox\.embed_in\."), "model.embed_tokens."),
    (re.compile(r"^gpt_neox\.final_layer_norm\."), "model.norm."),
    (re.compile(r"^gpt_neox\.layers\."), "model.layers."),
    (re.compile(r"^embed_out\."), "lm_head."),
    (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.down_proj."),
)


class GPTNeoXForCausalLM(GatelessRecipeLM):
    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_bias", rotary_fraction=rotary_fraction(hf, 0.25))

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("attention_bias", True)
        return LayerRecipe(
            parallel=self.hf.get("use_parallel_residual", True),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=True,
        )

    def rename(self, name: str) -> str | None:
        if name.endswith((".attention.bias", ".attention.masked_bias")):
            return None  # old checkpoints' causal-mask buffers
        for pattern, ours in NEOX_NAMES:
            name = pattern.sub(ours, name)
        return name

    def load_weights(self, weights) -> None:
        super().load_weights(self._split_qkv(weights))

    def _split_qkv(self, weights):
        """`query_key_value` holds each head's q, k and v rows in turn: as q_proj, k_proj,
        v_proj."""
        heads = self.hf["num_attention_heads"]
        for name, tensor in weights:
            if ".attention.query_key_value." not in name:
                yield name, tensor
                continue
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), split_per_head(tensor, heads, 3)):
                yield name.replace("query_key_value", part), rows
