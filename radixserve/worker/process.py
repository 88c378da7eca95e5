"""Model worker processes, one per tensor-parallel rank.

Rank 0 receives each ForwardBatch from the scheduler, forwards the same bytes to the other
ranks, runs its shard and answers with the ForwardResult; ranks > 0 only run their shard.
The ranks meet in the all-reduces of every layer (torch.distributed: gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import logging

import torch
import zmq

from ..config import EngineArgs
from ..distributed import init_tp_group
from ..ipc import Endpoints, decode, encode, exit_with_parent, pull_socket, push_socket
from ..models.loader import resolve_model
from .model_runner import ModelRunner, default_device

log = logging.getLogger(__name__)


def run_worker(args: EngineArgs, endpoints: Endpoints, tp_rank: int = 0) -> None:
    """Entry point of the worker process of TP rank `tp_rank`."""
    exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s worker tp{tp_rank}: %(message)s")
    device = worker_device(tp_rank)
    tp = init_tp_group(tp_rank, args.tp_size, endpoints.tp_init_file, device)
    runner = ModelRunner(resolve_model(args.model), args, device, tp=tp)
    ctx = zmq.Context()
    if tp_rank > 0:
        follow(runner, pull_socket(ctx, endpoints.worker_follower(tp_rank), bind=False))
    inbox = pull_socket(ctx, endpoints.worker_in, bind=True)
    outbox = push_socket(ctx, endpoints.worker_out, bind=False)
    followers = [push_socket(ctx, endpoints.worker_follower(r), bind=True) for r in range(1, args.tp_size)]
    outbox.send(encode(runner.info))
    while True:
        if not inbox.poll(1000):
            continue
        raw = inbox.recv()
        for follower in followers:
            follower.send(raw)
        outbox.send(encode(runner.forward(decode(raw))))


def follow(runner: ModelRunner, inbox: zmq.Socket) -> None:
    """A rank > 0: run every step rank 0 forwards; its results are rank 0's to report."""
    while True:
        if inbox.poll(1000):
            runner.forward(decode(inbox.recv()))


def worker_device(tp_rank: int) -> torch.device:
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(tp_rank)
        return torch.device("cuda", tp_rank)
    return device


class RemoteWorker:
    """The scheduler's Executor over ZeroMQ: one round trip per forward step."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, is_alive=lambda: True):
        self.outbox = push_socket(ctx, endpoints.worker_in, bind=False)
        self.inbox = pull_socket(ctx, endpoints.worker_out, bind=True)
        self.is_alive = is_alive
        self.info = self._receive()

    def forward(self, batch):
        self.outbox.send(encode(batch))
        return self._receive()

    def _receive(self):
        while not self.inbox.poll(1000):
            if not self.is_alive():
                raise RuntimeError("the model worker died")
        return decode(self.inbox.recv())
