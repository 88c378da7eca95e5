"""The offline engine: tokenizer, scheduler and model worker in one process (`Engine`)."""

from .engine import Engine

__all__ = ["Engine"]
