"""Attention backends behind one interface; imported lazily by name."""

from __future__ import annotations

import importlib

from .base import PLAIN, AttentionBackend, AttentionInputs, LayerAttention

_REGISTRY = {
    "torch_native": ("radixserve.attention.torch_native", "TorchNativeBackend"),
    "triton": ("radixserve.attention.triton_backend", "TritonBackend"),
    "flashinfer": ("radixserve.attention.flashinfer_backend", "FlashInferBackend"),
}
# the LayerAttention features each backend implements (known before importing it); "fp8_kv": it
# reads an FP8 KV pool; "deterministic": it runs batch-invariant (--enable-deterministic-inference);
# "head_dims": its layers may differ in head dim (Gemma 4); "head_counts": in query heads (Laguna)
FEATURES = {
    "torch_native": frozenset(
        {"scale", "window", "chunk", "softcap", "sinks", "latent", "fp8_kv", "deterministic"}
        | {"head_dims", "head_counts", "no_kv_layers"}
    ),
    "triton": frozenset({"scale", "head_counts"}),
    "flashinfer": frozenset(),
}


def resolve_backend_name(name: str, device_type: str, needs: frozenset[str] = frozenset()) -> str:
    """`auto` is flashinfer on CUDA when importable, else triton, else torch_native: the first
    of them that implements what the model's layers `needs`."""
    if name != "auto":
        if name in FEATURES and not needs <= FEATURES[name]:
            missing = ", ".join(sorted(needs - FEATURES[name]))
            raise ValueError(
                f"--attention-backend {name} does not implement this model's attention "
                f"({missing}); use torch_native or auto"
            )
        return name
    if device_type != "cuda":
        return "torch_native"
    for candidate in ("flashinfer", "triton"):
        if needs <= FEATURES[candidate] and importlib.util.find_spec(candidate) is not None:
            return candidate
    return "torch_native"


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = [
    "PLAIN",
    "AttentionBackend",
    "AttentionInputs",
    "LayerAttention",
    "create_backend",
    "resolve_backend_name",
]
