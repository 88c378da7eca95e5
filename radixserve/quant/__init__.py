"""How a checkpoint's linear weights are quantized, read from its `quantization_config`.

Free of torch: the api process refuses an unsupported layout before it starts the others. The
tensors themselves are assembled and multiplied by `radixserve.quant.weights`.

Layouts served (each a `QuantScheme.method`):
- `fp8_block`: HF's `fp8` (DeepSeek-V3, Qwen3-FP8): float8_e4m3fn weights with one
  `weight_scale_inv` per `weight_block_size` block (the name says inverse; it multiplies).
- `fp8_channel`: compressed-tensors float8 as llm-compressor writes it: float8_e4m3fn weights
  with a `weight_scale` per output channel or per tensor.
- `awq`: AutoAWQ's GEMM layout: `qweight` [in, out/8] int32 (nibbles in AWQ's column order),
  `qzeros` [in/group, out/8], `scales` [in/group, out].
- `gptq`: GPTQ's layout: `qweight` [in/8, out] int32, `qzeros` [in/group, out/8] (stored minus
  one in the `gptq` checkpoint format, as is in `gptq_v2`), `scales`, and `g_idx` for act-order.
"""

from __future__ import annotations

from dataclasses import dataclass

FP8_BLOCK, FP8_CHANNEL, AWQ, GPTQ = "fp8_block", "fp8_channel", "awq", "gptq"
ONLINE_QUANTIZATIONS = ("int8", "fp8")  # --quantization: applied to float weights at load
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # --kv-cache-dtype


class UnsupportedQuantization(ValueError):
    """A `quantization_config` no kernel here runs; the message names the field."""


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's weight quantization. `group`: input columns sharing one scale (the block's
    width for block FP8, the group size for int4, 0: the whole row); `block_rows`: output rows
    sharing one scale in block FP8 (1 otherwise)."""

    method: str
    group: int = 0
    block_rows: int = 1
    zeros_offset: int = 0  # added to stored GPTQ zeros (1 in the `gptq` format)
    scale_name: str = "weight_scale"  # FP8: HF's `fp8` calls its scales `weight_scale_inv`

    @property
    def bits(self) -> int:
        return 4 if self.method in (AWQ, GPTQ) else 8


def scheme_of(hf: dict) -> QuantScheme | None:
    """The scheme of a config.json (None: not quantized), or UnsupportedQuantization."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_block(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method in (AWQ, GPTQ):
        return _int4(method, qc)
    raise UnsupportedQuantization(
        f"config.json: quantization_config.quant_method {method!r} is not implemented; "
        "supported: fp8, compressed-tensors (float8), awq, gptq"
    )


INVERSE = "weight_scale_inv"  # the name says inverse; it multiplies


def _fp8_block(qc: dict) -> QuantScheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantization(f"config.json: fp8 fmt {qc['fmt']!r}; supported: e4m3")
    block = qc.get("weight_block_size", [128, 128])  # HF's default
    if block is None:
        return QuantScheme(FP8_CHANNEL, scale_name=INVERSE)  # one scale per tensor
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise UnsupportedQuantization(
            f"config.json: weight_block_size {block!r} must be two positive integers"
        )
    return QuantScheme(FP8_BLOCK, group=block[1], block_rows=block[0], scale_name=INVERSE)


def _compressed_tensors(qc: dict) -> QuantScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantization(
            "config.json: compressed-tensors with "
            f"{len(groups)} config_groups; one group is implemented"
        )
    weights = groups[0].get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != "float" or bits != 8:
        raise UnsupportedQuantization(
            f"config.json: compressed-tensors weights of type {kind!r} with {bits} bits; "
            "float8 (type 'float', num_bits 8) is implemented"
        )
    if strategy in ("channel", "tensor"):
        return QuantScheme(FP8_CHANNEL)
    if strategy == "block":
        rows, cols = weights.get("block_structure") or (0, 0)
        if rows <= 0 or cols <= 0:
            raise UnsupportedQuantization("config.json: a block strategy needs block_structure")
        return QuantScheme(FP8_BLOCK, group=cols, block_rows=rows)
    raise UnsupportedQuantization(
        f"config.json: compressed-tensors weight strategy {strategy!r}; supported: "
        "channel, tensor, block"
    )


def _int4(method: str, qc: dict) -> QuantScheme:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedQuantization(f"config.json: {method} with {bits} bits; 4 is implemented")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise UnsupportedQuantization(
            f"config.json: {method} group_size {group!r}; a positive group size is implemented"
        )
    if method == AWQ:
        if qc.get("version", "gemm").lower() != "gemm":
            raise UnsupportedQuantization(
                f"config.json: awq version {qc['version']!r}; the GEMM layout is implemented"
            )
        if not qc.get("zero_point", True):
            raise UnsupportedQuantization("config.json: awq without zero_point is not implemented")
        return QuantScheme(AWQ, group=group)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(
            f"config.json: gptq checkpoint_format {fmt!r}; supported: gptq, gptq_v2"
        )
    return QuantScheme(GPTQ, group=group, zeros_offset=1 if fmt == "gptq" else 0)


def unquantized_modules(hf: dict):
    """A predicate on module names: those a quantized checkpoint's config keeps in float
    (`modules_to_not_convert`, compressed-tensors' `ignore`, names or `re:` patterns)."""
    import re

    qc = hf.get("quantization_config") or {}
    entries = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignore") or [])

    def skipped(name: str) -> bool:
        for entry in entries:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], name):
                    return True
            elif entry == name or name.endswith("." + entry) or entry in name.split("."):
                return True
        return False

    return skipped


def quantization_problems(hf: dict, online: str | None, tp_size: int):
    """What a quantized checkpoint cannot be served with (one line each)."""
    scheme = scheme_of(hf) if hf else None
    if scheme is None:
        return
    if online is not None:
        yield (
            f"--quantization {online} quantizes float checkpoints; this one is already "
            f"quantized ({scheme.method})"
        )
    if tp_size > 1:
        yield f"{scheme.method} checkpoints run with --tp-size 1 only for now"
