"""OpenAI response bodies and stream chunks from finished and streaming requests:
completions and chat (content, reasoning, tool calls, logprobs, usage)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

from ..messages import GenerateReq
from ..reasoning import ReasoningParser, StreamingReasoningParser
from ..request_state import RequestState
from ..tool_calls import StreamingToolParser, ToolCall
from .tokenizer_manager import TokenizerManager


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
        reply = self.envelope(choices, self.object_name, _usage(states))
        reply["metadata"] = {"weight_version": self.tm.weight_version}  # SGLang's field
        return reply

    async def stream(self, reqs: list[GenerateReq]):
        queue: asyncio.Queue = asyncio.Queue()
        finals: dict[int, RequestState] = {}
        tasks = [asyncio.create_task(self._pump(i, r, queue)) for i, r in enumerate(reqs)]
        try:
            first = self.first_chunk(len(reqs))
            if first is not None:
                yield first
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


class CompletionAdapter(_Adapter):
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

    def first_chunk(self, n: int) -> dict | None:
        """None: a completion's first chunk carries its first token (a client timing the first
        token must not see an empty chunk sent before any was computed)."""
        return None

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


class ChatAdapter(_Adapter):
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
            chunks.append(self.delta_chunk_of(i, {}, finish, _matched_stop(state)))
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
            _matched_stop(state),
        )

    def delta_chunk_of(
        self, i: int, delta: dict, finish: str | None = None, matched: int | str | None = None
    ) -> dict:
        """A chunk of choice `i`; the last (with `finish`) also names the stop it matched."""
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return self.envelope([choice], self.chunk_object)


def _tool_call_json(call: ToolCall) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
