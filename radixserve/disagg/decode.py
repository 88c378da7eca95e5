"""The decode server's transfers: it tells a prefill server's bootstrap listener where to write
a request's KV (`KVDestination`) and collects the prefill servers' `KVArrived` notices."""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from ..ipc import decode, encode, push_socket
from ..messages import Bootstrap, KVArrived, KVDestination
from .transfer import PoolLayout, make_engine

log = logging.getLogger(__name__)


class DecodeTransfers:
    def __init__(self, args, pool, ctx: zmq.Context):
        host = args.disaggregation_host
        self.engine = make_engine(args.disaggregation_transfer_backend, host, pool.k, pool.v)
        self.layout = PoolLayout.of(pool.k, pool.v)
        self.timeout = args.disaggregation_transfer_timeout
        self.ctx = ctx
        inbox = ctx.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        port = inbox.bind_to_random_port(f"tcp://{host}")
        self.notify = f"tcp://{host}:{port}"
        self.arrived: queue.Queue[KVArrived] = queue.Queue()
        self.bootstraps: dict[str, zmq.Socket] = {}  # used by the scheduler thread only
        threading.Thread(target=self._listen, args=(inbox,), daemon=True, name="kv-notify").start()
        log.info(
            "disaggregation (decode): notices on %s, transfer engine %s",
            self.notify,
            self.engine.session,
        )

    def ask(self, where: Bootstrap, prompt_len: int, start: int, slots: list[int]) -> None:
        """Tell the prefill server at `where` to write tokens [start, prompt_len) into `slots`."""
        address = f"tcp://{where.host}:{where.port}"
        sock = self.bootstraps.get(address)
        if sock is None:
            sock = self.bootstraps[address] = push_socket(self.ctx, address)
        layout = self.layout
        dest = KVDestination(
            where.room,
            self.engine.session,
            self.notify,
            list(layout.k_addrs),
            list(layout.v_addrs),
            layout.slot_bytes,
            prompt_len,
            start,
            slots,
            self.timeout,
        )
        try:
            sock.send(encode(dest), zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: it is gone; the request times out
            log.warning("the prefill server at %s takes no destinations", address)

    def arrivals(self) -> list[KVArrived]:
        out = []
        while True:
            try:
                out.append(self.arrived.get_nowait())
            except queue.Empty:
                return out

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
