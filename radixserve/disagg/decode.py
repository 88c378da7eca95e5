"""The decode server's transfers: for each request it registers a landing buffer, tells the
prefill server's bootstrap listener where it is (`KVDestination`), collects the prefill
servers' `KVArrived` notices, and copies what landed into its pool. A buffer whose request
gave up stays registered for one more timeout, so a late write lands in memory no one uses."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from ..ipc import decode, encode, push_socket
from ..messages import Bootstrap, KVArrived, KVDestination
from .transfer import PoolShape, make_engine, scatter_kv

log = logging.getLogger(__name__)


@dataclass
class Landing:
    buffer: torch.Tensor
    slots: list[int]  # where it goes in the pool
    until: float = 0.0  # once abandoned: when it can be freed


class DecodeTransfers:
    def __init__(self, args, pool, ctx: zmq.Context):
        host = args.disaggregation_host
        self.engine = make_engine(args.disaggregation_transfer_backend, host)
        self.pool, self.shape = pool, PoolShape.of(pool.k)
        self.timeout = args.disaggregation_transfer_timeout
        self.ctx = ctx
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        port = inbox.bind_to_random_port(f"tcp://{host}")
        self.notify = f"tcp://{host}:{port}"
        self.arrived: queue.Queue[KVArrived] = queue.Queue()
        self.landings: dict[int, Landing] = {}  # room -> its buffer (the scheduler thread's)
        self.abandoned: dict[int, Landing] = {}
        self.bootstraps: dict[str, zmq.Socket] = {}  # used by the scheduler thread only
        threading.Thread(target=self._listen, args=(inbox,), daemon=True, name="kv-notify").start()
        log.info(
            "disaggregation (decode): notices on %s, transfer engine %s",
            self.notify,
            self.engine.session,
        )

    def ask(self, where: Bootstrap, prompt_len: int, start: int, slots: list[int]) -> None:
        """Ask the prefill server at `where` for tokens [start, prompt_len), bound for `slots`."""
        buffer = torch.empty(self.shape.bytes_for(len(slots)), dtype=torch.uint8)
        self.engine.register(buffer)
        self.landings[where.room] = Landing(buffer, slots)
        dest = KVDestination(
            where.room,
            self.engine.session,
            self.notify,
            self.shape.layers,
            self.shape.slot_bytes,
            prompt_len,
            start,
            buffer.data_ptr(),
            self.timeout,
        )
        address = f"tcp://{where.host}:{where.port}"
        sock = self.bootstraps.get(address)
        if sock is None:
            sock = self.bootstraps[address] = push_socket(self.ctx, address)
        try:
            sock.send(encode(dest), zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it is gone; the request times out
            log.warning("the prefill server at %s takes no destinations", address)

    def land(self, room: int) -> None:
        """Copy the room's landed KV into its slots and free the buffer."""
        landing = self.landings.pop(room)
        scatter_kv(self.pool.k, self.pool.v, landing.slots, landing.buffer)
        self.engine.unregister(landing.buffer)

    def abandon(self, room: int) -> None:
        """The room's request gave up (or failed): free its buffer once no write can come."""
        landing = self.landings.pop(room, None)
        if landing is not None:
            landing.until = time.monotonic() + self.timeout
            self.abandoned[room] = landing

    def arrivals(self) -> list[KVArrived]:
        """The notices that came in; late ones free their abandoned buffers here."""
        out, now = [], time.monotonic()
        while True:
            try:
                msg = self.arrived.get_nowait()
            except queue.Empty:
                break
            if msg.room in self.abandoned:
                self.engine.unregister(self.abandoned.pop(msg.room).buffer)
            else:
                out.append(msg)
        for room in [r for r, landing in self.abandoned.items() if now > landing.until]:
            self.engine.unregister(self.abandoned.pop(room).buffer)
        return out

    def busy(self) -> bool:
        return bool(self.abandoned)

    def _listen(self, inbox: zmq.Socket) -> None:
        while True:
            raw = inbox.recv()
            try:
                msg = decode(raw)
                if not isinstance(msg, KVArrived):
                    raise ValueError(f"a {type(msg).__name__}")
            except Exception as exc:  # noqa: BLE001 - a bad message is dropped, named
                log.warning("ignored a notice that is not a KVArrived: %s", exc)
                continue
            self.arrived.put(msg)
