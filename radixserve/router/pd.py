"""The router in prefill/decode mode (`--pd-disaggregation`, sgl-router's flags).

A generate or completion request goes to two servers at once, with the same bootstrap fields
added (`bootstrap_host`/`_port`: the prefill server's, `bootstrap_room`: a random number): a
prefill server picked cache-aware, which answers once the prompt's KV reached the decode
server, and a decode server picked by load, whose answer (streamed or whole) is the client's.
When the prefill server fails (no answer, or a 5xx), the decode request is closed (the decode
server aborts it and frees its slots) and both are tried again with another prefill server.
The decode servers are this router's workers (health, /list_workers, metrics); the prefill
servers are a second `Router` of their own, with their own health checks.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from urllib.parse import urlsplit

import orjson

from ..server.http import error_body
from .config import RouterArgs
from .keys import routing_key
from .proxy import Answer, Router, Stream

PD_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


class PDRouter(Router):
    def __init__(self, args: RouterArgs):
        servers = args.prefill_servers()
        common = dict(pd_disaggregation=False, prefill=(), decode=(), kv_events=False)
        super().__init__(replace(args, worker_urls=args.decode, policy="power_of_two", **common))
        self.prefill = Router(
            replace(args, worker_urls=tuple(u for u, _ in servers), policy="cache_aware", **common)
        )
        self.bootstrap_ports = dict(servers)

    async def start(self) -> None:
        await super().start()
        await self.prefill.start()

    async def stop(self) -> None:
        await self.prefill.stop()
        await super().stop()

    def summaries(self) -> list[dict]:
        decode = [dict(s, role="decode") for s in super().summaries()]
        return decode + [dict(s, role="prefill") for s in self.prefill.summaries()]

    async def open(
        self, method: str, path: str, body: bytes, headers: dict[str, str], pinned=None
    ) -> Answer | Stream:
        if path not in PD_PATHS or pinned is not None:
            return await super().open(method, path, body, headers, pinned)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            return _answer(400, "the request body must be a JSON object")
        key = routing_key(path, body)
        tried: set[str] = set()
        failure: Answer | None = None
        for attempt in range(1 + self.args.retry_max_retries):
            candidates = self.prefill.available(tried)
            if not candidates:
                break
            if attempt:
                self.retries += 1
            prefill = self.prefill.policy.pick(candidates, key)
            tried.add(prefill.url)
            fields = {
                "bootstrap_host": urlsplit(prefill.url).hostname,
                "bootstrap_port": self.bootstrap_ports[prefill.url],
                "bootstrap_room": secrets.randbits(63),
            }
            prefill_data = {**data, **fields, "stream": False}
            prefill_data.pop("stream_options", None)
            decoding = asyncio.create_task(
                super().open(method, path, orjson.dumps({**data, **fields}), headers)
            )
            try:
                prefilled = await self.prefill._try(
                    prefill, method, path, orjson.dumps(prefill_data), headers
                )
            except asyncio.CancelledError:  # the client went away: so does the decode request
                await _close(decoding)
                raise
            if prefilled is not None and prefilled.status == 200:
                return await decoding
            await _close(decoding)
            if prefilled is not None and prefilled.status < 500:
                return prefilled  # the request itself is refused
            failure = prefilled or failure
        if failure is not None:
            return failure
        self.unroutable += 1
        return _answer(503, "no healthy prefill server could take the request")


async def _close(decoding: asyncio.Task) -> None:
    """Give up a decode request: cancelled before its answer, or its stream closed."""
    if not decoding.done():
        decoding.cancel()
    try:
        outcome = await decoding
    except asyncio.CancelledError:
        return
    if isinstance(outcome, Stream):
        outcome.worker.in_flight -= 1
        outcome.response.close()


def _answer(status: int, message: str) -> Answer:
    return Answer(
        status, {"content-type": "application/json"}, orjson.dumps(error_body(message, status))
    )
