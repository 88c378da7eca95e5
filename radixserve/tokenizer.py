"""Tokenizer loading and prompt helpers shared by the engine and the api process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .tool_calls import with_tool_prompt

GENERIC_TOKENIZER_CLASSES = (
    "TokenizersBackend",
    "PreTrainedTokenizerFast",
)  # one class in transformers 5


def load_tokenizer(tokenizer_dir: Path | None) -> Any:
    """The HF tokenizer. Where `tokenizer_config.json` names transformers' generic class for a
    `tokenizer.json` (as the bundled model's does), that class is loaded directly: AutoTokenizer
    returns the same class but first loads the model's config through AutoConfig, which imports
    torch and its model modules (~5 s of a 2-core machine's start, in two processes)."""
    if tokenizer_dir is None:
        raise FileNotFoundError(
            "this model has no tokenizer; pass token ids (input_ids) instead of text"
        )
    config = _tokenizer_config(Path(tokenizer_dir))
    if (
        config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in config
        and (Path(tokenizer_dir) / "tokenizer.json").is_file()
    ):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(tokenizer_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _tokenizer_config(tokenizer_dir: Path) -> dict:
    path = tokenizer_dir / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer_or_none(tokenizer_dir: Path | None) -> Any:
    """The tokenizer when the model ships one; None means token ids only."""
    if tokenizer_dir is None:
        return None
    try:
        return load_tokenizer(tokenizer_dir)
    except (OSError, ValueError, TypeError):
        return None


class TokenDecoder:
    """Decoding only, straight from the model's `tokenizer.json` through the `tokenizers`
    library: what the detokenizer process needs, without importing transformers (and torch
    with it), which took ~3 s of CPU from a 2-core machine's start. Used only where it gives
    the HF tokenizer's text (no clean-up of spaces)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(tokenizer_dir: Path | None) -> Any:
    """What decodes token ids for the detokenizer: a TokenDecoder where the model's tokenizer
    allows one, else the HF tokenizer (None without a tokenizer)."""
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        if not _tokenizer_config(Path(tokenizer_dir)).get("clean_up_tokenization_spaces", False):
            return TokenDecoder(Path(tokenizer_dir) / "tokenizer.json")
    return tokenizer_in_child(tokenizer_dir)


def tokenizer_in_child(tokenizer_dir: Path | None) -> Any:
    """The tokenizer for a server's child process, or None where it fails to load: the api
    process loads the same one and reports in one line what is wrong with it (a child's
    traceback would add to that line, or race it)."""
    try:
        return load_tokenizer_or_none(tokenizer_dir)
    except Exception:  # whatever transformers raises: the api process reports it
        return None


def decode_ids(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Decode, dropping ids the tokenizer does not know (a dummy model's vocabulary can be
    larger)."""
    limit = len(tokenizer)
    return tokenizer.decode(
        [i for i in ids if 0 <= i < limit], skip_special_tokens=skip_special_tokens
    )


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    return (
        (tokenizer.eos_token_id,)
        if tokenizer is not None and tokenizer.eos_token_id is not None
        else ()
    )


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """The prompt text; `tools` (OpenAI function dicts) go to the template, or, when it has no
    tool support, into the default tool prompt (`tool_calls.with_tool_prompt`). With
    `continue_final_message` the last message is left open for the model to continue."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template")
    if tools and "tools" not in str(template):
        messages, tools = with_tool_prompt(messages, tools), None
    wrapped = [{"type": "function", "function": f} for f in tools] if tools else None
    return tokenizer.apply_chat_template(
        messages,
        tools=wrapped,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a prompt; a rendered chat prompt that already starts with the BOS token does
    not get a second one from the tokenizer."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


SENTINEL = "\u2063RADIXSERVE\u2063"


def chat_roles(tokenizer: Any) -> dict[str, Any]:
    """Text before and after each role's content in the model's chat template.

    Returned as {"roles": {role: [prefix, suffix]}, "default_system": str}: the text the
    template inserts when a conversation does not start with a system message.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return {
            "roles": {r: [f"{r}: ", "\n"] for r in ("system", "user", "assistant")},
            "default_system": "",
        }
    render = lambda msgs: tokenizer.apply_chat_template(msgs, tokenize=False)  # noqa: E731
    base = [{"role": "system", "content": "S"}]
    head = render(base)
    roles = {}
    for role in ("system", "user", "assistant"):
        msgs = (
            [{"role": role, "content": SENTINEL}]
            if role == "system"
            else base + [{"role": role, "content": SENTINEL}]
        )
        text = render(msgs)
        text = text if role == "system" else text[len(head) :]
        prefix, _, suffix = text.partition(SENTINEL)
        roles[role] = [prefix, suffix]
    alone = render([{"role": "user", "content": SENTINEL}])
    default_system = alone[: alone.index(roles["user"][0] + SENTINEL)]
    return {"roles": roles, "default_system": default_system}
