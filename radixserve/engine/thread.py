"""The offline engine's scheduler thread: it builds the model and the scheduler, then runs
every step. Callers post requests, aborts and control commands to it from any thread and read
each request's outputs from a queue of its own."""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from ..config import EngineArgs
from ..constrained import grammar_backend
from ..messages import ControlReq, GenerateReq, ReqOutput
from ..models.source import ModelSource
from ..scheduler.control import run_control
from ..scheduler.scheduler import Scheduler
from ..tokenizer import eos_ids
from ..worker.process import build_runners

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the thread's longest sleep with no work (a stop wakes it)


class SchedulerThread:
    def __init__(self, args: EngineArgs, source: ModelSource, tokenizer, detokenizer):
        """Returns once the model is built; raises what building it raised."""
        self.args, self.tokenizer, self.detokenizer = args, tokenizer, detokenizer
        self.runner = self.scheduler = None
        self.stopped = False
        self._inbox: deque = deque()
        self._streams: dict[str, queue.Queue] = {}
        self._wake = threading.Condition()
        started: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, args=(source, started), name="radixserve-scheduler", daemon=True
        )
        self._thread.start()
        failure = started.get()
        if failure is not None:
            self._thread.join()
            raise failure

    # ---- from the callers' threads -----------------------------------------------
    def submit(self, req: GenerateReq) -> queue.Queue:
        """Queue a checked request; its outputs (or an exception) arrive on the returned queue."""
        stream: queue.Queue = queue.Queue()
        self._streams[req.rid] = stream
        self._post(("add", req))
        return stream

    def abort(self, rid: str) -> None:
        self._post(("abort", rid))

    def control(self, kind: str, arg: int = 0, text: str = "") -> dict:
        """Run a command of `scheduler.control` on this thread and return its reply; a command
        refused for a reason raises ValueError with it."""
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

    def stop(self) -> None:
        """End the loop and drop the KV pool and the weights."""
        if self.stopped:
            return
        self.stopped = True
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout=30)
        self.scheduler = self.runner = None

    def _post(self, item) -> None:
        if self.stopped:
            raise RuntimeError("the engine is shut down")
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    # ---- on this thread ------------------------------------------------------------
    def _run(self, source: ModelSource, started: queue.Queue) -> None:
        """Build the model and scheduler here, then loop: one thread runs every torch op of the
        engine. With OpenMP, ops started from a second thread once another thread has run any
        take far longer (bench/results/cpu.md), so the caller's thread should not run torch
        work while the engine does."""
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
        while not self.stopped:
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
                self._streams.pop(payload.rid).put(exc)
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
            stream = self._streams.get(out.rid)
            if stream is not None:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.rid, None)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(RuntimeError(f"engine failed: {exc}"))
        self._streams.clear()


def next_output(stream: queue.Queue) -> ReqOutput:
    """A request's next output from its queue; raises what the thread put there instead."""
    item = stream.get()
    if isinstance(item, BaseException):
        raise item
    return item
