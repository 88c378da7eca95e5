"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request

from ..config import ServerArgs
from ..constrained import GRAMMAR_KEYS
from ..messages import GenerateReq
from ..reasoning import ReasoningParser, StreamingReasoningParser, make_reasoning_parser
from ..responses import RequestState
from ..tool_calls import (
    JsonCallsParser,
    StreamingToolParser,
    ToolCall,
    calls_schema,
    calls_structural_tag,
    detect_parser,
    make_parser,
)
from .api import json_response, parse_body, served_name, sse
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenizer_manager import RequestError, TokenizerManager

DEFAULT_COMPLETION_TOKENS = 16


def openai_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_name(tm, args),
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "radixserve",
                    "max_model_len": tm.info.max_context_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        prompts = await _prompt_ids(tm, body.prompt)
        params = body.sampling_params(DEFAULT_COMPLETION_TOKENS)
        reqs = _requests(
            tm,
            prompts,
            params,
            body.n,
            logprobs=body.logprobs,
            prompt_logprobs=body.echo and body.logprobs is not None,
        )
        echoed = (
            [text for text in _prompt_texts(tm, body.prompt, prompts) for _ in range(body.n)]
            if body.echo
            else None
        )
        adapter = _Completion(tm, served_name(tm, args), body, echoed)
        if body.stream:
            return sse(adapter.stream(reqs))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        return json_response(adapter.response(states))

    tool_parser = args.tool_call_parser or detect_parser(
        getattr(tm.tokenizer, "chat_template", None)
    )
    reasoning_parser = make_reasoning_parser(args.reasoning_parser)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        functions = body.offered_functions()
        prompt = tm.chat_prompt(
            [m.template_dict() for m in body.messages],
            body.template_functions() or None,
            **body.template_options(),
        )
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        params = body.sampling_params(default_max_tokens=tm.info.max_context_len)
        forced = body.forced_functions()
        parser = (JsonCallsParser() if forced else make_parser(tool_parser)) if functions else None
        if forced:
            if any(key in params for key in GRAMMAR_KEYS):
                raise RequestError(
                    "tool_choice 'required' or a named function cannot be combined with "
                    "response_format, regex or ebnf"
                )
            params["json_schema"] = calls_schema(forced, body.parallel_tool_calls)
        elif functions and not any(key in params for key in GRAMMAR_KEYS):
            tag = calls_structural_tag(parser, functions, body.parallel_tool_calls)
            if tag is not None:  # auto: free text, or calls that validate
                params["structural_tag"] = tag
        top = (body.top_logprobs or 0) if body.logprobs else None
        reqs = _requests(tm, [await tm.tokenize_async(prompt)], params, body.n, logprobs=top)
        adapter = _Chat(
            tm,
            served_name(tm, args),
            body,
            parser,
            reasoning_parser if body.separate_reasoning else None,
        )
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


