"""`POST /v1/embeddings` (OpenAI's shape), on a server started with `--is-embedding`: each
input's final-normed hidden states pooled into one L2-normalized vector, by the rule the
checkpoint's sentence-transformers config names (`1_Pooling/config.json`), last token when it
names none. The scheduler runs such a request as a prefill that generates nothing; mean pooling
needs every position, so it reuses no cached prefix."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ..models.source import ModelSource
from .http import RequestError, json_response, parse_body
from .tokenizer_manager import TokenizerManager

POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int | None = None
    cache_salt: str | None = None


def pooling_of(model_dir: Path | None) -> str:
    """The checkpoint's pooling ("last" or "mean"); ValueError for one radixserve lacks."""
    config = model_dir / "1_Pooling" / "config.json" if model_dir is not None else None
    if config is None or not config.is_file():
        return "last"
    modes = [key for key, on in json.loads(config.read_text()).items() if on is True]
    chosen = [POOLING_MODES[m] for m in modes if m in POOLING_MODES]
    if len(chosen) != 1 or len(modes) != 1:
        raise ValueError(
            f"{config}: pooling {modes} is not supported (one of {sorted(POOLING_MODES)})"
        )
    return chosen[0]


@dataclass(frozen=True)
class EmbeddingSetup:
    """How a server started with --is-embedding pools, and how wide its vectors are."""

    pooling: str
    dimensions: int

    @classmethod
    def of(cls, source: ModelSource) -> "EmbeddingSetup":
        return cls(pooling_of(source.weights_dir), source.config.hidden_size)


def embeddings_routes(
    app: FastAPI, tm: TokenizerManager, model: str, setup: EmbeddingSetup | None
) -> None:
    """`setup` None: the server generates only, and says how to serve embeddings."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        if setup is None:
            raise RequestError(
                "this server was started for generation; start it with --is-embedding to "
                "serve /v1/embeddings"
            )
        body = await parse_body(request, EmbeddingRequest)
        if body.dimensions is not None and body.dimensions != setup.dimensions:
            raise RequestError(
                f"dimensions: this model's embeddings have {setup.dimensions} dimensions and "
                f"cannot be shortened"
            )
        prompts = await _inputs(tm, body.input)
        reqs = [
            tm.make_request(
                ids,
                {"max_new_tokens": 0},
                priority=body.priority,
                cache_salt=body.cache_salt,
                pooling=setup.pooling,
            )
            for ids in prompts
        ]
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        tokens = sum(s.prompt_tokens for s in states)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(s.embedding, body)}
            for i, s in enumerate(states)
        ]
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


async def _inputs(tm: TokenizerManager, given) -> list[list[int]]:
    if isinstance(given, str):
        given = [given]
    elif isinstance(given[0], int):
        given = [given]
    out = []
    for i, item in enumerate(given):
        ids = await tm.tokenize_async(item) if isinstance(item, str) else item
        if not ids:
            raise RequestError(f"input[{i}] is empty")
        out.append(ids)
    return out


def _encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
