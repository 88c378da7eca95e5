"""Whether a model's sliding-window layers keep their KV in a pool of their own that frees it
past the window (`mem/window_kv.py`), and how large each pool is."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention import LayerAttention
from ..attention.windowed import WindowedBackend
from ..config import EngineArgs
from ..mem.kv_pool import KVPool
from ..worker_info import WindowKVInfo
from .build import attention_backend, kv_pool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowLayers:
    """The model's KV layers (its attention numbering) that attend within `window` tokens."""

    window: int
    layers: tuple[int, ...]
    num_layers: int

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - len(self.layers)


def window_layers(model, args: EngineArgs, device: torch.device) -> WindowLayers | None:
    """The window layers to keep apart, or None (with a start-up line saying why, where the
    model has them)."""
    windows = {  # a chunk layer reads at most its chunk's tokens back: a window that long
        m.layer: how.window or how.chunk
        for m in model.modules()  # every attention layer says how it attends (`how`)
        if isinstance(how := getattr(m, "how", None), LayerAttention) and (how.window or how.chunk)
    }
    num_layers = model.cfg.num_kv_layers
    if not windows or len(windows) == num_layers:
        return None
    off = [
        name
        for name, on in (
            ("disable_hybrid_swa_memory", args.disable_hybrid_swa_memory),
            ("a device other than cpu", device.type != "cpu"),
            ("page_size > 1", args.page_size > 1),
            ("tp_size > 1", args.tp_size > 1),
            ("enable_hierarchical_cache", args.enable_hierarchical_cache),
            ("disaggregation_mode", args.disaggregation_mode != "null"),
            ("speculative_algorithm", args.speculative_algorithm is not None),
            ("kv_cache_dtype", args.kv_cache_dtype != "auto"),
            ("enable_torch_compile", args.enable_torch_compile),
            ("images attended both ways", getattr(model, "whole_images", False)),
        )
        if on
    ]
    if off:
        log.info("window layers keep every token's KV (window KV freeing is off with %s)", off[0])
        return None
    return WindowLayers(max(windows.values()), tuple(sorted(windows)), num_layers)


def window_pool_tokens(args: EngineArgs, plan: WindowLayers, full_tokens: int) -> int:
    """--swa-full-tokens-ratio of the full pool, else what the running requests' windows and a
    step's prompt tokens need at most."""
    if args.swa_full_tokens_ratio is not None:
        return max(int(full_tokens * args.swa_full_tokens_ratio), plan.window + 1)
    return args.max_running_requests * (plan.window + 1) + args.prefill_budget("cpu")


@dataclass(frozen=True)
class PoolBytes:
    """What sizes the pools from memory: bytes per token of the full pool (the window pool's
    share included when it is a ratio of it) and bytes set aside first (a fixed window pool)."""

    per_token: int
    reserved: int = 0


def pool_bytes(cfg, plan: WindowLayers | None, args: EngineArgs, dtype: torch.dtype) -> PoolBytes:
    shapes = cfg.kv_layer_shapes()
    if plan is None:
        return PoolBytes(KVPool.bytes_per_token(shapes, dtype))
    full_shapes, window_shapes = split_shapes(shapes, plan)
    full = KVPool.bytes_per_token(full_shapes, dtype)
    window = KVPool.bytes_per_token(window_shapes, dtype)
    if args.swa_full_tokens_ratio is not None:
        return PoolBytes(full + int(window * args.swa_full_tokens_ratio))
    return PoolBytes(full, window_pool_tokens(args, plan, 0) * window)


def split_shapes(shapes: list, plan: WindowLayers) -> tuple[list, list]:
    """The layer shapes of the full pool and of the window pool."""
    windowed = set(plan.layers)
    full = [shape for i, shape in enumerate(shapes) if i not in windowed]
    return full, [shapes[i] for i in plan.layers]


def make_pools(model, plan: WindowLayers | None, args: EngineArgs, num_slots: int, dtype, device):
    """(KV pool, window pool or None, attention backend name, backend) for `num_slots` tokens
    of the main pool: with window layers kept apart, a pool and a backend for each."""
    if plan is None:
        pool = kv_pool(model, num_slots, dtype, device)
        return pool, None, *attention_backend(model, pool, args, device)
    full_shapes, window_shapes = split_shapes(model.cfg.kv_layer_shapes(), plan)
    full = KVPool(num_slots, full_shapes, dtype, device)
    window = KVPool(window_pool_tokens(args, plan, num_slots) + 1, window_shapes, dtype, device)
    name, full_backend = attention_backend(model, full, args, device)
    _, window_backend = attention_backend(model, window, args, device)
    backend = WindowedBackend(
        full_backend, window_backend, list(plan.layers), plan.num_layers, num_slots
    )
    return full, window, name, backend


def window_info(plan: WindowLayers | None, window_pool: KVPool | None) -> WindowKVInfo | None:
    if plan is None:
        return None
    slots = window_pool.k[0].shape[0]
    per_token = sum(t[0].numel() * t.element_size() for t in window_pool.k + window_pool.v)
    return WindowKVInfo(plan.window, slots, len(plan.layers), per_token)
