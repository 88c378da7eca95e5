"""Rotary position embeddings: the frequencies of each rope type HF names (default, linear,
llama3, yarn, Gemma 4's proportional, HunYuan's fixed NTK alpha), the precomputed cos/sin
table, and the rotation (the fused CPU kernel where it is loaded); and the position-dependent
query scale some families serve beside them (`QueryTemperature`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..model_config import rope_scaling_of
from .layers import fused


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Rotary frequencies and the factor on cos/sin (YaRN's attention factor, else 1)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_scaled(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, scaling)
    if kind == "dynamic" and scaling.get("alpha"):  # HunYuan: a fixed NTK alpha stretches the base
        base = theta * scaling["alpha"] ** (head_dim / (head_dim - 2))
        return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim), 1.0
    if kind == "proportional":  # Gemma 4: the first angles turn, the rest of each head stays
        turned = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turned:] = 0.0
        return inv_freq / scaling.get("factor", 1.0), 1.0
    if kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq, 1.0


def _yarn_scaled(
    inv_freq: torch.Tensor, dim: int, theta: float, s: dict
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies between interpolation and extrapolation by a linear ramp over the
    dimensions, and cos/sin scaled by the attention factor (HF's `_compute_yarn_parameters`)."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)
    mixed = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return mixed, float(attention_factor)


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling of rotary frequencies."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    mixed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mixed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq, factor = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", (angles.cos() * factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * factor).float(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables shaped to broadcast over heads: `[T, 1, head_dim/2]`."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cpu_ops=None
) -> torch.Tensor:
    """x: `[T, heads, head_dim]`; with the CPU kernels, rotated in place. Tables narrower than
    half a head rotate its first `2 x width` dims and keep the rest (a partial rotary)."""
    width = 2 * cos.shape[-1]
    if width < x.shape[-1]:
        turned = apply_rotary(x[..., :width].contiguous(), cos, sin, cpu_ops)
        return torch.cat([turned, x[..., width:]], dim=-1)
    if (ops := fused(cpu_ops)) is not None:
        return ops.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class QueryTemperature(nn.Module):
    """The scale of each query at its position, `1 + beta x log(1 + floor((p + offset) /
    span))`, served beside the rotary tables: Llama 4's no-rope layers (offset 1), Ministral 3
    and Mistral 4 (`llama_4_scaling_beta` over the original context, offset 0)."""

    def __init__(self, span: float, beta: float, offset: float = 0.0):
        super().__init__()
        self.span, self.beta, self.offset = span, beta, offset

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() > 1:
            positions = positions[0]
        steps = torch.floor((positions.float() + self.offset) / self.span)
        return (torch.log1p(steps) * self.beta + 1.0).view(-1, 1, 1), None


def beta_query_scaling(hf: dict) -> tuple[float, float] | None:
    """(span, beta) of the queries' scale past the original context that `rope_parameters` sets
    with `llama_4_scaling_beta` (Ministral 3, Mistral 4: `QueryTemperature(span, beta)`), or
    None."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    beta, span = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if beta is None:
        return None
    if not span:
        raise ValueError("rope_parameters.llama_4_scaling_beta needs its "
                         "original_max_position_embeddings")  # fmt: skip
    return span, beta


LAYER_KINDS = ("full_attention", "sliding_attention")  # per-kind rotary tables, in this order


def rotaries_by_kind(
    hf: dict, head_dim: int, max_positions: int, default_fraction: float = 1.0
) -> list[RotaryEmbedding]:
    """One rotary table per layer kind (`LAYER_KINDS`) where `rope_parameters` is keyed by
    kind (MiMo-V2-Flash, Laguna, LFM3), each over its own share of each head's dims (all of
    them for a proportional rope, which keeps the rest unturned itself)."""
    ropes, tables = hf["rope_parameters"], []
    for kind in LAYER_KINDS:
        rope = ropes.get(kind) or ropes.get("full_attention") or ropes
        fraction = rope.get("partial_rotary_factor", default_fraction)
        width = head_dim if rope.get("rope_type") == "proportional" else int(head_dim * fraction)
        scaling = rope_scaling_of(rope)
        tables.append(RotaryEmbedding(width, max_positions, rope["rope_theta"], scaling))
    return tables