def _prompt_texts(tm: TokenizerManager, prompt: Any, ids: list[list[int]]) -> list[str]:
    """Each prompt as text, for echo: as sent, or decoded when sent as token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [tm.text_of(p) for p in ids]


def _requests(
    tm: TokenizerManager,
    prompts: list[list[int]],
    params: dict,
    n: int,
    logprobs: int | None,
    prompt_logprobs: bool = False,
) -> list[GenerateReq]:
    """One scheduler request per (prompt, sample); the room for output is capped by the context."""
    room = tm.info.max_context_len - max(len(p) for p in prompts)
    params = dict(params, max_new_tokens=max(min(params["max_new_tokens"], room), 0), n=n)
    reqs = []
    for ids in prompts:
        reqs += tm.expand_n(
            tm.make_request(
                ids,
                params,
                return_logprob=logprobs is not None,
                logprob_start_len=0 if prompt_logprobs else -1,
                top_logprobs_num=logprobs or 0,
            )
        )
    return reqs


def _finish_reason(state: RequestState) -> str | None:
    return None if state.finish_reason is None else state.finish_reason.kind


def _matched_stop(state: RequestState) -> int | str | None:
    return None if state.finish_reason is None else state.finish_reason.matched


def _usage(states: list[RequestState], prompts_seen: set | None = None) -> dict:
    prompt = sum(s.prompt_tokens for s in states)
    completion = sum(s.completion_tokens for s in states)
    cached = sum(s.cached_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Adapter:
    object_name = ""

    def __init__(self, tm: TokenizerManager, model: str, body):
        self.tm, self.model, self.body = tm, model, body
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent: dict[int, int] = {}  # characters of each choice's text streamed so far
        self.sent_logprobs: dict[int, int] = {}  # output tokens whose logprobs were streamed

    def envelope(self, choices: list[dict], obj: str, usage: dict | None = None) -> dict:
        out = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
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
            yield self.first_chunk(len(reqs))
            while len(finals) < len(reqs):
                i, state = await queue.get()
                if isinstance(state, Exception):
                    raise state
                if i in finals:
                    continue
                for chunk in self.with_logprobs(i, state, self.chunks_for(i, state)):
                    yield chunk
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

    def chunks_for(self, i: int, state: RequestState) -> list[dict]:
        """The chunks a new state of choice `i` streams: the text added since the last one."""
        delta = state.text[self.sent.get(i, 0) :]
        self.sent[i] = len(state.text)
        return [self.delta_chunk(i, delta, state)] if delta or state.finished else []

    def with_logprobs(self, i: int, state: RequestState, chunks: list[dict]) -> list[dict]:
        """The logprobs of the tokens a choice got since its last chunk ride on the first chunk."""
        if chunks and self.wants_logprobs():
            first = i not in self.sent_logprobs
            entries = self.logprobs_of(state, self.sent_logprobs.get(i, 0))
            self.sent_logprobs[i] = len(state.output_logprobs)
            chunks[0]["choices"][0]["logprobs"] = self.format_logprobs(
                (self.prompt_entries(state) if first else []) + entries
            )
        return chunks

    def prompt_entries(self, state: RequestState) -> list:
        """Logprob entries that come before the output's (none but for an echoed prompt)."""
        return []

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

    def __init__(self, tm: TokenizerManager, model: str, body, echoed: list[str] | None = None):
        super().__init__(tm, model, body)
        self.echoed = echoed  # each choice's prompt text, with echo
        self.echo_sent: set[int] = set()

    def choice(self, i: int, state: RequestState) -> dict:
        text = (self.echoed[i] if self.echoed else "") + state.text
        logprobs = None
        if self.wants_logprobs():
            logprobs = self.format_logprobs(self.prompt_entries(state) + self.logprobs_of(state))
        return {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(state),
            "matched_stop": _matched_stop(state),
        }

    def wants_logprobs(self) -> bool:
        return self.body.logprobs is not None

    def prompt_entries(self, state: RequestState) -> list[tuple[str, float | None, list]]:
        """With echo and logprobs, the prompt's tokens come first (the first has no logprob)."""
        if not (self.echoed and self.wants_logprobs()):
            return []
        text = self.tm.token_text
        return [
            (text(tid), lp, [(text(t), v) for v, t in (top or [])])
            for (lp, tid), top in zip(state.input_logprobs or [], state.input_top_logprobs or [])
        ]

    @staticmethod
    def format_logprobs(entries: list[tuple[str, float | None, list]]) -> dict:
        return {
            "tokens": [t for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(alts) for _, _, alts in entries],
            "text_offset": [],
        }

    def chunks_for(self, i: int, state: RequestState) -> list[dict]:
        chunks = super().chunks_for(i, state)
        if self.echoed and chunks and i not in self.echo_sent:  # the prompt leads the first chunk
            self.echo_sent.add(i)
            chunks[0]["choices"][0]["text"] = self.echoed[i] + chunks[0]["choices"][0]["text"]
        return chunks

    def first_chunk(self, n: int) -> dict:
        return self.envelope(
            [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(n)],
            self.chunk_object,
        )

    def delta_chunk(self, i: int, delta: str, state: RequestState) -> dict:
        return self.envelope(
            [
                {
                    "index": i,
                    "text": delta,
                    "logprobs": None,
                    "finish_reason": _finish_reason(state) if state.finished else None,
                }
            ],
            self.chunk_object,
        )


