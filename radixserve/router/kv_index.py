"""The cache-aware policy's index when workers publish KV events (`router --kv-events`).

Each worker's cached blocks are known exactly from its BlockStored / BlockRemoved /
AllBlocksCleared events (`kv_events.py`): a block is a page of token ids named by a hash
chained to its parent's, so a prompt's blocks are found by hashing its pages in order and
its match on a worker is the run of leading blocks the worker holds. Events arrive only
after a prefill, so the blocks of a request just routed are held as pending for a while:
the requests of a prefix group that arrive together still land on one worker.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq
import zmq.asyncio

from ..kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
    chain_hashes,
)

log = logging.getLogger("radixserve.router")

PENDING_TTL_S = 30.0


class KVEventIndex:
    """The same interface as `tree.PrefixTree` (match, insert, sizes, evict, remove_tenant);
    keys are token ids written one character per token (`keys.ids_key`)."""

    def __init__(self, page_size: int | None = None, clock=time.monotonic):
        self.page_size = (
            page_size  # the workers' --page-size, learnt when the first one is followed
        )
        self.blocks: dict[str, set[int]] = {}
        self.pending: dict[str, dict[int, float]] = {}  # tenant -> block -> when routed
        self.clock = clock
        self._last: tuple[tuple[str, int | None] | None, list[int]] = (None, [])

    def apply(self, tenant: str, events: list[KVEvent]) -> None:
        held = self.blocks.setdefault(tenant, set())
        pending = self.pending.setdefault(tenant, {})
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
                for h in event.block_hashes:
                    pending.pop(h, None)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()
                pending.clear()

    def _blocks_of(self, key: str) -> list[int]:
        """The key's block hashes; `match` and then `insert` ask for the same key in a row."""
        if self._last[0] != (key, self.page_size):
            hashes = chain_hashes([ord(c) for c in key], self.page_size) if self.page_size else []
            self._last = ((key, self.page_size), hashes)
        return self._last[1]

    def match(self, key: str) -> dict[str, int]:
        """Tokens of `key` each tenant holds (cached or pending) as leading whole pages."""
        hashes = self._blocks_of(key)
        now = self.clock()
        matched = {}
        for tenant, held in self.blocks.items():
            pending = self.pending.get(tenant, {})
            n = 0
            while n < len(hashes) and (
                hashes[n] in held or now - pending.get(hashes[n], -PENDING_TTL_S) < PENDING_TTL_S
            ):
                n += 1
            if n:
                matched[tenant] = n * self.page_size
        return matched

    def insert(self, key: str, tenant: str) -> None:
        self.blocks.setdefault(tenant, set())
        now = self.clock()
        pending = self.pending.setdefault(tenant, {})
        for h in self._blocks_of(key):
            pending[h] = now

    @property
    def sizes(self) -> dict[str, int]:
        page = self.page_size or 1
        return {
            t: (len(held) + len(self.pending.get(t, {}))) * page for t, held in self.blocks.items()
        }

    def evict(self, max_size: int) -> None:
        """Pending blocks expire; the cached ones are the workers' to evict."""
        now = self.clock()
        for pending in self.pending.values():
            for h in [h for h, t in pending.items() if now - t >= PENDING_TTL_S]:
                del pending[h]

    def remove_tenant(self, tenant: str) -> None:
        self.blocks.pop(tenant, None)
        self.pending.pop(tenant, None)


def events_endpoint(config_json: str, worker_host: str) -> tuple[str, bytes]:
    """Where a worker publishes (its `--kv-events-config`, a wildcard host replaced by the
    worker's) and the topic to subscribe to."""
    config = KVEventsConfig.from_json(config_json)
    scheme, _, address = config.endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::"):
        host = worker_host
    return f"{scheme}://{host}:{port}", config.topic.encode()


async def follow_events(index: KVEventIndex, tenant: str, endpoint: str, topic: bytes) -> None:
    """Apply a worker's event batches to `index` until cancelled."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = decoder.decode(frames[-1])
            except msgspec.DecodeError as exc:
                log.warning("dropped a malformed KV event batch from %s: %s", tenant, exc)
                continue
            index.apply(tenant, batch.events)
    finally:
        sock.close(linger=0)
