"""Where programs run: a radixserve server over HTTP, or an in-process Engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import httpx
import orjson


@dataclass
class CallResult:
    text: str
    prompt_tokens: int
    cached_tokens: int
    meta: dict


@dataclass
class SelectResult:
    index: int
    scores: list[float]
    prompt_tokens: int
    cached_tokens: int


class Backend(Protocol):
    def chat_roles(self) -> dict: ...

    def generate(self, text: str, params: dict) -> CallResult: ...

    def generate_stream(self, text: str, params: dict) -> Iterator[str | CallResult]: ...

    def batch(self, body: dict) -> list[dict]: ...


def select_by_logprob(backend: Backend, text: str, choices: tuple[str, ...]) -> SelectResult:
    """Score every choice in one batched prompt-only request, reusing the cached prompt.

    The prompt is sent first (max_new_tokens 0) so that its KV is cached; the choices then
    ask for logprobs from the prompt's last token on, which leaves the rest of the prompt
    to the radix cache. When every choice starts with the prompt's last token unchanged
    (no merge at the boundary) that shared token is left out of the score.
    """
    first = backend.batch({"text": [text], "sampling_params": {"max_new_tokens": 0}})[0]
    prompt_len = first["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 1, 0)
    results = backend.batch(
        {
            "text": [text + c for c in choices],
            "return_logprob": True,
            "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        }
    )
    entries = [r["meta_info"]["input_token_logprobs"] for r in results]
    boundary = {e[0][1] for e in entries if e}
    skip = 1 if len(boundary) == 1 and start > 0 else 0
    scores = [_mean([lp for lp, *_ in e[skip:] if lp is not None]) for e in entries]
    best = max(range(len(choices)), key=lambda i: scores[i])
    prompt = first["meta_info"]["prompt_tokens"] + sum(
        r["meta_info"]["prompt_tokens"] for r in results
    )
    cached = first["meta_info"]["cached_tokens"] + sum(
        r["meta_info"]["cached_tokens"] for r in results
    )
    return SelectResult(best, scores, prompt, cached)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _call_result(body: dict) -> CallResult:
    meta = body["meta_info"]
    return CallResult(body["text"], meta["prompt_tokens"], meta["cached_tokens"], meta)


class RuntimeEndpoint:
    """A radixserve (or SGLang-compatible) server."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._roles: dict | None = None

    def chat_roles(self) -> dict:
        if self._roles is None:
            self._roles = self._check(self.client.get("/get_chat_template")).json()
        return self._roles

    def generate(self, text: str, params: dict) -> CallResult:
        return _call_result(self._post({"text": text, "sampling_params": params}))

    def generate_stream(self, text: str, params: dict) -> Iterator[str | CallResult]:
        body = {"text": text, "sampling_params": params, "stream": True}
        sent, last = 0, None
        with self.client.stream("POST", "/generate", json=body) as response:
            self._check(response)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = orjson.loads(line[6:])
                if "error" in last:
                    raise RuntimeError(last["error"]["message"])
                yield last["text"][sent:]
                sent = len(last["text"])
        yield _call_result(last)

    def batch(self, body: dict) -> list[dict]:
        return self._post(body)

    def _post(self, body: dict) -> Any:
        return self._check(self.client.post("/generate", json=body)).json()

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            response.read()
            raise RuntimeError(f"server answered {response.status_code}: {response.text}")
        return response


class EngineBackend:
    """An in-process `radixserve.Engine` (no HTTP)."""

    def __init__(self, engine):
        self.engine = engine

    def chat_roles(self) -> dict:
        from ..tokenizer import chat_roles

        return chat_roles(self.engine.tokenizer)

    def generate(self, text: str, params: dict) -> CallResult:
        return _call_result(self.engine.generate(text, params))

    def generate_stream(self, text: str, params: dict) -> Iterator[str | CallResult]:
        sent, last = 0, None
        for last in self.engine.generate_stream(text, params):
            yield last["text"][sent:]
            sent = len(last["text"])
        yield _call_result(last)

    def batch(self, body: dict) -> list[dict]:
        texts = body["text"]
        return self.engine.generate(
            list(texts),
            body.get("sampling_params"),
            return_logprob=body.get("return_logprob", False),
            logprob_start_len=body.get("logprob_start_len", -1),
        )
