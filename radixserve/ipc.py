"""ZeroMQ plumbing between the processes: a typed JSON codec, sockets, parent-death handling.

Messages are the dataclasses of `messages`; they travel as orjson, tagged with the
class name, and are rebuilt field by field. Nothing is ever unpickled.
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import os
import signal
import tempfile
import threading
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
import zmq

from . import messages

_MESSAGE_TYPES = {cls.__name__: cls for cls in vars(messages).values()
                  if dataclasses.is_dataclass(cls) and isinstance(cls, type)}


def encode(msg: Any) -> bytes:
    return orjson.dumps({"type": type(msg).__name__, "data": dataclasses.asdict(msg)})


def decode(raw: bytes) -> Any:
    envelope = orjson.loads(raw)
    cls = _MESSAGE_TYPES.get(envelope.get("type"))
    if cls is None:
        raise ValueError(f"unknown message type {envelope.get('type')!r}")
    return _build(cls, envelope["data"])


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(messages))


def _build(cls: type, data: dict) -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: _value(hints[k], v) for k, v in data.items() if k in names})


def _value(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(tp) if a is not type(None)]
        return _value(kinds[0], value) if len(kinds) == 1 else value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return [_value(item, v) for v in value]
    if origin is tuple:
        return tuple(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    return value


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
    def worker_in(self) -> str:
        return self._addr("worker_in")

    @property
    def worker_out(self) -> str:
        return self._addr("worker_out")

    def worker_follower(self, rank: int) -> str:
        """Where TP rank 0 forwards each step to rank `rank` > 0."""
        return self._addr(f"worker_tp{rank}")

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
