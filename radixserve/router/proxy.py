"""The router's core: its workers, their health, and forwarding with retries.

A request is retried on another worker when it fails before its first byte reached the
client: the worker could not be reached, the connection broke before the whole answer came
(or, for a stream, before its headers), or the worker answered 502, 503 or 504 (unavailable,
full, or shutting down). Other answers, 4xx included, pass through as they are. Whole answers
are read, then sent on; server-sent events are relayed as they come, and a failure once they
have begun ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import orjson

from ..server.http import RequestError, error_body
from .config import RouterArgs, worker_url_problem
from .following import EventFollowers
from .health import WorkerPool
from .keys import routing_key, token_key
from .kv_index import KVEventIndex
from .policies import CacheAware, Policy, make_policy
from .workers import Worker

log = logging.getLogger("radixserve.router")
RETRYABLE_STATUS = (502, 503, 504)
FORWARDED_REQUEST_HEADERS = ("content-type", "authorization", "accept")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after")
WORKER_HEADER = "x-radixserve-worker"
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Answer:
    """A whole response: a worker's, or the router's own when no worker could answer."""

    status: int
    headers: dict[str, str]
    body: bytes
    worker: Worker | None = None


@dataclass
class Stream:
    """A worker's server-sent events whose headers have arrived; the events are still to come."""

    worker: Worker
    response: aiohttp.ClientResponse


