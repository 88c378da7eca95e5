"""KV events of a real server, as Dynamo and llm-d read them: a subscriber rebuilds the
replica's cached block set from BlockStored / BlockRemoved / AllBlocksCleared alone, and it
matches the server's own count of cached slots through inserts, evictions and a flush."""

import time

import httpx
import msgspec
import pytest
import zmq
from server_utils import free_port, start_server, wait_idle

from radixserve.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    port, replay_port = free_port(), free_port()
    config = (
        f'{{"endpoint": "tcp://127.0.0.1:{port}", "topic": "kv", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", "buffer_steps": 1000}}'
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    srv = start_server(
        tmp_path_factory.mktemp("kv_events"),
        "--max-total-tokens",
        "1024",
        "--kv-events-config",
        config,
    )
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        client.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        yield client, sub
    sub.close()
    ctx.term()
    assert srv.stop() == 0, srv.log()


class Mirror:
    """The block set a router keeps from the events."""

    def __init__(self):
        self.blocks: dict[int, int] = {}  # hash -> tokens in the block
        self.sequence = -1
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def drain(self, sub, quiet: float = 0.5) -> None:
        deadline = time.time() + quiet
        while time.time() < deadline:
            if not sub.poll(50):
                continue
            topic, sequence, payload = sub.recv_multipart()
            assert topic == b"kv"
            number = int.from_bytes(sequence, "big")
            assert number == self.sequence + 1, "a batch was lost or reordered"
            self.sequence = number
            for event in self.decoder.decode(payload).events:
                self.apply(event)
            deadline = time.time() + quiet

    def apply(self, event) -> None:
        if isinstance(event, BlockStored):
            assert len(event.block_hashes) * event.block_size == len(event.token_ids)
            assert event.parent_block_hash is None or event.parent_block_hash in self.blocks
            for h in event.block_hashes:
                assert h not in self.blocks
                self.blocks[h] = event.block_size
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del self.blocks[h]
        else:
            assert isinstance(event, AllBlocksCleared)
            self.blocks.clear()

    def cached_tokens(self) -> int:
        return sum(self.blocks.values())


def generate(client, text: str, tokens: int = 8) -> None:
    r = client.post(
        "/generate",
        json={"text": text, "sampling_params": {"max_new_tokens": tokens, "temperature": 0}},
    )
    assert r.status_code == 200, r.text


def test_a_subscriber_rebuilds_the_cached_block_set(replica):
    client, sub = replica
    mirror = Mirror()
    shared = "You are a careful assistant. Answer briefly and precisely. " * 3
    for i in range(4):  # a shared prefix, then branches: stores and splits
        generate(client, shared + f"Question {i}: what is {i} + {i}?")
    stats = wait_idle(client)
    mirror.drain(sub)
    assert mirror.cached_tokens() == stats["cached_slots"] > 0
    for i in range(12):  # unshared prompts overflow the 1024-slot pool: evictions
        generate(client, f"Story {i}: " + " ".join(f"w{i}x{j}" for j in range(60)), tokens=16)
    stats = wait_idle(client)
    mirror.drain(sub)
    assert mirror.cached_tokens() == stats["cached_slots"]
    assert client.post("/flush_cache").status_code == 200
    stats = wait_idle(client)
    mirror.drain(sub)
    assert mirror.blocks == {} and stats["cached_slots"] == 0


def test_a_late_subscriber_catches_up_through_replay(replica):
    """A subscriber that joins after the fact asks the replay socket for every batch from 0
    and rebuilds the same block set as the server holds."""
    client, _ = replica
    generate(client, "A late subscriber needs the history. " * 4)
    stats = wait_idle(client)
    time.sleep(0.6)  # the idle scheduler answers replays each turn (at least every 0.5 s)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(client.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    mirror, sequences = Mirror(), []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, sequence, payload = dealer.recv_multipart()
        if not payload:
            assert int.from_bytes(sequence, "big", signed=True) == -1
            break
        sequences.append(int.from_bytes(sequence, "big"))
        for event in mirror.decoder.decode(payload).events:
            mirror.apply(event)
    dealer.close(linger=0)
    assert sequences == list(range(len(sequences))) and sequences
    assert mirror.cached_tokens() == stats["cached_slots"] > 0


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"hwm": 10}', "hwm"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"endpoint": 5}', "endpoint"),
        ('{"publisher": "nats"}', "publisher"),
        ("[1]", "JSON object"),
    ],
)
def test_unsupported_configs_are_refused_by_name(text, needle):
    with pytest.raises(ValueError, match=needle):
        KVEventsConfig.from_json(text)
