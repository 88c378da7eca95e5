"""ZeroMQ plumbing between the processes: a typed msgpack codec, sockets, parent-death handling.

Messages are the dataclasses of `messages`. Each travels as msgpack (msgspec, in C) in a
`[class name, body]` envelope, and the body is decoded straight into its class, with every
field's type checked. Nothing is ever unpickled.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from . import messages

_MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in vars(messages).values()
    if dataclasses.is_dataclass(cls) and isinstance(cls, type)
}
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_DECODERS = {name: msgspec.msgpack.Decoder(cls) for name, cls in _MESSAGE_TYPES.items()}


def encode(msg: Any) -> bytes:
    return _ENCODER.encode((type(msg).__name__, msg))


def decode(raw: bytes) -> Any:
    name, body = _ENVELOPE.decode(raw)
    decoder = _DECODERS.get(name)
    if decoder is None:
        raise ValueError(f"unknown message type {name!r}")
    return decoder.decode(body)


@dataclass(frozen=True)
class Endpoints:
    """ipc:// addresses inside a private (0700) directory."""

    folder: str

    @classmethod
    def create(cls) -> "Endpoints":
        return cls(tempfile.mkdtemp(prefix="radixserve-"))

    def _addr(self, name: str) -> str:
        return f"ipc://{Path(self.folder) / name}"

    @property
    def scheduler_in(self) -> str:
        return self._addr("scheduler_in")

    @property
    def detokenizer_in(self) -> str:
        return self._addr("detokenizer_in")

    @property
    def api_in(self) -> str:
        return self._addr("api_in")

    @property
    def tp_init_file(self) -> str:
        """The file torch.distributed's workers rendezvous through."""
        return str(Path(self.folder) / "tp_init")


def push_socket(ctx: zmq.Context, addr: str, bind: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


def pull_socket(ctx: zmq.Context, addr: str, bind: bool = True) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


def recv_all(sock: zmq.Socket, timeout_ms: int) -> list[Any]:
    """Wait up to `timeout_ms` for a first message (0: don't wait), then drain without blocking."""
    if timeout_ms and not sock.poll(timeout_ms):
        return []
    out = []
    while True:
        try:
            out.append(decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return out


class Heartbeat:
    """The scheduler loop's last turn (wall clock) and whether it had work then, in shared
    memory: the api's /health and the scheduler's own watchdog read it. Made before the
    processes start (it travels to the scheduler as a spawn argument)."""

    def __init__(self, ctx: Any):
        self._cells = ctx.RawArray(ctypes.c_double, 2)
        self.beat(busy=False)

    def beat(self, busy: bool) -> None:
        self._cells[0], self._cells[1] = time.time(), float(busy)

    def stalled_for(self) -> float:
        """Seconds since the last turn if the loop had work then; 0 when it was idle."""
        return time.time() - self._cells[0] if self._cells[1] else 0.0


def exit_with_parent() -> None:
    """Die with the parent: PR_SET_PDEATHSIG where Linux offers it, and a watchdog thread."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
