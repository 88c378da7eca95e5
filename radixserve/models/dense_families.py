"""The dense families that are recipes over the shared decoder (`recipe`): each says, from
its config, where its norms sit and what its layers add to Llama's."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import layer_window
from .layers import Linear, PlainMLP
from .llama import split_gate_up
from .recipe import (
    LayerRecipe,
    ModelRecipe,
    RecipeAttention,
    RecipeCausalLM,
    llama_biases,
    rotary_fraction,
)

POST_NORMS = dict(
    pre_attn=None,
    post_attn="post_attention_layernorm",
    pre_mlp=None,
    post_mlp="post_feedforward_layernorm",
)


def layer_window_of(hf: dict, i: int) -> int | None:
    """Layer i's window where the config lists `layer_types` beside a `sliding_window`."""
    types = hf.get("layer_types")
    if types and hf.get("sliding_window"):
        return hf["sliding_window"] if types[i] == "sliding_attention" else None
    return None


class GemmaForCausalLM(RecipeCausalLM):
    """Gemma (1): Llama's layer with `(1 + w)` norm weights, tanh-GELU gates, embeddings scaled
    by sqrt(hidden)."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(embed_scale=hf["hidden_size"] ** 0.5, norm="gemma")

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf))


class SmolLM3ForCausalLM(RecipeCausalLM):
    """Llama with no-rope layers (`no_rope_layers[i]` 0)."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        return LayerRecipe(
            **llama_biases(hf),
            rope=bool(hf.get("no_rope_layers", [1] * (i + 1))[i]),
            window=layer_window(hf, i) if hf.get("use_sliding_window") else None,
        )


class GraniteForCausalLM(RecipeCausalLM):
    """Llama with µP multipliers: embeddings, attention scores, each residual branch, and the
    logits divided by `logits_scaling`."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(
            embed_scale=hf.get("embedding_multiplier", 1.0),
            logit_scale=1.0 / hf.get("logits_scaling", 1.0),
        )

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        return LayerRecipe(
            **llama_biases(hf),
            attention_scale=hf.get("attention_multiplier"),
            residual_scale=hf.get("residual_multiplier", 1.0),
        )


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    """Naver's HyperCLOVA X: Granite's multipliers with logits multiplied (not divided) by
    `logits_scaling` and, where `use_post_norm`, a norm after each sublayer too."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return replace(super().model_recipe_of(hf), logit_scale=hf.get("logits_scaling", 1.0))

    def layer_recipe(self, i: int) -> LayerRecipe:
        recipe = super().layer_recipe(i)
        if not self.hf.get("use_post_norm", True):
            return recipe
        return replace(recipe, post_attn="post_norm1", post_mlp="post_norm2")


class SeedOssForCausalLM(RecipeCausalLM):
    """Llama with a q/k/v bias and its own switches for o_proj's and the MLP's."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        return LayerRecipe(
            qkv_bias=hf.get("attention_bias", True),
            o_bias=hf.get("attention_out_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
        )


class Ernie4_5ForCausalLM(RecipeCausalLM):
    """Llama with an interleaved rotary and one `use_bias` for every projection."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(interleaved_rope=True)

    def layer_recipe(self, i: int) -> LayerRecipe:
        bias = self.hf.get("use_bias", False)
        return LayerRecipe(qkv_bias=bias, o_bias=bias, mlp_bias=bias)


class OlmoForCausalLM(RecipeCausalLM):
    """OLMo (1): Llama's layer with LayerNorms that have neither weights nor biases, and q, k
    and v clamped to `clip_qkv` where set."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(norm="layer_unweighted")

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf), clip_qkv=self.hf.get("clip_qkv"))


class Olmo2ForCausalLM(RecipeCausalLM):
    """Norms after each sublayer (none before), q and k normed over all heads; OLMo 3 adds
    sliding-window layers."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(
            **POST_NORMS, **llama_biases(self.hf), qk_norm="all", window=layer_window_of(self.hf, i)
        )


class Exaone4ForCausalLM(RecipeCausalLM):
    """Norms after each sublayer, q and k normed per head; with sliding windows, only the
    window layers rotate (the global ones have no position embedding)."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        window = layer_window_of(self.hf, i)
        rope = window is not None or not self.hf.get("sliding_window")
        return LayerRecipe(**POST_NORMS, qk_norm="head", rope=rope, window=window)


class Glm4ForCausalLM(RecipeCausalLM):
    """Norms before and after each sublayer, a q/k/v bias, an interleaved rotary over part of
    each head; its checkpoint fuses the MLP's gate and up projections."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(interleaved_rope=True, rotary_fraction=rotary_fraction(hf, 0.5))

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(
            post_attn="post_self_attn_layernorm",
            post_mlp="post_mlp_layernorm",
            qkv_bias=self.hf.get("attention_bias", True),
        )

    def load_weights(self, weights) -> None:
        super().load_weights(split_gate_up(weights))


class GlmForCausalLM(Glm4ForCausalLM):
    """GLM-4 (`glm`, before GLM-4-0414): GLM-4's attention and fused MLP under Llama's norms."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(qkv_bias=self.hf.get("attention_bias", True))


class HeliumForCausalLM(RecipeCausalLM):
    """Kyutai's Helium: Llama with an interleaved rotary and a q/k/v bias (`attention_bias`)
    but none on o_proj."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(interleaved_rope=True)

    def layer_recipe(self, i: int) -> LayerRecipe:
        hf = self.hf
        return LayerRecipe(
            qkv_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False)
        )


