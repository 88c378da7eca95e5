"""Building a model's weights on a device: a HF checkpoint's tensors, or random for dummy shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from ..distributed import TPGroup
from ..mem.huge_pages import into_huge_pages
from ..model_config import ModelConfig
from .registry import model_class
from .source import ModelSource


def iter_checkpoint(path: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors of a HF checkpoint directory (safetensors preferred, else .bin)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    if files:
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    seed: int = 0,
    quantization: str | None = None,
    tp: TPGroup = TPGroup(),
):
    """This rank's shard of the model (the whole model on one rank)."""
    with torch.device(device):
        model = model_class(source.config)(source.config, max_positions, tp)
    if source.weights_dir is None:
        _init_dummy(model, seed)
    else:
        model.load_weights(iter_checkpoint(source.weights_dir))
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    from ..layers import Linear, use_cpu_ops

    cpu_ops = None
    if device.type == "cpu":
        cpu_ops = load_cpu_kernels()
        use_cpu_ops(model, cpu_ops)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for linear in linears:
        if quantization == "int8":
            linear.quantize_int8()
        elif cpu_ops is not None and dtype == torch.float32:
            linear.pack_for_cpu()
    packed = [m for m in linears if m.weight_packed is not None]
    for linear, weight in zip(packed, into_huge_pages([m.weight_packed for m in packed])):
        linear.weight_packed = weight  # one mapping in huge pages: the decode step streams them all
    return model


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
