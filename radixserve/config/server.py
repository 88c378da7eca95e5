"""`ServerArgs`: the HTTP front (where to listen, who may call, how many replicas) around an
engine's `EngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..multimodal.media import MediaPolicy, media_limits
from .engine import EngineArgs
from .options import check_choices, option, refuse_problems


def _names(module: str) -> tuple[str, ...]:
    """The names a parser registry offers (imported here so that config stays the one place
    of each option's choices)."""
    if module == "tool_calls":
        from ..tool_calls import PARSERS
    else:
        from ..reasoning import PARSERS
    return tuple(sorted(PARSERS))


@dataclass(frozen=True)
class ServerArgs:
    """The HTTP front: where to listen, who may call, how many replicas."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>'")
    served_model_name: str | None = option(None, "model name reported by /v1/models")
    engine: EngineArgs = field(default_factory=EngineArgs, metadata=dict(flag=False))
    max_request_bytes: int = option(8 << 20, "largest request body accepted; a larger one is a 413")
    max_queued_requests: int | None = option(
        None,
        "requests allowed to wait beyond --max-running-requests; more are answered 503 with "
        "Retry-After (default: no limit)",
    )
    tool_call_parser: str | None = option(
        None,
        "format of the model's tool calls (default: detected from the chat template)",
        _names("tool_calls"),
    )
    reasoning_parser: str | None = option(
        None,
        "split <think>...</think> reasoning from the answer into reasoning_content (deepseek-r1 "
        "and qwen3-thinking: the output starts inside the reasoning; qwen3: only when it opens "
        "<think>)",
        _names("reasoning"),
    )
    is_embedding: bool = option(
        False,
        "also serve /v1/embeddings: the prompt's final hidden states pooled as the checkpoint's "
        "sentence-transformers config says (1_Pooling: last token or mean; last by default), "
        "L2-normalized",
    )
    dp_size: int = option(
        1,
        "data-parallel replicas, each a whole server with its share of the CPU cores (or its own "
        "GPUs), behind a router on --host/--port",
    )

    allowed_media_domains: tuple[str, ...] = option(
        (),
        "hosts (and their subdomains) images may be fetched from over http(s); none by "
        "default. A name must not resolve to a private address; an address listed here is "
        "allowed as it is",
    )
    allowed_local_media_path: str | None = option(
        None, "a folder images may be read from as file:// URLs (none by default)"
    )
    limit_mm_per_prompt: str = option(
        '{"image": 8, "video": 1}',
        "the images and videos a prompt may carry, as a JSON object (a kind left out keeps its "
        "default)",
    )
    media_fetch_timeout: float = option(10.0, "seconds an image fetch may take")
    max_image_pixels: int = option(
        40_000_000, "the largest image or video frame accepted, in pixels (a larger one is a 400)"
    )
    max_video_frames: int = option(
        7200, "the most frames a video may have (a longer one is a 400; they are sampled at fps)"
    )
    mm_processor_cache_gb: float = option(
        1.0,
        "GiB of preprocessed images and videos the api process keeps by the hash of their "
        "bytes, so one sent again (each turn of a chat) is not decoded and preprocessed again "
        "(0: none kept)",
    )

    def __post_init__(self) -> None:
        refuse_problems("server", self._problems())

    def media_policy(self) -> MediaPolicy:
        return MediaPolicy(
            tuple(d.lower() for d in self.allowed_media_domains),
            self.allowed_local_media_path,
            self.max_request_bytes,
            self.media_fetch_timeout,
            self.max_image_pixels,
            self.max_video_frames,
        )

    def _problems(self):
        yield from check_choices(self)
        if not 0 <= self.port <= 65535:
            yield f"port must be in [0, 65535], got {self.port}"
        if self.max_request_bytes < 1:
            yield "max_request_bytes must be >= 1"
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            yield "max_queued_requests must be >= 0"
        if self.dp_size < 1:
            yield "dp_size must be >= 1"
        try:
            media_limits(self.limit_mm_per_prompt)
        except ValueError as exc:
            yield str(exc)
        if (
            self.allowed_local_media_path is not None
            and not Path(self.allowed_local_media_path).is_dir()
        ):
            yield f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder"
        if self.media_fetch_timeout <= 0 or min(self.max_image_pixels, self.max_video_frames) < 1:
            yield "media_fetch_timeout, max_image_pixels and max_video_frames must be > 0"
        if self.mm_processor_cache_gb < 0:
            yield "mm_processor_cache_gb must be >= 0"
        if self.dp_size > 1 and self.engine.nnodes > 1:
            yield (
                "dp_size with nnodes is not supported: start each multi-node replica on its own, "
                "behind `radixserve router`"
            )
        if self.dp_size > 1 and self.engine.disaggregation_mode != "null":
            yield (
                "disaggregation_mode with dp_size is not supported: start the prefill and decode "
                "servers one by one behind `radixserve router --pd-disaggregation`"
            )
        if self.dp_size > 1 and self.engine.kv_events_config is not None:
            yield (
                "kv_events_config with dp_size is not supported (each replica needs its own "
                "endpoint): --router-kv-events gives each one its own, or start them one by one "
                "behind `radixserve router`"
            )
