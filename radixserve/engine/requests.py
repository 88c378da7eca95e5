"""The offline Engine's inputs: its prompts and options turned into checked `GenerateReq`s."""

from __future__ import annotations

import uuid

from ..messages import GenerateReq, ImageInput
from ..sampling_params import SamplingParams
from ..tokenizer import encode_prompt
from ..validation import check_cache_salt, check_generate
from ..worker_info import WorkerInfo


def make_requests(
    tokenizer,
    info: WorkerInfo,
    prompt,
    input_ids,
    sampling_params,
    return_logprob,
    logprob_start_len,
    top_logprobs_num,
    cache_salt: str | None = None,
    lora_path: str | list[str | None] | None = None,
    media=None,
) -> tuple[list[GenerateReq], bool]:
    """The offline Engine's prompts (text, or token ids) and options as checked `GenerateReq`s,
    one per prompt and sample, and whether one prompt was given; ValueError naming what is
    wrong, as the server's validation would. `media`: a callable that expands one prompt's
    ids by its images and videos (`EngineMedia.attach` bound to them), or None."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt or input_ids")
    check_cache_salt(cache_salt)
    single = isinstance(prompt, str) or (
        input_ids is not None and input_ids and isinstance(input_ids[0], int)
    )
    if input_ids is not None:
        id_lists = [input_ids] if single else list(input_ids)
    else:
        need_tokenizer(tokenizer)
        id_lists = [encode_prompt(tokenizer, p) for p in ([prompt] if single else prompt)]
    images: list[ImageInput] | None = None
    if media is not None:
        if not single:
            raise ValueError("image_data and video_data go with one prompt, not a batch")
        id_lists[0], images = media(id_lists[0])
    params_list = (
        sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(id_lists)
    )
    if len(params_list) != len(id_lists):
        raise ValueError("sampling_params list must match the number of prompts")
    adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(id_lists)
    if len(adapters) != len(id_lists):
        raise ValueError("lora_path list must match the number of prompts")
    reqs = []
    for ids, raw, adapter in zip(id_lists, params_list, adapters):
        params = raw if isinstance(raw, SamplingParams) else SamplingParams.from_dict(raw)
        if isinstance(raw, SamplingParams):
            params.validate()
        for sample in params.per_sample():
            req = GenerateReq(
                uuid.uuid4().hex,
                list(ids),
                sample,
                return_logprob,
                logprob_start_len,
                top_logprobs_num,
                cache_salt=cache_salt,
                lora_path=adapter,
                images=images,
            )
            check_generate(req, info)
            reqs.append(req)
    return reqs, single


def need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass input_ids")
