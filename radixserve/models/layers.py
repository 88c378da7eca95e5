"""Reusable decoder layers: RMSNorm, linear layers, SwiGLU MLP (the rotary: `rotary`).

On CPU, `use_cpu_ops` hands the modules radixserve's compiled kernels
(`radixserve_kernels.cpu_ops`):
RMSNorm, the SwiGLU activation and the rotary embedding then run as one fused op each instead
of a chain of small torch ops. Under torch.compile they keep the torch code, which inductor fuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from ..quant import QuantScheme
from ..quant.weights import (
    QuantizedWeight,
    TensorName,
    build_fp8,
    build_int4,
    fp8_part,
    int4_part,
    is_quantized_tensor,
    quantize_fp8,
    quantize_int8,
)


def fused(cpu_ops):
    """The CPU kernels to call now: None while torch.compile traces (it fuses the torch code)."""
    return None if cpu_ops is None or torch.compiler.is_compiling() else cpu_ops


class RMSNorm(nn.Module):
    """`weight_offset`: the checkpoint stores the weight minus this (Gemma's `1 + w` norms);
    it is added once, when the weight is loaded."""

    def __init__(self, size: int, eps: float, weight_offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_offset = weight_offset
        self.cpu_ops = None

    @torch.no_grad()
    def load_weight(self, tensor: torch.Tensor) -> None:
        self.weight.copy_(tensor.float() + self.weight_offset)

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


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x over its RMS along the last dim, without a weight (DeepSeek-V4's query heads and
    hyper-connections)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass
class StepImages:
    """A step's image features: `embeds[i]` takes the place of token `rows[i]`; DeepStack
    models add `deepstack[k][i]` to that token's hidden state after layer k."""

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)
    # whole images attended both ways (Gemma 3): (table row, first position, end, step row)
    blocks: list[tuple[int, int, int, int]] = field(default_factory=list)


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


