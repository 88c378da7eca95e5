"""The scheduler process: requests in from the api, steps through the model, outputs to the
detokenizer.

It hosts TP rank 0's model runner and calls it directly (SGLang's process model).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import math
import os
import signal
import threading
import time

import zmq

from ..config import EngineArgs
from ..constrained import grammar_backend
from ..disagg import start_transfers
from ..ipc import Endpoints, Heartbeat, encode, exit_with_parent, pull_socket, push_socket, recv_all
from ..kv_events import KVEventPublisher, KVEventsConfig
from ..messages import (
    AbortReq,
    BatchOut,
    ControlReply,
    ControlReq,
    FinishReason,
    GenerateReq,
    ReqOutput,
    SchedulerReady,
)
from ..models.source import resolve_model
from ..tokenizer import decode_ids, eos_ids, tokenizer_in_child
from ..worker.process import start_rank0
from .control import run_control
from .scheduler import Scheduler

log = logging.getLogger(__name__)
IDLE_POLL_MS = 500
WATCHDOG_EXIT_CODE = 70
STORAGE_FLUSH_S = 3.0  # the launcher kills a child that takes more than 5 s to stop


def run_scheduler(args: EngineArgs, endpoints: Endpoints, heartbeat: Heartbeat) -> None:
    exit_with_parent()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s scheduler: %(message)s")
    source = resolve_model(args.model)
    # One after the other: loading the tokenizer in a thread beside the model raced the two
    # threads' imports of sympy (through transformers and torch) and, once in a CI run, left a
    # half-imported module that killed the process at start-up.
    tokenizer = tokenizer_in_child(source.tokenizer_dir)
    runner, draft_runner = start_rank0(args, endpoints, source)
    decode_tail = (lambda ids: decode_ids(tokenizer, ids)) if tokenizer else None
    ctx = zmq.Context()
    inbox = pull_socket(ctx, endpoints.scheduler_in, bind=True)
    outbox = push_socket(ctx, endpoints.detokenizer_in, bind=False)
    scheduler = Scheduler(
        args,
        runner,
        decode_tail,
        eos_ids(tokenizer),
        grammar_backend(tokenizer, runner.info),
        draft_runner,
        start_transfers(args, runner, ctx),
    )
    outbox.send(encode(SchedulerReady(runner.info, source.name, tuple(scheduler.adapters.names()))))
    threading.Thread(
        target=watch_loop,
        args=(heartbeat, args.watchdog_timeout),
        daemon=True,
        name="scheduler-watchdog",
    ).start()
    events = (
        KVEventPublisher(KVEventsConfig.from_json(args.kv_events_config), ctx)
        if args.kv_events_config is not None
        else None
    )
    signal.signal(signal.SIGTERM, lambda *_: stop(scheduler))
    # What start-up loaded (torch, transformers, the model's modules) lives as long as the
    # process: out of the cyclic collector's sight, its collections walk only what the loop
    # allocates (SGLang's and vLLM's schedulers do the same).
    gc.freeze()
    SchedulerLoop(scheduler, inbox, outbox, heartbeat, events).run()


def stop(scheduler: Scheduler) -> None:
    """On SIGTERM: let the storage tier's writer finish the blocks it has queued (briefly), then
    exit."""
    if scheduler.kv.hicache is not None and scheduler.kv.hicache.storage is not None:
        scheduler.kv.hicache.storage.flush(timeout=STORAGE_FLUSH_S)
    raise SystemExit(0)


def watch_loop(heartbeat: Heartbeat, timeout: float) -> None:
    """Exit the process when the loop has not turned for `timeout` seconds with work to do: a
    stuck scheduler is then a dead child, which the launcher reports and shuts down on."""
    while True:
        time.sleep(min(timeout / 4, 5.0))
        stalled = heartbeat.stalled_for()
        if stalled > timeout:
            log.error(
                "the scheduler loop has not turned for %.1f s with work to do; exiting (watchdog)",
                stalled,
            )
            faulthandler.dump_traceback(all_threads=True)
            os._exit(WATCHDOG_EXIT_CODE)


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        heartbeat: Heartbeat,
        kv_events: KVEventPublisher | None = None,
    ):
        self.scheduler, self.inbox, self.outbox, self.heartbeat = (
            scheduler,
            inbox,
            outbox,
            heartbeat,
        )
        self.kv_events = kv_events

    def run(self) -> None:
        while True:
            wait = math.ceil(1000 * self.scheduler.poll_timeout_s(IDLE_POLL_MS / 1000))
            for msg in recv_all(self.inbox, wait):
                self.handle(msg)
            self.heartbeat.beat(busy=self.scheduler.has_work())
            outputs = self.scheduler.step()
            if outputs:
                self.outbox.send(encode(BatchOut(outputs)))
            if self.kv_events is not None:  # this turn's stores, evictions and flushes
                self.kv_events.publish(self.scheduler.kv.cache.take_events())

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            try:
                data = run_control(self.scheduler, msg)
            except Exception as exc:  # noqa: BLE001 - a failed query must not stop the scheduler
                log.exception("control %r failed", msg.kind)
                data = {"error": f"{type(exc).__name__}: {exc}"}
            self.outbox.send(encode(ControlReply(msg.kind, msg.token, data)))

    def add(self, msg: GenerateReq) -> None:
        try:
            self.scheduler.add_request(msg)
        except Exception as exc:  # noqa: BLE001 - a request that cannot be queued fails alone
            if not isinstance(exc, ValueError):
                log.exception("queueing request %s failed", msg.rid)
            reason = FinishReason("abort", message=str(exc), rejected=isinstance(exc, ValueError))
            out = ReqOutput(msg.rid, [], True, reason, len(msg.input_ids), 0, 0)
            self.outbox.send(encode(BatchOut([out])))
