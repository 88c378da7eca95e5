"""A request as the scheduler tracks it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..mem.radix_cache import TreeNode
from ..messages import Bootstrap, FinishReason, ImageInput
from ..multimodal.positions import MRopePositions
from ..sampling_params import SamplingParams
from .speculative import SpecState


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    output_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # higher is admitted first and retracted last (priority scheduling)
    cache_salt: str | None = None  # its KV is shared only with requests of this namespace
    lora: str | None = None  # its LoRA adapter's name (None: the base model)
    pooling: str | None = None  # an embedding request: "last" or "mean" pooling of its prompt
    pooled: Any = None  # the running sum (mean) or the last hidden state so far
    embedding: list[float] | None = None
    bootstrap: Bootstrap | None = None  # disaggregated: where its prefill runs, its room
    images: list[ImageInput] | None = None  # a vision-language model's images, prompt order
    mrope: MRopePositions | None = None  # its tokens' 3-D positions (M-RoPE models)
    whole_images: bool = False  # chunks and cached prefixes end outside its images (Gemma 3)

    # memory: kv_slots[:cached_len] belong to the radix tree (locked through `node`);
    # the rest are this request's own pages. `synced` leading slots are in the worker's row.
    row: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    cached_len: int = 0
    node: TreeNode | None = None
    synced: int = 0
    branch_at: int | None = None  # hybrid: where it leaves a cached path with no snapshot
    window_trimmed: int = 0  # window layers kept apart: its tokens before this hold none

    cached_tokens: int = 0
    admitted: bool = False
    queue_time: float = 0.0
    finish_reason: FinishReason | None = None
    sent_len: int = 0
    input_logprobs: list[list] = field(default_factory=list)
    input_top_logprobs: list[list] = field(default_factory=list)
    output_logprobs: list[list] = field(default_factory=list)
    output_top_logprobs: list[list] = field(default_factory=list)
    sent_logprobs: int = 0
    prompt_logprobs_done: bool = False
    grammar: Any = None  # an xgrammar matcher when the request asked for structured output
    spec: SpecState | None = None  # speculative decoding's state, when the server speculates

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs: prompt plus every output but the newest."""
        return self.input_ids + self.output_ids

    @property
    def drafts(self) -> list[int]:
        """Draft tokens this step verifies after the newest output token (their KV slots follow)."""
        return self.spec.drafts if self.spec is not None else []

    @property
    def pending(self) -> int:
        """Tokens still to feed through the model (1 while decoding)."""
        return len(self.input_ids) + len(self.output_ids) - len(self.kv_slots)

    @property
    def is_decoding(self) -> bool:
        return self.pending == 1 and bool(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Admitted, with prompt (or, after retraction, prompt and output) tokens left to
        compute."""
        return self.pending > 0 and not self.is_decoding

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - len(self.output_ids), 0)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.prompt_logprobs_done

    def image_edge(self, end: int, forward: bool) -> int:
        """`end`, or, for a request whose images are computed whole, where the image `end`
        falls inside starts (or, `forward`, ends)."""
        if not self.whole_images:
            return end
        for image in self.images or ():
            if image.offset < end < image.end:
                return image.end if forward else image.offset
        return end

    def max_prefix_len(self) -> int:
        """Cached prefix we may reuse: leave one token to compute, and the prompt positions whose
        logprobs (or hidden states, to mean-pool) are wanted."""
        limit = len(self.fill_ids) - 1
        if self.pooling == "mean":  # every position's hidden state is pooled
            return 0
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit
