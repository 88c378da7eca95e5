"""Every tokenization and chat-template render of user input, off the api process's event loop.

Short inputs run on a thread of normal priority (they take microseconds). Long ones run on
threads at the lowest CPU priority: on a 2-core machine a long tokenization (400,000 words
take ~2.5 s) on a thread of normal priority takes a core from the scheduler's OpenMP threads,
and a 4-token request beside it took 4x its usual time; at the lowest priority it yields that
core to them."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..tokenizer import apply_chat_template, encode_prompt
from .http import RequestError

LONG_INPUT_CHARS = 20_000  # from this length on, an input is tokenized at the lowest priority
LOWEST_PRIORITY = 19
T = TypeVar("T")


def lower_this_threads_priority() -> None:
    """Linux gives each thread its own nice value (PRIO_PROCESS with a thread id)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except OSError:  # not permitted here: the thread runs at the process's priority
        pass


class InputTokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.short_lane = ThreadPoolExecutor(4, thread_name_prefix="tokenize")
        self.long_lane = ThreadPoolExecutor(
            2, thread_name_prefix="tokenize-long", initializer=lower_this_threads_priority
        )

    def close(self) -> None:
        self.short_lane.shutdown(wait=False, cancel_futures=True)
        self.long_lane.shutdown(wait=False, cancel_futures=True)

    async def _run(self, size: int, work: Callable[..., T], *args, **kwargs) -> T:
        lane = self.long_lane if size >= LONG_INPUT_CHARS else self.short_lane
        return await asyncio.get_running_loop().run_in_executor(lane, lambda: work(*args, **kwargs))

    # ---- the calls, each off the event loop -------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids (`tokenizer.encode_prompt`: no second BOS); without
        `add_special_tokens`, the text's own tokens only (/tokenize)."""
        tokenizer = self._need("this model has no tokenizer; send input_ids")
        if add_special_tokens:
            return await self._run(len(text), encode_prompt, tokenizer, text)
        return await self._run(len(text), tokenizer.encode, text, add_special_tokens=False)

    async def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input, the way HF's tokenizer pairs them (for cross-encoders)."""
        tokenizer = self._need("this model has no tokenizer")
        ids = await self._run(len(first) + len(second), tokenizer, first, second)
        return ids["input_ids"]

    async def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None = None, **options
    ) -> str:
        """The rendered prompt; `options` are the template's
        (`ChatCompletionRequest.template_options`)."""
        tokenizer = self._need("this model has no chat template")
        size = sum(len(str(m.get("content") or "")) for m in messages)
        try:
            return await self._run(
                size, apply_chat_template, tokenizer, messages, tools=tools, **options
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        except Exception as exc:  # template errors are the caller's input
            raise RequestError(f"cannot apply the chat template: {exc}") from exc

    def _need(self, problem: str) -> Any:
        if self.tokenizer is None:
            raise RequestError(problem)
        return self.tokenizer
