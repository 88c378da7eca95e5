"""Structured output: regex, JSON schema and EBNF grammars through xgrammar.

The scheduler keeps one grammar matcher per request. Before each step it fills a bitmask of
the tokens the grammar allows next (bit `i % 32` of word `i // 32` set = token i allowed);
the worker masks the logits with it (`worker/sampler.apply_token_masks`), and the sampled
token advances the matcher. A request whose grammar is complete ends with its stop token.
Compiled grammars are cached per spec, so repeated schemas compile once. JSON schemas
compile to compact JSON (`", "` and `": "` separators, no free whitespace): small models
otherwise tend to emit runs of whitespace.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .tokenizer import eos_ids

GRAMMAR_KEYS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KEYS
    text: str

    @classmethod
    def from_params(cls, params: Any) -> "GrammarSpec | None":
        given = [
            (key, getattr(params, key)) for key in GRAMMAR_KEYS if getattr(params, key) is not None
        ]
        return cls(*given[0]) if given else None


MAX_GRAMMAR_CHARS = 65536
MAX_NESTING = 64  # xgrammar compiles nested groups and schemas recursively; deeper is refused


def json_grammar_text(value: Any, key: str) -> str:
    """A grammar written as JSON (`json_schema`, or an xgrammar `structural_tag`) given as an
    object or a string holding one: the string, after size and nesting checks."""
    if isinstance(value, dict):
        _check_depth(value, key)
        return json_grammar_text(json.dumps(value), key)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a JSON object or a string holding one")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{key} is longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        parsed = json.loads(value)
    except RecursionError:
        raise ValueError(f"{key} is nested deeper than {MAX_NESTING} levels") from None
    except ValueError as exc:
        raise ValueError(f"{key} is not valid JSON: {exc}") from None
    _check_depth(parsed, key)
    return value


def _check_depth(value: Any, key: str) -> None:
    """Refuse JSON nested deeper than MAX_NESTING (walked without recursion)."""
    level = [value]
    for _ in range(MAX_NESTING + 1):
        level = [
            child
            for item in level
            for child in (
                item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
            )
        ]
        if not level:
            return
    raise ValueError(f"{key} is nested deeper than {MAX_NESTING} levels")


def check_grammar_text(key: str, text: str) -> None:
    """Size and group-nesting limits of a regex or EBNF grammar (JSON ones: `json_grammar_text`)."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{key} is longer than {MAX_GRAMMAR_CHARS} characters")
    if group_depth(text) > MAX_NESTING:
        raise ValueError(f"{key} nests groups deeper than {MAX_NESTING} levels")


def group_depth(pattern: str) -> int:
    """The deepest nesting of ( ) groups in a regex or EBNF text, skipping escapes (an upper
    bound: parentheses inside [...] and quoted strings count too)."""
    depth = deepest = 0
    escaped = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest


class GrammarBackend:
    """Compiles grammars against one tokenizer's vocabulary. The vocabulary index (~0.3 s for
    49k tokens) is built on the first request that needs it, not at start-up."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.mask_words = (vocab_size + 31) // 32
        self.compiler = None
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for `spec`; a grammar that does not compile raises ValueError."""
        import xgrammar

        return xgrammar.GrammarMatcher(self._compile(spec))

    def _compiler(self):
        if self.compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=sorted(self.stop_token_ids) or None,
            )
            self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self.compiler

    def _compile_uncached(self, spec: GrammarSpec):
        compiler = self._compiler()
        try:
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "json_schema":  # compact JSON: no whitespace runs, long forced spans
                return compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.text)
            return compiler.compile_grammar(spec.text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad input
            raise ValueError(f"invalid {spec.kind}: {_clean_message(exc)}") from None

    def forced_tokens(self, matcher, room: int):
        """Jump-forward: the tokens of the text `matcher` forces next (at most `room`) and the
        matcher advanced past them, or ([], matcher) when nothing is forced or the text's own
        tokenization does not fit the grammar."""
        text = matcher.find_jump_forward_string()
        if not text or room <= 0:
            return [], matcher
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:room]
        advanced = matcher.fork()
        if all(advanced.accept_token(t) for t in tokens):
            return tokens, advanced
        return [], matcher

    def draft_masks(self, matcher, drafts: list[int]) -> list[list[int]]:
        """Speculative drafts checked against the grammar: the bitmask after each draft token it
        accepts, up to the first it refuses or one that would end it (those are dropped, and
        the model samples that position itself). `matcher` is not advanced."""
        fork, masks = matcher.fork(), []
        for token in drafts:
            if not fork.accept_token(token) or fork.is_terminated():
                break
            masks.append(self.token_mask(fork))
        return masks

    def token_mask(self, matcher) -> list[int]:
        """The allowed-next-token bitmask of `matcher` as int32 words."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.mask_words * 32)
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0].tolist()


def _clean_message(exc: Exception) -> str:
    """xgrammar's first error line without its `[time] file.cc:line:` prefix."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", line)[:300]


def grammar_backend(tokenizer, info) -> GrammarBackend | None:
    """The grammar backend for a worker's vocabulary (`WorkerInfo`); None without a tokenizer."""
    if tokenizer is None:
        return None
    return GrammarBackend(
        tokenizer, info.vocab_size, tuple(set(info.eos_token_ids) | set(eos_ids(tokenizer)))
    )
