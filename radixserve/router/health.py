"""The router's workers and their health: the pool of `Worker`s by URL, periodic and
out-of-turn `/health` checks, failures that trip a worker's circuit breaker or mark it dead."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .config import RouterArgs
from .workers import CircuitBreaker, Worker

log = logging.getLogger("radixserve.router")


class WorkerPool:
    def __init__(self, args: RouterArgs):
        self.args = args
        self.session: aiohttp.ClientSession | None = None  # the router's, once it started
        self.workers: dict[str, Worker] = {}
        self.checking: set[str] = set()  # workers with an out-of-turn health check running
        for url in args.worker_urls:
            self.add(url)

    def add(self, url: str) -> Worker:
        breaker = CircuitBreaker(
            self.args.cb_failure_threshold,
            self.args.cb_success_threshold,
            self.args.cb_timeout_duration_secs,
        )
        url = url.rstrip("/")
        worker = self.workers[url] = Worker(url, breaker)
        return worker

    def remove(self, url: str) -> Worker | None:
        return self.workers.pop(url.rstrip("/"), None)

    def available(self, exclude: set[str] = frozenset()) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.url not in exclude and w.available(now)]

    async def check(self, worker: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.args.health_check_timeout_secs)
        fatal = False
        try:
            async with self.session.get(worker.url + "/health", timeout=timeout) as reply:
                problem = None if reply.status == 200 else f"/health answered {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem, fatal = (
                f"/health failed: {type(exc).__name__}",
                isinstance(exc, aiohttp.ClientConnectorError),
            )
        if problem is None:
            if not worker.healthy:
                log.info("worker %s is healthy again", worker.url)
            worker.healthy, worker.failed_checks, worker.last_problem = True, 0, ""
            return
        worker.failed_checks += 1
        worker.last_problem = problem
        if worker.healthy and (fatal or worker.failed_checks >= self.args.health_failure_threshold):
            self.mark_dead(worker, problem)

    def spawn_check(self, worker: Worker) -> None:
        """An out-of-turn check after a broken connection: is the worker still there?"""
        if worker.healthy and worker.url not in self.checking:
            self.checking.add(worker.url)
            task = asyncio.create_task(self.check(worker))
            task.add_done_callback(lambda _: self.checking.discard(worker.url))

    def mark_dead(self, worker: Worker, problem: str) -> None:
        worker.healthy, worker.last_problem = False, problem
        log.warning("worker %s is down: %s", worker.url, problem)

    def failed(self, worker: Worker, problem: str, dead: bool = False) -> None:
        worker.errors += 1
        worker.last_problem = problem
        worker.breaker.record_failure(time.monotonic())
        if dead and worker.healthy:
            self.mark_dead(worker, problem)

    async def check_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.args.health_check_interval_secs)
