"""The router's workers: health, load and a circuit breaker each."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class CircuitBreaker:
    """Closed: requests flow. After `failure_threshold` failures in a row it opens and the
    worker gets no requests for `cooldown_s`; then it is half-open: requests flow again, and
    the first failure reopens it while `success_threshold` successes close it."""

    failure_threshold: int = 3
    success_threshold: int = 1
    cooldown_s: float = 10.0
    failures: int = 0
    successes: int = 0
    opened_at: float | None = None

    def allows(self, now: float) -> bool:
        return self.opened_at is None or now - self.opened_at >= self.cooldown_s

    def record_success(self) -> None:
        self.failures = 0
        if self.opened_at is not None:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.opened_at, self.successes = None, 0

    def record_failure(self, now: float) -> None:
        self.failures += 1
        self.successes = 0
        half_open = self.opened_at is not None
        if half_open or self.failures >= self.failure_threshold:
            self.opened_at = now

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.allows(time.monotonic()) else "open"


@dataclass
class Worker:
    url: str
    breaker: CircuitBreaker
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0
    errors: int = 0
    failed_checks: int = 0
    last_problem: str = ""
    added: float = field(default_factory=time.time)

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def summary(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "circuit": self.breaker.state,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "errors": self.errors,
            "last_problem": self.last_problem,
        }