class Router:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.session: aiohttp.ClientSession | None = None  # made by start(), inside the event loop
        self.tasks: list[asyncio.Task] = []
        self.index = KVEventIndex() if args.kv_events else None
        self.policy: Policy = (
            CacheAware(args, self.index) if self.index is not None else make_policy(args)
        )
        self.tokenizer = None  # with kv_events, to compute the token ids the index is keyed by
        self.adapters: set[str] = set()  # the workers' LoRA adapters' names (their /v1/models)
        self.followers = (
            EventFollowers(self.index, self._ask, self.adapters, args.health_check_interval_secs)
            if self.index is not None
            else None
        )
        self.pool = WorkerPool(args)
        self.workers = self.pool.workers
        self.retries = 0
        self.unroutable = 0

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self.args.request_timeout_secs
        )
        self.session = self.pool.session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        self.tasks = [
            asyncio.create_task(self.pool.check_forever()),
            asyncio.create_task(self.evict_forever()),
        ]
        if self.index is not None:
            self.tokenizer = await asyncio.to_thread(
                load_router_tokenizer, self.args.tokenizer_path
            )
            for worker in self.workers.values():
                self.followers.follow(worker)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.followers is not None:
            self.followers.stop()
        await self.session.close()

    def key_of(self, method: str, path: str, body: bytes) -> str:
        if method != "POST":
            return ""
        return (
            token_key(path, body, self.tokenizer, self.adapters)
            if self.tokenizer is not None
            else routing_key(path, body)
        )

    async def _ask(self, worker: Worker, path: str) -> tuple[int, bytes] | None:
        answer = (await self.broadcast("GET", path, self.auth_headers(), [worker])).get(worker.url)
        return (answer.status, answer.body) if isinstance(answer, Answer) else None

    def summaries(self) -> list[dict]:
        """Each worker's state; with KV events, the blocks it caches (None until followed)."""
        out = []
        for worker in self.workers.values():
            summary = worker.summary()
            if self.followers is not None:
                summary["kv_blocks"] = self.followers.blocks_of(worker.url)
            out.append(summary)
        return out

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}

    # -- workers ---------------------------------------------------------------------------

    async def add_worker(self, url: str | None) -> Worker:
        if not url:
            raise RequestError("query parameter 'url' is required")
        if (problem := worker_url_problem(url)) is not None:
            raise RequestError(f"url: {problem}")
        url = url.rstrip("/")
        if url in self.workers:
            raise RequestError(f"url: worker {url} is already routed to")
        worker = self.pool.add(url)
        await self.pool.check(worker)
        if self.followers is not None:
            self.followers.follow(worker)
        log.info("added worker %s (%s)", url, "healthy" if worker.healthy else worker.last_problem)
        return worker

    def remove_worker(self, url: str | None) -> None:
        worker = self.pool.remove(url or "")
        if worker is None:
            raise RequestError(f"url: no worker {url!r}", 404)
        self.policy.forget(worker.url)
        if self.followers is not None:
            self.followers.forget(worker.url)
        log.info("removed worker %s", worker.url)

    def available(self, exclude: set[str] = frozenset()) -> list[Worker]:
        return self.pool.available(exclude)

    async def evict_forever(self) -> None:
        if not isinstance(self.policy, CacheAware):
            return
        while True:
            await asyncio.sleep(self.args.eviction_interval_secs)
            self.policy.evict()

    # -- forwarding ------------------------------------------------------------------------

    async def owner_of(self, response_id: str, headers: dict[str, str]) -> Worker | None:
        """The worker that stored a Responses-API response (each replica keeps its own),
        asked in turn."""
        for worker in self.available(set()):
            try:
                url = f"{worker.url}/v1/responses/{response_id}"
                async with self.session.get(url, headers=headers) as response:
                    if response.status == 200:
                        return worker
            except (aiohttp.ClientError, TimeoutError):
                continue
        return None

    async def open(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        pinned: Worker | None = None,
    ) -> Answer | Stream:
        """Send the request to a worker the policy picks (or to `pinned`, the only one that can
        serve it), retrying elsewhere on failures before the first byte; the last failure when
        every try failed."""
        key = self.key_of(method, path, body)
        tried: set[str] = set()
        failure: Answer | None = None
        for attempt in range(1 + self.args.retry_max_retries):
            candidates = self.available(tried) if pinned is None else [pinned][: not tried]
            if not candidates:
                break
            if attempt:
                self.retries += 1
            worker = self.policy.pick(candidates, key)
            tried.add(worker.url)
            outcome = await self._try(worker, method, path, body, headers)
            if isinstance(outcome, Stream) or (
                outcome is not None and outcome.status not in RETRYABLE_STATUS
            ):
                return outcome
            failure = outcome or failure
        if failure is not None:
            return failure
        self.unroutable += 1
        message = "no healthy worker could take the request" + (
            f" (tried {sorted(tried)})" if tried else ""
        )
        return Answer(
            503, {"content-type": "application/json"}, orjson.dumps(error_body(message, 503))
        )

    async def _try(
        self, worker: Worker, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> Answer | Stream | None:
        """One try: a stream to relay, a whole answer, or None when no answer came."""
        worker.in_flight += 1
        worker.routed += 1
        try:
            response = await self.session.request(
                method, worker.url + path, data=body, headers=headers
            )
            streamed = is_event_stream(response) and response.status not in RETRYABLE_STATUS
            content = b"" if streamed else await response.read()
        except asyncio.CancelledError:  # given up by the caller (the PD router)
            worker.in_flight -= 1
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            worker.in_flight -= 1
            self.pool.failed(
                worker,
                f"{type(exc).__name__} before the response began",
                dead=isinstance(exc, aiohttp.ClientConnectorError),
            )
            self.pool.spawn_check(worker)  # a broken connection: is the worker still there?
            return None
        if streamed:
            worker.breaker.record_success()
            return Stream(worker, response)
        worker.in_flight -= 1
        response.release()
        if response.status in RETRYABLE_STATUS:
            self.pool.failed(worker, f"answered {response.status}")
        elif response.status >= 500:
            worker.errors += 1
        else:
            worker.breaker.record_success()
        return Answer(response.status, relayed_headers(response), content, worker)

    async def relay(self, stream: Stream) -> AsyncIterator[bytes]:
        """The worker's events as they come; closing this (a client that went away) closes the
        connection to the worker, which aborts the request there."""
        worker, response = stream.worker, stream.response
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.pool.failed(worker, f"{type(exc).__name__} while streaming")
            self.pool.spawn_check(worker)
            message = f"the worker serving this request failed mid-stream ({type(exc).__name__})"
            yield b"data: " + orjson.dumps(error_body(message, 502)) + b"\n\ndata: [DONE]\n\n"
        finally:
            worker.in_flight -= 1
            if response.content.at_eof():
                response.release()
            else:
                response.close()

    async def broadcast(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        workers: list[Worker] | None = None,
        body: bytes = b"",
        timeout_s: float | None = None,
    ) -> dict[str, Answer | str]:
        """The same call to each of `workers` (every healthy one by default): each worker's
        answer, or why it failed. `timeout_s` defaults to the health checks' timeout."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.args.health_check_timeout_secs)

        async def call(worker: Worker) -> Answer | str:
            try:
                async with self.session.request(
                    method, worker.url + path, headers=headers, data=body, timeout=timeout
                ) as r:
                    return Answer(r.status, relayed_headers(r), await r.read(), worker)
            except (aiohttp.ClientError, TimeoutError) as exc:
                return f"{type(exc).__name__}: {exc}"

        workers = self.available() if workers is None else workers
        replies = await asyncio.gather(*(call(w) for w in workers))
        return {w.url: r for w, r in zip(workers, replies)}


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def relayed_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {
        k.lower(): v for k, v in response.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS
    }


def forwarded_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}


def load_router_tokenizer(path: str | None) -> Any:
    """The tokenizer at `path`, else the bundled model's."""
    from ..models.source import resolve_model
    from ..tokenizer import load_tokenizer

    return load_tokenizer(Path(path) if path else resolve_model(None).tokenizer_dir)