def make_batch_invariant(model: nn.Module) -> None:
    """--enable-deterministic-inference: every Linear runs radixserve's packed float32 CPU GEMM,
    which gives a row the same bits however many rows share the call (torch's bf16 GEMM did
    not, bench/results/cpu.md); a bf16 model keeps a float32 packed copy of each weight and rounds
    the output back. ValueError for a quantized layer, whose GEMM is torch's."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight_packed is not None:
            continue
        if module.quantized is not None or module.cpu_ops is None:
            raise ValueError(
                f"enable_deterministic_inference: {name} is quantized (or the CPU kernels are "
                "missing); quantized checkpoints are not batch-invariant yet"
            )
        module.invariant = module.cpu_ops.pack_linear_weight(
            module.weight_t.t().float().contiguous()
        )
        module.invariant_bias = module.bias.float() if module.bias is not None else None


class Linear(nn.Module):
    """y = x W^T + b with W stored transposed, `[in, out]`.

    On CPU a small-batch matmul against a contiguous `[in, out]` matrix runs about
    twice as fast as F.linear against `[out, in]` (measured: bench/decode_step.py).
    Checkpoint tensors arrive as `[out, in]`; `load` transposes them into place.
    After loading, a float32 or bf16 CPU model packs its weights for radixserve's CPU kernel
    (`pack_for_cpu`), which is faster still at every row count.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parts: tuple[int, ...] = (),
    ):
        """`parts`: the output widths of the checkpoint tensors fused into this one."""
        super().__init__()
        self.parts = parts
        self.loaded: set[tuple[str, int]] = set()  # (kind, offset) of each tensor loaded
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", None)
        self.quant_parts: dict[int, dict[str, torch.Tensor]] = {}  # offset -> kind -> tensor
        self.quantized: QuantizedWeight | None = None
        self.cpu_ops = None
        self.lora = None  # the adapters' deltas (lora_weights.LinearLora), when served
        self.invariant: torch.Tensor | None = None  # make_batch_invariant's packed weight
        self.invariant_bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            out = self.cpu_ops.packed_linear(
                x.float(), self.invariant, self.invariant_bias, self.out_features
            ).to(x.dtype)
        else:
            out = self._base(x)
        return out if self.lora is None else self.lora.add(x, out)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_packed is not None:
            if torch.compiler.is_compiling():
                return packed_linear(x, self.weight_packed, self.bias, self.out_features)
            # eagerly, straight to the kernel: the custom op's dispatch costs ~40 us a call
            return self.cpu_ops.packed_linear(x, self.weight_packed, self.bias, self.out_features)
        if self.quantized is not None:
            out = self.quantized.matmul(x)
            return out + self.bias if self.bias is not None else out
        if self.bias is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return torch.mm(x, self.weight_t)

    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Replace the weight by its copy packed for `cpu_ops.packed_linear` (float32 or bf16
        on CPU; bf16 wants an even `in_features`), faster than oneDNN's prepacked weights in
        decode (bench/results/cpu.md)."""
        packed = self.cpu_ops.pack_linear_weight(self.weight_t.t().contiguous())
        self.register_buffer("weight_packed", packed)
        self.weight_t = None

    @torch.no_grad()
    def quantize(self, method: str) -> None:
        """`--quantization`: weight-only int8 or FP8 (one scale per output channel) of the
        loaded float weight."""
        weight = self.weight_t.t()
        self.quantized = quantize_int8(weight) if method == "int8" else quantize_fp8(weight)
        self.weight_t = None

    @torch.no_grad()
    def load_quantized(self, scheme: QuantScheme, name: TensorName, dtype: torch.dtype) -> None:
        """Build the quantized weight from the checkpoint tensors `load` kept (`name(part,
        kind)`: a tensor's checkpoint name, for errors)."""
        in_features = self.weight_t.shape[0]
        widths = self.parts or (self.out_features,)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        if set(self.quant_parts) - set(starts):
            raise ValueError(f"checkpoint tensor {name(0, 'weight')!r}: parts do not line up")
        parts = []
        for part, (start, rows) in enumerate(zip(starts, widths)):
            pieces = self.quant_parts.get(start, {})
            if scheme.bits == 4:
                parts.append(int4_part(scheme, pieces, rows, in_features, name, part))
            else:
                parts.append(fp8_part(scheme, pieces, rows, in_features, name, part))
        if scheme.bits == 4:
            self.quantized = build_int4(parts, scheme.group, dtype, name(0, "qweight"))
        else:
            self.quantized = build_fp8(parts)
        self.quant_parts = {}
        self.weight_t = None

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, offset: int = 0) -> None:
        """Copy a checkpoint weight (`[out, in]`) or bias into rows `offset:` of the output;
        a quantized checkpoint's tensors (FP8 bytes, scales, packed int4) are kept for
        `load_quantized`."""
        if is_quantized_tensor(name, tensor):
            self.quant_parts.setdefault(offset, {})[name] = tensor
            if name in ("weight", "qweight"):
                self.loaded.add(("weight", offset))
            return
        rows = tensor.shape[0]
        in_features = self.weight_t.shape[0]
        if name == "weight" and (tensor.dim() != 2 or tensor.shape[1] != in_features):
            raise ValueError(f"expected [rows, {in_features}]")
        if name not in ("weight", "bias") or (name == "bias" and self.bias is None):
            raise ValueError(f"the layer has no {name}")
        if offset + rows > self.out_features or (name == "bias" and tensor.dim() != 1):
            raise ValueError(f"expected at most {self.out_features - offset} rows")
        if name == "bias":
            self.bias.narrow(0, offset, rows).copy_(tensor)
        else:
            self.weight_t.narrow(1, offset, rows).copy_(tensor.t())
        self.loaded.add((name, offset))

    def missing_tensors(self) -> list[tuple[str, int]]:
        """(kind, part) of each fused part loading left unfilled (a bias the layer has but
        the checkpoint lacked, or one of q/k/v never seen)."""
        starts = [sum(self.parts[:i]) for i in range(len(self.parts))] or [0]
        kinds = ["weight"] + (["bias"] if self.bias is not None else [])
        return [
            (kind, i)
            for kind in kinds
            for i, at in enumerate(starts)
            if (kind, at) not in self.loaded
        ]


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # the same tanh approximation
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul; `act(gate) * up`, then down (SiLU:
    SwiGLU; tanh-GELU: Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(
            hidden, 2 * intermediate, bias=bias, parts=(intermediate, intermediate)
        )
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name, self.act = act, activation(act)
        self.cpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_name == "silu" and (ops := fused(self.cpu_ops)) is not None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.gated(gate, up))

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class PlainMLP(nn.Module):
    """`down(act(up(x)))`, without a gate (Nemotron-H's squared-ReLU MLP and experts)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name, self.act = act, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def use_cpu_ops(model: nn.Module, cpu_ops) -> None:
    """Give every module that has fused CPU kernels the compiled ones (`cpu_ops.load()`)."""
    for module in model.modules():
        if hasattr(module, "cpu_ops"):
            module.cpu_ops = cpu_ops
