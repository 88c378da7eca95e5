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
from ..distributed import init_tp_group
from ..ipc import Endpoints, exit_with_parent
from ..models.loader import ModelSource, resolve_model
from .model_runner import ModelRunner, default_device


def start_rank0(args: EngineArgs, endpoints: Endpoints, source: ModelSource) -> ModelRunner:
    """TP rank 0, in the calling (scheduler) process."""
    device = worker_device(0, args)
    tp = init_tp_group(0, args.tp_size, args.dist_init_method(endpoints.tp_init_file), device)
    return ModelRunner(source, args, device, tp=tp)


def run_follower(args: EngineArgs, init_method: str, tp_rank: int) -> None:
    """Entry point of the process of TP rank `tp_rank` > 0, meeting the others at `init_method`."""
    exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s worker tp{tp_rank}: %(message)s")
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
