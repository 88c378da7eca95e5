"""Starts the processes (scheduler with TP rank 0, ranks > 0, detokenizer), serves HTTP, and
cleans up."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import uvicorn
import zmq

from ..config import EngineArgs, ServerArgs, refuse_problems
from ..detokenizer import run_detokenizer
from ..ipc import Endpoints, Heartbeat, pull_socket, recv_all
from ..messages import SchedulerReady
from ..models.option_support import model_problems
from ..models.registry import is_classifier
from ..models.source import resolve_draft_model, resolve_model
from ..multimodal.media import media_limits
from ..multimodal.spec import VisionSpec
from ..quant import quantization_problems
from ..tokenizer import load_tokenizer_or_none
from .api import Health, create_app
from .embeddings_api import EmbeddingSetup
from .images import ImageInputs
from .tokenizer_manager import TokenizerManager, api_inbox

log = logging.getLogger("radixserve")
READY_TIMEOUT_S = 900
HEALTH_STALL_S = 30.0  # /health turns 503 when the scheduler loop is stuck this long with work
DEATH_GRACE_S = (
    0.5  # after a child dies, time for the failed requests' errors to reach their clients
)
SCHEDULER_MAIN = "radixserve.scheduler.process:run_scheduler"
FOLLOWER_MAIN = "radixserve.worker.process:run_follower"  # a tensor-parallel rank > 0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would kill us
    before the children are stopped; we exit on our own terms instead. Once the server has
    stopped, further stop signals are ignored: restoring the default handler would let a
    second SIGTERM (a launcher stopping its replicas) cut the bounded clean-up short."""

    @contextlib.contextmanager
    def capture_signals(self):
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:
            ignore_stop_signals()


@dataclass
class Children:
    procs: dict[str, mp.Process]

    def first_dead(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return name, proc.exitcode
        return None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.time() + 5
        for proc in self.procs.values():
            proc.join(timeout=max(deadline - time.time(), 0.1))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)


REFUSED_EXIT_CODE = 2  # a child refused its input (a checkpoint, a flag): it said why, in a line


class StartupRefused(Exception):
    """A child refused to start and has printed the reason."""


