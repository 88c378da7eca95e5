"""Model workers: rank 0 lives in the scheduler process; TP ranks > 0 are processes of their own.

The scheduler calls rank 0's ModelRunner directly, so a step crosses no process boundary.
With tensor parallelism, rank 0 broadcasts each step's model inputs as one packed tensor
(torch.distributed: gloo on CPU, NCCL on GPU) and the ranks meet again in every layer's
all-reduces.
"""

from __future__ import annotations

import logging

import torch

from ..config import EngineArgs
from ..distributed import TPGroup, init_tp_group
from ..ipc import Endpoints, exit_with_parent
from ..mem.kv_pool import KVPool, kv_storage_dtype
from ..models.source import ModelSource, resolve_draft_model, resolve_model
from .device import default_device, resolve_dtype
from .model_runner import ModelRunner


def start_rank0(
    args: EngineArgs, endpoints: Endpoints, source: ModelSource
) -> tuple[ModelRunner, ModelRunner | None]:
    """TP rank 0, in the calling (scheduler) process, and the draft model when there is one."""
    device = worker_device(0, args)
    tp = init_tp_group(0, args.tp_size, args.dist_init_method(endpoints.tp_init_file), device)
    return build_runners(source, args, device, tp)


def build_runners(
    source: ModelSource,
    args: EngineArgs,
    device: torch.device | None = None,
    tp: TPGroup = TPGroup(),
) -> tuple[ModelRunner, ModelRunner | None]:
    """The model's runner (rank 0's shard) and, with `--speculative-algorithm draft`, the draft
    model's, unsharded, on the same device and slots; the KV pool is sized for both."""
    if args.speculative_algorithm != "draft":
        return ModelRunner(source, args, device, tp=tp), None
    draft = resolve_draft_model(args.speculative_draft_model, source)
    cfg, dtype = (
        draft.config,
        resolve_dtype(args.dtype, device or default_device(), draft.config.checkpoint_dtype)[0],
    )
    reserve = KVPool.bytes_per_token(
        cfg.kv_layer_shapes(), kv_storage_dtype(args.kv_cache_dtype, dtype)
    )
    target = ModelRunner(source, args, device, tp=tp, reserve_bytes_per_token=reserve)
    return target, ModelRunner(draft, args, target.device, layout=target.slot_layout())


def run_follower(args: EngineArgs, init_method: str, tp_rank: int) -> None:
    """Entry point of the process of TP rank `tp_rank` > 0, meeting the others at `init_method`."""
    exit_with_parent()
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s worker tp{tp_rank}: %(message)s"
    )
    device = worker_device(tp_rank, args)
    tp = init_tp_group(tp_rank, args.tp_size, init_method, device)
    ModelRunner(resolve_model(args.model), args, device, tp=tp).follow()


def worker_device(tp_rank: int, args: EngineArgs) -> torch.device:
    """On CUDA, the node's GPU at the rank's place among the node's ranks."""
    device = default_device()
    if device.type == "cuda":
        local = args.local_tp_ranks().index(tp_rank)
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return device
