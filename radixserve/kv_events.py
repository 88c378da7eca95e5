"""KV cache events for existing KV-aware routers (NVIDIA Dynamo, llm-d), published as vLLM
and SGLang publish them (`--kv-events-config`).

Wire format: ZeroMQ PUB multipart `[topic, sequence number (8 bytes, big endian), payload]`;
the payload is a msgpack array `[ts, [event, ...]]` whose events are arrays led by their type:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size]`,
`["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]` (trailing fields left at their
defaults are omitted, as msgspec does for vLLM). A block is one page of the radix cache; its
hash chains its parent block's, so one hash names the whole prefix up to its page.
"""
from __future__ import annotations

import hashlib
import json
import time
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


@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config` as JSON, with vLLM's key names; keys radixserve does not
    implement (replay_endpoint, buffer_steps, ...) are refused by name."""

    endpoint: str = "tcp://*:5557"
    topic: str = ""
    publisher: str = ZMQ_PUBLISHER

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            given = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("kv_events_config must be a JSON object")
        given.pop("enable_kv_cache_events", None)
        unknown = sorted(set(given) - {"endpoint", "topic", "publisher"})
        if unknown:
            raise ValueError(f"kv_events_config keys {unknown} are not supported by radixserve")
        config = cls(**given)
        if config.publisher != ZMQ_PUBLISHER:
            raise ValueError(f"kv_events_config publisher must be {ZMQ_PUBLISHER!r}")
        return config


class KVEventPublisher:
    """Publishes the events of each scheduler step as one batch on a ZeroMQ PUB socket."""

    def __init__(self, config: KVEventsConfig, ctx):
        import zmq

        self.socket = ctx.socket(zmq.PUB)
        self.socket.bind(config.endpoint)
        self.topic = config.topic.encode()
        self.sequence = 0
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = self.encoder.encode(KVEventBatch(time.time(), events))
        self.socket.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), payload])
        self.sequence += 1
