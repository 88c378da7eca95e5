"""Constrained tool calls: the JSON schema of a list of calls (`tool_choice` required or named),
the structural tag that makes a call after a format's trigger valid (`auto`), and the default
tool prompt for templates that render no tools."""

from __future__ import annotations

import json

from .formats import Llama3Parser, MistralParser, TaggedParser

MAX_PARALLEL_CALLS = 4  # the grammar closes a list of required calls after this many


def calls_schema(functions: list[dict], parallel: bool) -> dict:
    """JSON schema of a call to one of `functions` (OpenAI function dicts), or of a list of 1 to
    MAX_PARALLEL_CALLS calls: decoding constrained by it can only produce calls that validate,
    and a model that repeats a call cannot keep the list open until max_tokens."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}


def calls_structural_tag(parser, functions: list[dict], parallel: bool) -> dict | None:
    """For `tool_choice: auto`: an xgrammar structural tag that leaves text free but makes
    whatever follows the format's trigger a call that validates (only one call, or one list of
    calls, without `parallel`). None for a format with no trigger (constrained calls only)."""
    if isinstance(parser, TaggedParser) and parser.json_body:  # <tool_call>{call}</tool_call>
        tags = [_tag(parser.start, calls_schema(functions, False), parser.end)]
        triggers = [parser.start]
    elif isinstance(parser, MistralParser):  # [TOOL_CALLS] [calls]
        listed = calls_schema(functions, True) | ({} if parallel else {"maxItems": 1})
        tags, triggers = [_tag(parser.marker, listed, "")], [parser.marker]
        parallel = False  # one list holds every call
    elif isinstance(
        parser, Llama3Parser
    ):  # {"name": "f", "parameters": {args}}, one tag per function
        opening = '{"name": '
        tags = [
            _tag(
                f'{opening}"{f["name"]}", "parameters": ',
                f.get("parameters") or {"type": "object"},
                "}",
            )
            for f in functions
        ]
        triggers = [opening]
    else:
        return None
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": triggers,
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        },
    }


def _tag(begin: str, schema: dict, end: str) -> dict:
    return {"begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}


def default_tool_prompt(functions: list[dict]) -> str:
    """The system text that offers `functions` to a model whose chat template has no tool
    support, asking for the hermes format."""
    listed = "\n".join(
        json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions
    )
    return (
        "You can call functions. Their signatures, one JSON object per line:\n"
        + listed
        + "\nTo call one, answer with a JSON object in tags, one block per call:\n"
        '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>'
    )


def with_tool_prompt(messages: list[dict], functions: list[dict]) -> list[dict]:
    """Messages for a chat template without tool support: the default tool prompt joins the
    system message, and earlier calls become hermes blocks in the assistant's text."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")} | (
            {
                "content": message.get("content", "")
                + "".join(
                    "<tool_call>"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                        ensure_ascii=False,
                    )
                    + "</tool_call>"
                    for c in message["tool_calls"]
                )
            }
            if message.get("tool_calls")
            else {}
        )
        out.append(message)
    prompt = default_tool_prompt(functions)
    if out and out[0]["role"] == "system":
        return [dict(out[0], content=out[0]["content"] + "\n\n" + prompt)] + out[1:]
    return [{"role": "system", "content": prompt}] + out
