"""Quantized linear weights: assembled from a checkpoint's tensors (or quantized from float ones
at load), and multiplied against activations.

Each checkpoint part (one of a fused projection's q/k/v, or a whole projection) is first brought
to one canonical form per kind, rows = output channels and columns = inputs; the parts are then
stacked in output order and the compute form built once:
- FP8: bytes `[out, in]` (float8_e4m3fn viewed as uint8) and float32 scales `[out, groups]`,
  `group` input columns to a scale (block scales expanded to each of their rows).
- int4: values `[out, in]` in 0..15, scales and zeros `[out, groups]`, and the input permutation
  that makes act-order groups contiguous.
Errors name the checkpoint tensor (`TensorName`) and are ValueErrors: a start-up error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from . import AWQ, FP8_BLOCK, QuantScheme

TensorName = Callable[[int, str], str]  # (part, kind) -> the checkpoint's tensor name
QUANT_KINDS = frozenset(
    {"weight_scale_inv", "weight_scale", "input_scale", "qweight", "qzeros", "scales", "g_idx"}
)
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 CPU kernel takes
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs columns in this order


def is_quantized_tensor(kind: str, tensor: torch.Tensor) -> bool:
    return kind in QUANT_KINDS or tensor.dtype == torch.float8_e4m3fn


class QuantizedWeight:
    """`matmul(x)` = x W^T for a quantized W `[out, in]`; `nbytes` what it holds."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to(self, device: torch.device) -> "QuantizedWeight":
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(self).items()}
        return type(self)(**moved)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if torch.is_tensor(t))


@dataclass
class Fp8Weight(QuantizedWeight):
    """Weight-only FP8: one byte a weight, dequantized inside the GEMM on CPU."""

    data: torch.Tensor  # [out, in] uint8 (float8_e4m3fn bits)
    scales: torch.Tensor  # [out, groups] float32
    group: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":  # FP8 GEMM with per-token activation scales
            from radixserve_kernels import fp8_linear

            return fp8_linear(x, self.data, self.scales, self.group)
        kernels = load_cpu_kernels() if x.device.type == "cpu" else None
        if kernels is not None and x.shape[0] <= FP8_STREAM_ROWS:
            return kernels.fp8_linear(x.float(), self.data, self.scales, self.group).to(x.dtype)
        if kernels is not None:
            weight = kernels.fp8_dequantize(self.data, self.scales, self.group)
        else:
            weight = dequantize_fp8(self.data, self.scales, self.group)
        return (x @ weight.to(x.dtype).t()).to(x.dtype)


@dataclass
class Int4Weight(QuantizedWeight):
    """Group-wise int4 (AWQ, GPTQ) through torch's int4 CPU kernel, which dequantizes as
    `(q - 8) * scale + zero` per group; `perm` reorders the inputs of an act-order checkpoint."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [groups, out, 2] in the compute dtype
    group: int
    perm: torch.Tensor | None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        sz = self.scales_and_zeros
        return torch._weight_int4pack_mm_for_cpu(x.to(sz.dtype), self.packed, self.group, sz).to(
            x.dtype
        )


@dataclass
class Int8Weight(QuantizedWeight):
    """Weight-only int8, one scale per output channel; activations go through bf16."""

    data: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.data, self.scales)
        return out.to(x.dtype)


# ---- FP8 --------------------------------------------------------------------------------------
FP8_MAX = 448.0
FP8_STREAM_ROWS = 32  # up to these rows the CPU kernel streams the bytes; more widen W once


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 `[out, in]` of FP8 bytes and their group scales."""
    values = data.view(torch.float8_e4m3fn).float()
    return values * scales.repeat_interleave(group, dim=1)[:, : values.shape[1]]