class ArceeForCausalLM(RecipeCausalLM):
    """Arcee's AFM: Llama with an MLP without a gate (`up_proj`, squared ReLU, `down_proj`)."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf))

    def make_mlp(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        act, bias = hf.get("hidden_act", "relu2"), hf.get("mlp_bias", False)
        return PlainMLP(cfg.hidden_size, cfg.intermediate_size, act, bias=bias)


class Cohere2ForCausalLM(RecipeCausalLM):
    """Command A: attention and MLP side by side on one mean-subtracting norm, an interleaved
    rotary on the sliding-window layers only, logits scaled by `logit_scale`."""

    @classmethod
    def model_recipe_of(cls, hf: dict) -> ModelRecipe:
        return ModelRecipe(
            logit_scale=hf.get("logit_scale", 1.0), interleaved_rope=True, norm="layer"
        )

    def layer_recipe(self, i: int) -> LayerRecipe:
        window = layer_window_of(self.hf, i)
        return LayerRecipe(
            **llama_biases(self.hf), pre_mlp=None, parallel=True, rope=window is not None,
            window=window,
        )  # fmt: skip


class CohereForCausalLM(Cohere2ForCausalLM):
    """Command R and R+, Aya (`CohereForCausalLM`): Command A's parallel layer with the
    interleaved rotary in every layer, and (`use_qk_norm`, Command R+) q and k each through a
    mean-subtracting norm with its own weights per head."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return replace(super().layer_recipe(i), rope=True, window=None)

    def make_attention(self, i: int, recipe: LayerRecipe) -> nn.Module:
        if not self.hf.get("use_qk_norm"):
            return super().make_attention(i, recipe)
        return HeadNormedAttention(self.cfg, i, self.tp, recipe)


class HeadNormedAttention(RecipeAttention):
    """q and k, each head through a LayerNorm (no bias) with that head's own weights."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, recipe: LayerRecipe):
        super().__init__(cfg, layer, tp, recipe)
        self.q_norm = HeadLayerNorm(cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = HeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        q, k = q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        return self.q_norm(q), self.k_norm(k)


class HeadLayerNorm(nn.Module):
    """LayerNorm without a bias over each head of `[T, heads, dim]`, a weight row per head."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class XIELU(nn.Module):
    """xIELU, with its learned `alpha_p`, `alpha_n` and fixed `beta`, `eps` from the checkpoint:
    `alpha_p x^2 + beta x` above zero, `alpha_n (expm1(min(x, eps)) - x) + beta x` below
    (each alpha through a softplus, alpha_n above beta)."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32, beta = x.float(), self.beta.float()
        alpha_p = F.softplus(self.alpha_p.float())
        alpha_n = beta + F.softplus(self.alpha_n.float())
        negative = (torch.expm1(torch.minimum(x32, self.eps.float())) - x32) * alpha_n
        return torch.where(x32 > 0, alpha_p * x32 * x32, negative).add_(beta * x32).to(x.dtype)


class ApertusMLP(nn.Module):
    """`down(xielu(up(x)))`, no gate."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act_fn = XIELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(RecipeCausalLM):
    """Llama with q and k normed per head, its norms named for their sublayers, and an MLP
    without a gate through xIELU."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(
            **llama_biases(self.hf),
            pre_attn="attention_layernorm",
            pre_mlp="feedforward_layernorm",
            qk_norm="head",
        )

    def make_mlp(self, i: int) -> nn.Module:
        if self.hf.get("hidden_act", "xielu") != "xielu":
            raise ValueError("Apertus runs its MLP through xIELU (hidden_act 'xielu')")
        return ApertusMLP(self.cfg.hidden_size, self.cfg.intermediate_size)


class Apertus1p5ForCausalLM(ApertusForCausalLM):
    """Apertus 1.5's language model (alone, or in its multimodal checkpoint under
    `model.language_model.`; the image and audio tokenizers are not served): Apertus, its head
    possibly pruned to the first `output_vocab_size` ids (the others' logits are -inf)."""

    NOT_TEXT = ("model.vision_tokenizer.", "model.audio_tokenizer.")

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        super().__init__(cfg, max_positions, tp)
        self.kept = self.hf.get("output_vocab_size") or cfg.vocab_size
        self.lm_head = Linear(cfg.hidden_size, self.kept)

    def rename(self, name: str) -> str | None:
        if name.startswith(self.NOT_TEXT):
            return None
        return super().rename(name.replace("model.language_model.", "model.", 1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        pruned = self.cfg.vocab_size - self.kept
        return F.pad(logits, (0, pruned), value=float("-inf")) if pruned else logits


class HunYuanDenseV1ForCausalLM(RecipeCausalLM):
    """Llama with q and k normed per head after the rotary (`query_layernorm`,
    `key_layernorm`); its rotary may stretch the base by a fixed NTK `alpha`."""

    def layer_recipe(self, i: int) -> LayerRecipe:
        return LayerRecipe(**llama_biases(self.hf), qk_norm="head", qk_norm_after_rope=True)

    def rename(self, name: str) -> str | None:
        return name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm.")
