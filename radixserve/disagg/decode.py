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

from ..messages import Bootstrap, KVArrived, KVDestination
from .transfer import PoolShape, RowStates, make_engine, scatter_kv
from .wire import Senders, receive_forever

log = logging.getLogger(__name__)


@dataclass
class Landing:
    buffer: torch.Tensor
    slots: list[int]  # where it goes in the pool
    row: int  # the request's row (a hybrid model's state goes there)
    until: float = 0.0  # once abandoned: when it can be freed


class DecodeTransfers:
    def __init__(self, args, pool, ctx: zmq.Context, states: RowStates | None = None):
        host = args.disaggregation_host
        self.states = states
        self.state_bytes = 0 if states is None else states.size
        self.engine = make_engine(args.disaggregation_transfer_backend, host)
        self.pool, self.shape = pool, PoolShape.of(pool.k)
        self.timeout = args.disaggregation_transfer_timeout
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        port = inbox.bind_to_random_port(f"tcp://{host}")
        self.notify = f"tcp://{host}:{port}"
        self.arrived: queue.Queue[KVArrived] = queue.Queue()
        self.landings: dict[int, Landing] = {}  # room -> its buffer (the scheduler thread's)
        self.abandoned: dict[int, Landing] = {}
        self.bootstraps = Senders(ctx)  # used by the scheduler thread only
        threading.Thread(
            target=receive_forever,
            args=(inbox, KVArrived, self.arrived.put),
            daemon=True,
            name="kv-notify",
        ).start()
        log.info(
            "disaggregation (decode): notices on %s, transfer engine %s",
            self.notify,
            self.engine.session,
        )

    def ask(
        self, where: Bootstrap, prompt_len: int, start: int, slots: list[int], row: int
    ) -> None:
        """Ask the prefill server at `where` for tokens [start, prompt_len), bound for `slots`
        (and a hybrid model's state at the prompt's end, bound for `row`)."""
        size = self.shape.bytes_for(len(slots)) + self.state_bytes
        buffer = torch.empty(size, dtype=torch.uint8)
        self.engine.register(buffer)
        self.landings[where.room] = Landing(buffer, slots, row)
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
            self.state_bytes,
        )
        self.bootstraps.send(f"tcp://{where.host}:{where.port}", dest)

    def land(self, arrived: KVArrived) -> None:
        """Copy the room's landed KV into its slots (a hybrid model's state into its row) and
        free the buffer. ValueError: the state sent is not this model's."""
        landing = self.landings.pop(arrived.room)
        try:
            kv = self.shape.bytes_for(len(landing.slots))
            if landing.slots and self.shape.layers:
                scatter_kv(self.pool.k, self.pool.v, landing.slots, landing.buffer[:kv])
            if self.states is not None:
                state = landing.buffer[kv:]
                self.states.states.put_row(landing.row, arrived.states, state, self.pool.device)
        finally:
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
