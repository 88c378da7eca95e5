"""Sampling parameters of one request, validated at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Any

import re2

from .constrained import GRAMMAR_KEYS, check_grammar_text, json_grammar_text

MAX_TOP_K = 1 << 20
GREEDY_BELOW = 1e-5  # a smaller temperature samples like greedy; dividing by it overflows float32
MAX_SEED = (1 << 63) - 1
MAX_N = 16  # most samples one request may ask for (`n`)
MAX_STOP_REGEX_CHARS = 4096
# SGLang parameters we accept only when unset.
UNSUPPORTED_WHEN_SET = ("custom_params", "dtype", "no_stop_trim", "stream_interval")


@dataclass
class SamplingParams:
    """SGLang-compatible sampling parameters. `temperature == 0` means greedy."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = (
        None  # xgrammar's JSON format: free text with constrained tagged parts
    )
    logit_bias: dict[str, float] | None = (
        None  # token id (as a string, like OpenAI) -> added to its logit
    )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a JSON dict and validate (at most `MAX_N` samples); unknown keys, wrong
        types and values out of range raise ValueError."""
        if data is not None and not isinstance(data, dict):
            raise ValueError("sampling_params must be an object")
        data = {k: v for k, v in (data or {}).items() if v is not None}
        for name in UNSUPPORTED_WHEN_SET:
            if data.pop(name, None) not in (None, False, "", [], {}):
                raise ValueError(f"sampling parameter {name!r} is not supported by radixserve yet")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        if isinstance(data.get("stop"), tuple):
            data["stop"] = list(data["stop"])
        if isinstance(data.get("stop_regex"), str):
            data["stop_regex"] = [data["stop_regex"]]
        for key in ("json_schema", "structural_tag"):
            if key in data:
                data[key] = json_grammar_text(data[key], key)
        params = cls(**data)
        params.validate()
        return params

    def per_sample(self) -> list["SamplingParams"]:
        """n samples become n single-sample parameter sets; sample i draws with seed + i."""
        return [
            replace(self, n=1, seed=None if self.seed is None else self.seed + i)
            for i in range(self.n)
        ]

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        problems = list(self._problems(MAX_N))
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self, max_n: int):
        checks = [
            ("max_new_tokens", int, lambda v: v >= 0, "must be an integer >= 0"),
            ("min_new_tokens", int, lambda v: v >= 0, "must be an integer >= 0"),
            ("temperature", float, lambda v: 0 <= v <= 100, "must be a number in [0, 100]"),
            ("top_p", float, lambda v: 0 < v <= 1, "must be a number in (0, 1]"),
            (
                "top_k",
                int,
                lambda v: v == -1 or 1 <= v <= MAX_TOP_K,
                "must be -1 or an integer >= 1",
            ),
            ("min_p", float, lambda v: 0 <= v <= 1, "must be a number in [0, 1]"),
            ("frequency_penalty", float, lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
            ("presence_penalty", float, lambda v: -2 <= v <= 2, "must be a number in [-2, 2]"),
            ("repetition_penalty", float, lambda v: 0 < v <= 10, "must be a number in (0, 10]"),
            ("n", int, lambda v: 1 <= v <= max_n, f"must be an integer in [1, {max_n}]"),
        ]
        for name, kind, ok, message in checks:
            value = getattr(self, name)
            if not _is_kind(value, kind) or not ok(value):
                yield f"{name} {message}, got {value!r}"
        if self.seed is not None and not (
            _is_kind(self.seed, int) and 0 <= self.seed <= MAX_SEED - max_n
        ):
            yield (
                f"seed must be an integer in [0, {MAX_SEED - max_n}] "
                f"(sample i of n uses seed + i), got {self.seed!r}"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            yield "stop must be a non-empty string or a list of non-empty strings"
        yield from _stop_regex_problems(self.stop_regex)
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_kind(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            yield "stop_token_ids must be a list of non-negative integers"
        grammars = [key for key in GRAMMAR_KEYS if getattr(self, key) is not None]
        if len(grammars) > 1:
            yield f"give at most one of {', '.join(GRAMMAR_KEYS)}, got {', '.join(grammars)}"
        for key in grammars:
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                yield f"{key} must be a non-empty string"
            elif key in ("regex", "ebnf"):
                try:
                    check_grammar_text(key, getattr(self, key))
                except ValueError as exc:
                    yield str(exc)
        if self.logit_bias is not None and not _valid_logit_bias(self.logit_bias):
            yield "logit_bias must map token ids to numbers in [-100, 100]"
        for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                yield f"{flag} must be a boolean"


def _stop_regex_problems(patterns: Any):
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        yield "stop_regex must be a non-empty string or a list of them"
        return
    for pattern in patterns:
        if len(pattern) > MAX_STOP_REGEX_CHARS:
            yield f"stop_regex is longer than {MAX_STOP_REGEX_CHARS} characters"
            continue
        try:
            compile_stop_regex(pattern)
        except re2.error as exc:
            reason = (
                exc.args[0].decode(errors="replace")
                if exc.args and isinstance(exc.args[0], bytes)
                else str(exc)
            )
            yield (
                f"stop_regex {pattern[:80]!r} does not compile as RE2 syntax "
                f"(no lookaround or backreferences): {reason}"
            )


@lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> "re2._Regexp":
    """A stop regex compiled by RE2, which matches in time linear in the text (Python's `re`
    backtracks: `(a+)+b` over a run of a's froze the scheduler) and bounds its own memory."""
    options = re2.Options()
    options.max_mem = 8 << 20
    options.log_errors = False
    return re2.compile(pattern, options)


def _valid_logit_bias(bias: Any) -> bool:
    if not isinstance(bias, dict):
        return False
    return all(
        str(k).isdigit() and _is_kind(v, float) and -100 <= v <= 100 for k, v in bias.items()
    )


def _is_kind(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and value == value
    return isinstance(value, kind)
