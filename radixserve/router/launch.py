"""Runs the router (`radixserve router`), and N replicas behind it (`radixserve serve --dp-size
N`)."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Callable

import uvicorn

from ..config import ServerArgs
from ..server.launch import GracefulServer
from .app import create_router_app
from .config import RouterArgs
from .pd import PDRouter
from .proxy import Router

log = logging.getLogger("radixserve.router")
REPLICA_READY_TIMEOUT_S = 900.0
MAX_REPLICA_RESTARTS = (
    3  # per replica; a replica that keeps dying stays down (the router routes around it)
)


def run_router(args: RouterArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    router = PDRouter(args) if args.pd_disaggregation else Router(args)
    app = create_router_app(router)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        log.info(
            "routing to %d worker(s) with %s on http://%s:%d",
            len(router.workers),
            args.policy,
            args.host,
            args.port,
        )
        yield
        await router.stop()

    app.router.lifespan_context = lifespan
    server = GracefulServer(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2
        )
    )
    server.run()
    return 0 if server.started else 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_args(server: ServerArgs, index: int, dp_size: int, kv_events: bool) -> ServerArgs:
    """Replica `index`: loopback on a free port, its share of the CPU threads, its own request
    log folder, and with `kv_events` its own KV event endpoint."""
    threads = server.engine.num_threads or os.cpu_count() or 1
    engine = server.engine.with_(num_threads=max(1, threads // dp_size))
    if engine.log_requests is not None:
        engine = engine.with_(log_requests=str(Path(engine.log_requests) / f"replica-{index}"))
    if kv_events:
        engine = engine.with_(
            kv_events_config=json.dumps(
                {"endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv"}
            )
        )
    return replace(server, host="127.0.0.1", port=free_port(), engine=engine, dp_size=1)


def place_replica(rank: int, dp_size: int, tp_size: int) -> None:
    """Give replica `rank` its own devices: GPUs rank*tp_size.. when there are enough and none
    were chosen, else its share of the CPU cores (its processes inherit the affinity)."""
    import torch

    if torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        if torch.cuda.device_count() >= dp_size * tp_size:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(rank * tp_size + i) for i in range(tp_size)
            )
        return
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // dp_size
    if share:
        os.sched_setaffinity(0, cores[rank * share : (rank + 1) * share])


def _run_replica(args: ServerArgs, rank: int, dp_size: int) -> None:
    from ..ipc import exit_with_parent
    from ..server.launch import launch_server

    exit_with_parent()
    place_replica(rank, dp_size, args.engine.tp_size)
    raise SystemExit(launch_server(args))


def wait_replicas(urls: list[str], procs: list[mp.Process]) -> None:
    deadline = time.time() + REPLICA_READY_TIMEOUT_S
    pending = set(urls)
    while pending:
        for url, proc in zip(urls, procs):
            if not proc.is_alive():
                raise RuntimeError(
                    f"replica {url} exited during start-up (exit code {proc.exitcode})"
                )
        for url in list(pending):
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=1):
                pending.discard(url)  # urlopen raises on anything but a 2xx
        if time.time() > deadline:
            raise TimeoutError(f"replicas {sorted(pending)} did not become ready in time")
        time.sleep(0.5)


class ReplicaSupervisor(threading.Thread):
    """Starts a replica again, on the same port, when it dies abnormally (a crash, an OOM kill,
    its watchdog): the router's health checks then bring it back. A replica that exits cleanly
    or on SIGTERM is being stopped and stays stopped, as do all once `stopping` is set."""

    def __init__(self, procs: list[mp.Process], start: Callable[[int], mp.Process]):
        super().__init__(name="radixserve-replica-supervisor", daemon=True)
        self.procs, self.start_replica = procs, start
        self.restarts = [0] * len(procs)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(1.0):
            for i, proc in enumerate(self.procs):
                if (
                    proc.is_alive()
                    or proc.exitcode in (0, -signal.SIGTERM)
                    or self.restarts[i] >= MAX_REPLICA_RESTARTS
                ):
                    continue
                self.restarts[i] += 1
                log.warning(
                    "replica %d exited with code %s; starting it again (restart %d of %d)",
                    i,
                    proc.exitcode,
                    self.restarts[i],
                    MAX_REPLICA_RESTARTS,
                )
                self.procs[i] = self.start_replica(i)


def launch_data_parallel(server: ServerArgs, dp_size: int, router: RouterArgs) -> int:
    """`dp_size` replicas of `server`, each a whole radixserve server, behind a router on
    `server`'s address; the replicas stop with the router."""
    logging.basicConfig(
        level=server.engine.log_level.upper(), format="%(asctime)s %(name)s: %(message)s"
    )
    replicas = [replica_args(server, i, dp_size, router.kv_events) for i in range(dp_size)]
    ctx = mp.get_context("spawn")

    def start_replica(i: int) -> mp.Process:
        proc = ctx.Process(
            target=_run_replica, args=(replicas[i], i, dp_size), name=f"radixserve-replica-{i}"
        )
        proc.start()
        return proc

    procs = [start_replica(i) for i in range(dp_size)]
    urls = [f"http://127.0.0.1:{r.port}" for r in replicas]
    supervisor = ReplicaSupervisor(procs, start_replica)
    try:
        wait_replicas(urls, procs)
        log.info("%d replicas ready: %s", dp_size, ", ".join(urls))
        supervisor.start()
        tokenizer = router.tokenizer_path
        if router.kv_events and tokenizer is None:
            from ..models.source import resolve_model

            tokenizer = str(resolve_model(server.engine.model).tokenizer_dir)
        return run_router(
            replace(
                router,
                host=server.host,
                port=server.port,
                api_key=server.api_key,
                worker_urls=tuple(urls),
                tokenizer_path=tokenizer,
            )
        )
    except (RuntimeError, TimeoutError) as exc:
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        supervisor.stopping.set()
        if supervisor.is_alive():
            supervisor.join()
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
