"""Hierarchical KV cache: a host-memory tier (L2) and a storage tier (L3) under the radix tree.

The radix tree holds what is in the device pool (L1). Below it, KV is kept in blocks of
`block` tokens (a whole number of pages), named by a hash chained over the token ids of
every block from the start of the prompt, seeded with a fingerprint of the model, dtype,
block size and tensor-parallel layout: a block's name stands for its whole prefix, and a
different model never reads it. L2 is a pool of blocks in host memory, least recently used
out first; L3 a folder of block files that outlives the server and is shared by the servers
of one machine. Every block written to L2 is also written to L3 (by a background thread).

A request whose device match stops short is extended from L2, then L3: consecutive blocks
after the match are copied into fresh device slots and inserted into the tree, until a
block is missing or the load has taken `load_timeout_s`; the rest is recomputed. A stored
block carries its token ids and a checksum: a corrupt, truncated or foreign file is a miss
(logged and deleted), never served.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import torch

from ..kv_events import chain_hashes, salted_parent
from ..messages import StateTensor
from .hicache_storage import FileStore, TierStats
from .kv_pool import KVPool, _zeros

log = logging.getLogger(__name__)
BLOCK_TOKENS = 64
STATE_KEY = 0x5EED57A7E0000001  # xor'ed into a block's hash: the name of the state at its end
LAYOUT = msgspec.msgpack.Decoder(list[StateTensor])  # a stored state's parts, type-checked


def block_size(page_size: int) -> int:
    """Tokens per stored block: the smallest whole number of pages of at least BLOCK_TOKENS."""
    return page_size * -(-BLOCK_TOKENS // page_size)


def fingerprint(*parts: object) -> str:
    """16 hex digits naming what KV is compatible: model, dtype, block size, TP layout."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


class HostStore:
    """L2: `capacity` blocks of K and V in host memory, by hash, least recently used out first."""

    def __init__(self, capacity: int, block: int, pool: KVPool):
        self.block, self.capacity = block, capacity
        pin = pool.k[0].device.type == "cuda"
        dtype = pool.k[0].dtype

        def make(like: torch.Tensor) -> torch.Tensor:
            """Host rows shaped like the pool's (a latent pool's values are 0 wide)."""
            shape = (capacity * block, *like.shape[1:])
            if pin:
                return torch.zeros(shape, dtype=dtype, pin_memory=True)
            return _zeros(shape, dtype, torch.device("cpu"))

        self.k = [make(t) for t in pool.k]
        self.v = [make(t) for t in pool.v]
        self.index: OrderedDict[int, int] = OrderedDict()  # hash -> block number
        self.free: list[int] = list(range(capacity - 1, -1, -1))

    def lookup(self, h: int) -> int | None:
        number = self.index.get(h)
        if number is not None:
            self.index.move_to_end(h)
        return number

    def claim(self, h: int) -> int | None:
        """A block for `h` (the least recently used one when full; None when every block is
        pinned by a load in progress); the caller fills it."""
        if not self.free and not self.index:
            return None
        number = self.free.pop() if self.free else self.index.popitem(last=False)[1]
        self.index[h] = number
        return number

    def pin(self, hashes: list[int]) -> None:
        """Take blocks out of the LRU order while a load copies from them."""
        for h in hashes:
            del self.index[h]

    def unpin(self, hashes: list[int], numbers: list[int]) -> None:
        self.index.update(zip(hashes, numbers))

    def check(self) -> None:
        assert len(self.index) + len(self.free) == self.capacity, "host KV blocks leaked"

    def rows(self, number: int, start: int = 0) -> torch.Tensor:
        return torch.arange(number * self.block + start, (number + 1) * self.block)

    def clear(self) -> None:
        self.free.extend(self.index.values())
        self.index.clear()


@dataclass
class TierState:
    """A hybrid model's per-request state at a block's end, as the tiers keep it: what each
    part is (`models.recurrent_states.RecurrentStates.row_bytes`) and the bytes."""

    layout: list[StateTensor]
    data: torch.Tensor  # uint8

    def payload(self) -> bytes:
        """The layout as length-prefixed msgpack, then the bytes (a storage file's payload)."""
        head = msgspec.msgpack.encode(self.layout)
        return struct.pack("<I", len(head)) + head + self.data.numpy().tobytes()

    @classmethod
    def parse(cls, payload: bytes) -> TierState:
        (size,) = struct.unpack_from("<I", payload)
        layout = LAYOUT.decode(payload[4 : 4 + size])
        return cls(layout, torch.frombuffer(bytearray(payload[4 + size :]), dtype=torch.uint8))