def fp8_part(scheme: QuantScheme, pieces: dict, rows: int, cols: int, name: TensorName, part: int):
    """(bytes, scales, group) of one checkpoint part in the canonical FP8 form."""
    weight = _piece(pieces, "weight", name, part)
    if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (rows, cols):
        raise ValueError(
            f"checkpoint tensor {name(part, 'weight')!r} {tuple(weight.shape)} {weight.dtype}: "
            f"expected float8_e4m3fn [{rows}, {cols}]"
        )
    kind = scheme.scale_name
    scale = _piece(pieces, kind, name, part).float()
    _check_scales(scale, name(part, kind))
    if scheme.method == FP8_BLOCK:
        br, bc = scheme.block_rows, scheme.group
        want = (-(-rows // br), -(-cols // bc))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"checkpoint tensor {name(part, kind)!r} {tuple(scale.shape)}: blocks of "
                f"{br}x{bc} over [{rows}, {cols}] need {list(want)} scales"
            )
        return weight.view(torch.uint8), scale.repeat_interleave(br, dim=0)[:rows], bc
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(rows, 1)
    elif scale.numel() == rows:
        scale = scale.reshape(rows, 1)
    else:
        raise ValueError(
            f"checkpoint tensor {name(part, kind)!r} {tuple(scale.shape)}: expected one scale "
            f"per tensor or one per output channel ({rows})"
        )
    return weight.view(torch.uint8), scale.contiguous(), cols


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Online FP8 of a float `[out, in]` weight: one scale per output channel."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    data = (weight / scales).to(torch.float8_e4m3fn).view(torch.uint8).contiguous()
    return Fp8Weight(data, scales.contiguous(), weight.shape[1])


def build_fp8(parts: list[tuple[torch.Tensor, torch.Tensor, int]]) -> Fp8Weight:
    groups = {group for _, _, group in parts}
    if len(groups) > 1:  # a per-tensor part beside block ones: spread its scale over the blocks
        group = min(groups)
        parts = [
            (d, s if g == group else s.expand(-1, -(-d.shape[1] // group)), group)
            for d, s, g in parts
        ]
    data = torch.cat([d for d, _, _ in parts]).contiguous()
    scales = torch.cat([s for _, s, _ in parts]).contiguous()
    return Fp8Weight(data, scales, parts[0][2])


# ---- int4 -------------------------------------------------------------------------------------
def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (lowest first), unpacked along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    if dim == 1:
        return values.flatten(1)
    return values.permute(0, 2, 1).flatten(0, 1)  # words along rows: [rows * 8, cols]


def int4_part(scheme: QuantScheme, pieces: dict, rows: int, cols: int, name: TensorName, part: int):
    """(values, scales, zeros, g_idx) of one checkpoint part, rows = outputs."""
    group = scheme.group
    if cols % group:
        raise ValueError(
            f"checkpoint tensor {name(part, 'qweight')!r}: group_size {group} does not divide "
            f"the input size {cols}"
        )
    groups = cols // group
    qweight = _piece(pieces, "qweight", name, part)
    qzeros = _piece(pieces, "qzeros", name, part)
    scales = _piece(pieces, "scales", name, part)
    expect = {
        "qweight": (cols, rows // 8) if scheme.method == AWQ else (cols // 8, rows),
        "qzeros": (groups, rows // 8),
        "scales": (groups, rows),
    }
    for kind, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if rows % 8 or tuple(tensor.shape) != expect[kind]:
            raise ValueError(
                f"checkpoint tensor {name(part, kind)!r} {tuple(tensor.shape)}: expected "
                f"{list(expect[kind])} for a [{rows}, {cols}] weight in groups of {group}"
            )
    _check_scales(scales.float(), name(part, "scales"))
    zeros = _nibbles(qzeros.to(torch.int32), 1)
    if scheme.method == AWQ:
        order = torch.tensor(AWQ_COLUMN_OF_NIBBLE)
        at = (torch.arange(rows) // 8 * 8).view(-1, 8) + order  # column held by each nibble
        inverse = torch.empty(rows, dtype=torch.long)
        inverse[at.flatten()] = torch.arange(rows)
        values = _nibbles(qweight.to(torch.int32), 1)[:, inverse]  # [in, out]
        zeros = zeros[:, inverse]
        g_idx = None
    else:
        values = _nibbles(qweight.to(torch.int32), 0)  # [in, out]
        zeros = (zeros + scheme.zeros_offset) & 0xF  # `gptq` stores zero - 1: 0 as 15
        g_idx = pieces.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.long()
            if tuple(g_idx.shape) != (cols,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(
                    f"checkpoint tensor {name(part, 'g_idx')!r}: expected {cols} group indices "
                    f"in [0, {groups})"
                )
    return (
        values.t().to(torch.uint8),
        scales.float().t(),
        zeros.float().t(),
        g_idx,
    )


def build_int4(parts: list, group: int, dtype: torch.dtype, name: str) -> Int4Weight:
    """`parts`: `int4_part` results in output order; `name` for errors (the first part's)."""
    if group not in INT4_GROUPS:
        raise ValueError(
            f"checkpoint tensor {name!r}: group_size {group} is not one the int4 CPU kernel "
            f"takes ({', '.join(map(str, INT4_GROUPS))})"
        )
    values = torch.cat([p[0] for p in parts])
    scales = torch.cat([p[1] for p in parts])
    zeros = torch.cat([p[2] for p in parts])
    g_idxs = [p[3] for p in parts]
    perm = None
    cols = values.shape[1]
    g_idx = g_idxs[0]
    if any(g is not None for g in g_idxs):
        if any(g is None or not torch.equal(g, g_idx) for g in g_idxs):
            raise ValueError(f"checkpoint tensor {name!r}: the fused parts' g_idx differ")
        if not torch.equal(g_idx, torch.arange(cols) // group):
            counts = torch.bincount(g_idx, minlength=cols // group)
            if not bool((counts == group).all()):
                raise ValueError(
                    f"checkpoint tensor {name!r}: g_idx gives groups other than {group} columns"
                )
            perm = torch.argsort(g_idx, stable=True)
            values = values[:, perm]
    packed = torch._convert_weight_to_int4pack_for_cpu(values.to(torch.int32).contiguous(), 1)
    # (q - z) * s == (q - 8) * s + (8 - z) * s
    sz = torch.stack([scales.t(), ((8 - zeros) * scales).t()], dim=2).to(dtype).contiguous()
    return Int4Weight(packed, sz, group, perm)


def dequantize_int4(parts: list, group: int) -> torch.Tensor:
    """float32 `[out, in]` of stacked `int4_part`s (the oracle's arithmetic, for tests)."""
    values = torch.cat([p[0] for p in parts]).float()
    scales = torch.cat([p[1] for p in parts])
    zeros = torch.cat([p[2] for p in parts])
    g_idx = parts[0][3]
    cols = values.shape[1]
    g_idx = torch.arange(cols) // group if g_idx is None else g_idx
    return (values - zeros[:, g_idx]) * scales[:, g_idx]


# ---- int8 (online) ----------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Weight-only int8 of a float `[out, in]` weight; a quarter of the fp32 bytes per step."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    data = torch.round(weight / scales[:, None]).to(torch.int8).contiguous()
    return Int8Weight(data, scales.to(torch.bfloat16))


def planned_linear_bytes(
    fmt: QuantScheme | str | None, out: int, inp: int, dtype: torch.dtype
) -> int:
    """The bytes a `[out, inp]` linear weight will hold in format `fmt` (a checkpoint's scheme,
    an online `--quantization`, or None: float in `dtype`), as the classes above store it."""
    if fmt is None:
        return out * inp * dtype.itemsize
    if fmt == "int8":
        return out * inp + out * 2
    if fmt == "fp8":
        return out * inp + out * 4
    if fmt.bits == 4:
        return out * inp // 2 + (inp // fmt.group) * out * 2 * dtype.itemsize
    groups = -(-inp // fmt.group) if fmt.method == FP8_BLOCK else 1
    return out * inp + out * groups * 4


# ---- shared -----------------------------------------------------------------------------------
def _piece(pieces: dict, kind: str, name: TensorName, part: int) -> torch.Tensor:
    if kind not in pieces:
        raise ValueError(f"checkpoint is missing tensors: {name(part, kind)}")
    return pieces[kind]


def _check_scales(scales: torch.Tensor, tensor_name: str) -> None:
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"checkpoint tensor {tensor_name!r} holds NaN or infinite scales")
    if not bool((scales > 0).all()):
        raise ValueError(f"checkpoint tensor {tensor_name!r} holds zero or negative scales")
