"""radixserve: an LLM serving runtime built around a radix-tree prefix cache."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Engine", "SamplingParams", "EngineArgs"]


def __getattr__(name: str):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from .config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
