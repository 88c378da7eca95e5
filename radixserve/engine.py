"""The offline engine: tokenizer, scheduler and model worker in one process.

The scheduler runs in a background thread; `generate` and `generate_stream` may be
called from any thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import fields
from typing import Any, Iterator

from .config import EngineArgs
from .constrained import grammar_backend
from .detokenizer import Detokenizer
from .messages import ControlReq, GenerateReq, ReqOutput, SchedulerStats
from .models.source import resolve_model
from .request_state import RequestState
from .sampling_params import SamplingParams
from .scheduler.control import run_control
from .scheduler.scheduler import Scheduler
from .tokenizer import encode_prompt, eos_ids, load_tokenizer_or_none
from .validation import check_cache_salt, check_generate
from .worker.process import build_runners

log = logging.getLogger(__name__)

_STOP = object()
IDLE_WAIT_S = 0.5  # the scheduler thread's longest sleep with no work (a stop wakes it)


class Engine:
    def __init__(self, model: str | None = None, *, args: EngineArgs | None = None, **kwargs: Any):
        """`Engine(model, **options)` as SGLang's, or `Engine(args=EngineArgs(...))`."""
        if args is not None and (model is not None or kwargs):
            raise ValueError("give the Engine either args or options, not both")
        self.args = args if args is not None else EngineArgs(model=model, **kwargs)
        if self.args.tp_size != 1:
            raise ValueError(
                "the offline Engine runs one process; serve with `radixserve serve --tp-size N` "
                "for tensor parallelism"
            )
        if self.args.kv_events_config is not None:
            raise ValueError(
                "KV events are published by the server: `radixserve serve --kv-events-config ...`"
            )
        source = resolve_model(self.args.model)
        self.model_name = source.name
        self.tokenizer = load_tokenizer_or_none(source.tokenizer_dir)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer else None
        self._inbox: deque = deque()
        self._queues: dict[str, queue.Queue] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        started: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(source, started), name="radixserve-scheduler", daemon=True
        )
        self._thread.start()
        failure = started.get()
        if failure is not None:
            self._thread.join()
            raise failure
        log.info(self.runner.info.capacity_line())

    # ---- public API ------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list[dict | SamplingParams] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        cache_salt: str | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> dict | list[dict]:
        """SGLang-shaped results: one dict for one prompt, a list for a batch (n>1 expands in
        place). `lora_path`: an adapter's name for every prompt, or a list, one per prompt."""
        reqs, single = self._make_requests(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            cache_salt,
            lora_path,
        )
        streams = [self._submit(r) for r in reqs]
        results = [
            self._collect(r, s, return_logprob, return_text_in_logprobs)
            for r, s in zip(reqs, streams)
        ]
        return results[0] if single and len(results) == 1 else results

    def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict | SamplingParams | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
    ) -> Iterator[dict]:
        """Yields the cumulative result after every step that produced text."""
        reqs, _ = self._make_requests(
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            cache_salt,
        )
        if len(reqs) != 1:
            raise ValueError("generate_stream takes one prompt with n=1")
        req = reqs[0]
        stream = self._submit(req)
        state = RequestState(req.rid)
        try:
            while not state.finished:
                state.update(self._next_output(stream))
                yield state.to_dict(return_logprob, self._token_text)
        finally:
            if not state.finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._post(("abort", rid))

    def flush_cache(self) -> bool:
        return self._control("flush_cache")["success"]

    def update_weights_from_disk(self, model_path: str, abort_all_requests: bool = False) -> int:
        """Serve the checkpoint at `model_path` from the next step on (`control.update_weights`);
        returns how many in-flight requests were ended or retracted."""
        reply = self._control("update_weights", int(abort_all_requests), model_path)
        return reply["num_paused_requests"]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve one more LoRA adapter; ValueError with the reason when it does not fit."""
        self._control("load_lora", text=f"{lora_name}\n{lora_path}")

    def unload_lora_adapter(self, lora_name: str, timeout: float = 300.0) -> None:
        """Unload an adapter once the requests that use it finish (it takes no new ones);
        TimeoutError when they outlast `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (busy := self._control("unload_lora", text=lora_name)["in_use"]) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"LoRA adapter {lora_name!r} is still used by {busy} requests")
            time.sleep(0.02)

    def get_stats(self) -> SchedulerStats:
        figures = self._control("stats")
        return SchedulerStats(**{f.name: figures[f.name] for f in fields(SchedulerStats)})

    def check_memory(self) -> None:
        """AssertionError naming the broken capacity invariant."""
        reply = self._control("check_memory")
        if not reply["ok"]:
            raise AssertionError(reply["error"])

    def encode(self, text: str) -> list[int]:
        self._need_tokenizer()
        return encode_prompt(self.tokenizer, text)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=30)
        self.scheduler = self.runner = None  # drop the KV pool and the weights

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- request plumbing --------------------------------------------------
    def _make_requests(
        self,
        prompt,
        input_ids,
        sampling_params,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        cache_salt: str | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> tuple[list[GenerateReq], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt or input_ids")
        check_cache_salt(cache_salt)
        single = isinstance(prompt, str) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], int)
        )
        if input_ids is not None:
            id_lists = [input_ids] if single else list(input_ids)
        else:
            self._need_tokenizer()
            id_lists = [encode_prompt(self.tokenizer, p) for p in ([prompt] if single else prompt)]
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(id_lists)
        )
        if len(params_list) != len(id_lists):
            raise ValueError("sampling_params list must match the number of prompts")
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(id_lists)
        if len(adapters) != len(id_lists):
            raise ValueError("lora_path list must match the number of prompts")
        reqs = []
        for ids, raw, adapter in zip(id_lists, params_list, adapters):
            params = raw if isinstance(raw, SamplingParams) else SamplingParams.from_dict(raw)
            if isinstance(raw, SamplingParams):
                params.validate()
            for sample in params.per_sample():
                req = GenerateReq(
                    uuid.uuid4().hex,
                    list(ids),
                    sample,
                    return_logprob,
                    logprob_start_len,
                    top_logprobs_num,
                    cache_salt=cache_salt,
                    lora_path=adapter,
                )
                check_generate(req, self.runner.info)
                reqs.append(req)
        return reqs, single

    def _submit(self, req: GenerateReq) -> queue.Queue:
        stream: queue.Queue = queue.Queue()
        self._queues[req.rid] = stream
        self._post(("add", req))
        return stream

    def _collect(
        self, req: GenerateReq, stream: queue.Queue, with_logprobs: bool, text_in_logprobs: bool
    ) -> dict:
        state = RequestState(req.rid)
        while not state.finished:
            state.update(self._next_output(stream))
        return state.to_dict(with_logprobs, self._token_text if text_in_logprobs else None)

    def _next_output(self, stream: queue.Queue) -> ReqOutput:
        item = stream.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _token_text(self, token_id: int) -> str:
        return (
            self.detokenizer.decode([token_id], skip_special_tokens=False)
            if self.detokenizer
            else ""
        )

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass input_ids")

    def _post(self, item) -> None:
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _control(self, kind: str, arg: int = 0, text: str = "") -> dict:
        """Run a command of `scheduler.control` on the scheduler thread; a command refused for
        a reason raises ValueError with it."""
        reply: queue.Queue = queue.Queue()
        self._post(("control", (reply, ControlReq(kind, "", arg, text))))
        result = reply.get()
        if isinstance(result, BaseException):
            raise result
        if "error" in result:
            raise RuntimeError(result["error"])
        if result.get("success") is False and "message" in result:
            raise ValueError(result["message"])
        return result

    # ---- the scheduler thread ------------------------------------------------
    def _run(self, source, started: queue.Queue) -> None:
        """Build the model and scheduler here, then loop: one thread runs every torch op of the
        engine. With OpenMP, ops started from a second thread once another thread has run any
        take far longer (bench/README.md), so the caller's thread should not run torch work
        while the engine does."""
        try:
            self.runner, draft_runner = build_runners(source, self.args)
            decode_tail = self.detokenizer.decode if self.detokenizer else None
            self.scheduler = Scheduler(
                self.args,
                self.runner,
                decode_tail,
                eos_ids(self.tokenizer),
                grammar_backend(self.tokenizer, self.runner.info),
                draft_runner,
            )
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            started.put(exc)
            return
        started.put(None)
        self._loop()

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stopped:
            with self._wake:
                timeout = sched.poll_timeout_s(IDLE_WAIT_S)
                if not self._inbox and timeout > 0:
                    self._wake.wait(timeout=timeout)
                items = list(self._inbox)
                self._inbox.clear()
            for kind, payload in items:
                self._handle(kind, payload)
            try:
                outputs = sched.step()
            except BaseException as exc:  # a crash must not hang callers
                log.exception("scheduler step failed")
                self._fail_all(exc)
                return
            self._deliver(outputs)

    def _handle(self, kind: str, payload) -> None:
        sched = self.scheduler
        if kind == "add":
            try:
                sched.add_request(payload)
            except ValueError as exc:
                self._queues.pop(payload.rid).put(exc)
        elif kind == "abort":
            sched.abort(payload)
        else:
            reply, msg = payload
            try:
                reply.put(run_control(sched, msg))
            except BaseException as exc:
                reply.put(exc)

    def _deliver(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            if self.detokenizer:
                out.text = self.detokenizer.text_for(out)
            stream = self._queues.get(out.rid)
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._queues.pop(out.rid, None)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._queues.values():
            stream.put(RuntimeError(f"engine failed: {exc}"))
        self._queues.clear()
