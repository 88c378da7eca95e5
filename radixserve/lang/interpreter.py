"""Program state: each state runs its expressions in order on its own thread.

`s += expr` only queues; reading a variable, the text or the messages waits for the
queue to drain. Forked branches have their own threads, so they run concurrently and
share the prefix that `fork` cached on the server first.
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..tool_calls import JsonCallsParser, calls_schema, default_tool_prompt
from .backend import Backend, CallResult, select_by_logprob
from .ir import CallTool, Expr, Gen, OfferTools, RoleBegin, RoleEnd, Select, Seq

CALL_START, CALL_END = (
    "<tool_call>",
    "</tool_call>",
)  # the hermes block the default tool prompt asks for

_END = object()


@dataclass
class CacheReport:
    """How much of the prompt traffic of a program was served from the radix cache."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, prompt: int, cached: int) -> None:
        self.calls += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached


@dataclass
class _Snapshot:
    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    role: tuple[str, int] | None = None
    started: bool = False
    tools: tuple[dict, ...] = ()  # offered with system(tools=...)


class ProgramState:
    def __init__(
        self,
        backend: Backend,
        stream: bool = False,
        snapshot: _Snapshot | None = None,
        report: CacheReport | None = None,
    ):
        self.backend = backend
        self.stream = stream
        self._s = snapshot or _Snapshot()
        self.report = report or CacheReport()
        self.error: BaseException | None = None
        self._roles = backend.chat_roles()
        self._ops: queue.Queue = queue.Queue()
        self._chunks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="radixserve-program")
        self._thread.start()

    # ---- building ---------------------------------------------------------
    def __iadd__(self, expr: Expr) -> "ProgramState":
        self._ops.put(expr)
        return self

    def fork(self, n: int) -> "ForkGroup":
        """n branches sharing this state's text; the shared prefix is cached on the server first."""
        self.sync()
        if self._s.text:
            result = self.backend.generate(self._s.text, {"max_new_tokens": 0})
            self.report.add(result.prompt_tokens, result.cached_tokens)
        return ForkGroup(
            [ProgramState(self.backend, self.stream, self._copy(), self.report) for _ in range(n)]
        )

    # ---- reading ----------------------------------------------------------
    def sync(self) -> "ProgramState":
        self._ops.join()
        if self.error is not None:
            raise self.error
        return self

    def __getitem__(self, name: str) -> Any:
        return self.sync()._s.variables[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.sync()._s.variables.get(name, default)

    def text(self) -> str:
        return self.sync()._s.text

    def messages(self) -> list[dict]:
        return list(self.sync()._s.messages)

    def variables(self) -> dict[str, Any]:
        return dict(self.sync()._s.variables)

    def text_iter(self) -> Iterator[str]:
        """Text as it is produced, until every queued expression has run."""
        self._ops.put(_END)
        while True:
            chunk = self._chunks.get()
            if chunk is _END:
                break
            yield chunk
        self.sync()

    def close(self) -> None:
        self._ops.put(None)

    # ---- execution (on the state's thread) -----------------------------------
    def _run(self) -> None:
        while True:
            expr = self._ops.get()
            try:
                if expr is None:
                    return
                if expr is _END:
                    self._chunks.put(_END)
                elif self.error is None:
                    self._execute(expr)
            except BaseException as exc:  # surfaces on the next read
                self.error = exc
            finally:
                self._ops.task_done()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Seq):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, OfferTools):
            self._s.tools = expr.functions
            self._append("\n\n" + default_tool_prompt(list(expr.functions)))
        elif isinstance(expr, CallTool):
            self._tool_call(expr)
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _append(self, text: str) -> None:
        self._s.text += text
        if self.stream:
            self._chunks.put(text)

    def _gen(self, expr: Gen) -> None:
        if self.stream:
            result = None
            for piece in self.backend.generate_stream(self._s.text, expr.params):
                if isinstance(piece, CallResult):
                    result = piece
                elif piece:
                    self._chunks.put(piece)
            self._s.text += result.text
        else:
            result = self.backend.generate(self._s.text, expr.params)
            self._s.text += result.text
        self.report.add(result.prompt_tokens, result.cached_tokens)
        if expr.name:
            self._s.variables[expr.name] = result.text

    def _select(self, expr: Select) -> None:
        result = select_by_logprob(self.backend, self._s.text, expr.choices)
        self.report.add(result.prompt_tokens, result.cached_tokens)
        choice = expr.choices[result.index]
        self._append(choice)
        if expr.name:
            self._s.variables[expr.name] = choice
            self._s.variables[f"{expr.name}__scores"] = result.scores

    def _tool_call(self, expr: CallTool) -> None:
        functions = expr.functions or self._s.tools
        if not functions:
            raise ValueError("tool_call needs tools: pass tools= to it or to system()")
        schema = json.dumps(calls_schema(list(functions), expr.parallel))
        self._append(CALL_START)
        result = self.backend.generate(self._s.text, {**expr.params, "json_schema": schema})
        self.report.add(result.prompt_tokens, result.cached_tokens)
        self._append(result.text + CALL_END)
        calls = JsonCallsParser().parse(result.text).calls
        if not calls:
            raise ValueError(f"the tool call did not finish within max_tokens: {result.text!r}")
        if expr.name:
            self._s.variables[expr.name] = [
                {"name": c.name, "arguments": json.loads(c.arguments)} for c in calls
            ]

    def _role_begin(self, role: str) -> None:
        if self._s.role is not None:
            raise ValueError(f"{role} begins inside an open {self._s.role[0]} block")
        if not self._s.started and role != "system":
            self._append(self._roles["default_system"])
        self._s.started = True
        self._append(self._roles["roles"][role][0])
        self._s.role = (role, len(self._s.text))

    def _role_end(self, role: str) -> None:
        if self._s.role is None or self._s.role[0] != role:
            raise ValueError(f"{role}_end without a matching {role}_begin")
        content = self._s.text[self._s.role[1] :]
        self._s.messages.append({"role": role, "content": content})
        self._s.role = None
        self._append(self._roles["roles"][role][1])

    def _copy(self) -> _Snapshot:
        s = self._s
        return _Snapshot(s.text, dict(s.variables), list(s.messages), s.role, s.started, s.tools)


class ForkGroup:
    """Branches of one state; `+=` appends to every branch."""

    def __init__(self, states: list[ProgramState]):
        self.states = states

    def __iadd__(self, expr: Expr) -> "ForkGroup":
        for state in self.states:
            state += expr
        return self

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def join(self) -> list[ProgramState]:
        for state in self.states:
            state.sync()
        return self.states
