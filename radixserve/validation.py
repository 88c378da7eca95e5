"""The checks a generate request passes before it is queued, in one place.

The api process (TokenizerManager) and the offline Engine run them; the scheduler trusts what
it receives. Sampling parameters are checked on their own by `SamplingParams.from_dict`; what
is checked here needs the model's limits (`WorkerInfo`). Each message names the field.
"""

from __future__ import annotations

import re

from .messages import Bootstrap, GenerateReq, ImageInput
from .multimodal.processing import image_token_id
from .worker_info import WorkerInfo

MAX_TOP_LOGPROBS = 100
PRIORITY_LIMIT = 2**31  # |priority| below this
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.\-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]")


def check_generate(req: GenerateReq, info: WorkerInfo) -> None:
    """Raise ValueError if `req` can never run on this model and pool."""
    _check_prompt(req.input_ids, info, req.images)
    params = req.sampling_params
    outside = [t for t in params.stop_token_ids if t >= info.vocab_size]
    if outside:
        raise ValueError(
            f"stop_token_ids: token id {outside[0]} is outside the vocabulary [0, "
            f"{info.vocab_size})"
        )
    outside = [k for k in (params.logit_bias or {}) if int(k) >= info.vocab_size]
    if outside:
        raise ValueError(
            f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {info.vocab_size})"
        )
    if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
    if req.logprob_start_len < -1:
        raise ValueError("logprob_start_len must be >= -1")
    if req.images and req.return_logprob and req.logprob_start_len >= 0:
        raise ValueError(
            "logprob_start_len: prompt logprobs are not available for prompts with images"
        )


def check_output_room(prompt_len: int, max_new_tokens: int, info: WorkerInfo, field: str) -> None:
    """An explicit output length that the context cannot hold after the prompt is refused
    (a default one is capped instead)."""
    limit = context_limit(info)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"{field}: this server holds {limit} tokens of context and the prompt has "
            f"{prompt_len}, so at most {max(limit - prompt_len, 0)} can be generated, not "
            f"{max_new_tokens}"
        )


CACHE_SALT_MAX = 256  # characters


def check_cache_salt(salt: str | None) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > CACHE_SALT_MAX:
        raise ValueError(
            f"cache_salt must be a non-empty string of at most {CACHE_SALT_MAX} characters"
        )


def check_bootstrap(req: GenerateReq, mode: str, samples: int) -> None:
    """A disaggregated server takes only the router's requests (with a bootstrap), one sample
    each and without logprobs; another server takes none of them."""
    where: Bootstrap | None = req.bootstrap
    if mode == "null":
        if where is not None:
            raise ValueError("bootstrap_room: this server is not disaggregated")
        return
    if where is None:
        raise ValueError(
            f"bootstrap_room: a --disaggregation-mode {mode} server takes requests with "
            "bootstrap_host, bootstrap_port and bootstrap_room; send them through "
            "`radixserve router --pd-disaggregation`"
        )
    if not HOST_NAME.fullmatch(where.host):
        raise ValueError("bootstrap_host must be a host name or an IP address")
    if not 0 <= where.room < 2**63:
        raise ValueError("bootstrap_room must be in [0, 2**63)")
    if not 0 < where.port <= 65535:
        raise ValueError("bootstrap_port must be in [1, 65535]")
    if samples > 1:
        raise ValueError("n > 1 is not supported with disaggregation")
    if req.return_logprob:
        raise ValueError("return_logprob is not supported with disaggregation")


def check_priority(priority: int | None, enabled: bool) -> None:
    if priority is None:
        return
    if not enabled:
        raise ValueError("priority: this server was not started with --enable-priority-scheduling")
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or abs(priority) >= PRIORITY_LIMIT
    ):
        raise ValueError(f"priority must be an integer with |priority| < 2**31, got {priority!r}")


def context_limit(info: WorkerInfo) -> int:
    """Tokens one request may hold: the context and the KV pool bound it."""
    return min(info.max_context_len, info.num_slots)


def _check_prompt(ids: list[int], info: WorkerInfo, images: list[ImageInput] | None) -> None:
    limit = context_limit(info)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= limit:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; this server accepts at most {limit - 1} "
            "(the context and the KV pool must hold the prompt and one new token)"
        )
    text = _text_ids(ids, images) if images else ids
    if any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < info.vocab_size for t in text
    ):
        raise ValueError(f"input_ids must be integers in the vocabulary [0, {info.vocab_size})")


def _text_ids(ids: list[int], images: list[ImageInput]) -> list[int]:
    """The prompt's text tokens: all but its images' content-hash ids, each image's span
    checked to start with them (Pixtral's spans also hold row-break and image-end tokens)."""
    text, last = [], 0
    for image in images:
        if image.offset < last or image.end > len(ids):
            raise ValueError("images must lie in the prompt, in order, apart")
        span, own = ids[image.offset : image.end], image_token_id(image.digest)
        if span[0] != own:
            raise ValueError("an image's tokens must be its content-hash ids")
        text += ids[last : image.offset] + [t for t in span if t != own]
        last = image.end
    return text + ids[last:]