class HostStates:
    """L2 for a hybrid model's states: up to `capacity` of them by the hash of the block they
    end, least recently used out first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.index: OrderedDict[int, TierState] = OrderedDict()

    def get(self, h: int) -> TierState | None:
        state = self.index.get(h)
        if state is not None:
            self.index.move_to_end(h)
        return state

    def put(self, h: int, state: TierState) -> None:
        self.index[h] = state
        self.index.move_to_end(h)
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)

    def clear(self) -> None:
        self.index.clear()


@dataclass
class HiCache:
    """Moves KV between the device pool and the tiers below it; the scheduler decides when."""

    pool: KVPool
    block: int
    seed: int
    host: HostStore
    storage: FileStore | None = None
    load_timeout_s: float = 5.0
    stats: TierStats = field(default_factory=TierStats)
    states: HostStates | None = None  # a hybrid model's

    @classmethod
    def create(
        cls,
        pool: KVPool,
        page_size: int,
        host_tokens: int,
        fingerprint_hex: str,
        storage_dir: str | None,
        load_timeout_s: float = 5.0,
        host_states: int = 0,
    ) -> "HiCache":
        block = block_size(page_size)
        stats = TierStats()
        storage = FileStore(storage_dir, fingerprint_hex, stats) if storage_dir else None
        return cls(
            pool,
            block,
            int(fingerprint_hex, 16) >> 1,
            HostStore(max(host_tokens // block, 1), block, pool),
            storage,
            load_timeout_s,
            stats,
            HostStates(host_states) if host_states else None,
        )

    @property
    def block_bytes(self) -> int:
        tensors = (*self.host.k, *self.host.v)
        return sum(self.block * t[0].numel() * t.element_size() for t in tensors)

    def backup(self, tokens: list[int], slots: list[int], salt: str | None = None) -> list[int]:
        """Copy the whole blocks of a cached prefix (its device `slots`) that L2 lacks, all in
        one gather per layer. A `salt` keys its blocks apart from everyone else's. Returns the
        blocks' hashes."""
        hashes = self.hashes(tokens, salt)
        new: list[tuple[int, int, int]] = []  # (block index, hash, host block number)
        for i, h in enumerate(hashes):
            if h in self.host.index:
                self.host.index.move_to_end(h)
                continue
            number = (
                self.host.claim(h) if len(new) < self.host.capacity else None
            )  # never reclaim a block of `new`
            if number is None:
                break
            new.append((i, h, number))
        if not new:
            return hashes
        device = torch.tensor(
            [s for i, _, _ in new for s in slots[i * self.block : (i + 1) * self.block]],
            device=self.pool.k[0].device,
        )
        rows = torch.cat([self.host.rows(number) for _, _, number in new])
        for layer in range(len(self.pool.k)):
            self.host.k[layer].index_copy_(
                0, rows, self.pool.k[layer].index_select(0, device).to("cpu")
            )
            self.host.v[layer].index_copy_(
                0, rows, self.pool.v[layer].index_select(0, device).to("cpu")
            )
        self.stats.backed_up_tokens += len(new) * self.block
        self.stats.backed_up_bytes += len(new) * self.block_bytes
        if self.storage is not None:
            for i, h, number in new:
                if not self.storage.contains(h):
                    self.storage.put(
                        h, tokens[i * self.block : (i + 1) * self.block], self._payload(number)
                    )
        return hashes

    def load(
        self,
        tokens: list[int],
        cached: int,
        alloc: Callable[[int], list[int] | None],
        salt: str | None = None,
    ) -> list[int]:
        """Device slots holding `tokens[cached:cached + n]`, loaded from L2/L3 for the longest
        run of consecutive blocks found there (n = 0 when none is)."""
        started = time.monotonic()
        hashes = self.hashes(tokens, salt)
        found: list[tuple[int, int]] = []  # (block index, host block number), consecutive
        for i in range(cached // self.block, len(hashes)):
            if len(found) >= self.host.capacity:  # a longer run would evict its own first blocks
                break
            if time.monotonic() - started > self.load_timeout_s:
                self.stats.load_timeouts += 1
                break
            number = self._find(hashes[i], tokens[i * self.block : (i + 1) * self.block])
            if number is None:
                break
            found.append((i, number))
        if not found:
            return []
        n = (found[-1][0] + 1) * self.block - cached
        pinned = [hashes[i] for i, _ in found]
        self.host.pin(pinned)  # making room on the device may back up (write_back) into L2
        try:
            slots = alloc(n)
            if slots:
                self._copy_in(found, cached, slots)
        finally:
            self.host.unpin(pinned, [number for _, number in found])
        if not slots:
            return []
        self.stats.loaded_tokens += n
        self.stats.loaded_bytes += n * self.block_bytes // self.block
        self.stats.load_seconds += time.monotonic() - started
        return slots

    def _copy_in(self, found: list[tuple[int, int]], cached: int, slots: list[int]) -> None:
        rows = torch.cat(
            [self.host.rows(number, max(cached - i * self.block, 0)) for i, number in found]
        )
        device = torch.tensor(slots, device=self.pool.k[0].device)
        for layer in range(len(self.pool.k)):
            self.pool.k[layer].index_copy_(
                0, device, self.host.k[layer].index_select(0, rows).to(device.device)
            )
            self.pool.v[layer].index_copy_(
                0, device, self.host.v[layer].index_select(0, rows).to(device.device)
            )

    def _find(self, h: int, tokens: list[int]) -> int | None:
        """The host block holding `h`, read from storage into L2 when only storage has it."""
        number = self.host.lookup(h)
        if number is not None:
            self.stats.host_hit_tokens += self.block
            return number
        if self.storage is None:
            return None
        payload = self.storage.read(h, tokens, self.block_bytes)
        if payload is None:
            return None
        number = self.host.claim(h)
        if number is None:
            return None
        self._unpack(number, payload)
        self.stats.storage_hit_tokens += self.block
        return number

    def _payload(self, number: int) -> bytes:
        rows = self.host.rows(number)
        parts = [t.index_select(0, rows).flatten() for t in (*self.host.k, *self.host.v)]
        return torch.cat(parts).view(torch.uint8).numpy().tobytes()

    def _unpack(self, number: int, payload: bytes) -> None:
        """A block's K then V of every layer, as `_payload` wrote them."""
        tensors = (*self.host.k, *self.host.v)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(tensors[0].dtype)
        sizes = [self.block * t[0].numel() for t in tensors]
        rows = self.host.rows(number)
        for tensor, part in zip(tensors, data.split(sizes)):
            tensor.index_copy_(0, rows, part.view(self.block, *tensor.shape[1:]))

    def backup_state(self, h: int, tokens: list[int], read: Callable[[], TierState]) -> None:
        """Keep a hybrid model's state at the end of the block hashed `h` (its `tokens`) in L2
        and L3; `read` takes it from the device, only when L2 lacks it."""
        if h in self.states.index:
            self.states.index.move_to_end(h)
            return
        state = read()
        self.states.put(h, state)
        if self.storage is not None and not self.storage.contains(h ^ STATE_KEY):
            self.storage.put(h ^ STATE_KEY, tokens, state.payload())

    def clear_host(self) -> None:
        """Empty host memory: its KV blocks and a hybrid model's states."""
        self.host.clear()
        if self.states is not None:
            self.states.clear()

    def find_state(self, h: int, tokens: list[int]) -> TierState | None:
        """The state at the end of the block hashed `h` (its `tokens`), from L2 or else L3."""
        state = self.states.get(h)
        if state is not None or self.storage is None:
            return state
        payload = self.storage.read(h ^ STATE_KEY, tokens, None)
        if payload is None:
            return None
        try:
            state = TierState.parse(payload)
        except (msgspec.DecodeError, struct.error) as exc:  # a file of another layout
            log.warning("hicache: a stored state is unreadable (%s); recomputing it", exc)
            return None
        self.states.put(h, state)
        return state

    def hashes(self, tokens: list[int], salt: str | None = None) -> list[int]:
        """The chained block hashes the tiers key `tokens` by (a salt heads the chain)."""
        return chain_hashes(tokens, self.block, salted_parent(self.seed, salt))

    def tiers_of(self, tokens: list[int], salt: str | None = None) -> list[str]:
        """The tiers below the device holding every whole block of `tokens`."""
        hashes = self.hashes(tokens, salt)
        if not hashes:
            return []
        tiers = ["host"] if all(h in self.host.index for h in hashes) else []
        if self.storage is not None and all(self.storage.contains(h) for h in hashes):
            tiers.append("disk")
        return tiers

    def used_tokens(self) -> int:
        return len(self.host.index) * self.block

    def capacity_tokens(self) -> int:
        return self.host.capacity * self.block

    def snapshot(self) -> dict:
        return {
            **vars(self.stats),
            "host_used_tokens": self.used_tokens(),
            "host_capacity_tokens": self.capacity_tokens(),
            "storage": self.storage is not None,
        }
