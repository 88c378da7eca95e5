"""An async load generator for OpenAI-compatible and SGLang-native endpoints, with streaming.

A workload is a list of sessions; a session is a list of stages; a stage is a list of
prompts sent concurrently. Each stage's prompts may contain "{history}", replaced by the
session's text so far (prompt and answer of the stage before): multi-turn chat and agent
trees re-send a growing history, which is what a prefix cache serves.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import orjson


@dataclass
class Stage:
    prompts: list[str]
    output_len: int


@dataclass
class Session:
    stages: list[Stage]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""


@dataclass
class Target:
    """Where to send: `api` is "openai" (/v1/completions) or "sglang" (/generate)."""

    name: str
    base_url: str
    model: str
    api: str = "openai"


async def send(client: httpx.AsyncClient, target: Target, prompt: str, output_len: int) -> Result:
    if target.api == "sglang":
        body = {
            "text": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        }
        url = "/generate"
    else:
        body = {
            "model": target.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        url = "/v1/completions"
    start = time.perf_counter()
    result = Result(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[5:].strip())
                now = time.perf_counter()
                if _consume(chunk, target, result):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0 or output_len == 0
        if not result.ok:
            result.error = "no tokens"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = repr(exc)
    return result


def _consume(chunk: dict, target: Target, result: Result) -> bool:
    """Fold one streamed chunk into the result; True when it carried new output."""
    if target.api == "sglang":
        meta = chunk.get("meta_info", {})
        new = meta.get("completion_tokens", 0) - result.output_tokens
        result.output_tokens = meta.get("completion_tokens", result.output_tokens)
        result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
        result.text = chunk.get("text", result.text)
        return new > 0
    usage = chunk.get("usage") or {}
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = max(result.output_tokens, usage.get("completion_tokens", 0))
    choices = chunk.get("choices") or []
    text = "".join(c.get("text") or "" for c in choices)
    if text:
        result.text += text
        if not usage:
            result.output_tokens += 1
        return True
    return False


async def run_session(
    client, target: Target, session: Session, gate: asyncio.Semaphore
) -> list[Result]:
    history, results = "", []
    for stage in session.stages:

        async def one(prompt: str) -> Result:
            async with gate:
                return await send(
                    client, target, prompt.replace("{history}", history), stage.output_len
                )

        outcomes = await asyncio.gather(*(one(p) for p in stage.prompts))
        results += outcomes
        history = stage.prompts[0].replace("{history}", history) + outcomes[0].text
    return results


async def run_workload(
    target: Target,
    sessions: list[Session],
    concurrency: int,
    request_rate: float | None = None,
    seed: int = 0,
    timeout: float = 600,
) -> dict:
    """Fixed concurrency, or Poisson session arrivals at `request_rate` per second."""
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency * 4)
    async with httpx.AsyncClient(
        base_url=target.base_url, timeout=timeout, limits=limits
    ) as client:
        start = time.perf_counter()
        tasks = []
        for session in sessions:
            tasks.append(asyncio.create_task(run_session(client, target, session, gate)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = [r for group in await asyncio.gather(*tasks) for r in group]
        elapsed = time.perf_counter() - start
    return summarize(results, elapsed)


def _pcts(values: list[float]) -> dict:
    if not values:
        return {k: None for k in ("mean", "p50", "p90", "p95", "p99")}
    data = sorted(values)
    pick = lambda q: data[min(int(q * len(data)), len(data) - 1)]  # noqa: E731
    return {
        "mean": statistics.fmean(data),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p95": pick(0.95),
        "p99": pick(0.99),
    }


def summarize(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "seconds": elapsed,
        "request_throughput": len(ok) / elapsed,
        "input_tok_per_s": sum(r.prompt_tokens for r in ok) / elapsed,
        "output_tok_per_s": sum(r.output_tokens for r in ok) / elapsed,
        "ttft": _pcts([r.ttft for r in ok]),
        "itl": _pcts([x for r in ok for x in r.itl]),
        "tpot": _pcts(tpot),
        "e2e": _pcts([r.e2e for r in ok]),
    }
