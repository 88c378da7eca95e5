"""The request log behind cache sizing (`--log-requests DIR`): one JSON line per finished request.

`DIR/requests.jsonl` is the newest file; it rotates by size into `requests.jsonl.1` .. `.N`
(older numbers are older; logging's RotatingFileHandler does the rotation). `DIR/server.json`
records what the server ran with (KV pool size, page size, eviction policy, log level), so that
`radixserve replay DIR` replays the server's own setting by default. Under `--dp-size` each
replica logs into `DIR/replica-<i>`.

Level `full` stores prompt and output token ids. Level `hashes` stores only a chain of block
hashes over the request's tokens (each 16-token block's hash covers every token before it, as
KV-event block hashes do): prefixes can be compared, no text can be recovered. A salted
request's chain starts from its salt (as in KV events), and its record names the salt's hash,
so a replay never lets two salts share a prefix.
"""

from __future__ import annotations

import logging
import logging.handlers
import time
from pathlib import Path
from typing import Protocol, Sequence

import msgspec

from .kv_events import chain_hashes, salt_hash, salted_parent

HASH_BLOCK = 16  # tokens per hashed block at level `hashes`
LOG_NAME = "requests.jsonl"
SERVER_FILE = "server.json"
MAX_FILE_BYTES = 64 << 20
KEPT_FILES = 8


class ServerRecord(msgspec.Struct, frozen=True):
    """The cache setting the log was recorded under."""

    cache_tokens: int  # KV pool slots
    page_size: int
    eviction_policy: str
    level: str
    started: float  # unix seconds
    hash_block: int = HASH_BLOCK
    chunk_tokens: int = 0  # --chunked-prefill-size
    state_snapshots: int = 0  # a hybrid model's snapshot slots (0: not a hybrid model)
    state_interval: int = 0  # a hybrid model: its snapshots' --mamba-track-interval
    state_layer_tokens: int = 0  # ... tokens whose KV in one layer is worth one layer's state


class RequestRecord(msgspec.Struct, frozen=True):
    rid: str
    arrival: float  # unix seconds
    admitted: bool  # False: finished (aborted) before it ever reached the cache
    queue_time: float  # seconds from arrival to (first) admission
    latency: float  # seconds from arrival to finish, as the scheduler saw it
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the radix cache held at admission
    finish_reason: str
    prompt_ids: list[int] | None = None  # level full
    output_ids: list[int] | None = None  # level full
    block_hashes: list[int] | None = None  # level hashes: over prompt + output, whole blocks only
    salt: int | None = None  # a salted request's `kv_events.salt_hash` (never the salt itself)


class LoggedRequest(Protocol):
    """What the log reads of a finished request (the scheduler's `Req`)."""

    rid: str
    arrival: float  # time.monotonic() at arrival
    admitted: bool
    queue_time: float
    input_ids: Sequence[int]
    output_ids: Sequence[int]
    cached_tokens: int
    cache_salt: str | None


class RequestLog:
    """Appends finished requests to the rotating log of one server."""

    def __init__(self, folder: str | Path, level: str, server: ServerRecord):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.level = level
        (self.folder / SERVER_FILE).write_bytes(msgspec.json.encode(server))
        self.handler = logging.handlers.RotatingFileHandler(
            self.folder / LOG_NAME,
            maxBytes=MAX_FILE_BYTES,
            backupCount=KEPT_FILES,
            encoding="utf-8",
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, req: LoggedRequest, finish_reason: str) -> None:
        now = time.monotonic()
        full = self.level == "full"
        record = RequestRecord(
            req.rid,
            time.time() - (now - req.arrival),
            req.admitted,
            req.queue_time,
            now - req.arrival,
            len(req.input_ids),
            len(req.output_ids),
            req.cached_tokens,
            finish_reason,
            prompt_ids=list(req.input_ids) if full else None,
            output_ids=list(req.output_ids) if full else None,
            block_hashes=None
            if full
            else chain_hashes(
                [*req.input_ids, *req.output_ids], HASH_BLOCK, salted_parent(None, req.cache_salt)
            ),
            salt=None if req.cache_salt is None else salt_hash(req.cache_salt),
        )
        self.handler.emit(logging.makeLogRecord({"msg": msgspec.json.encode(record).decode()}))

    def close(self) -> None:
        self.handler.close()


def read_log(folder: str | Path) -> tuple[list[ServerRecord], list[RequestRecord]]:
    """Each replica's server record (one without --dp-size) and every request of a log folder,
    replicas merged, by arrival."""
    folder = Path(folder)
    replicas = sorted(p for p in folder.glob("replica-*") if p.is_dir())
    parts = [_read_one(p) for p in replicas] if replicas else [_read_one(folder)]
    return [server for server, _ in parts], sorted(
        (r for _, rs in parts for r in rs), key=lambda r: r.arrival
    )


def _read_one(folder: Path) -> tuple[ServerRecord, list[RequestRecord]]:
    server_file = folder / SERVER_FILE
    if not server_file.is_file():
        raise FileNotFoundError(
            f"{folder} is not a request log folder (no {SERVER_FILE}); "
            "record one with `radixserve serve --log-requests DIR`"
        )
    server = msgspec.json.decode(server_file.read_bytes(), type=ServerRecord)
    files = sorted(folder.glob(LOG_NAME + ".*"), key=lambda p: -int(p.suffix[1:])) + [
        folder / LOG_NAME
    ]
    decoder = msgspec.json.Decoder(RequestRecord)
    records = [
        decoder.decode(line)
        for f in files
        if f.is_file()
        for line in f.read_bytes().splitlines()
        if line.strip()
    ]
    return server, records
