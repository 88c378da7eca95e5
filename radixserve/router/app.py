"""The router's HTTP app: the serving routes proxied to workers, worker management, health,
Prometheus metrics and the cluster dashboard."""

from __future__ import annotations

from pathlib import Path

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..server.http import (
    RequestError,
    auth_dependency,
    error_response,
    install_error_handlers,
    json_response,
    read_body,
)
from .proxy import WORKER_HEADER, Answer, Router, Stream, forwarded_headers

ROUTED_POSTS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
)
RESPONSES = "/v1/responses"  # a follow-up goes to the replica that stored its predecessor
ANY_WORKER_GETS = ("/v1/models", "/get_model_info", "/get_chat_template")
DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"
P = "radixserve_router:"


def create_router_app(router: Router) -> FastAPI:
    app = FastAPI(
        title="radixserve router",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(auth_dependency(router.args.api_key))],
    )
    install_error_handlers(app)  # RequestError, raised by the router too, becomes its 4xx

    for path in ROUTED_POSTS:
        app.add_api_route(path, _proxy(router, "POST", path), methods=["POST"])
    for path in ANY_WORKER_GETS:
        app.add_api_route(path, _proxy(router, "GET", path), methods=["GET"])
    _responses_routes(app, router)
    _management_routes(app, router)
    _observability_routes(app, router)
    return app


def _proxy(router: Router, method: str, path: str):
    async def route(request: Request):
        body = await read_body(request, router.args.max_request_bytes) if method == "POST" else b""
        outcome = await router.open(method, path, body, forwarded_headers(request.headers))
        return _answer(router, outcome)

    return route


def _responses_routes(app: FastAPI, router: Router) -> None:
    """The Responses API: a body naming `previous_response_id`, and GET or DELETE of a stored
    response, go to the replica holding it."""

    @app.post(RESPONSES)
    async def create(request: Request):
        body = await read_body(request, router.args.max_request_bytes)
        headers = forwarded_headers(request.headers)
        try:
            previous = orjson.loads(body).get("previous_response_id")
        except (orjson.JSONDecodeError, AttributeError):
            previous = None
        owner = await router.owner_of(previous, headers) if isinstance(previous, str) else None
        return _answer(router, await router.open("POST", RESPONSES, body, headers, owner))

    async def stored(request: Request, response_id: str):
        headers = forwarded_headers(request.headers)
        owner = await router.owner_of(response_id, headers)
        if owner is None:
            raise RequestError(f"no worker holds a stored response with id {response_id!r}", 404)
        path = f"{RESPONSES}/{response_id}"
        return _answer(router, await router.open(request.method, path, b"", headers, owner))

    app.add_api_route(RESPONSES + "/{response_id}", stored, methods=["GET", "DELETE"])


def _answer(router: Router, outcome: Answer | Stream) -> Response:
    if isinstance(outcome, Stream):
        return StreamingResponse(
            router.relay(outcome),
            status_code=outcome.response.status,
            headers={"content-type": "text/event-stream", WORKER_HEADER: outcome.worker.url},
        )
    headers = dict(
        outcome.headers, **({WORKER_HEADER: outcome.worker.url} if outcome.worker else {})
    )
    return Response(outcome.body, status_code=outcome.status, headers=headers)


def _management_routes(app: FastAPI, router: Router) -> None:
    @app.post("/add_worker")
    async def add_worker(url: str | None = None):
        return json_response((await router.add_worker(url)).summary())

    @app.post("/remove_worker")
    async def remove_worker(url: str | None = None):
        router.remove_worker(url)
        return Response(status_code=200)

    @app.get("/list_workers")
    async def list_workers():
        workers = router.summaries()
        return json_response({"urls": [w["url"] for w in workers], "workers": workers})

    @app.get("/health")
    async def health():
        if not router.available():
            return error_response("unhealthy: no healthy worker", 503)
        return Response(status_code=200)

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        replies = await router.broadcast("POST", "/flush_cache", forwarded_headers(request.headers))
        failed = {url: _problem(r) for url, r in replies.items() if _problem(r)}
        if failed or not replies:
            return error_response(
                f"flush failed on {failed or 'every worker (none is healthy)'}",
                400 if failed else 503,
            )
        return Response("Cache flushed.", status_code=200)

    for route in ("/load_lora_adapter", "/unload_lora_adapter"):
        app.post(route)(_adapter_route(router, route))


