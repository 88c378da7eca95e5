"""The router's core: its workers, their health, and forwarding with retries.

A request is retried on another worker when it fails before its first byte reached the
client: the worker could not be reached, the connection broke before the response began,
or the worker answered 502, 503 or 504 (unavailable, full, or shutting down). Other answers,
4xx included, pass through as they are. Once streaming has begun a failure ends the stream
(with an error event when it is server-sent events).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import httpx
import orjson

from ..config import RouterArgs, worker_url_problem
from ..server.api import error_body
from .keys import routing_key
from .policies import CacheAware, Policy, make_policy
from .workers import CircuitBreaker, Worker

log = logging.getLogger("radixserve.router")
RETRYABLE_STATUS = (502, 503, 504)
FORWARDED_REQUEST_HEADERS = ("content-type", "authorization", "accept")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after")
WORKER_HEADER = "x-radixserve-worker"


class RouterError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Upstream:
    """A worker's response whose headers have arrived; its body is still to be relayed."""

    worker: Worker
    response: httpx.Response


@dataclass
class Failure:
    status: int
    body: bytes
    headers: dict[str, str]


class Router:
    def __init__(self, args: RouterArgs, client: httpx.AsyncClient):
        self.args = args
        self.client = client
        self.policy: Policy = make_policy(args)
        self.workers: dict[str, Worker] = {}
        self.retries = 0
        self.unroutable = 0
        self.checking: set[str] = set()  # workers with an out-of-turn health check running
        for url in args.worker_urls:
            self._add(url)

    # -- workers ---------------------------------------------------------------------------

    def _add(self, url: str) -> Worker:
        breaker = CircuitBreaker(self.args.cb_failure_threshold, self.args.cb_success_threshold,
                                 self.args.cb_timeout_duration_secs)
        worker = self.workers[url] = Worker(url.rstrip("/"), breaker)
        return worker

    async def add_worker(self, url: str | None) -> Worker:
        if not url:
            raise RouterError("query parameter 'url' is required")
        if (problem := worker_url_problem(url)) is not None:
            raise RouterError(f"url: {problem}")
        url = url.rstrip("/")
        if url in self.workers:
            raise RouterError(f"url: worker {url} is already routed to")
        worker = self._add(url)
        await self.check(worker)
        log.info("added worker %s (%s)", url, "healthy" if worker.healthy else worker.last_problem)
        return worker

    def remove_worker(self, url: str | None) -> None:
        worker = self.workers.pop((url or "").rstrip("/"), None)
        if worker is None:
            raise RouterError(f"url: no worker {url!r}", 404)
        self.policy.forget(worker.url)
        log.info("removed worker %s", worker.url)

    def available(self, exclude: set[str] = frozenset()) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.url not in exclude and w.available(now)]

    # -- health ----------------------------------------------------------------------------

    async def check(self, worker: Worker) -> None:
        try:
            reply = await self.client.get(worker.url + "/health", timeout=self.args.health_check_timeout_secs)
            problem = None if reply.status_code == 200 else f"/health answered {reply.status_code}"
            fatal = False
        except httpx.HTTPError as exc:
            problem, fatal = f"/health failed: {type(exc).__name__}", isinstance(exc, httpx.ConnectError)
        if problem is None:
            if not worker.healthy:
                log.info("worker %s is healthy again", worker.url)
            worker.healthy, worker.failed_checks, worker.last_problem = True, 0, ""
            return
        worker.failed_checks += 1
        worker.last_problem = problem
        if worker.healthy and (fatal or worker.failed_checks >= self.args.health_failure_threshold):
            self._mark_dead(worker, problem)

    def _spawn_check(self, worker: Worker) -> None:
        if worker.healthy and worker.url not in self.checking:
            self.checking.add(worker.url)
            task = asyncio.create_task(self.check(worker))
            task.add_done_callback(lambda _: self.checking.discard(worker.url))

    def _mark_dead(self, worker: Worker, problem: str) -> None:
        worker.healthy, worker.last_problem = False, problem
        log.warning("worker %s is down: %s", worker.url, problem)

    async def check_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.args.health_check_interval_secs)

    async def evict_forever(self) -> None:
        if not isinstance(self.policy, CacheAware):
            return
        while True:
            await asyncio.sleep(self.args.eviction_interval_secs)
            self.policy.evict()

    # -- forwarding ------------------------------------------------------------------------

    async def open(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Upstream | Failure:
        """Send the request to a worker the policy picks, retrying elsewhere on failures before
        the first byte; the last failure when every try failed."""
        key = routing_key(path, body) if method == "POST" else ""
        tried: set[str] = set()
        failure = Failure(503, b"", {})
        for attempt in range(1 + self.args.retry_max_retries):
            candidates = self.available(tried)
            if not candidates:
                break
            if attempt:
                self.retries += 1
            worker = self.policy.pick(candidates, key)
            tried.add(worker.url)
            outcome = await self._try(worker, method, path, body, headers)
            if isinstance(outcome, Upstream):
                return outcome
            failure = outcome
        if not failure.body:
            self.unroutable += 1
            message = "no healthy worker could take the request" + (f" (tried {sorted(tried)})" if tried else "")
            failure.body = orjson.dumps(error_body(message, 503))
            failure.headers = {"content-type": "application/json"}
        return failure

    async def _try(self, worker: Worker, method: str, path: str, body: bytes,
                   headers: dict[str, str]) -> Upstream | Failure:
        worker.in_flight += 1
        worker.routed += 1
        request = self.client.build_request(method, worker.url + path, content=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            worker.in_flight -= 1
            self._failed(worker, f"{type(exc).__name__} before the response began",
                         dead=isinstance(exc, httpx.ConnectError))
            if isinstance(exc, httpx.TransportError):  # a broken connection: is the worker still there?
                self._spawn_check(worker)
            return Failure(503, b"", {})
        if response.status_code in RETRYABLE_STATUS:
            try:
                content = await response.aread()
            except httpx.HTTPError:
                content = b""
            await response.aclose()
            worker.in_flight -= 1
            self._failed(worker, f"answered {response.status_code}")
            return Failure(response.status_code, content, relayed_headers(response))
        if response.status_code >= 500:
            worker.errors += 1
        else:
            worker.breaker.record_success()
        return Upstream(worker, response)

    def _failed(self, worker: Worker, problem: str, dead: bool = False) -> None:
        worker.errors += 1
        worker.last_problem = problem
        worker.breaker.record_failure(time.monotonic())
        if dead and worker.healthy:
            self._mark_dead(worker, problem)

    async def relay(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """The worker's body, chunk by chunk; closing this (a client that went away) closes
        the worker's response, which aborts the request there."""
        worker, response = upstream.worker, upstream.response
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            self._failed(worker, f"{type(exc).__name__} while streaming")
            self._spawn_check(worker)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                message = f"the worker serving this request failed mid-stream ({type(exc).__name__})"
                yield b"data: " + orjson.dumps(error_body(message, 502)) + b"\n\ndata: [DONE]\n\n"
        finally:
            worker.in_flight -= 1
            await response.aclose()

    async def broadcast(self, method: str, path: str, headers: dict[str, str]) -> dict[str, httpx.Response | str]:
        """The same call to every healthy worker: each worker's response, or why it failed."""
        async def call(worker: Worker):
            try:
                return await self.client.request(method, worker.url + path, headers=headers,
                                                 timeout=self.args.health_check_timeout_secs)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
        workers = self.available()
        replies = await asyncio.gather(*(call(w) for w in workers))
        return {w.url: r for w, r in zip(workers, replies)}


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k in FORWARDED_RESPONSE_HEADERS}


def forwarded_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}

