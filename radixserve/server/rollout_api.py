"""Rollout control for RL frameworks (verl, slime, OpenRLHF drive SGLang through these routes):
`/update_weights_from_disk`, `/get_weight_version`, `/pause_generation`, `/continue_generation`,
`/release_memory_occupation` and `/resume_memory_occupation` (the KV cache's pages and the
weights given back while a trainer uses the memory, then taken again).

A weight update swaps the weights between two scheduler steps: in-flight requests are aborted
(`abort_all_requests`) or retracted to recompute with the new weights, and every cached prefix
is dropped, so nothing computed with the old weights is served again. Every reply names the
weight version serving when it was made (`meta_info.weight_version` on /generate)."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from .http import RequestError, parse_body
from .tokenizer_manager import TokenizerManager

WEIGHT_LOAD_TIMEOUT_S = 600.0


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model_path: str
    load_format: Literal["auto"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class PauseRequest(BaseModel):
    """`abort` ends every request; `retract` sends the running ones back to the queue (they
    recompute on /continue_generation); `in_place` keeps them where they are."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryRequest(BaseModel):
    """Which memory to give back or take again (both when `tags` is left out)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tags: list[Literal["kv_cache", "weights"]] | None = None

    def joined(self) -> str:
        return ",".join(sorted(set(self.tags or MEMORY_TAGS)))


MEMORY_TAGS = ("kv_cache", "weights")


class ContinueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def rollout_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await parse_body(request, UpdateWeightsRequest)
        reply = await tm.control(
            "update_weights",
            int(body.abort_all_requests),
            timeout=WEIGHT_LOAD_TIMEOUT_S,
            text=body.model_path,
        )
        if not reply.get("success"):
            raise RequestError(f"model_path: {reply.get('message') or reply.get('error')}")
        if body.weight_version is not None:
            tm.weight_version = body.weight_version
        return {**reply, "weight_version": tm.weight_version}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": tm.weight_version}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await parse_body(request, PauseRequest) if await request.body() else PauseRequest()
        return await tm.control("pause", text=body.mode)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        return await _memory(request, "release_memory")

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        return await _memory(request, "resume_memory")

    async def _memory(request: Request, kind: str) -> dict:
        body = await parse_body(request, MemoryRequest) if await request.body() else MemoryRequest()
        reply = await tm.control(kind, timeout=WEIGHT_LOAD_TIMEOUT_S, text=body.joined())
        if not reply.get("success"):
            raise RequestError(reply.get("message") or reply.get("error"))
        return reply

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        if await request.body():  # an empty body, or an empty object
            await parse_body(request, ContinueRequest)
        return await tm.control("resume")
