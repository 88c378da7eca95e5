"""radixserve.lang: structured multi-call programs that reuse cached prompt prefixes.

    from radixserve.lang import function, gen, select, system, user, assistant, RuntimeEndpoint

    @function
    def qa(s, question):
        s += system("You are concise.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="What is a radix tree?", backend=RuntimeEndpoint("http://127.0.0.1:30000"))
    print(state["answer"], state.report.hit_rate)

Tool calls: `system(..., tools=[...])` lists the functions; `tool_call("calls")` decodes a call
constrained to their schemas and stores `[{"name": ..., "arguments": {...}}]` in `s["calls"]`.
"""

from .api import SglFunction, function, set_default_backend
from .backend import EngineBackend, RuntimeEndpoint
from .interpreter import CacheReport, ForkGroup, ProgramState
from .ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    tool_call,
    user,
    user_begin,
    user_end,
)

__all__ = [
    "function",
    "gen",
    "select",
    "tool_call",
    "system",
    "user",
    "assistant",
    "system_begin",
    "system_end",
    "user_begin",
    "user_end",
    "assistant_begin",
    "assistant_end",
    "RuntimeEndpoint",
    "EngineBackend",
    "set_default_backend",
    "ProgramState",
    "ForkGroup",
    "CacheReport",
    "SglFunction",
]
