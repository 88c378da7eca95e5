"""The FastAPI app: SGLang's native routes, health, control; OpenAI routes live in openai_api."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST

from ..config import ServerArgs
from ..ipc import Heartbeat
from ..messages import GenerateReq, ImageInput
from ..multimodal.inputs import MediaPart, data_fields
from ..tokenizer import chat_roles
from .anthropic_api import anthropic_routes
from .embeddings_api import EmbeddingSetup, embeddings_routes
from .http import (
    RequestError,
    auth_dependency,
    error_body,
    error_response,
    install_error_handlers,
    json_response,
    parse_body,
    sse,
)
from .lora_api import lora_routes
from .metrics import Metrics
from .openai_api import ChatSetup, openai_routes, served_name
from .protocol import AbortRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest
from .responses_api import responses_routes
from .rollout_api import rollout_routes
from .tokenizer_manager import TokenizerManager

DASHBOARD_HTML = Path(__file__).parent / "static" / "dashboard.html"


@dataclass
class Health:
    """Set unhealthy by the launcher's watchdog when a child process dies; also unhealthy
    while the scheduler loop has been stuck on a step for `stall_limit` seconds."""

    healthy: bool = True
    reason: str = ""
    processes: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    heartbeat: Heartbeat | None = None
    stall_limit: float = 30.0

    def problem(self) -> str | None:
        if not self.healthy:
            return self.reason
        stalled = self.heartbeat.stalled_for() if self.heartbeat is not None else 0.0
        if stalled > self.stall_limit:
            return f"the scheduler loop has not turned for {stalled:.0f} s"
        return None


def create_app(
    tm: TokenizerManager,
    server_args: ServerArgs,
    health: Health,
    embedding: EmbeddingSetup | None = None,
) -> FastAPI:
    # FastAPI's own docs routes skip app dependencies: they are added below, behind the key
    app = FastAPI(
        title="radixserve",
        version="0.1.0",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(auth_dependency(server_args.api_key))],
    )
    app.state.tm, app.state.args, app.state.health = tm, server_args, health
    install_error_handlers(app)
    _native_routes(app, tm, server_args, health)
    setup = ChatSetup.of(tm, server_args)
    openai_routes(app, tm, server_args, setup)
    responses_routes(app, tm, setup)
    anthropic_routes(app, tm, setup)
    rollout_routes(app, tm)
    lora_routes(app, tm)
    embeddings_routes(app, tm, setup.model, embedding)
    app.state.metrics = Metrics(tm)
    _observability_routes(app, app.state.metrics)
    _docs_routes(app)
    return app


def _docs_routes(app: FastAPI) -> None:
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="radixserve")

    @app.get("/redoc", include_in_schema=False)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title="radixserve")


def _observability_routes(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard():
        return Response(DASHBOARD_HTML.read_bytes(), media_type="text/html")

    @app.get("/dashboard/data")
    async def dashboard_data():
        return json_response(await metrics.dashboard_data())


def _per_prompt(value: Any, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


async def _generate_images(
    tm: TokenizerManager, body: GenerateRequest, single: bool, ids: list[int]
) -> tuple[list[int], list[ImageInput] | None]:
    """A /generate prompt's `image_data` and `video_data`: one prompt's images and videos, each
    marked in its text (or by the image or video token among its input_ids)."""
    for kind, value in (("image", body.image_data), ("video", body.video_data)):
        if value is not None and not single:
            raise RequestError(f"{kind}_data goes with one prompt, not a batch")
    fields = data_fields(body.image_data, body.video_data)
    parts = [MediaPart(url, where, kind=kind) for kind, where, url in fields]
    return tm.images.attach(ids, await tm.images.prepare(parts))


async def build_generate(
    tm: TokenizerManager, body: GenerateRequest
) -> tuple[list[GenerateReq], bool]:
    """The batch of scheduler requests a /generate body stands for, and whether it was a single
    prompt."""
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("send exactly one of 'text' or 'input_ids'")
    if body.text is not None:
        single = isinstance(body.text, str)
        id_lists = [await tm.inputs.encode(t) for t in ([body.text] if single else body.text)]
    else:
        single = not body.input_ids or isinstance(body.input_ids[0], int)
        id_lists = [body.input_ids] if single else body.input_ids
    if not id_lists:
        raise RequestError("the batch is empty")
    id_lists[0], images = await _generate_images(tm, body, single, id_lists[0])
    n = len(id_lists)
    params = _per_prompt(body.sampling_params, n, "sampling_params")
    rids = (
        _per_prompt(body.rid, n, "rid")
        if isinstance(body.rid, list)
        else [
            None if body.rid is None else (body.rid if single else f"{body.rid}-{i}")
            for i in range(n)
        ]
    )
    logprob = _per_prompt(body.return_logprob or False, n, "return_logprob")
    starts = _per_prompt(
        -1 if body.logprob_start_len is None else body.logprob_start_len, n, "logprob_start_len"
    )
    tops = _per_prompt(body.top_logprobs_num or 0, n, "top_logprobs_num")
    adapters = _per_prompt(body.lora_path, n, "lora_path")
    reqs = []
    for i in range(n):
        explicit = isinstance(params[i], dict) and "max_new_tokens" in params[i]
        req = tm.make_request(
            id_lists[i],
            params[i],
            rids[i],
            logprob[i],
            starts[i],
            tops[i],
            priority=body.priority,
            max_tokens_field="max_new_tokens" if explicit else None,
            cache_salt=body.cache_salt,
            lora_path=adapters[i],
            bootstrap=body.bootstrap(),
            images=images,
        )
        reqs += tm.expand_n(req)
    tm.check_disaggregated(reqs)
    return reqs, single and len(reqs) == 1


def generate_result(tm: TokenizerManager, state, body: GenerateRequest, with_logprob: bool) -> dict:
    result = state.to_dict(with_logprob, tm.token_text if body.return_text_in_logprobs else None)
    if with_logprob:
        lps = [e[0] for e in result["meta_info"]["input_token_logprobs"] if e[0] is not None]
        result["meta_info"]["normalized_prompt_logprob"] = sum(lps) / len(lps) if lps else 0.0
    result["meta_info"]["weight_version"] = tm.weight_version
    return result


def _native_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, health: Health) -> None:
    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateRequest)
        reqs, single = await build_generate(tm, body)
        if body.stream:
            if single:
                return sse(_stream_generate(tm, reqs[0], body))
            return sse(_stream_generate_many(tm, reqs, body))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        results = [generate_result(tm, s, body, r.return_logprob) for s, r in zip(states, reqs)]
        return json_response(results[0] if single else results)

    @app.get("/health")
    async def health_check():
        if (problem := health.problem()) is not None:
            return error_response(f"unhealthy: {problem}", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if (problem := health.problem()) is not None:
            return error_response(f"unhealthy: {problem}", 503)
        req = tm.make_request(
            [tm.info.eos_token_ids[0] if tm.info.eos_token_ids else 0],
            {"max_new_tokens": 0 if tm.only_pooling else 1, "temperature": 0},
            pooling=tm.only_pooling,
        )
        await asyncio.wait_for(tm.run_to_end(req), timeout=60)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": args.engine.model or tm.model_name,
            "tokenizer_path": args.engine.model,
            "is_generation": True,
            "served_model_name": served_name(tm, args),
            "weight_version": tm.weight_version,
        }

    @app.get("/get_server_info")
    async def server_info(request: Request):
        stats = await tm.control("stats")
        return json_response(
            {
                **server_args_dict(args),
                "worker": vars(tm.info),
                "max_total_num_tokens": tm.info.num_slots,
                "memory_plan": tm.info.memory_plan().as_dict(),
                "stats": stats,
                "uptime_s": time.time() - health.started,
                "processes": health.processes,
                "routes": served_routes(request.app),
            }
        )

    @app.get("/get_chat_template")
    async def chat_template():
        return chat_roles(tm.tokenizer)

    @app.post("/flush_cache")
    async def flush_cache():
        reply = await tm.control("flush_cache")
        if not reply.get("success"):
            return error_response("cannot flush the cache while requests are running", 400)
        return Response("Cache flushed.", status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse_body(request, TokenizeRequest)
        if tm.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        tokens = await tm.inputs.encode(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": tm.info.max_context_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        if tm.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        vocab = tm.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"tokens: every token id must be in [0, {vocab})")
        return {"prompt": tm.text_of(body.tokens)}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse_body(request, AbortRequest)
        if body.rid not in tm.pending:
            raise RequestError(f"no running request has rid {body.rid!r}", 404)
        await tm.abort(body.rid)
        return Response(status_code=200)


async def _stream_generate(tm: TokenizerManager, req: GenerateReq, body: GenerateRequest):
    stream = tm.run(req)
    try:
        async for state in stream:
            yield generate_result(tm, state, body, req.return_logprob)
    except RequestError as exc:
        yield error_body(str(exc), exc.status)
    finally:
        await stream.aclose()


async def _stream_generate_many(
    tm: TokenizerManager, reqs: list[GenerateReq], body: GenerateRequest
):
    """Several prompts (or n > 1) in one stream: chunks interleave as they come, each with the
    `index` of its request; closing the stream aborts whatever is still running."""
    updates: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: GenerateReq) -> None:
        try:
            async for chunk in _stream_generate(tm, req, body):
                await updates.put(dict(chunk, index=index))
        finally:
            await updates.put(None)

    tasks = [asyncio.create_task(pump(i, req)) for i, req in enumerate(reqs)]
    try:
        running = len(tasks)
        while running:
            chunk = await updates.get()
            if chunk is None:
                running -= 1
            else:
                yield chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def server_args_dict(args: ServerArgs) -> dict:
    data = {k: v for k, v in vars(args).items() if k not in ("engine", "api_key")}
    data.update(vars(args.engine))
    return data


def served_routes(app: FastAPI) -> list[str]:
    """`METHOD /path` of every route this server answers (the docs' routes left out)."""
    return sorted(
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in route.methods
    )
