"""A byte-bounded cache, least recently used out first: the scheduler's encoder cache (a tower's
features by content hash) and the api process's processor cache (a request's preprocessed
image or video by the hash of its bytes) are both one."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


K = TypeVar("K")
V = TypeVar("V", bound=Sized)


class BoundedCache(Generic[K, V]):
    """Values by key within `max_bytes` (each value's `nbytes`); a value larger than the whole
    cache is not kept. Safe to share between threads."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self.lock:
            found = self.entries.get(key)
            if found is not None:
                self.entries.move_to_end(key)
            return found

    def put(self, key: K, value: V) -> None:
        with self.lock:
            if value.nbytes > self.max_bytes or key in self.entries:
                return
            while self.bytes + value.nbytes > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.nbytes
            self.entries[key] = value
            self.bytes += value.nbytes
