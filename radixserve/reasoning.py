"""Reasoning output: the `<think>…</think>` part of an answer, split from its content
(`--reasoning-parser`, `message.reasoning_content`, streamed `reasoning_content` deltas).

Two formats of the family, as SGLang and vLLM name them:
- `deepseek-r1` (and `qwen3-thinking`): the chat template opens `<think>` itself, so the output
  starts inside the reasoning and everything before `</think>` is reasoning;
- `qwen3` (and `glm45`): the model opens `<think>` when it thinks (not with
  `enable_thinking: false`), so an output that does not start with `<think>` is all content;
- `seed_oss`: the same with Seed-OSS's `<seed:think>` and `</seed:think>`;
- `gemma4`: the same with Gemma 4's `<|channel>thought` and `<channel|>`.

An output cut off before `</think>` is all reasoning. Text is never stripped: the reasoning is
what lies between the tags, the content what follows the closing one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_calls import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool
    start: str = START
    end: str = END

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when there was none."""
        body = self.reasoning_body(text)
        if body is None:
            return None, text
        reasoning, closed, content = body.partition(self.end)
        return reasoning, content if closed else ""

    def reasoning_body(self, text: str) -> str | None:
        """The text after the opening tag, or None when the output does not reason."""
        opened = text.lstrip()
        if opened.startswith(self.start):
            return opened[len(self.start) :]
        return text if self.starts_in_reasoning else None


PARSERS = {
    p.name: p
    for p in (
        ReasoningParser("deepseek-r1", True),
        ReasoningParser("qwen3-thinking", True),
        ReasoningParser("qwen3", False),
        ReasoningParser("glm45", False),
        ReasoningParser("seed_oss", False, "<seed:think>", "</seed:think>"),
        ReasoningParser("gemma4", False, "<|channel>thought", "<channel|>"),
    )
}


def detect_reasoning(chat_template: str | None) -> str | None:
    """The reasoning format a chat template shows: a generation prompt that opens `<think>`
    and leaves it open (DeepSeek-R1) starts the output inside the reasoning; a template that
    merely knows the tags (Qwen3) reasons only when the output opens one; None without tags."""
    template = chat_template or ""
    if "<seed:think>" in template:
        return "seed_oss"
    if "<|channel>" in template:
        return "gemma4"
    if START not in template:
        return None
    prompt = template.rpartition("add_generation_prompt")[2]
    return "deepseek-r1" if START in prompt and END not in prompt else "qwen3"


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name]


@dataclass
class StreamingReasoningParser:
    """Reasoning and content deltas of a growing output. What may still turn into a tag (the
    start of `<think>` at the beginning, of `</think>` later) is held back until it is known."""

    parser: ReasoningParser
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the output so far."""
        reasoning, content = self._visible(text, finished)
        deltas = ((reasoning or "")[self.sent_reasoning :], content[self.sent_content :])
        self.sent_reasoning, self.sent_content = len(reasoning or ""), len(content)
        return deltas

    def _visible(self, text: str, finished: bool) -> tuple[str | None, str]:
        if finished:
            return self.parser.split(text)
        if self.parser.start.startswith(text.lstrip()):
            return None, ""  # may still open with the start tag
        body = self.parser.reasoning_body(text)
        if body is None:
            return None, text
        if self.parser.end in body:
            return self.parser.split(text)
        return body[: len(body) - partial_suffix(body, self.parser.end)], ""
