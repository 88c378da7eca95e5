"""Tokenizer loading and prompt helpers shared by the engine and the api process."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(tokenizer_dir: Path | None) -> Any:
    if tokenizer_dir is None:
        raise FileNotFoundError("this model has no tokenizer; pass token ids (input_ids) instead of text")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    return (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ()


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
