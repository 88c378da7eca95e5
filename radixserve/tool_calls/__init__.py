"""Tool calls: the formats models emit, by family (`formats`), the constraints that make calls
valid (`constraints`) and the streaming parser (`streaming`)."""

from .constraints import (
    MAX_PARALLEL_CALLS,
    calls_schema,
    calls_structural_tag,
    default_tool_prompt,
    with_tool_prompt,
)
from .formats import PARSERS, JsonCallsParser, Parsed, ToolCall, detect_parser, make_parser
from .streaming import StreamingToolParser, partial_suffix

__all__ = [
    "MAX_PARALLEL_CALLS",
    "PARSERS",
    "JsonCallsParser",
    "Parsed",
    "StreamingToolParser",
    "ToolCall",
    "calls_schema",
    "calls_structural_tag",
    "default_tool_prompt",
    "detect_parser",
    "make_parser",
    "partial_suffix",
    "with_tool_prompt",
]
