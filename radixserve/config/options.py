"""How an option is defined once (`option`: default, flag help, choices), the choices
themselves, and the checks every options dataclass shares."""

from __future__ import annotations

from dataclasses import MISSING, field, fields

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_ALGORITHMS = ("ngram", "draft")
EVICTION_POLICIES = ("lru", "lfu", "slru")  # radix cache eviction order; see mem/radix_cache.py
REQUEST_LOG_LEVELS = ("full", "hashes")  # what --log-requests stores of each prompt
LOG_LEVELS = ("debug", "info", "warning", "error")
HICACHE_STORAGE_BACKENDS = ("file",)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake",)  # NIXL would plug in beside it (disagg/transfer.py)


def option(default, help: str, choices: tuple | None = None, flag: bool = True, **extra):
    """A configuration field: its default, its `--flag` help and its allowed values, defined
    once. The CLI builds each flag from this (`cli.add_flags`) and `check_choices` enforces
    `choices`; `flag=False` marks a field that is set by the program, not by a flag."""
    metadata = dict(help=help, choices=choices, flag=flag, **extra)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not options")
    return field(default=default, metadata=metadata)


def option_default(f):
    return f.default_factory() if f.default is MISSING else f.default


def refuse_problems(kind: str, problems) -> None:
    """Raise one ValueError naming every problem of a set of options (a one-line start-up
    error)."""
    found = list(problems)
    if found:
        raise ValueError(f"invalid {kind} arguments: " + "; ".join(found))


def check_choices(obj):
    """Each option with `choices` holds one of them (None stays allowed where it is the
    default)."""
    for f in fields(obj):
        choices = f.metadata.get("choices")
        value = getattr(obj, f.name)
        if choices and value not in choices and not (value is None and f.default is None):
            yield f"{f.name} must be one of {choices}, got {value!r}"
