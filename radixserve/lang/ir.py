"""The expressions a program appends to its state: text, gen, select, roles."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Union


class _Concat:
    """`"text" + gen(...) + "more"` builds a Seq, as in SGLang."""

    def __add__(self, other: "Expr") -> "Seq":
        return Seq((*_items(self), *_items(other)))

    def __radd__(self, other: "Expr") -> "Seq":
        return Seq((*_items(other), *_items(self)))


def _items(expr: "Expr") -> tuple:
    return expr.items if isinstance(expr, Seq) else (expr,)


@dataclass(frozen=True)
class Gen(_Concat):
    name: str | None
    params: dict[str, Any]


@dataclass(frozen=True)
class Select(_Concat):
    name: str | None
    choices: tuple[str, ...]


@dataclass(frozen=True)
class RoleBegin(_Concat):
    role: str


@dataclass(frozen=True)
class RoleEnd(_Concat):
    role: str


@dataclass(frozen=True)
class OfferTools(_Concat):
    """Lists functions in the prompt (the default tool prompt) and makes them the state's tools."""

    functions: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class CallTool(_Concat):
    """A call decoded under the tools' schemas, appended as a `<tool_call>` block."""

    name: str | None
    functions: tuple[dict[str, Any], ...] | None  # None: the tools offered earlier in the program
    parallel: bool
    params: dict[str, Any]


@dataclass(frozen=True)
class Seq(_Concat):
    """Several expressions appended in order (a role with its content)."""

    items: tuple["Expr", ...] = field(default_factory=tuple)


Expr = Union[str, Gen, Select, RoleBegin, RoleEnd, OfferTools, CallTool, Seq]

_GEN_KEYS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    min_tokens: int | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Gen:
    """Generate text into variable `name`; keyword names follow SGLang's `gen`. `regex` or
    `json_schema` constrain the output (structured output on the server)."""
    given = dict(
        max_tokens=max_tokens,
        stop=stop,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
        seed=seed,
        regex=regex,
        json_schema=json.dumps(json_schema) if isinstance(json_schema, dict) else json_schema,
    )
    params = {_GEN_KEYS.get(k, k): v for k, v in given.items() if v is not None}
    return Gen(name, params)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Pick the choice the model finds most likely (length-normalized prompt logprob)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, tuple(choices))


def _role(role: str, content: Expr | list[Expr] | None) -> Seq:
    items = (
        content if isinstance(content, (list, tuple)) else [content] if content is not None else []
    )
    return Seq((RoleBegin(role), *items, RoleEnd(role)))


def system(
    content: Expr | list[Expr] | None = None, tools: list[dict[str, Any]] | None = None
) -> Seq:
    """A system message; `tools` (OpenAI tool or function dicts) are listed after its content
    and become the program's tools for `tool_call`."""
    role = _role("system", content)
    if not tools:
        return role
    return Seq((*role.items[:-1], OfferTools(function_dicts(tools)), role.items[-1]))


def function_dicts(tools: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """OpenAI function dicts of tools given as `{"type": "function", "function": {...}}` or bare."""
    functions = tuple(
        t["function"] if t.get("type") == "function" and "function" in t else t for t in tools
    )
    for f in functions:
        if not isinstance(f.get("name"), str):
            raise ValueError(f"a tool needs a function name: {f!r}")
    return functions


def tool_call(
    name: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    parallel: bool = False,
    max_tokens: int = 256,
    temperature: float | None = None,
    seed: int | None = None,
) -> CallTool:
    """Call one of `tools` (default: those given to `system(tools=...)`), or several with
    `parallel`. Decoding is constrained to the tools' JSON schemas, so the call always parses
    and validates; variable `name` gets the calls as `[{"name": ..., "arguments": {...}}]`."""
    given = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
    params = {_GEN_KEYS.get(k, k): v for k, v in given.items() if v is not None}
    return CallTool(name, function_dicts(tools) if tools else None, parallel, params)


def user(content: Expr | list[Expr] | None = None) -> Seq:
    return _role("user", content)


def assistant(content: Expr | list[Expr] | None = None) -> Seq:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
