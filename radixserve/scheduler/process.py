"""The scheduler process: requests in from the api, steps out to the detokenizer."""
from __future__ import annotations

import logging
import os
import time

import zmq

from ..config import EngineArgs
from ..constrained import grammar_backend
from ..ipc import Endpoints, exit_with_parent, pull_socket, push_socket, recv_all, encode
from ..messages import (AbortReq, BatchOut, ControlReply, ControlReq, GenerateReq, ReqOutput,
                        SchedulerReady)
from ..models.loader import resolve_model
from ..tokenizer import decode_ids, eos_ids, load_tokenizer_or_none
from ..worker.process import RemoteWorker
from .scheduler import Scheduler

log = logging.getLogger(__name__)
IDLE_POLL_MS = 500


def run_scheduler(args: EngineArgs, endpoints: Endpoints) -> None:
    exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s scheduler: %(message)s")
    torch_threads_off()
    source = resolve_model(args.model)
    tokenizer = load_tokenizer_or_none(source.tokenizer_dir)
    decode_tail = (lambda ids: decode_ids(tokenizer, ids)) if tokenizer else None
    ctx = zmq.Context()
    inbox = pull_socket(ctx, endpoints.scheduler_in, bind=True)
    outbox = push_socket(ctx, endpoints.detokenizer_in, bind=False)
    worker = RemoteWorker(ctx, endpoints)
    scheduler = Scheduler(args, worker, decode_tail, eos_ids(tokenizer), grammar_backend(tokenizer, worker.info))
    outbox.send(encode(SchedulerReady(worker.info, source.name)))
    SchedulerLoop(scheduler, inbox, outbox).run()


def torch_threads_off() -> None:
    """The scheduler does no math: leave the cores to the worker."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, inbox: zmq.Socket, outbox: zmq.Socket):
        self.scheduler, self.inbox, self.outbox = scheduler, inbox, outbox
        self.last_log = time.monotonic()

    def run(self) -> None:
        while True:
            wait = 0 if self.scheduler.has_work() else IDLE_POLL_MS
            for msg in recv_all(self.inbox, wait):
                self.handle(msg)
            outputs = self.scheduler.step()
            if outputs:
                self.outbox.send(encode(BatchOut(outputs)))

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            self.outbox.send(encode(ControlReply(msg.kind, msg.token, self.control(msg))))

    def add(self, msg: GenerateReq) -> None:
        try:
            self.scheduler.add_request(msg)
        except ValueError as exc:
            reason = {"type": "abort", "message": str(exc), "status_code": 400}
            out = ReqOutput(msg.rid, [], True, reason, len(msg.input_ids), 0, 0)
            self.outbox.send(encode(BatchOut([out])))

    def control(self, msg: ControlReq) -> dict:
        if msg.kind == "flush_cache":
            return {"success": self.scheduler.flush_cache()}
        if msg.kind == "stats":
            stats = self.scheduler.snapshot(top_prefixes=msg.arg)
            return dict(vars(stats), cache_hit_rate=stats.cache_hit_rate)
        if msg.kind == "check_memory":
            try:
                self.scheduler.check_memory()
                return {"ok": True}
            except AssertionError as exc:
                return {"ok": False, "error": str(exc)}
        return {"error": f"unknown control {msg.kind!r}"}
