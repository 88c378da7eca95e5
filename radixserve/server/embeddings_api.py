"""The pooling routes of a server started with `--is-embedding`. The scheduler runs their
requests as prefills that generate nothing.

- `POST /v1/embeddings` (OpenAI's shape): each input's final-normed hidden states pooled into
  one L2-normalized vector, by the rule the checkpoint's sentence-transformers config names
  (`1_Pooling/config.json`), the last token when it names none; mean pooling needs every
  position, so it reuses no cached prefix.
- `POST /v1/rerank` and `POST /v1/score` (vLLM's shapes) on a cross-encoder
  (`*ForSequenceClassification`, one label): each (query, document) pair, tokenized as HF pairs
  texts, is scored by the `score` head on its last token, through a sigmoid."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ..models.registry import architecture_of, is_classifier, num_labels
from ..models.source import ModelSource
from .http import RequestError, json_response, parse_body
from .tokenizer_manager import CLASSIFIER_ONLY, TokenizerManager

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
        hf = source.config.hf_config
        if hf and is_classifier(hf):
            if num_labels(hf) != 1:
                raise ValueError(
                    f"{architecture_of(hf)}: num_labels is {num_labels(hf)}; /v1/rerank and "
                    f"/v1/score serve cross-encoders with one label"
                )
            return cls("score", 1)
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
        if setup.pooling == "score":
            raise RequestError(CLASSIFIER_ONLY)
        body = await parse_body(request, EmbeddingRequest)
        if body.dimensions is not None and body.dimensions != setup.dimensions:
            raise RequestError(
                f"dimensions: this model's embeddings have {setup.dimensions} dimensions and "
                f"cannot be shortened"
            )
        prompts = await _inputs(tm, body.input)
        states = await pooled(tm, request, setup, prompts, body)
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

    @app.post("/v1/rerank")
    async def rerank(request: Request):
        _need_classifier(setup)
        body = await parse_body(request, RerankRequest)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        pairs = [await tm.inputs.encode_pair(body.query, d) for d in documents]
        states = await pooled(tm, request, setup, pairs, body)
        ranked = sorted(range(len(states)), key=lambda i: -_relevance(states[i]))
        results = [
            {
                "index": i,
                "relevance_score": _relevance(states[i]),
                **({"document": {"text": documents[i]}} if body.return_documents else {}),
            }
            for i in ranked[: body.top_n]
        ]
        return json_response(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": model,
                "results": results,
                "usage": _usage(states),
            }
        )

    @app.post("/v1/score")
    async def score(request: Request):
        _need_classifier(setup)
        body = await parse_body(request, ScoreRequest)
        pairs = [await tm.inputs.encode_pair(a, b) for a, b in body.pairs()]
        states = await pooled(tm, request, setup, pairs, body)
        data = [
            {"index": i, "object": "score", "score": _relevance(s)} for i, s in enumerate(states)
        ]
        return json_response(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "model": model,
                "data": data,
                "usage": _usage(states),
            }
        )


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    query: str
    documents: list[str | Document] = Field(min_length=1)
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    priority: int | None = None
    cache_salt: str | None = None


class ScoreRequest(BaseModel):
    """`text_1` against each of `text_2`: one text against many, or two lists pairwise."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    priority: int | None = None
    cache_salt: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds) or not seconds:
            raise RequestError(
                f"text_2 has {len(seconds)} texts for the {len(firsts)} of text_1 (send one "
                f"text_1, or as many as text_2)"
            )
        return list(zip(firsts, seconds))


def _need_classifier(setup: EmbeddingSetup | None) -> None:
    if setup is None or setup.pooling != "score":
        raise RequestError(
            "/v1/rerank and /v1/score need a *ForSequenceClassification checkpoint (a "
            "cross-encoder) served with --is-embedding"
        )


def _relevance(state) -> float:
    return 1 / (1 + math.exp(-state.embedding[0]))


def _usage(states) -> dict:
    tokens = sum(s.prompt_tokens for s in states)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def pooled(tm: TokenizerManager, request: Request, setup: EmbeddingSetup, prompts, body):
    """Run each prompt as a pooling request; their finished states, in order."""
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
    for state in states:
        if state.embedding is None:  # aborted (a pause, a failed step): no vector to give
            reason = state.finish_reason.message if state.finish_reason else None
            raise RequestError(f"the request was aborted: {reason or 'no result'}", 503)
    return states


async def _inputs(tm: TokenizerManager, given) -> list[list[int]]:
    if isinstance(given, str):
        given = [given]
    elif isinstance(given[0], int):
        given = [given]
    out = []
    for i, item in enumerate(given):
        ids = await tm.inputs.encode(item) if isinstance(item, str) else item
        if not ids:
            raise RequestError(f"input[{i}] is empty")
        out.append(ids)
    return out


def _encoded(vector: list[float], body: EmbeddingRequest) -> list[float] | str:
    if body.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
