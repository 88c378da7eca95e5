"""Building a model's weights on a device: a HF checkpoint's tensors, or random for dummy shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from ..distributed import TPGroup
from ..mem.huge_pages import into_huge_pages
from ..model_config import ModelConfig
from ..quant import QuantScheme, scheme_of, unquantized_modules
from ..quant.weights import planned_linear_bytes
from .decoder import checkpoint_name
from .layers import Linear, use_cpu_ops
from .moe import Experts
from .registry import model_class
from .source import ModelSource

PACKED_DTYPES = (torch.float32, torch.bfloat16)  # what the CPU GEMM packs (cpu_linear.cpp)


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's tensor files: those its `model.safetensors.index.json` maps (each one
    must exist), else every `*.safetensors` but Mistral's duplicate `consolidated*` copy, else
    `pytorch_model*.bin`."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} maps tensors to missing files: {missing[:3]}")
        return [path / n for n in names]
    files = [f for f in sorted(path.glob("*.safetensors")) if not f.name.startswith("consolidated")]
    files = files or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    return files


def iter_checkpoint(path: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors of a HF checkpoint directory, file by file."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        if file.suffix == ".bin":
            yield from torch.load(file, map_location="cpu", weights_only=True).items()
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    quantization: str | None = None,
    tp: TPGroup = TPGroup(),
):
    """This rank's shard of the model (the whole model on one rank). A field the family reads
    that config.json lacks is a ValueError naming it."""
    with torch.device(device):
        try:
            model = model_class(source.config)(source.config, max_positions, tp)
        except KeyError as exc:
            raise ValueError(f"config.json: the field {exc.args[0]!r} is missing") from None
    if source.weights_dir is None:
        _init_dummy(model, seed)
    else:
        model.load_weights(iter_checkpoint(source.weights_dir))
        _load_quantized(model, scheme_of(source.config.hf_config), dtype, device)
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    if device.type == "cuda":
        for module in model.modules():
            if isinstance(module, Experts):
                module.stack_for_gpu()
    cpu_ops = None
    if device.type == "cpu":
        cpu_ops = load_cpu_kernels()
        use_cpu_ops(model, cpu_ops)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight_t is not None]
    for linear in linears:
        if quantization is not None:
            linear.quantize(quantization)
        elif cpu_ops is not None and dtype in PACKED_DTYPES and linear.in_features % 2 == 0:
            linear.pack_for_cpu()
    packed = [m for m in linears if m.weight_packed is not None]
    for linear, weight in zip(packed, into_huge_pages([m.weight_packed for m in packed])):
        linear.weight_packed = weight  # one mapping in huge pages: the decode step streams them all
    return model


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes a built model holds: parameters, buffers and quantized weights."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    quantized = [m.quantized for m in model.modules() if getattr(m, "quantized", None)]
    return total + sum(q.nbytes for q in quantized)


def planned_weight_bytes(
    source: ModelSource,
    dtype: torch.dtype,
    max_positions: int,
    quantization: str | None = None,
    tp: TPGroup = TPGroup(),
) -> int:
    """What `model_bytes` will be for this rank, from the config alone: the model built on the
    meta device, each linear layer counted at its format's bytes (a quantized checkpoint's
    layers but those its config leaves in float, and the LM head, which no layout here
    quantizes; or every layer under `--quantization`)."""
    with torch.device("meta"):
        model = model_class(source.config)(source.config, max_positions, tp)
    scheme = scheme_of(source.config.hf_config) if source.weights_dir is not None else None
    skipped = unquantized_modules(source.config.hf_config)
    total = 0
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if isinstance(module, Linear):
            own = [t for t in own if t is not module.weight_t]
            quantized = scheme is not None and name != "lm_head" and not skipped(name)
            fmt = scheme if quantized else quantization
            total += planned_linear_bytes(fmt, module.out_features, module.weight_t.shape[0], dtype)
        total += sum(
            t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in own
        )
    return total


def _load_quantized(
    model: torch.nn.Module, scheme: QuantScheme | None, dtype: torch.dtype, device: torch.device
) -> None:
    """Build each linear layer's quantized weight from the checkpoint tensors it kept."""
    for module_name, linear in model.named_modules():
        if not isinstance(linear, Linear) or not linear.quant_parts:
            continue

        def name(part: int, kind: str, module_name=module_name) -> str:
            return checkpoint_name(module_name, (kind, part))

        if scheme is None:
            raise ValueError(
                f"checkpoint tensor {name(0, 'weight')!r} is quantized, but config.json has no "
                "quantization_config"
            )
        if scheme.bits == 4 and device.type != "cpu":
            raise ValueError(f"{scheme.method} checkpoints run on CPU only for now")
        linear.load_quantized(scheme, name, dtype)
        linear.quantized = linear.quantized.to(device)


def _init_dummy(model: torch.nn.Module, seed: int) -> None:
    """Random weights drawn on the model's own device (8B of them on one CPU core take minutes)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)


def with_max_context(cfg: ModelConfig, max_context: int | None) -> int:
    return min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
