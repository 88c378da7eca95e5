"""Frozen configuration dataclasses, composed per process: `EngineArgs` (the engine),
`ServerArgs` (the HTTP front); `radixserve.router.config.RouterArgs` builds on the same
`option`s."""

from .engine import EngineArgs
from .options import (
    ATTENTION_BACKENDS,
    DISAGGREGATION_MODES,
    DTYPES,
    EVICTION_POLICIES,
    HICACHE_STORAGE_BACKENDS,
    HICACHE_WRITE_POLICIES,
    LOG_LEVELS,
    REQUEST_LOG_LEVELS,
    ROUTER_POLICIES,
    SCHEDULE_POLICIES,
    SPECULATIVE_ALGORITHMS,
    TRANSFER_BACKENDS,
    check_choices,
    option,
    option_default,
    refuse_problems,
)
from .server import ServerArgs

__all__ = [
    "ATTENTION_BACKENDS",
    "DISAGGREGATION_MODES",
    "DTYPES",
    "EVICTION_POLICIES",
    "HICACHE_STORAGE_BACKENDS",
    "HICACHE_WRITE_POLICIES",
    "LOG_LEVELS",
    "REQUEST_LOG_LEVELS",
    "ROUTER_POLICIES",
    "SCHEDULE_POLICIES",
    "SPECULATIVE_ALGORITHMS",
    "TRANSFER_BACKENDS",
    "EngineArgs",
    "ServerArgs",
    "check_choices",
    "option",
    "option_default",
    "refuse_problems",
]
