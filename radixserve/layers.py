"""Reusable decoder layers: RMSNorm, rotary embedding, SwiGLU MLP.

On CPU, `use_cpu_ops` hands the modules radixserve's compiled kernels
(`radixserve_kernels.cpu_ops`):
RMSNorm, the SwiGLU activation and the rotary embedding then run as one fused op each instead
of a chain of small torch ops. Under torch.compile they keep the torch code, which inductor fuses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels.cpu_ops import load as load_cpu_kernels


def fused(cpu_ops):
    """The CPU kernels to call now: None while torch.compile traces (it fuses the torch code)."""
    return None if cpu_ops is None or torch.compiler.is_compiling() else cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.cpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := fused(self.cpu_ops)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, norm(x + delta))`; with the CPU kernels in one pass, adding into x in
        place."""
        if (ops := fused(self.cpu_ops)) is not None:
            return x, ops.add_rms_norm_(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


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
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

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
    """x: `[T, heads, head_dim]`; with the CPU kernels, rotated in place."""
    if (ops := fused(cpu_ops)) is not None:
        return ops.rotary_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@torch.library.custom_op("radixserve::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ W^T + b through radixserve's CPU kernel and its packed W. An op of our own, so that
    torch.compile keeps it as one opaque call."""
    return load_cpu_kernels().packed_linear(x, packed, bias, out_features)


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, `[in, out]`.

    On CPU a small-batch matmul against a contiguous `[in, out]` matrix runs about
    twice as fast as F.linear against `[out, in]` (measured: bench/decode_step.py).
    Checkpoint tensors arrive as `[out, in]`; `load` transposes them into place.
    After loading, a float32 CPU model packs its weights for radixserve's CPU kernel
    (`pack_for_cpu`), which is faster still at every row count.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.out_features = out_features
        self.register_buffer("weight_packed", None)
        self.cpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_packed is not None:
            if torch.compiler.is_compiling():
                return packed_linear(x, self.weight_packed, self.bias, self.out_features)
            # eagerly, straight to the kernel: the custom op's dispatch costs ~40 us a call
            return self.cpu_ops.packed_linear(x, self.weight_packed, self.bias, self.out_features)
        if self.weight_t is None:
            return self._forward_int8(x)
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return torch.mm(x, self.weight_t)

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Replace the weight by its copy packed for `cpu_ops.packed_linear` (float32 on CPU),
        faster than oneDNN's prepacked weights in decode (bench/README.md)."""
        packed = self.cpu_ops.pack_linear_weight(self.weight_t.t().contiguous())
        self.register_buffer("weight_packed", packed)
        self.weight_t = None

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Weight-only int8 with one scale per output channel; activations go through bf16.

        Streams a quarter of the fp32 bytes per step (decode is bandwidth-bound on CPU).
        """
        weight = self.weight_t.t().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.register_buffer(
            "weight_int8", torch.round(weight / scales[:, None]).to(torch.int8).contiguous()
        )
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.weight_t = None

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scales).to(
            x.dtype
        )
        return out + self.bias if self.bias is not None else out

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, offset: int = 0) -> None:
        """Copy a checkpoint weight (`[out, in]`) or bias into rows `offset:` of the output."""
        if name == "bias":
            self.bias.narrow(0, offset, tensor.shape[0]).copy_(tensor)
        else:
            self.weight_t.narrow(1, offset, tensor.shape[0]).copy_(tensor.t())


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.cpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := fused(self.cpu_ops)) is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def use_cpu_ops(model: nn.Module, cpu_ops) -> None:
    """Give every module that has fused CPU kernels the compiled ones (`cpu_ops.load()`)."""
    for module in model.modules():
        if hasattr(module, "cpu_ops"):
            module.cpu_ops = cpu_ops