def _adapter_route(router: Router, route: str):
    """A LoRA adapter loaded or unloaded on every healthy worker, and the router's list of
    adapter names (which keys the KV-event index) kept with them. The first worker that refuses
    gives its own status and reason."""

    async def handler(request: Request):
        body = await read_body(request, router.args.max_request_bytes)
        replies = await router.broadcast(
            "POST",
            route,
            forwarded_headers(request.headers),
            body=body,
            timeout_s=router.args.request_timeout_secs,
        )
        if not replies:
            return error_response(f"{route}: no healthy worker", 503)
        for url, reply in replies.items():
            if isinstance(reply, str):
                return error_response(f"{route} failed on {url}: {reply}", 503)
            if reply.status != 200:
                return Response(reply.body, reply.status, media_type="application/json")
        name = orjson.loads(body)["lora_name"]  # every worker took the body: it is valid
        if route == "/load_lora_adapter":
            router.adapters.add(name)
        else:
            router.adapters.discard(name)
        return Response(next(iter(replies.values())).body, 200, media_type="application/json")

    return handler


def _problem(reply: Answer | str) -> str | None:
    if isinstance(reply, str):
        return reply
    return (
        None
        if reply.status == 200
        else f"{reply.status} {reply.body[:200].decode(errors='replace')}"
    )


async def cluster_stats(router: Router) -> dict[str, dict]:
    """Each healthy worker's own scheduler counters (its /get_server_info stats)."""
    replies = await router.broadcast("GET", "/get_server_info", router.auth_headers())
    return {url: orjson.loads(r.body)["stats"] for url, r in replies.items() if not _problem(r)}


def cluster_hit_rate(stats: dict[str, dict]) -> float:
    prompt = sum(s["prompt_tokens_total"] for s in stats.values())
    return sum(s["cached_tokens_total"] for s in stats.values()) / prompt if prompt else 0.0


def _observability_routes(app: FastAPI, router: Router) -> None:
    @app.get("/metrics")
    async def metrics():
        registry = CollectorRegistry()
        registry.register(_RouterCollector(router, await cluster_stats(router)))
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard():
        return Response(DASHBOARD_HTML.read_bytes(), media_type="text/html")

    @app.get("/dashboard/data")
    async def dashboard_data():
        stats = await cluster_stats(router)
        workers = [dict(w, stats=stats.get(w["url"])) for w in router.summaries()]
        return json_response(
            {
                "policy": router.args.policy,
                "cluster_hit_rate": cluster_hit_rate(stats),
                "retries": router.retries,
                "unroutable": router.unroutable,
                "workers": workers,
            }
        )


class _RouterCollector:
    def __init__(self, router: Router, stats: dict[str, dict]):
        self.router, self.stats = router, stats

    def collect(self):
        workers = list(self.router.workers.values())
        for name, doc, kind, value in [
            (
                "requests",
                "Requests routed to the worker (tries included)",
                CounterMetricFamily,
                lambda w: w.routed,
            ),
            ("errors", "Failed tries on the worker", CounterMetricFamily, lambda w: w.errors),
            (
                "in_flight_requests",
                "Requests in flight on the worker",
                GaugeMetricFamily,
                lambda w: w.in_flight,
            ),
            (
                "worker_healthy",
                "1 when the worker passes its health checks",
                GaugeMetricFamily,
                lambda w: int(w.healthy),
            ),
        ]:
            family = kind(P + name, doc, labels=["worker"])
            for w in workers:
                family.add_metric([w.url], value(w))
            yield family
        yield CounterMetricFamily(
            P + "retries", "Requests retried on another worker", value=self.router.retries
        )
        yield CounterMetricFamily(
            P + "unroutable", "Requests no worker could take", value=self.router.unroutable
        )
        yield GaugeMetricFamily(
            P + "cluster_cache_hit_rate",
            "Cached / all prompt tokens, summed over the healthy workers' own counters",
            value=cluster_hit_rate(self.stats),
        )
