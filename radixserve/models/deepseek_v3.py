"""DeepSeek-V3: multi-head latent attention (MLA) over routed and shared experts.

MLA keeps one compressed latent per token in the KV pool, `kv_lora_rank` normalised channels and
`qk_rope_head_dim` rotated ones, shared by every head: the pool holds that and nothing else, so
the radix cache, HiCache and KV events carry latents as they carry K/V. Attention runs in the
absorbed form: each head's key up-projection is folded into its query (`q_nope @ W_UK` scores
against the latent directly), attention reads values from the latent, and the value
up-projection follows. The same scores as HF's expanded keys, without expanding them.

The first `first_k_dense_replace` layers have dense MLPs; the others route each token to
`num_experts_per_tok` of `n_routed_experts` (sigmoid scores with a correction bias, best groups
first) and add the shared experts."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import CausalLM, DecoderLayer, Rope
from .layers import Linear, RMSNorm, SwiGLU
from .moe import Routing, deepseek_moe, deepseek_routing, unstack_experts
from .recipe import LayerRecipe, RecipeLayer
from .rotary import QueryTemperature, RotaryEmbedding, apply_rotary, beta_query_scaling

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class KVUpProjection(nn.Module):
    """kv_b_proj as `[heads, qk_nope + v, kv_lora_rank]`: the rows of this rank's heads."""

    def __init__(self, heads: int, rows: int, rank: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, rows, rank))
        self.loaded = False

    @torch.no_grad()
    def load_checkpoint(self, name: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        if name != "weight":
            raise ValueError("it has no place in kv_b_proj")
        heads, rows, rank = self.weight.shape
        if tensor.shape != (heads * tp.size * rows, rank):
            raise ValueError(f"expected shape {(heads * tp.size * rows, rank)}")
        self.weight.copy_(tp.shard(tensor, 0).view(heads, rows, rank))
        self.loaded = True

    def missing_tensors(self) -> list[str]:
        return [] if self.loaded else ["weight"]


class LatentAttention(nn.Module):
    """`temperature`: which of the model's tables scales each query by its position
    (`rotary.QueryTemperature`: Mistral 4), if any; `rotate`: False where the rotary part of
    each key is kept unrotated (Kimi Linear's NoPE); `lora_scaled`: the queries scaled by
    sqrt(hidden / q_lora_rank) and the latents by sqrt(hidden / kv_lora_rank) (LongCat-Flash).
    The latent norms keep eps 1e-6 whatever `rms_norm_eps` says, as DeepSeek's do."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        tp: TPGroup,
        temperature: int | None = None,
        rotate: bool = True,
        lora_scaled: bool = False,
    ):
        super().__init__()
        hf = cfg.hf_config
        self.layer, self.tp, self.heads = layer, tp, cfg.num_heads
        self.temperature, self.rotate = temperature, rotate
        self.nope, self.rope_dim = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        self.v_dim, self.rank = hf["v_head_dim"], hf["kv_lora_rank"]
        self.interleaved = hf.get("rope_interleave", True)
        q_dim, eps, hidden = self.heads * (self.nope + self.rope_dim), 1e-6, cfg.hidden_size
        self.q_lora = hf.get("q_lora_rank")
        bias = hf.get("attention_bias", False)
        if self.q_lora is None:
            self.q_proj = Linear(hidden, q_dim)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps)
            self.q_b_proj = Linear(self.q_lora, q_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = KVUpProjection(self.heads, self.nope + self.v_dim, self.rank)
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.how = LayerAttention(scale=mla_scale(hf), value_dim=self.rank)
        self.q_scale = (hidden / self.q_lora) ** 0.5 if lora_scaled else 1.0
        self.latent_scale = (hidden / self.rank) ** 0.5 if lora_scaled else 1.0
        self.cpu_ops = None

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        query, key, _ = self.project(x, ropes)
        empty = key.new_empty(key.shape[0], 1, 0)
        return self.finish(backend.forward(self.layer, query, key, empty, self.how))

    def project(self, x: torch.Tensor, ropes: list[Rope]):
        """The absorbed queries `[T, heads, rank + rope]`, each token's key (its latent and
        rotated part) `[T, 1, rank + rope]`, and q's LoRA output (None without one)."""
        q_resid = None
        if self.q_lora is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q_nope, q_pe = q.view(-1, self.heads, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        k_pe = k_pe.unsqueeze(1)
        if self.rotate:
            cos, sin = ropes[0]
            q_pe = apply_rotary(self._pairs_first(q_pe), cos, sin)
            k_pe = apply_rotary(self._pairs_first(k_pe), cos, sin)
        latent = self.kv_a_layernorm(latent.contiguous())
        if self.latent_scale != 1.0:
            latent = latent * self.latent_scale
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)
        w_uk = self.kv_b_proj.weight[:, : self.nope]
        query = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_pe], dim=-1)
        if self.temperature is not None:
            query = (query.float() * ropes[self.temperature][0]).to(query.dtype)
        return query, key, q_resid

    def finish(self, out: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over latents `[T, heads x rank]` -> the layer's output; `gate [T, heads,
        v_head_dim]`: each head's values scaled by it first (Hunyuan v4), where given."""
        w_uv = self.kv_b_proj.weight[:, self.nope :]
        out = torch.einsum("thc,hvc->thv", out.view(-1, self.heads, self.rank), w_uv)
        out = out if gate is None else out * gate
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))

    def _pairs_first(self, x: torch.Tensor) -> torch.Tensor:
        return pairs_first(x) if self.interleaved else x.contiguous()


def pairs_first(x: torch.Tensor) -> torch.Tensor:
    """HF rotates interleaved pairs (x0, x1), (x2, x3)...: gathered into halves, the rotate-half
    kernel rotates the same pairs (q and k move alike; scores are unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_scale(hf: dict) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when the rope says `mscale_all_dim`."""
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    m_all = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and m_all:
        factor = rope["factor"]
        mscale = 0.1 * m_all * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def deepseek_mlp(cfg: ModelConfig, i: int, tp: TPGroup, routing: Routing | None = None):
    """Layer i's MLP: dense in the first `first_k_dense_replace` layers (or where
    `mlp_layer_types` says "dense": GLM-4.7-Flash, Kimi Linear), else DeepSeek's MoE block
    (routed by `routing` where the family's differs from `deepseek_routing`'s)."""
    hf = cfg.hf_config
    types = hf.get("mlp_layer_types")
    dense = types[i] == "dense" if types else i < hf.get("first_k_dense_replace", 0)
    if dense or not hf.get("n_routed_experts"):
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    return deepseek_moe(hf, cfg.hidden_size, tp, routing)


def latent_rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The rotary table over each head's `qk_rope_head_dim` rotated channels."""
    dim = cfg.hf_config["qk_rope_head_dim"]
    return RotaryEmbedding(dim, max_positions, cfg.rope_theta, cfg.rope_scaling_dict)


class DeepseekV3ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return DecoderLayer(self.cfg, i, self.tp, self.make_attention(i), self.make_mlp(i))

    def make_attention(self, i: int) -> nn.Module:
        return LatentAttention(self.cfg, i, self.tp)

    def make_mlp(self, i: int) -> nn.Module:
        return deepseek_mlp(self.cfg, i, self.tp)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return [latent_rotary(self.cfg, max_positions)]

    def rename(self, name: str) -> str | None:
        """The multi-token-prediction layers after the last one are not served."""
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.cfg.num_layers:
            return None
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral Small 4: DeepSeek-V3's MLA whose queries grow with the position past the
    original context (Ministral 3's `llama_4_scaling_beta`), over experts chosen by softmax
    scores among the groups with the best two (no correction bias)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.scaling = beta_query_scaling(cfg.hf_config)
        super().__init__(cfg, max_positions, tp)

    def make_attention(self, i: int) -> nn.Module:
        temperature = None if self.scaling is None else 1
        return LatentAttention(self.cfg, i, self.tp, temperature)

    def make_rotaries(self, max_positions: int):
        rotaries = super().make_rotaries(max_positions)
        return rotaries if self.scaling is None else [*rotaries, QueryTemperature(*self.scaling)]

    def make_mlp(self, i: int) -> nn.Module:
        routing = replace(deepseek_routing(self.hf), kind="grouped_softmax", group_best_of=2)
        return deepseek_mlp(self.cfg, i, self.tp, routing)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


class PostNormedMLPLayer(DecoderLayer):
    """DecoderLayer whose MLP output, summed over ranks, is RMS-normed before its residual add."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, attention, mlp):
        super().__init__(cfg, layer, tp, attention, mlp)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, normed, ropes, backend, next_norm: RMSNorm):
        x, normed = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(normed, ropes, backend)
        )
        mixed = self.post_mlp_layernorm(self.tp.all_reduce(self.mlp(normed)))
        return next_norm.add_and_norm(x, mixed)


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """A.X K1 (SK Telecom): DeepSeek-V3 whose MoE blocks' outputs are RMS-normed
    (`post_mlp_layernorm`), dense or sparse by `mlp_layer_types`."""

    def make_layer(self, i: int) -> nn.Module:
        if self.hf["mlp_layer_types"][i] == "dense":
            return super().make_layer(i)
        return PostNormedMLPLayer(self.cfg, i, self.tp, self.make_attention(i), self.make_mlp(i))

    def rename(self, name: str) -> str | None:
        name = super().rename(name)  # transformers' own place for the norm, inside the block
        return name and name.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm.")


class MiniCPM3ForCausalLM(DeepseekV3ForCausalLM):
    """MiniCPM3: DeepSeek-V2's MLA (its rotary turning halves, not interleaved pairs) over dense
    MLPs, with µP scales: embeddings times `scale_emb`, each sublayer's output times
    `scale_depth / sqrt(layers)`, logits divided by `hidden_size / dim_model_base`."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        hf = cfg.hf_config
        self.embed_scale = hf.get("scale_emb", 1.0)
        self.residual_scale = hf.get("scale_depth", 1.0) / math.sqrt(hf["num_hidden_layers"])
        self.logits_scaling = hf["hidden_size"] / (hf.get("dim_model_base") or hf["hidden_size"])
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        recipe = LayerRecipe(residual_scale=self.residual_scale)
        return RecipeLayer(self.cfg, self.tp, recipe, self.make_attention(i), self.make_mlp(i))

    def make_attention(self, i: int) -> nn.Module:
        attention = super().make_attention(i)
        attention.interleaved = False
        return attention

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden / self.logits_scaling)
