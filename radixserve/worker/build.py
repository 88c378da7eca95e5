"""What a model runner is built from, besides the model: the KV pool's size, the attention
backend the model's features call for, and the decode graphs."""

from __future__ import annotations

import logging
import os
import time

import torch

from ..attention import create_backend, resolve_backend_name
from ..config import EngineArgs
from ..mem.kv_pool import KVPool
from ..memory_plan import STATE_ONLY_INTERVAL, covered_tokens, kv_pages
from ..models.layers import make_batch_invariant
from ..worker_info import StatePoolInfo
from .cuda_graph import CudaGraph, CudaGraphRunner, capture_batch_sizes
from .torch_compile import CompiledForward

log = logging.getLogger(__name__)


def kv_num_pages(
    args: EngineArgs,
    device: torch.device,
    weights_bytes: int,
    bytes_per_token: int,
    reserved_bytes: int = 0,
) -> int:
    """Pages of the KV pool: --max-total-tokens, else --mem-fraction of the memory left beside
    the weights (on CUDA, what the device has free with the weights loaded)."""
    if device.type == "cuda":
        available, _ = torch.cuda.mem_get_info(device)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = total - weights_bytes
    return kv_pages(
        available,
        bytes_per_token,
        args.mem_fraction,
        args.max_total_tokens,
        device.type,
        args.page_size,
        reserved_bytes,
    )


def attention_backend(model, pool, args: EngineArgs, device: torch.device):
    """(name, backend): the backend --attention-backend names, or `auto`'s pick among those
    with every feature the model's attention needs (FP8 KV, determinism; a model without
    attention takes only the step's inputs from it, which torch_native gives)."""
    features = model.attention_features()
    needs = features | ({"fp8_kv"} if pool.is_fp8 else frozenset())
    needs |= {"head_dims"} if len(pool.key_widths) > 1 else frozenset()
    needs |= {"no_kv_layers"} if not pool.k else frozenset()  # Mamba: the step's inputs only
    deterministic = args.enable_deterministic_inference
    if deterministic and features - {"scale"}:
        raise ValueError(
            "enable_deterministic_inference: this model's attention "
            f"({', '.join(sorted(features))}) is not batch-invariant yet"
        )
    needs |= {"deterministic"} if deterministic else frozenset()
    name = resolve_backend_name(args.attention_backend, device.type, needs)
    cfg = model.cfg
    backend = create_backend(
        name,
        pool=pool,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        device=device,
        **({"deterministic": True} if deterministic else {}),
    )
    return name, backend


def prepare_forward(
    model, backend, req_to_token, max_context_len: int, args: EngineArgs, graph_cls, lora
):
    """What runs the model's steps: fused CPU layers, decode graphs (or None) and a compiled
    forward (or None)."""
    if args.enable_deterministic_inference:
        make_batch_invariant(model)
    cpu = req_to_token.device.type == "cpu"
    if cpu and not args.enable_torch_compile and model.fuse_cpu_layers(backend):
        log.info(
            "CPU forward: the decoder layers run in one C++ call "
            "(radixserve_kernels/cpu_decoder.cpp)"
        )
    graphs = capture_graphs(model, backend, req_to_token, max_context_len, args, graph_cls, lora)
    compiled = CompiledForward(model, backend, req_to_token) if args.enable_torch_compile else None
    return graphs, compiled


def capture_graphs(
    model, backend, req_to_token, max_context_len: int, args: EngineArgs, graph_cls, lora
) -> CudaGraphRunner | None:
    """Decode graphs on CUDA with a graph-capable backend, unless disabled; `graph_cls`
    (EagerGraph) runs the same path on CPU for tests."""
    graph_cls = graph_cls or (CudaGraph if req_to_token.device.type == "cuda" else None)
    if (
        graph_cls is None
        or args.disable_cuda_graph
        or lora is not None  # segments change from step to step
        or model.cfg.keeps_state  # requests' states are picked by row, outside the graph
        or not getattr(backend, "supports_cuda_graph", False)
    ):
        return None
    sizes = capture_batch_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
    start = time.perf_counter()
    with torch.inference_mode():
        graphs = CudaGraphRunner(model, backend, req_to_token, max_context_len, sizes, graph_cls)
    log.info(
        "captured decode graphs for batch sizes %s in %.1f s", sizes, time.perf_counter() - start
    )
    return graphs


def kv_pool(model, num_slots: int, dtype: torch.dtype, device: torch.device) -> KVPool:
    """The KV pool of the model's layers that keep KV per token, with an FP8 checkpoint's
    scales."""
    cfg = model.cfg
    pool = KVPool(num_slots, cfg.kv_layer_shapes(), dtype, device)
    if pool.is_fp8:
        pool.set_scales(model.kv_cache_scales())
    return pool


def state_pool(
    model, args: EngineArgs, kv_bytes_per_token: int, kv_tokens: int, dtype: torch.dtype
) -> StatePoolInfo | None:
    """A hybrid model's state slots: one per request row, then the snapshot slots, made room
    for after the rows: --max-mamba-cache-size, else what --mamba-full-memory-ratio times the
    KV pool's bytes holds beyond the rows, else 4 per running request. Recurrent states are
    stored as --mamba-ssm-dtype; the snapshots' interval is --mamba-track-interval, else the
    tokens whose KV a state is worth (STATE_ONLY_INTERVAL for a model that keeps no KV)."""
    if not model.cfg.keeps_state:
        return None
    model.states.ssm_dtype = getattr(torch, args.mamba_ssm_dtype)
    if args.enable_deterministic_inference:
        model.run_mixers_a_token_at_a_time()
    size = model.state_bytes(dtype)
    rows = model.states.rows = args.max_running_requests
    count = args.max_mamba_cache_size
    if count is None and args.mamba_full_memory_ratio is not None:
        count = max(
            int(args.mamba_full_memory_ratio * kv_tokens * kv_bytes_per_token) // size - rows, 0
        )
    model.states.snapshot_slots = 4 * rows if count is None else count
    covered = covered_tokens(size, kv_bytes_per_token)
    interval = args.mamba_track_interval
    if interval is None:
        interval = covered or STATE_ONLY_INTERVAL
    cfg = model.cfg
    per_layer = covered_tokens(size * cfg.num_kv_layers // cfg.state_layers, kv_bytes_per_token)
    return StatePoolInfo(rows, model.states.snapshot_slots, size, covered, interval, per_layer)
