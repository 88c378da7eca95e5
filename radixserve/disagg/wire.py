"""The control messages between a prefill and a decode server, over ZeroMQ (the KV bytes go
through the transfer engine): a listener that takes one message type, and sends that never
block on a peer that is gone."""

from __future__ import annotations

import logging
from typing import Callable

import zmq

from ..ipc import decode, encode, push_socket

log = logging.getLogger(__name__)


def receive_forever(sock: zmq.Socket, kind: type, deliver: Callable) -> None:
    """Hand each message of type `kind` to `deliver`; anything else is dropped, named."""
    while True:
        raw = sock.recv()
        try:
            msg = decode(raw)
            if not isinstance(msg, kind):
                raise ValueError(f"a {type(msg).__name__}")
        except Exception as exc:  # noqa: BLE001 - a bad message is dropped, named
            log.warning("ignored a message that is not a %s: %s", kind.__name__, exc)
            continue
        deliver(msg)


class Senders:
    """PUSH sockets by address, for one thread."""

    def __init__(self, ctx: zmq.Context):
        self.ctx, self.sockets = ctx, {}

    def send(self, address: str, msg) -> None:
        """Queue `msg` for `address`; raises zmq.ZMQError for an address ZeroMQ refuses."""
        sock = self.sockets.get(address)
        if sock is None:
            sock = push_socket(self.ctx, address)
            self.sockets[address] = sock
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # its queue is full: the peer is gone; the request times out
            log.warning("%s takes no messages; %s dropped", address, type(msg).__name__)