class _Chat(_Adapter):
    prefix, object_name, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(
        self,
        tm: TokenizerManager,
        model: str,
        body,
        tool_parser=None,
        reasoning: ReasoningParser | None = None,
    ):
        super().__init__(tm, model, body)
        self.tool_parser = tool_parser  # None: no tools offered, the text is all content
        self.reasoning = reasoning  # None: no reasoning is split out
        self.streams: dict[int, StreamingToolParser] = {}
        self.thoughts: dict[int, StreamingReasoningParser] = {}
        self.contents: dict[
            int, str
        ] = {}  # each choice's content streamed so far (reasoning split out)
        self.called: set[int] = set()  # choices that made a call

    def choice(self, i: int, state: RequestState) -> dict:
        reasoning, content = (
            self.reasoning.split(state.text) if self.reasoning else (None, state.text)
        )
        message: dict = {"role": "assistant", "content": content}
        finish = _finish_reason(state)
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(content)
            if parsed.calls:
                message = {
                    "role": "assistant",
                    "content": parsed.content or None,
                    "tool_calls": [_tool_call_json(call) for call in parsed.calls],
                }
                finish = "tool_calls"
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {
            "index": i,
            "message": message,
            "logprobs": self.chat_logprobs(state),
            "finish_reason": finish,
            "matched_stop": _matched_stop(state),
        }

    def chunks_for(self, i: int, state: RequestState) -> list[dict]:
        """Reasoning as `reasoning_content` deltas; content as it comes (holding back what may
        start a tag); each call as OpenAI streams one: a delta with its id and name, then one
        with its arguments; then a last delta with the finish reason."""
        if self.tool_parser is None and self.reasoning is None:
            return super().chunks_for(i, state)
        chunks, content = [], state.text
        if self.reasoning is not None:
            split = self.thoughts.setdefault(i, StreamingReasoningParser(self.reasoning))
            thought, more = split.feed(state.text, state.finished)
            if thought:
                chunks.append(self.delta_chunk_of(i, {"reasoning_content": thought}))
            content = self.contents[i] = self.contents.get(i, "") + more
        if self.tool_parser is None:
            chunks += super().chunks_for(i, replace(state, text=content))
            return chunks
        stream = self.streams.setdefault(i, StreamingToolParser(self.tool_parser))
        events = stream.feed(content) + (stream.finish() if state.finished else [])
        for event in events:
            if event.call is None:
                chunks.append(self.delta_chunk_of(i, {"content": event.content}))
                continue
            self.called.add(i)
            call = _tool_call_json(event.call)
            chunks.append(
                self.delta_chunk_of(
                    i,
                    {
                        "tool_calls": [
                            {
                                "index": event.call_index,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": call["function"]["name"], "arguments": ""},
                            }
                        ]
                    },
                )
            )
            chunks.append(
                self.delta_chunk_of(
                    i,
                    {
                        "tool_calls": [
                            {
                                "index": event.call_index,
                                "function": {"arguments": call["function"]["arguments"]},
                            }
                        ]
                    },
                )
            )
        if state.finished:
            finish = "tool_calls" if i in self.called else _finish_reason(state)
            chunks.append(self.delta_chunk_of(i, {}, finish))
        return chunks

    def chat_logprobs(self, state: RequestState) -> dict | None:
        return self.format_logprobs(self.logprobs_of(state)) if self.wants_logprobs() else None

    def wants_logprobs(self) -> bool:
        return self.body.logprobs

    @staticmethod
    def format_logprobs(entries: list[tuple[str, float, list]]) -> dict:
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alts
                    ],
                }
                for t, lp, alts in entries
            ]
        }

    def first_chunk(self, n: int) -> dict:
        return self.envelope(
            [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(n)
            ],
            self.chunk_object,
        )

    def delta_chunk(self, i: int, delta: str, state: RequestState) -> dict:
        return self.delta_chunk_of(
            i,
            {"content": delta} if delta else {},
            _finish_reason(state) if state.finished else None,
        )

    def delta_chunk_of(self, i: int, delta: dict, finish: str | None = None) -> dict:
        return self.envelope(
            [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}],
            self.chunk_object,
        )


def _tool_call_json(call: ToolCall) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
