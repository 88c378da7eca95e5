"""Accumulates a request's outputs into SGLang's response shape."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .messages import FinishReason, ReqOutput


@dataclass
class RequestState:
    rid: str
    created: float = field(default_factory=time.monotonic)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_time: float = 0.0
    output_logprobs: list[list] = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: list[list] | None = None
    input_top_logprobs: list | None = None
    error: str | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None
    lora_path: str | None = None  # the LoRA adapter it ran on (None: the base model)

    def update(self, out: ReqOutput) -> None:
        if out.new_token_ids:
            self._time_tokens(len(out.new_token_ids))
        self.queue_time = out.queue_time
        self.text += out.text
        self.output_ids += out.new_token_ids
        self.finished, self.finish_reason = out.finished, out.finish_reason
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        self.spec_verify_ct, self.spec_accepted_tokens = (
            out.spec_verify_ct,
            out.spec_accepted_tokens,
        )
        self.output_logprobs += out.output_logprobs or []
        self.output_top_logprobs += out.output_top_logprobs or []
        if out.input_logprobs is not None:
            self.input_logprobs, self.input_top_logprobs = (
                out.input_logprobs,
                out.input_top_logprobs,
            )

    def _time_tokens(self, count: int) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.inter_token_latencies += [(now - self.last_token_at) / count] * count
        self.last_token_at = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.created

    def to_dict(
        self, with_logprobs: bool = False, token_text: Callable[[int], str] | None = None
    ) -> dict:
        meta = {
            "id": self.rid,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.to_json(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": time.monotonic() - self.created,
        }
        if self.spec_verify_ct:
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accept_length"] = 1 + self.spec_accepted_tokens / self.spec_verify_ct
        if with_logprobs:
            meta.update(self._logprob_meta(token_text))
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _logprob_meta(self, token_text) -> dict:
        entry = lambda pair: [pair[0], pair[1], token_text(pair[1]) if token_text else None]  # noqa: E731
        tops = lambda rows: [None if r is None else [entry(p) for p in r] for r in rows]  # noqa: E731
        return {
            "input_token_logprobs": [entry(p) for p in self.input_logprobs or []],
            "output_token_logprobs": [entry(p) for p in self.output_logprobs],
            "input_top_logprobs": tops(self.input_top_logprobs or []),
            "output_top_logprobs": tops(self.output_top_logprobs),
        }
