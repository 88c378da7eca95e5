"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request

from ..config import ServerArgs
from ..messages import GenerateReq
from ..responses import RequestState
from .api import json_response, parse_body, served_name, sse
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenizer_manager import RequestError, TokenizerManager

DEFAULT_COMPLETION_TOKENS = 16


def openai_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name(tm, args), "object": "model",
                                            "created": int(time.time()), "owned_by": "radixserve",
                                            "max_model_len": tm.info.max_context_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        prompts = await _prompt_ids(tm, body.prompt)
        params = body.sampling_params(DEFAULT_COMPLETION_TOKENS)
        reqs = _requests(tm, prompts, params, body.n, logprobs=body.logprobs)
        adapter = _Completion(tm, served_name(tm, args), body)
        if body.stream:
            return sse(adapter.stream(reqs))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        return json_response(adapter.response(states))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        prompt = tm.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        params = body.sampling_params(default_max_tokens=tm.info.max_context_len)
        top = (body.top_logprobs or 0) if body.logprobs else None
        reqs = _requests(tm, [await tm.tokenize_async(prompt)], params, body.n, logprobs=top)
        adapter = _Chat(tm, served_name(tm, args), body)
        if body.stream:
            return sse(adapter.stream(reqs))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        return json_response(adapter.response(states))


async def _prompt_ids(tm: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await tm.tokenize_async(prompt)]
    if not prompt:
        raise RequestError("prompt is empty")
    if isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt[0], str):
        return [await tm.tokenize_async(p) for p in prompt]
    return list(prompt)


def _requests(tm: TokenizerManager, prompts: list[list[int]], params: dict, n: int,
              logprobs: int | None) -> list[GenerateReq]:
    """One scheduler request per (prompt, sample); the room for output is capped by the context."""
    room = tm.info.max_context_len - max(len(p) for p in prompts)
    params = dict(params, max_new_tokens=max(min(params["max_new_tokens"], room), 0), n=n)
    reqs = []
    for ids in prompts:
        reqs += tm.expand_n(tm.make_request(ids, params, return_logprob=logprobs is not None,
                                            top_logprobs_num=logprobs or 0))
    return reqs


def _finish_reason(state: RequestState) -> str | None:
    return None if state.finish_reason is None else state.finish_reason.kind


def _matched_stop(state: RequestState) -> int | str | None:
    return None if state.finish_reason is None else state.finish_reason.matched


def _usage(states: list[RequestState], prompts_seen: set | None = None) -> dict:
    prompt = sum(s.prompt_tokens for s in states)
    completion = sum(s.completion_tokens for s in states)
    cached = sum(s.cached_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Adapter:
    object_name = ""

    def __init__(self, tm: TokenizerManager, model: str, body):
        self.tm, self.model, self.body = tm, model, body
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, choices: list[dict], obj: str, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def response(self, states: list[RequestState]) -> dict:
        choices = [self.choice(i, s) for i, s in enumerate(states)]
        return self.envelope(choices, self.object_name, _usage(states))

    async def stream(self, reqs: list[GenerateReq]):
        queue: asyncio.Queue = asyncio.Queue()
        finals: dict[int, RequestState] = {}
        tasks = [asyncio.create_task(self._pump(i, r, queue)) for i, r in enumerate(reqs)]
        try:
            sent = {i: 0 for i in range(len(reqs))}
            yield self.first_chunk(len(reqs))
            while len(finals) < len(reqs):
                i, state = await queue.get()
                if isinstance(state, Exception):
                    raise state
                if i in finals:
                    continue
                delta = state.text[sent[i]:]
                sent[i] = len(state.text)
                if delta or state.finished:
                    yield self.delta_chunk(i, delta, state)
                if state.finished:
                    finals[i] = state
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self.envelope([], self.chunk_object, _usage(list(finals.values())))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, i: int, req: GenerateReq, queue: asyncio.Queue) -> None:
        stream = self.tm.run(req)
        try:
            async for state in stream:
                queue.put_nowait((i, state))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            await stream.aclose()

    def logprobs_of(self, state: RequestState, start: int = 0) -> list[tuple[str, float, list]]:
        """(token text, logprob, [(text, logprob) of the top alternatives]) per output token."""
        text = self.tm.token_text
        out = []
        for (lp, tid), top in zip(state.output_logprobs[start:], state.output_top_logprobs[start:]):
            alts = [(text(t), v) for v, t in (top or [])]
            out.append((text(tid), lp, alts))
        return out


class _Completion(_Adapter):
    prefix, object_name, chunk_object = "cmpl", "text_completion", "text_completion"

    def choice(self, i: int, state: RequestState) -> dict:
        return {"index": i, "text": state.text, "logprobs": self.completion_logprobs(state),
                "finish_reason": _finish_reason(state), "matched_stop": _matched_stop(state)}

    def completion_logprobs(self, state: RequestState, start: int = 0) -> dict | None:
        if self.body.logprobs is None:
            return None
        entries = self.logprobs_of(state, start)
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [dict(alts) for _, _, alts in entries], "text_offset": []}

    def first_chunk(self, n: int) -> dict:
        return self.envelope([{"index": i, "text": "", "logprobs": None, "finish_reason": None}
                              for i in range(n)], self.chunk_object)

    def delta_chunk(self, i: int, delta: str, state: RequestState) -> dict:
        return self.envelope([{"index": i, "text": delta, "logprobs": None,
                               "finish_reason": _finish_reason(state) if state.finished else None}],
                             self.chunk_object)


class _Chat(_Adapter):
    prefix, object_name, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def choice(self, i: int, state: RequestState) -> dict:
        return {"index": i, "message": {"role": "assistant", "content": state.text},
                "logprobs": self.chat_logprobs(state), "finish_reason": _finish_reason(state),
                "matched_stop": _matched_stop(state)}

    def chat_logprobs(self, state: RequestState) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())}
                                              for a, v in alts]}
                            for t, lp, alts in self.logprobs_of(state)]}

    def first_chunk(self, n: int) -> dict:
        return self.envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None} for i in range(n)], self.chunk_object)

    def delta_chunk(self, i: int, delta: str, state: RequestState) -> dict:
        return self.envelope([{"index": i, "delta": {"content": delta} if delta else {}, "logprobs": None,
                               "finish_reason": _finish_reason(state) if state.finished else None}],
                             self.chunk_object)
