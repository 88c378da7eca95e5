"""`@function` programs, `run` and `run_batch`."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .backend import Backend
from .interpreter import ProgramState


class _DefaultBackend:
    """The backend used when `run` gets none; set explicitly with `set_default_backend`."""

    backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    _DefaultBackend.backend = backend


def _resolve(backend: Backend | None) -> Backend:
    backend = backend or _DefaultBackend.backend
    if backend is None:
        raise ValueError(
            "no backend: pass backend=RuntimeEndpoint(url) / EngineBackend(engine), "
            "or call set_default_backend"
        )
    return backend


class SglFunction:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run the program; with stream=True return at once and read `state.text_iter()`."""
        state = ProgramState(_resolve(backend), stream=stream)
        self.fn(state, *args, **kwargs)
        return state if stream else state.sync()

    def run_batch(
        self,
        batch_kwargs: list[dict],
        backend: Backend | None = None,
        num_threads: int = 8,
        progress_bar: bool = False,
    ) -> list[ProgramState]:
        """Run many programs concurrently; results keep input order. A program that fails
        gets its exception in `state.error` instead of sinking the batch."""
        backend = _resolve(backend)
        bar = _progress(len(batch_kwargs), progress_bar)
        with ThreadPoolExecutor(max_workers=max(num_threads, 1)) as pool:
            futures = [pool.submit(self._run_one, backend, kwargs, bar) for kwargs in batch_kwargs]
            states = [f.result() for f in futures]
        if bar is not None:
            bar.close()
        return states

    def _run_one(self, backend: Backend, kwargs: dict, bar) -> ProgramState:
        state = ProgramState(backend)
        try:
            self.fn(state, **kwargs)
            state.sync()
        except Exception as exc:
            state.error = exc
        if bar is not None:
            bar.update(1)
        return state

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> SglFunction:
    """Decorate `def program(s, ...)` into a runnable program."""
    return SglFunction(fn)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="programs")
