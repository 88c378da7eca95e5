"""The offline engine: tokenizer, scheduler and model worker in one process.

The scheduler runs in a background thread; `generate` and `generate_stream` may be
called from any thread.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import fields
from typing import Any, Iterator

from ..config import EngineArgs, refuse_problems
from ..detokenizer import Detokenizer
from ..messages import GenerateReq, SchedulerStats
from ..models.option_support import model_problems
from ..models.source import resolve_model
from ..multimodal.spec import VisionSpec
from ..request_state import RequestState
from ..sampling_params import SamplingParams
from ..tokenizer import encode_prompt, load_tokenizer_or_none
from .media import Data, EngineMedia
from .requests import make_requests, need_tokenizer
from .thread import SchedulerThread, next_output

log = logging.getLogger(__name__)


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
        refuse_problems("model", model_problems(source.config, self.args))
        self.model_name = source.name
        self.tokenizer = load_tokenizer_or_none(source.tokenizer_dir)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer else None
        self._thread = SchedulerThread(self.args, source, self.tokenizer, self.detokenizer)
        spec = VisionSpec.of(source.config.hf_config, source.weights_dir)
        self.media = EngineMedia(spec, self.tokenizer, self.runner.info.max_context_len)
        log.info(self.runner.info.capacity_line())

    @property
    def runner(self):
        return self._thread.runner

    @property
    def scheduler(self):
        return self._thread.scheduler

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
        image_data: Data | list[Data] | None = None,
        video_data: Data | list[Data] | None = None,
    ) -> dict | list[dict]:
        """SGLang-shaped results: one dict for one prompt, a list for a batch (n>1 expands in
        place). `lora_path`: an adapter's name for every prompt, or a list, one per prompt.
        `image_data`, `video_data`: one prompt's images and videos (`engine.media`), each
        marked in it as a chat turn marks one."""
        reqs, single = make_requests(
            self.tokenizer,
            self.runner.info,
            prompt,
            input_ids,
            sampling_params,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            cache_salt,
            lora_path,
            self._media(image_data, video_data),
        )
        streams = [self._thread.submit(r) for r in reqs]
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
        reqs, _ = make_requests(
            self.tokenizer,
            self.runner.info,
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
        stream = self._thread.submit(req)
        state = RequestState(req.rid)
        try:
            while not state.finished:
                state.update(next_output(stream))
                yield state.to_dict(return_logprob, self._token_text)
        finally:
            if not state.finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._thread.abort(rid)

    def flush_cache(self) -> bool:
        return self._thread.control("flush_cache")["success"]

    def update_weights_from_disk(self, model_path: str, abort_all_requests: bool = False) -> int:
        """Serve the checkpoint at `model_path` from the next step on (`control.update_weights`);
        returns how many in-flight requests were ended or retracted."""
        reply = self._thread.control("update_weights", int(abort_all_requests), model_path)
        return reply["num_paused_requests"]

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve one more LoRA adapter; ValueError with the reason when it does not fit."""
        self._thread.control("load_lora", text=f"{lora_name}\n{lora_path}")

    def unload_lora_adapter(self, lora_name: str, timeout: float = 300.0) -> None:
        """Unload an adapter once the requests that use it finish (it takes no new ones);
        TimeoutError when they outlast `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (busy := self._thread.control("unload_lora", text=lora_name)["in_use"]) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"LoRA adapter {lora_name!r} is still used by {busy} requests")
            time.sleep(0.02)

    def get_stats(self) -> SchedulerStats:
        figures = self._thread.control("stats")
        return SchedulerStats(**{f.name: figures[f.name] for f in fields(SchedulerStats)})

    def check_memory(self) -> None:
        """AssertionError naming the broken capacity invariant."""
        reply = self._thread.control("check_memory")
        if not reply["ok"]:
            raise AssertionError(reply["error"])

    def encode(self, text: str) -> list[int]:
        need_tokenizer(self.tokenizer)
        return encode_prompt(self.tokenizer, text)

    def shutdown(self) -> None:
        self._thread.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- request plumbing --------------------------------------------------
    def _media(self, image_data, video_data):
        if image_data is None and video_data is None:
            return None
        return lambda ids: self.media.attach(ids, image_data, video_data)

    def _collect(
        self, req: GenerateReq, stream: queue.Queue, with_logprobs: bool, text_in_logprobs: bool
    ) -> dict:
        state = RequestState(req.rid)
        while not state.finished:
            state.update(next_output(stream))
        return state.to_dict(with_logprobs, self._token_text if text_in_logprobs else None)

    def _token_text(self, token_id: int) -> str:
        return (
            self.detokenizer.decode([token_id], skip_special_tokens=False)
            if self.detokenizer
            else ""
        )
