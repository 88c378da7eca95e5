"""Adapters at runtime, SGLang's routes: `/load_lora_adapter` and `/unload_lora_adapter`.

Unloading an adapter that queued or running requests use waits for them (the adapter takes no
new request meanwhile), up to `UNLOAD_WAIT_S`; after that the reply is a 409 and the adapter
stays closed to new requests until an unload is asked again and finds it unused."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from .http import RequestError, parse_body
from .tokenizer_manager import TokenizerManager

LOAD_TIMEOUT_S = 300.0
UNLOAD_WAIT_S = 300.0
UNLOAD_POLL_S = 0.05


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str


def lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoraRequest)
        if not body.lora_name or "\n" in body.lora_name:
            raise RequestError("lora_name: must be a non-empty name on one line")
        text = f"{body.lora_name}\n{body.lora_path}"
        reply = await tm.control("load_lora", timeout=LOAD_TIMEOUT_S, text=text)
        return _answer(tm, reply)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoraRequest)
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while True:
            reply = await tm.control("unload_lora", text=body.lora_name)
            if reply.get("success") or "in_use" not in reply or time.monotonic() > deadline:
                break
            tm.lora_adapters = list(reply["loaded_adapters"])  # it takes no new requests
            await asyncio.sleep(UNLOAD_POLL_S)
        if not reply.get("success") and reply.get("in_use"):
            raise RequestError(
                f"lora_name: adapter {body.lora_name!r} is still used by {reply['in_use']} "
                "requests; it takes no new ones, ask again to finish unloading",
                409,
            )
        return _answer(tm, reply)


def _answer(tm: TokenizerManager, reply: dict) -> dict:
    if not reply.get("success"):
        raise RequestError(reply.get("message") or reply.get("error") or "failed")
    tm.lora_adapters = list(reply["loaded_adapters"])
    return {"success": True, "loaded_adapters": tm.lora_adapters}
