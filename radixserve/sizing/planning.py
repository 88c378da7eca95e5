"""`radixserve plan`: what a server started with these flags allocates, from the config alone
(the weights counted on the meta device, nothing loaded)."""

from __future__ import annotations

import torch

from ..distributed import TPGroup
from ..mem.kv_pool import KVPool, kv_storage_dtype
from ..memory_plan import MemoryPlan, context_problem, human_bytes, kv_pages
from ..models.loader import planned_weight_bytes, with_max_context
from ..models.source import resolve_model
from ..worker.device import resolve_dtype


def plan_for(args, memory_bytes: int, device_type: str) -> MemoryPlan:
    """The plan of `radixserve plan`: what a server started with `args` (EngineArgs) on a
    device of `memory_bytes` (free, before the weights) allocates, from the config alone."""
    source = resolve_model(args.model)
    cfg = source.config
    dtype, _ = resolve_dtype(args.dtype, torch.device(device_type), cfg.checkpoint_dtype)
    context = with_max_context(cfg, args.context_length)
    tp = TPGroup(rank=0, size=args.tp_size)
    weights = planned_weight_bytes(source, dtype, context, args.quantization, tp)
    ranked = tp.shard_config(cfg)
    kv_dtype = kv_storage_dtype(args.kv_cache_dtype, dtype)
    per_token = KVPool.bytes_per_token(ranked.kv_layer_shapes(), kv_dtype)
    pages = kv_pages(
        memory_bytes - weights,
        per_token,
        args.mem_fraction,
        args.max_total_tokens,
        device_type,
        args.page_size,
    )
    kv_name = "fp8_e4m3" if args.kv_cache_dtype == "fp8_e4m3" else str(dtype).removeprefix("torch.")
    return MemoryPlan(weights, per_token, pages * args.page_size, context, kv_name)


def plan_report(plan: MemoryPlan, memory_bytes: int, args) -> str:
    """What `radixserve plan` prints: the plan, then the concurrency each context length
    allows."""
    lines = [
        f"memory: {human_bytes(memory_bytes)}; --mem-fraction {args.mem_fraction} of what the "
        "weights leave goes to KV",
        plan.summary(),
        "context x concurrent requests that fit:",
    ]
    context = 1024
    while context < plan.max_context_len:
        lines.append(f"  {context:>8} x {plan.kv_tokens // context}")
        context *= 2
    lines.append(f"  {plan.max_context_len:>8} x {plan.full_context_requests}")
    problem = context_problem(plan, args.context_length)
    if problem:
        lines.append(f"refused at start-up: {problem}")
    return "\n".join(lines)
