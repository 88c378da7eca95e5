"""Gemma 2 and Gemma 3 (text): norms around both sublayers, `(1 + w)` RMSNorm weights, tanh-GELU
gates, embeddings scaled by sqrt(hidden), queries scaled by `query_pre_attn_scalar`, sliding
windows on the local layers. Gemma 2 soft-caps attention scores and logits; Gemma 3 normalises
q and k per head and gives its local layers their own rotary base. VaultGemma is Gemma 2
without the norms after each sublayer."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..attention import LayerAttention
from ..distributed import TPGroup
from ..model_config import ModelConfig, rope_scaling_of
from .decoder import Attention, CausalLM
from .layers import RMSNorm, SwiGLU
from .rotary import RotaryEmbedding

GemmaNorm = partial(RMSNorm, weight_offset=1.0)


def attend_whole_images(q, out, backend, layer: int, cfg: ModelConfig, how, blocks) -> torch.Tensor:
    """`out` with the rows of each of the step's images attended again, each seeing the keys
    before it and all of its image (within the layer's window), from pool layer `layer`.
    `blocks`: (table row, first position, end, step row) of each image; rows [row, row + end -
    start) of the step are positions [start, end) of the request."""
    if not blocks:
        return out
    out = out.clone()
    group = cfg.num_heads // cfg.num_kv_heads
    scale = how.scale if how.scale is not None else cfg.head_dim**-0.5
    for table_row, start, end, row in blocks:
        slots = backend.inputs.req_to_token[table_row, :end]
        k = backend.pool.k[layer][slots].float().repeat_interleave(group, 1)
        v = backend.pool.v[layer][slots].float().repeat_interleave(group, 1)
        queries = torch.arange(start, end).unsqueeze(1)
        keys = torch.arange(end).unsqueeze(0)
        seen = (keys <= queries) | (keys >= start)
        if how.window is not None:
            seen &= keys > queries - how.window
        scores = torch.einsum("qhd,khd->hqk", q[row : row + end - start].float(), k)
        scores = (scores * scale).masked_fill(~seen, float("-inf"))
        rows = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        out[row : row + end - start] = rows.reshape(end - start, -1).to(out.dtype)
    return out


class GemmaDecoderLayer(nn.Module):
    """x + post_attn(attn(norm(x))), then x + post_ffw(mlp(pre_ffw(x)))."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, attention: Attention, mlp: SwiGLU):
        super().__init__()
        self.tp = tp
        eps, size = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaNorm(size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaNorm(size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaNorm(size, eps)

    def forward(self, x, normed, ropes, backend, next_norm: RMSNorm):
        x = x + self.post_attention_layernorm(self.self_attn(normed, ropes, backend))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(self.tp.all_reduce(h))
        return x, next_norm(x)


class UnwrappedGemmaLayer(GemmaDecoderLayer):
    """VaultGemma's: Gemma 2's layer without the norms after each sublayer."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, attention: Attention, mlp: SwiGLU):
        super().__init__(cfg, tp, attention, mlp)
        del self.post_attention_layernorm, self.post_feedforward_layernorm

    def forward(self, x, normed, ropes, backend, next_norm: RMSNorm):
        x = x + self.self_attn(normed, ropes, backend)
        x = x + self.tp.all_reduce(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, next_norm(x)


class Gemma2ForCausalLM(CausalLM):
    norm_class = GemmaNorm
    qk_norm: type[RMSNorm] | None = None
    layer_class: type[GemmaDecoderLayer] = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.embed_scale = cfg.hidden_size**0.5
        self.final_softcap = cfg.hf_config.get("final_logit_softcapping")
        super().__init__(cfg, max_positions, tp)

    def is_sliding(self, i: int) -> bool:
        types = self.hf.get("layer_types")
        return types[i] == "sliding_attention" if types else i % 2 == 0

    def make_layer(self, i: int) -> nn.Module:
        cfg, hf = self.cfg, self.hf
        sliding = self.is_sliding(i)
        how = LayerAttention(
            scale=hf.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5,
            window=hf.get("sliding_window") if sliding else None,
            softcap=hf.get("attn_logit_softcapping"),
        )
        attention = self.make_attention(
            cfg,
            i,
            self.tp,
            how,
            qkv_bias=hf.get("attention_bias", False),
            qk_norm=self.qk_norm,
            rope=int(sliding),
        )
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        return self.layer_class(
            cfg, self.tp, attention, SwiGLU(cfg.hidden_size, cfg.intermediate_size, act)
        )

    def make_attention(self, *args, **kwargs) -> Attention:
        return Attention(*args, **kwargs)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        """[global, local]: the same table for Gemma 2."""
        table = super().make_rotaries(max_positions)[0]
        return [table, table]


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    layer_class = UnwrappedGemmaLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = GemmaNorm

    def is_sliding(self, i: int) -> bool:
        types = self.hf.get("layer_types")
        pattern = self.hf.get("sliding_window_pattern", self.hf.get("_sliding_window_pattern", 6))
        return types[i] == "sliding_attention" if types else bool((i + 1) % pattern)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        hf, head_dim = self.hf, self.cfg.head_dim
        ropes = hf.get("rope_parameters") or {}
        if "full_attention" in ropes:
            full, local = ropes["full_attention"], ropes.get("sliding_attention", {})
        else:  # transformers 4 layout
            full = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 1e6))
            local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
        return [
            _rotary(head_dim, max_positions, full, 1e6),
            _rotary(head_dim, max_positions, local, 1e4),
        ]


def _rotary(head_dim: int, max_positions: int, rope: dict, theta: float) -> RotaryEmbedding:
    theta = float(rope.get("rope_theta", theta))
    return RotaryEmbedding(head_dim, max_positions, theta, rope_scaling_of(rope))
