"""The model worker process: receives ForwardBatch, answers ForwardResult."""
from __future__ import annotations

import logging

import zmq

from ..config import EngineArgs
from ..ipc import Endpoints, decode, encode, exit_with_parent, pull_socket, push_socket
from ..models.loader import resolve_model
from .model_runner import ModelRunner

log = logging.getLogger(__name__)


def run_worker(args: EngineArgs, endpoints: Endpoints, tp_rank: int = 0) -> None:
    """Entry point of a worker process (one per tensor-parallel rank; rank 0 talks to the scheduler)."""
    exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s worker: %(message)s")
    if args.tp_size != 1:
        raise NotImplementedError("tensor parallelism over torch.distributed is not built yet; use tp_size=1")
    runner = ModelRunner(resolve_model(args.model), args)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, endpoints.worker_in, bind=True)
    outbox = push_socket(ctx, endpoints.worker_out, bind=False)
    outbox.send(encode(runner.info))
    while True:
        if not inbox.poll(1000):
            continue
        outbox.send(encode(runner.forward(decode(inbox.recv()))))


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
