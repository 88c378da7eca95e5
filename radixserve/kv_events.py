"""KV cache events for existing KV-aware routers (NVIDIA Dynamo, llm-d), published as vLLM
and SGLang publish them (`--kv-events-config`).

Wire format: ZeroMQ PUB multipart `[topic, sequence number (8 bytes, big endian), payload]`;
the payload is a msgpack array `[ts, [event, ...]]` whose events are arrays led by their type:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size]`,
`["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]` (trailing fields left at their
defaults are omitted, as msgspec does for vLLM). A block is one page of the radix cache; its
hash chains its parent block's, so one hash names the whole prefix up to its page. With a
`replay_endpoint`, missed batches can be asked for again (`KVEventPublisher`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Union

import msgspec

ZMQ_PUBLISHER = "zmq"


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """A 63-bit hash of a page's tokens chained to its parent block's hash."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent or 0).to_bytes(8, "little"))
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(digest.digest(), "little") >> 1


def salt_hash(salt: str) -> int:
    """The hash a salted run's first block chains to (vLLM and SGLang mix the salt into the
    first block's hash; a chain from it never meets an unsalted one)."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"cachesalt")
    return int.from_bytes(digest.digest(), "little") >> 1


def salted_parent(parent: int | None, salt: str | None) -> int | None:
    """The parent a chain of `salt` starts from, in place of `parent` (the hierarchical
    cache's seed)."""
    if salt is None:
        return parent
    return block_hash((parent or 0) ^ salt_hash(salt), [])


def chain_hashes(tokens: list[int], block: int, parent: int | None = None) -> list[int]:
    """The chained hashes of the whole blocks of `tokens`, the first chained to `parent`."""
    hashes = []
    for start in range(0, len(tokens) - block + 1, block):
        parent = block_hash(parent, tokens[start : start + block])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config` as JSON, with vLLM's key names; keys radixserve does not
    implement (hwm, max_queue_size, ...) are refused by name."""

    endpoint: str = "tcp://*:5557"
    topic: str = ""
    publisher: str = ZMQ_PUBLISHER
    replay_endpoint: str | None = None  # a ROUTER socket answering "batches from sequence number N"
    buffer_steps: int = 10_000  # batches kept for replay

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            given = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("kv_events_config must be a JSON object")
        given.pop("enable_kv_cache_events", None)
        unknown = sorted(
            set(given) - {"endpoint", "topic", "publisher", "replay_endpoint", "buffer_steps"}
        )
        if unknown:
            raise ValueError(f"kv_events_config keys {unknown} are not supported by radixserve")
        config = cls(**given)
        for key in ("endpoint", "topic", "publisher"):
            if not isinstance(getattr(config, key), str):
                raise ValueError(f"kv_events_config {key} must be a string")
        if config.replay_endpoint is not None and not isinstance(config.replay_endpoint, str):
            raise ValueError("kv_events_config replay_endpoint must be a string")
        if not isinstance(config.buffer_steps, int) or config.buffer_steps < 1:
            raise ValueError("kv_events_config buffer_steps must be a positive integer")
        if config.publisher != ZMQ_PUBLISHER:
            raise ValueError(f"kv_events_config publisher must be {ZMQ_PUBLISHER!r}")
        return config


END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Publishes the events of each scheduler step as one batch on a ZeroMQ PUB socket.

    With a replay endpoint, a subscriber that missed batches (it joined late, or saw a gap
    in the sequence numbers) sends the first sequence number it wants, 8 bytes big-endian,
    to a ROUTER socket, and gets `[sequence, payload]` for each batch still buffered from
    there on, then `[-1, b""]`, as vLLM's publisher answers."""

    def __init__(self, config: KVEventsConfig, ctx):
        import zmq

        self.zmq = zmq
        self.socket = ctx.socket(zmq.PUB)
        self.socket.bind(config.endpoint)
        self.replay = None
        if config.replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.topic = config.topic.encode()
        self.sequence = 0
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVEvent]) -> None:
        """Send this turn's events (if any) and answer waiting replay requests."""
        if events:
            payload = self.encoder.encode(KVEventBatch(time.time(), events))
            self.socket.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), payload])
            self.buffer.append((self.sequence, payload))
            self.sequence += 1
        if self.replay is not None:
            self._answer_replays()

    def _answer_replays(self) -> None:
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            client, start = (
                frames[0],
                int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0,
            )
            for sequence, payload in self.buffer:
                if sequence >= start:
                    self.replay.send_multipart([client, b"", sequence.to_bytes(8, "big"), payload])
            self.replay.send_multipart([client, b"", END_OF_REPLAY, b""])