def run_child(main: str, *args) -> None:
    """A spawned child's entry point, `module:function`: the child imports the model code (and
    torch) itself, so that the api process never does; it starts the children ~2.5 s sooner.
    Bad input (a ValueError or a missing file, e.g. a checkpoint's wrong tensor) ends it with one
    line on stderr, not a traceback."""
    module, function = main.split(":")
    try:
        getattr(importlib.import_module(module), function)(*args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixserve: {exc}", file=sys.stderr, flush=True)
        sys.exit(REFUSED_EXIT_CODE)


def start_children(
    args: ServerArgs, endpoints: Endpoints, tokenizer_dir, heartbeat: Heartbeat
) -> Children:
    ctx = mp.get_context("spawn")
    e = args.engine
    init_method = e.dist_init_method(endpoints.tp_init_file)
    procs = {
        "detokenizer": ctx.Process(
            target=run_detokenizer,
            args=(tokenizer_dir, endpoints, e.log_level),
            name="radixserve-detokenizer",
        ),
        **{
            f"worker (tp rank {rank})": ctx.Process(
                target=run_child,
                args=(FOLLOWER_MAIN, e, init_method, rank),
                name=f"radixserve-worker-tp{rank}",
            )
            for rank in e.local_tp_ranks()
            if rank > 0
        },
        "scheduler": ctx.Process(
            target=run_child,
            args=(SCHEDULER_MAIN, e, endpoints, heartbeat),
            name="radixserve-scheduler",
        ),
    }
    for proc in procs.values():
        proc.start()
    return Children(procs)


def wait_ready(endpoints: Endpoints, children: Children) -> SchedulerReady:
    ctx = zmq.Context()
    sock = pull_socket(ctx, endpoints.api_in, bind=True)
    try:
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            dead = children.first_dead()
            if dead and dead[1] == REFUSED_EXIT_CODE:
                raise StartupRefused()
            if dead:
                raise RuntimeError(
                    f"the {dead[0]} process died during start-up (exit code {dead[1]})"
                )
            for msg in recv_all(sock, 500):
                if isinstance(msg, SchedulerReady):
                    return msg
        raise TimeoutError("the scheduler did not become ready in time")
    finally:
        sock.close(linger=0)
        ctx.term()


def watch_children(
    children: Children,
    health: Health,
    server: uvicorn.Server,
    exit_code: list[int],
    on_death: Callable[[str], None],
) -> None:
    """When a child dies: go unhealthy, fail the requests in flight (`on_death`), give their
    clients a moment to receive the error, then shut down."""
    while not server.should_exit:
        dead = children.first_dead()
        if dead:
            health.healthy = False
            health.reason = f"the {dead[0]} process died (exit code {dead[1]})"
            log.error("%s; shutting down", health.reason)
            on_death(health.reason)
            time.sleep(DEATH_GRACE_S)
            exit_code[0] = 1
            server.should_exit = True
            return
        time.sleep(0.2)


def launch_server(args: ServerArgs) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a child dies (exit 1). On a node other
    than node 0, only this node's tensor-parallel ranks run."""
    logging.basicConfig(
        level=args.engine.log_level.upper(), format="%(asctime)s %(name)s: %(message)s"
    )
    if args.engine.node_rank > 0:
        return run_node_ranks(args.engine)
    started = time.time()
    source = resolve_model(args.engine.model)
    embedding = EmbeddingSetup.of(source) if args.is_embedding else None  # refused here
    if embedding is None and source.config.hf_config and is_classifier(source.config.hf_config):
        raise ValueError(
            f"{source.name} is a sequence classifier: serve it with --is-embedding "
            f"(for /v1/rerank and /v1/score)"
        )
    refuse_problems(
        "model",
        quantization_problems(
            source.config.hf_config, args.engine.quantization, args.engine.tp_size
        ),
    )
    refuse_problems("model", model_problems(source.config, args.engine))
    if args.engine.speculative_draft_model is not None:
        resolve_draft_model(
            args.engine.speculative_draft_model, source
        )  # refused here, before any child starts
    endpoints = Endpoints.create()
    heartbeat = Heartbeat(mp.get_context("spawn"))
    children = start_children(args, endpoints, source.tokenizer_dir, heartbeat)
    exit_code = [0]
    try:
        tokenizer = load_tokenizer_or_none(source.tokenizer_dir)  # while the children start
        ready = wait_ready(endpoints, children)
        tm = TokenizerManager(
            tokenizer,
            endpoints,
            ready,
            args.max_queued_requests,
            args.engine.enable_priority_scheduling,
            args.engine.disaggregation_mode,
        )
        spec = VisionSpec.of(source.config.hf_config, source.weights_dir)
        tm.images = ImageInputs(
            spec,
            args.media_policy(),
            media_limits(args.limit_mm_per_prompt),
            tokenizer,
            tm.info.max_context_len,
            int(args.mm_processor_cache_gb * (1 << 30)),
        )
        if embedding is not None and embedding.pooling == "score":
            tm.only_pooling = "score"
        health = Health(
            processes={name: p.pid for name, p in children.procs.items()},
            heartbeat=heartbeat,
            stall_limit=min(HEALTH_STALL_S, args.engine.watchdog_timeout),
        )
        app = create_app(tm, args, health, embedding)
        on_death: list[Callable[[str], None]] = [
            lambda reason: None
        ]  # set once the event loop runs

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            loop = asyncio.get_running_loop()
            on_death[0] = lambda reason: loop.call_soon_threadsafe(tm.fail_all, reason)
            await tm.start(api_inbox(endpoints))
            sampler = asyncio.create_task(app.state.metrics.sample_forever())
            log_ready(args, ready, time.time() - started)
            yield
            sampler.cancel()

        app.router.lifespan_context = lifespan
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2
        )
        server = GracefulServer(config)
        threading.Thread(
            target=watch_children,
            daemon=True,
            name="child-watch",
            args=(children, health, server, exit_code, lambda reason: on_death[0](reason)),
        ).start()
        server.run()
        if not server.started and exit_code[0] == 0:
            exit_code[0] = 1
    except StartupRefused:
        exit_code[0] = REFUSED_EXIT_CODE
    except Exception as exc:
        log.error("start-up failed: %s", exc)
        exit_code[0] = 1
    finally:
        ignore_stop_signals()  # a second signal must not cut the (bounded) clean-up short
        children.stop()
        shutil.rmtree(endpoints.folder, ignore_errors=True)
    return exit_code[0]


def log_ready(args: ServerArgs, ready: SchedulerReady, seconds: float) -> None:
    log.info(
        "serving %s on http://%s:%d (cold start %.1f s)",
        ready.model_name,
        args.host,
        args.port,
        seconds,
    )
    log.info(ready.info.capacity_line())


def run_node_ranks(engine: EngineArgs) -> int:
    """A node > 0 of multi-node tensor parallelism: its ranks follow rank 0 (on node 0) over
    torch.distributed. Exits 0 on SIGINT/SIGTERM, 1 when a rank exits (node 0 went away)."""
    ctx = mp.get_context("spawn")
    children = Children(
        {
            f"worker (tp rank {rank})": ctx.Process(
                target=run_child,
                args=(FOLLOWER_MAIN, engine, engine.dist_init_method(), rank),
                name=f"radixserve-worker-tp{rank}",
            )
            for rank in engine.local_tp_ranks()
        }
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    for proc in children.procs.values():
        proc.start()
    log.info(
        "node %d of %d: tensor-parallel ranks %s joining %s",
        engine.node_rank,
        engine.nnodes,
        engine.local_tp_ranks(),
        engine.dist_init_addr,
    )
    try:
        while not stop.wait(0.2):
            if (dead := children.first_dead()) is not None:
                log.error("the %s process exited (code %s); stopping this node", *dead)
                return 1
        return 0
    finally:
        children.stop()
