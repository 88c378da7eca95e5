"""Attention backends behind one interface; imported lazily by name."""

from __future__ import annotations

import importlib

from .base import AttentionBackend, AttentionInputs

_REGISTRY = {
    "torch_native": ("radixserve.attention.torch_native", "TorchNativeBackend"),
    "triton": ("radixserve.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("radixserve.attention.flashinfer_backend", "FlashInferBackend"),
}


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` is flashinfer on CUDA when importable, else triton, else torch_native."""
    if name != "auto":
        return name
    if device_type != "cuda":
        return "torch_native"
    for candidate in ("flashinfer", "triton"):
        if importlib.util.find_spec(candidate) is not None:
            return candidate
    return "torch_native"


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["AttentionBackend", "AttentionInputs", "create_backend", "resolve_backend_name"]
