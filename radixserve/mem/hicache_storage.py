"""The hierarchical cache's storage tier (L3): a folder of block files that outlives the
server and is shared by the servers of one machine, written by a background thread. A block
file carries its token ids and a checksum: a corrupt, truncated or foreign file is a miss
(logged and deleted), never served."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
MAGIC = b"RSKVBLK1"
HEADER = struct.Struct("<8s8sQIQ8s")  # magic, fingerprint, hash, tokens, payload bytes, checksum
WRITE_QUEUE_BLOCKS = 256  # blocks waiting for the storage writer; more are dropped (counted)


@dataclass
class TierStats:
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    loaded_tokens: int = 0
    load_seconds: float = 0.0
    loaded_bytes: int = 0
    backed_up_tokens: int = 0
    backed_up_bytes: int = 0
    storage_written_blocks: int = 0
    storage_skipped_blocks: int = 0  # disk full (or past the writer's queue)
    storage_bad_blocks: int = 0  # corrupt, truncated or foreign files found on a read
    load_timeouts: int = 0


class FileStore:
    """L3: one file per block under `folder/<fingerprint>/`, written atomically (a temporary
    file renamed into place), so servers sharing the folder never read half a block."""

    def __init__(
        self, folder: str, fingerprint_hex: str, stats: TierStats, min_free_bytes: int = 1 << 30
    ):
        self.folder = Path(folder) / fingerprint_hex
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fingerprint = bytes.fromhex(fingerprint_hex)
        self.stats = stats
        self.min_free_bytes = min_free_bytes
        self.pending: queue.Queue = queue.Queue(WRITE_QUEUE_BLOCKS)
        self.writer = threading.Thread(
            target=self._write_forever, daemon=True, name="hicache-writer"
        )
        self.writer.start()

    def path(self, h: int) -> Path:
        name = f"{h:016x}"
        return self.folder / name[:2] / f"{name}.kv"

    def contains(self, h: int) -> bool:
        return self.path(h).exists()

    def put(self, h: int, tokens: list[int], payload: bytes) -> None:
        """Queue a block for writing; dropped (and counted) when the writer is behind."""
        try:
            self.pending.put_nowait((h, tokens, payload))
        except queue.Full:
            self.stats.storage_skipped_blocks += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the queued blocks are written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_forever(self) -> None:
        while True:
            h, tokens, payload = self.pending.get()
            try:
                self.write(h, tokens, payload)
            finally:
                self.pending.task_done()

    def write(self, h: int, tokens: list[int], payload: bytes) -> bool:
        path = self.path(h)
        if path.exists():
            return True
        ids = struct.pack(f"<{len(tokens)}I", *tokens)
        header = HEADER.pack(
            MAGIC, self.fingerprint, h, len(tokens), len(payload), _checksum(ids, payload)
        )
        try:
            path.parent.mkdir(exist_ok=True)
            if shutil.disk_usage(path.parent).free < self.min_free_bytes + len(payload):
                raise OSError("the disk is (nearly) full")
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(header + ids + payload)
            os.replace(tmp, path)
        except OSError as exc:
            self.stats.storage_skipped_blocks += 1
            log.warning("hicache: block %016x not written to storage: %s", h, exc)
            return False
        self.stats.storage_written_blocks += 1
        return True

    def read(self, h: int, tokens: list[int], payload_bytes: int | None) -> bytes | None:
        """The block's payload, or None when it is missing or fails a check (then it is deleted).
        `payload_bytes`: its size (None: any, as its header says)."""
        path = self.path(h)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        problem = self._problem(data, h, tokens, payload_bytes)
        if problem is None:
            return data[HEADER.size + 4 * len(tokens) :]
        self.stats.storage_bad_blocks += 1
        log.warning("hicache: block file %s is unusable (%s); recomputing it", path, problem)
        path.unlink(missing_ok=True)
        return None

    def _problem(
        self, data: bytes, h: int, tokens: list[int], payload_bytes: int | None
    ) -> str | None:
        if len(data) < HEADER.size:
            return "truncated header"
        magic, fp, stored_hash, n, size, checksum = HEADER.unpack_from(data)
        if magic != MAGIC or fp != self.fingerprint or stored_hash != h:
            return "not this model's block"
        if payload_bytes is not None and size != payload_bytes:
            return "wrong size"
        if n != len(tokens) or len(data) != HEADER.size + 4 * n + size:
            return "truncated or wrong size"
        ids = data[HEADER.size : HEADER.size + 4 * n]
        if ids != struct.pack(f"<{n}I", *tokens):
            return "other tokens (hash collision)"
        if _checksum(ids, data[HEADER.size + 4 * n :]) != checksum:
            return "checksum mismatch"
        return None


def _checksum(ids: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(ids, digest_size=8)
    digest.update(payload)
    return digest.digest()
