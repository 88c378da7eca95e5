"""The scheduler's requests: the waiting queue and the running batch, and every move between
them. The parts of the scheduler read both through read-only views and ask this object for a
transition; none of them holds or changes the lists."""

from __future__ import annotations

from .req import Req


class RequestQueues:
    def __init__(self) -> None:
        self._waiting: list[Req] = []
        self._running: list[Req] = []

    # ---- views ---------------------------------------------------------------
    @property
    def waiting(self) -> tuple[Req, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Req, ...]:
        return tuple(self._running)

    def all(self) -> tuple[Req, ...]:
        """Every queued and running request, the queue first."""
        return (*self._waiting, *self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    def is_running(self, req: Req) -> bool:
        return req in self._running

    def __bool__(self) -> bool:
        return bool(self._waiting or self._running)

    # ---- transitions -----------------------------------------------------------
    def enqueue(self, req: Req) -> None:
        """A new request joins the back of the queue."""
        self._waiting.append(req)

    def admit(self, req: Req) -> None:
        """A queued request joins the running batch."""
        self._waiting.remove(req)
        self._running.append(req)

    def join(self, req: Req) -> None:
        """A request that never queued here (its prompt ran elsewhere) joins the batch."""
        self._running.append(req)

    def retract(self, req: Req) -> None:
        """A running request goes back to the front of the queue, to run again first."""
        self._running.remove(req)
        self._waiting.insert(0, req)

    def finish(self, req: Req) -> None:
        """A running request leaves the batch (finished, handed over or failed)."""
        self._running.remove(req)

    def remove(self, req: Req) -> None:
        """A request leaves wherever it is (an abort)."""
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)

    def clear(self) -> tuple[Req, ...]:
        """Every request leaves; returns them, the queue first."""
        gone = self.all()
        self._waiting.clear()
        self._running.clear()
        return gone
