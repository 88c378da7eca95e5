"""The api process's side of a request: validate, tokenize, send, await outputs, abort."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from ..ipc import Endpoints, decode, encode, pull_socket, push_socket
from ..messages import (
    AbortReq,
    BatchOut,
    Bootstrap,
    ControlReply,
    ControlReq,
    GenerateReq,
    ImageInput,
    SchedulerReady,
)
from ..multimodal.media import MediaPolicy
from ..request_state import RequestState
from ..sampling_params import SamplingParams
from ..tokenizer import decode_ids
from ..validation import (
    check_bootstrap,
    check_cache_salt,
    check_generate,
    check_output_room,
    check_priority,
)
from .http import RequestError
from .images import ImageInputs
from .tokenizing import InputTokenizer

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1
CLASSIFIER_ONLY = (
    "this model is a sequence classifier (a cross-encoder): it serves /v1/rerank and /v1/score"
)


@dataclass
class _Pending:
    state: RequestState
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)


class TokenizerManager:
    def __init__(
        self,
        tokenizer: Any,
        endpoints: Endpoints,
        ready: SchedulerReady,
        max_queued: int | None = None,
        priority_scheduling: bool = False,
        disaggregation_mode: str = "null",
    ):
        self.tokenizer = tokenizer
        self.inputs = InputTokenizer(tokenizer)  # every tokenization, off the event loop
        self.endpoints = endpoints
        self.info = ready.info
        self.model_name = ready.model_name
        self.priority_scheduling = priority_scheduling
        self.disaggregation_mode = disaggregation_mode
        self.max_in_flight = (
            None if max_queued is None else max_queued + ready.info.max_running_requests
        )
        self.dead: str | None = None  # why the server can no longer run requests
        self.pending: dict[str, _Pending] = {}
        self.replies: dict[str, asyncio.Future] = {}
        self.observers: list[Callable[[RequestState], None]] = []
        self.weight_version = "default"  # named by /update_weights_from_disk; in every reply
        self.only_pooling: str | None = None  # a classifier serves pooling requests only
        self.lora_adapters = list(ready.lora_adapters)  # kept by /load_ and /unload_lora_adapter
        self.images = ImageInputs(None, MediaPolicy(), {}, None)  # a vision model's: set at launch

    async def start(self, inbox: zmq.Socket | None = None) -> None:
        """Bind sockets and start reading outputs (call inside the server's event loop)."""
        ctx = zmq.asyncio.Context.instance()
        self.outbox = push_socket(ctx, self.endpoints.scheduler_in, bind=False)
        self.inbox = inbox
        self.reader = asyncio.create_task(self._read_outputs())

    def make_request(
        self,
        input_ids: list[int],
        params: dict | None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        priority: int | None = None,
        max_tokens_field: str | None = None,
        cache_salt: str | None = None,
        pooling: str | None = None,
        lora_path: str | None = None,
        bootstrap: Bootstrap | None = None,
        images: list[ImageInput] | None = None,
    ) -> GenerateReq:
        """A validated request: the scheduler never sees bad input. `max_tokens_field` names
        the field when the output length was given explicitly (then it must fit the context)."""
        try:
            sp = SamplingParams.from_dict(params)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"invalid sampling_params: {exc}") from exc
        req = GenerateReq(
            rid or uuid.uuid4().hex,
            input_ids,
            sp,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            priority=priority or 0,
            cache_salt=cache_salt,
            pooling=pooling,
            lora_path=lora_path,
            bootstrap=bootstrap,
            images=images,
        )
        if self.only_pooling is not None and pooling != self.only_pooling:
            raise RequestError(CLASSIFIER_ONLY)
        try:
            check_priority(priority, self.priority_scheduling)
            check_cache_salt(cache_salt)
            check_bootstrap(req, self.disaggregation_mode, sp.n)
            check_generate(req, self.info)
            if max_tokens_field is not None:
                check_output_room(len(input_ids), sp.max_new_tokens, self.info, max_tokens_field)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        return req

    @staticmethod
    def check_disaggregated(reqs: list[GenerateReq]) -> None:
        """A bootstrap room names one request: one prompt, one sample."""
        if len(reqs) > 1 and any(r.bootstrap is not None for r in reqs):
            raise RequestError("bootstrap_room: a disaggregated request has one prompt")

    @staticmethod
    def expand_n(req: GenerateReq) -> list[GenerateReq]:
        """n samples become n requests; the shared prompt is computed once through the radix
        cache."""
        if req.sampling_params.n == 1:
            return [req]
        return [
            replace(req, rid=f"{req.rid}-{i}", sampling_params=sample)
            for i, sample in enumerate(req.sampling_params.per_sample())
        ]

    # ---- running ----------------------------------------------------------
    async def run(self, req: GenerateReq) -> AsyncIterator[RequestState]:
        """Send a request and yield its state after every update; aborts if the caller stops
        early."""
        pending = await self._send(req)
        try:
            while not pending.state.finished:
                pending.state.update(_raise_error(await pending.updates.get()))
                yield pending.state
        finally:
            await self._close(req.rid, pending)
        self._finish(pending)

    async def run_to_end(
        self, req: GenerateReq, disconnected: Callable | None = None
    ) -> RequestState:
        """Await the final state; abort if `disconnected()` turns true while waiting."""
        pending = await self._send(req)
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while not pending.state.finished:
                try:
                    update = await asyncio.wait_for(pending.updates.get(), DISCONNECT_POLL_S)
                    pending.state.update(_raise_error(update))
                except asyncio.TimeoutError:
                    pass
                if disconnected is not None and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await disconnected():
                        raise RequestError("client disconnected", 499)
        finally:
            await self._close(req.rid, pending)
        return self._finish(pending)

    async def _send(self, req: GenerateReq) -> _Pending:
        if self.dead is not None:
            raise RequestError(f"the server cannot run requests: {self.dead}", 503)
        if self.max_in_flight is not None and len(self.pending) >= self.max_in_flight:
            raise RequestError(
                "the request queue is full; retry later", 503, {"Retry-After": str(RETRY_AFTER_S)}
            )
        if req.rid in self.pending:
            raise RequestError(f"a request with rid {req.rid!r} is already running")
        state = RequestState(req.rid, lora_path=req.lora_path)
        pending = self.pending[req.rid] = _Pending(state)
        await self.outbox.send(encode(req))
        return pending

    async def _close(self, rid: str, pending: _Pending) -> None:
        self.pending.pop(rid, None)
        if not pending.state.finished:
            await self.abort(rid)

    def _finish(self, pending: _Pending) -> RequestState:
        reason = pending.state.finish_reason
        if reason is not None and reason.rejected:
            raise RequestError(reason.message or "bad request")
        if reason is not None and reason.unavailable:
            raise RequestError(reason.message or "unavailable", 503)
        for observe in self.observers:
            observe(pending.state)
        return pending.state

    async def abort(self, rid: str) -> None:
        await self.outbox.send(encode(AbortReq(rid)))

    def fail_all(self, reason: str) -> None:
        """A child process died: every waiting request ends with a 503 naming `reason`, and
        new ones are refused. Call on the event loop."""
        self.dead = reason
        for pending in self.pending.values():
            pending.updates.put_nowait(
                RequestError(f"the server cannot finish this request: {reason}", 503)
            )

    async def control(self, kind: str, arg: int = 0, timeout: float = 10.0, text: str = "") -> dict:
        token = uuid.uuid4().hex
        future = self.replies[token] = asyncio.get_running_loop().create_future()
        await self.outbox.send(encode(ControlReq(kind, token, arg, text)))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.replies.pop(token, None)

    async def _read_outputs(self) -> None:
        while True:
            msg = decode(await self.inbox.recv())
            if isinstance(msg, BatchOut):
                for out in msg.outputs:
                    pending = self.pending.get(out.rid)
                    if pending is not None:
                        pending.updates.put_nowait(out)
            elif isinstance(msg, ControlReply):
                future = self.replies.get(msg.token)
                if future is not None and not future.done():
                    future.set_result(msg.data)

    def token_text(self, token_id: int) -> str:
        return self.text_of([token_id])

    def text_of(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included ("" without a tokenizer)."""
        return (
            ""
            if self.tokenizer is None
            else decode_ids(self.tokenizer, token_ids, skip_special_tokens=False)
        )


def _raise_error(update: Any) -> Any:
    if isinstance(update, RequestError):
        raise update
    return update


def api_inbox(endpoints: Endpoints) -> zmq.Socket:
    """The api's inbound socket, bound before the children start so nothing is lost."""
    return pull_socket(zmq.asyncio.Context.instance(), endpoints.api_in, bind=True)
