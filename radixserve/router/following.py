"""With `--kv-events`: per worker, a task that finds where the worker publishes its KV events
(its /get_server_info, asked until it answers) and applies them to the router's index, and
learns the worker's LoRA adapters (its /v1/models) for the routing keys."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import orjson

from .kv_index import KVEventIndex, events_endpoint, follow_events
from .workers import Worker

log = logging.getLogger("radixserve.router")

# asks a worker `GET path`: (status, body), or None when no answer came
Ask = Callable[[Worker, str], Awaitable[tuple[int, bytes] | None]]


class EventFollowers:
    def __init__(self, index: KVEventIndex, ask: Ask, adapters: set[str], retry_s: float):
        """`adapters`: the router's set of adapter names, which this fills in."""
        self.index, self.ask, self.adapters, self.retry_s = index, ask, adapters, retry_s
        self.tasks: dict[str, asyncio.Task] = {}
        self.following: set[str] = set()  # workers whose events are being applied

    def follow(self, worker: Worker) -> None:
        self.tasks[worker.url] = asyncio.create_task(self._follow(worker))

    def forget(self, url: str) -> None:
        if (task := self.tasks.pop(url, None)) is not None:
            task.cancel()

    def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    def blocks_of(self, url: str) -> int | None:
        """The blocks a worker caches, as its events say; None until it is followed."""
        return len(self.index.blocks.get(url, ())) if url in self.following else None

    async def _follow(self, worker: Worker) -> None:
        while (answer := await self.ask(worker, "/get_server_info")) is None or answer[0] != 200:
            await asyncio.sleep(self.retry_s)
        info = orjson.loads(answer[1])
        await self._learn_adapters(worker)
        if not info.get("kv_events_config"):
            worker.last_problem = "publishes no KV events (start it with --kv-events-config)"
            log.error("worker %s %s", worker.url, worker.last_problem)
            return
        if self.index.page_size not in (None, info["page_size"]):
            worker.last_problem = (
                f"page size {info['page_size']} differs from the others' {self.index.page_size}"
            )
            log.error("worker %s: %s; its events are ignored", worker.url, worker.last_problem)
            return
        self.index.page_size = info["page_size"]
        endpoint, topic = events_endpoint(info["kv_events_config"], urlsplit(worker.url).hostname)
        log.info("following the KV events of %s at %s", worker.url, endpoint)
        self.following.add(worker.url)
        try:
            await follow_events(self.index, worker.url, endpoint, topic)
        finally:
            self.following.discard(worker.url)

    async def _learn_adapters(self, worker: Worker) -> None:
        """The worker's start-up adapters: /v1/models lists them with their base as `parent`."""
        answer = await self.ask(worker, "/v1/models")
        if answer is not None and answer[0] == 200:
            models = orjson.loads(answer[1]).get("data", [])
            self.adapters |= {m["id"] for m in models if m.get("parent")}
