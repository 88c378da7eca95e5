"""The prefill server's transfers: a bootstrap listener collects where decode servers want each
room's KV, and a worker thread writes each finished prompt's KV there, then tells the decode
server (`KVArrived`). The scheduler keeps the request's KV locked until its job is done."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from ..ipc import pull_socket
from ..messages import KVArrived, KVDestination, StateTensor
from .transfer import PoolShape, RowStates, gather_kv, make_engine
from .wire import Senders, receive_forever

log = logging.getLogger(__name__)


@dataclass
class TransferJob:
    room: int
    slots: list[int]  # the prompt's slots in this pool
    first_token: int
    cached_tokens: int
    deadline: float  # monotonic: give up waiting for the destination then
    row: int | None = None  # a hybrid model's: the request's state row
    layout: list[StateTensor] = field(default_factory=list)  # what `state` is made of
    state: torch.Tensor | None = None  # its state at the prompt's end, as bytes


@dataclass
class TransferDone:
    room: int
    error: str | None
    bytes: int = 0
    seconds: float = 0.0


class PrefillTransfers:
    def __init__(self, args, pool, ctx: zmq.Context, states: RowStates | None = None):
        host = args.disaggregation_host
        self.states = states
        self.engine = make_engine(args.disaggregation_transfer_backend, host)
        self.pool, self.shape = pool, PoolShape.of(pool.k)
        self.timeout = args.disaggregation_transfer_timeout
        self.destinations: dict[int, tuple[KVDestination, float]] = {}  # room -> (it, arrived)
        self.arrived = threading.Condition()
        self.jobs: queue.Queue[TransferJob] = queue.Queue()
        self.done: queue.Queue[TransferDone] = queue.Queue()
        bootstrap = pull_socket(ctx, f"tcp://{host}:{args.disaggregation_bootstrap_port}")
        self.notifiers = Senders(ctx)  # used by the transfer thread only
        listen = (bootstrap, KVDestination, self._arrived)
        threading.Thread(target=receive_forever, args=listen, daemon=True, name="bootstrap").start()
        threading.Thread(target=self._work, daemon=True, name="kv-transfer").start()
        log.info(
            "disaggregation (prefill): bootstrap on %s:%d, transfer engine %s",
            host,
            args.disaggregation_bootstrap_port,
            self.engine.session,
        )

    def submit(self, job: TransferJob) -> None:
        """Queue the job; a hybrid model's state is read now, while the scheduler waits."""
        if self.states is not None:
            job.layout, job.state = self.states.states.row_bytes(job.row)
        self.jobs.put(job)

    def finished(self) -> list[TransferDone]:
        out = []
        while True:
            try:
                out.append(self.done.get_nowait())
            except queue.Empty:
                return out

    # ---- threads -----------------------------------------------------------------
    def _arrived(self, dest: KVDestination) -> None:
        now = time.monotonic()
        with self.arrived:
            self.destinations[dest.room] = (dest, now)
            stale = [r for r, (_, t) in self.destinations.items() if now - t > 4 * self.timeout]
            for room in stale:  # asked for by a decode server, never prefilled here
                del self.destinations[room]
            self.arrived.notify_all()

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            started = time.monotonic()
            dest, error, sent = self._destination(job), None, 0
            try:
                if dest is None:
                    error = f"no decode server asked for room {job.room} in {self.timeout:g} s"
                else:
                    sent = self._write(job, *dest)
            except Exception as exc:  # noqa: BLE001 - the request fails, the thread goes on
                error = f"the KV transfer failed: {type(exc).__name__}: {exc}"
            if dest is not None:
                first = job.first_token
                notice = KVArrived(job.room, first, job.cached_tokens, error, job.layout)
                try:
                    self.notifiers.send(dest[0].notify, notice)
                except zmq.ZMQError as exc:  # a destination naming no usable address
                    log.warning("room %d: cannot notify %r: %s", job.room, dest[0].notify, exc)
            self.done.put(TransferDone(job.room, error, sent, time.monotonic() - started))

    def _destination(self, job: TransferJob) -> tuple[KVDestination, float] | None:
        with self.arrived:
            while job.room not in self.destinations:
                left = job.deadline - time.monotonic()
                if left <= 0:
                    return None
                self.arrived.wait(left)
            return self.destinations.pop(job.room)

    def _write(self, job: TransferJob, dest: KVDestination, arrived: float) -> int:
        """Write the prompt tokens the decode server lacks; the bytes written."""
        if (
            problem := self.shape.problem_with(PoolShape(dest.layers, dest.slot_bytes))
        ) is not None:
            raise ValueError(problem)
        if dest.prompt_len != len(job.slots):
            raise ValueError(
                f"the decode server holds a {dest.prompt_len}-token prompt for room {job.room}, "
                f"this one has {len(job.slots)} tokens"
            )
        if time.monotonic() > arrived + dest.valid_s:
            raise ValueError("the decode server stopped waiting for this room's KV")
        state = job.state if job.state is not None else torch.empty(0, dtype=torch.uint8)
        if dest.state_bytes != state.numel():
            raise ValueError(
                f"the servers' request states differ: {state.numel()} bytes here, "
                f"{dest.state_bytes} there (the same model and --mamba-ssm-dtype are needed)"
            )
        slots = job.slots[dest.start :]
        kv = slots and self.shape.layers
        rows = [gather_kv(self.pool.k, self.pool.v, slots).view(-1)] if kv else []
        staged = torch.cat([*rows, state])
        if not staged.numel():
            return 0
        self.engine.register(staged)
        try:
            self.engine.write(dest.session, staged, dest.landing)
        finally:
            self.engine.unregister(staged)
        return staged.numel()
