"""The typed messages between the parts of the server, as plain dataclasses.

Across processes (ZeroMQ, msgpack through `ipc`):
  api -> scheduler: GenerateReq (with SamplingParams validated once, in the api), AbortReq,
  ControlReq
  scheduler -> detokenizer -> api: BatchOut of ReqOutput (text added by the detokenizer),
  ControlReply
Inside the scheduler process, scheduler -> model runner: ForwardBatch in, ForwardResult out
(TP ranks > 0 receive the batch's model inputs as one packed tensor, `worker/step_inputs.py`).
Fields hold only plain values, so nothing is ever pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from .sampling_params import SamplingParams
from .worker_info import WorkerInfo


class ForwardMode(IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3  # prompt chunks and decoding requests in one pass


@dataclass
class SamplingBatch:
    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    min_ps: list[float]
    seeds: list[int | None]
    steps: list[int]
    frequency_penalties: list[float]
    presence_penalties: list[float]
    repetition_penalties: list[float]
    penalty_outputs: list[list[int] | None]
    penalty_prompts: list[list[int] | None]
    suppressed_ids: list[list[int] | None]
    token_masks: list[list[int] | None] | None = (
        None  # grammar bitmasks, int32 words (constrained.py)
    )
    logit_biases: list[list[tuple[int, float]] | None] | None = None
    # the token (EOS) a row takes when masks and suppression forbid every token
    fallback_ids: list[int] | None = None
    # verify steps: request b's grammar bitmasks after each of its drafts (its rows 1..k)
    draft_token_masks: list[list[list[int]] | None] | None = None

    @classmethod
    def greedy(cls, n: int) -> "SamplingBatch":
        """n rows of plain argmax: no penalties, masks or seeds."""
        return cls(
            [0.0] * n,
            [1.0] * n,
            [-1] * n,
            [0.0] * n,
            [None] * n,
            [0] * n,
            [0.0] * n,
            [0.0] * n,
            [1.0] * n,
            [None] * n,
            [None] * n,
            [None] * n,
        )


@dataclass
class LogprobRequest:
    """Logprobs wanted for one request of the batch.

    `prompt_targets[i]` is the token that follows position `prompt_start + i` of this
    step's tokens; its logprob is read from that position's logits.
    """

    top_k: int = 0
    prompt_start: int = -1
    prompt_targets: list[int] = field(default_factory=list)
    want_output: bool = False


@dataclass
class ImageInput:
    """One image of a prompt (or a video, or a video's frame pair): its content hash (its
    tokens' ids derive from it), where its tokens lie in the prompt, and its preprocessed pixels
    (float32 bytes, `[patches, patch_dim]`) with their (t, h, w) patch grid; a video's time
    positions lie `time_interval` apart from one frame pair to the next."""

    digest: int
    offset: int
    tokens: int
    grid: list[int]
    pixels: bytes
    patch_dim: int
    time_interval: float = 1.0

    @property
    def end(self) -> int:
        return self.offset + self.tokens


@dataclass
class ImageSlice:
    """The tokens [start, end) of an image that a step computes, at `row` of the step's tokens."""

    row: int
    image: ImageInput
    start: int
    end: int


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    out_cache_loc: list[int]
    rows: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    row_writes: list[tuple[int, int, list[int]]]
    sampling: SamplingBatch
    logprobs: list[LogprobRequest | None]
    # speculative decoding: request b's last draft_lens[b] tokens are drafts to verify
    draft_lens: list[int] | None = None
    # embedding requests: how request b's hidden states are pooled (None: it generates)
    pooling: list[str | None] | None = None
    # LoRA: request b's adapter (None: the base model); None when no request has one
    lora_names: list[str | None] | None = None
    # window layers kept apart: (full slots, their window slots) the worker has not seen
    window_map: tuple[list[int], list[int]] | None = None
    # vision-language models: the image tokens of this step, and (time, height, width)
    # positions of every token where a request has images (M-RoPE)
    images: list[ImageSlice] | None = None
    mrope_positions: tuple[list[int], list[int], list[int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)


@dataclass
class TokenLogprobs:
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class ForwardResult:
    """Per request: the token sampled this step; with drafts, `accepted_drafts[b]` (the drafts
    the model agreed with) precede it in the output."""

    next_token_ids: list[int]
    output_logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None]
    accepted_drafts: list[list[int]] | None = None
    # with `ForwardBatch.pooling`: per pooling request, the sum ("mean") or the last ("last")
    # of this step's final-normed hidden states, float32
    pooled: list[Any] | None = None


# ---- api <-> scheduler ---------------------------------------------------


@dataclass
class Bootstrap:
    """Where a disaggregated request's prefill runs (SGLang's `bootstrap_host`/`_port`) and the
    number both servers know its transfer by (`bootstrap_room`)."""

    host: str
    port: int
    room: int


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    priority: int = 0  # higher runs first, with --enable-priority-scheduling
    cache_salt: str | None = None  # requests of different salts never share cached KV
    pooling: str | None = None  # an embedding request: its prompt pooled ("last", "mean")
    lora_path: str | None = None  # the LoRA adapter's name (None: the base model)
    bootstrap: Bootstrap | None = None  # on a disaggregated server: the request's transfer
    images: list[ImageInput] | None = None  # a vision-language model's images, in prompt order


@dataclass
class KVDestination:
    """A decode server to a prefill server's bootstrap listener: where to write the KV of the
    request numbered `room` (disagg)."""

    room: int
    session: str  # the decode server's transfer engine, as peers name it
    notify: str  # the ZeroMQ address that takes the `KVArrived`
    layers: int  # the decode pool's shape (transfer.PoolShape)
    slot_bytes: int
    prompt_len: int
    start: int  # prompt tokens the decode server has cached itself: not sent
    landing: int  # the address of its buffer for the tokens [start, prompt_len)
    valid_s: float  # how long it waits: no write may start later
    state_bytes: int = 0  # a hybrid model's state, landed after the KV


@dataclass
class StateTensor:
    """One part of a hybrid model's per-request state as it travels between servers: the
    state of `kind` ("conv", "delta", ...) of `layer`, one request's `shape` in `dtype`."""

    kind: str
    layer: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class KVArrived:
    """A prefill server to a decode server: the room's KV is written (or why not), with the
    first output token (-1: none was asked for) and, for a hybrid model, what the state written
    after the KV is made of."""

    room: int
    first_token: int
    cached_tokens: int  # prompt tokens the prefill server found in its cache
    error: str | None = None
    states: list[StateTensor] = field(default_factory=list)


@dataclass
class AbortReq:
    rid: str


@dataclass
class FinishReason:
    """Why a request ended, in SGLang's terms: `stop` (on `matched`, a token id or a stop
    string), `length` (after `length` tokens) or `abort` (with a `message`). A request the
    scheduler refused (a grammar that does not compile, say) is `rejected`: the api answers
    it with a 400 instead of a result."""

    kind: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    rejected: bool = False
    unavailable: bool = False  # the api answers a 503 (a KV transfer that failed, say)

    def to_json(self) -> dict:
        """The `finish_reason` object of SGLang's responses."""
        out: dict = {"type": self.kind}
        if self.kind == "stop":
            out["matched"] = self.matched
        elif self.kind == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass
class ReqOutput:
    """One request's progress in one scheduler step (token ids; text is added later)."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[list] | None = None  # [logprob, token id] per token
    output_top_logprobs: list[list | None] | None = (
        None  # per token: [[logprob, token id], ...] or None
    )
    input_logprobs: list[list] | None = None
    input_top_logprobs: list[list | None] | None = None
    text: str = ""
    queue_time: float = 0.0
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    spec_verify_ct: int = 0  # steps that verified drafts for this request (SGLang's meta_info name)
    spec_accepted_tokens: int = 0  # drafts accepted in them
    embedding: list[float] | None = None  # an embedding request's normalized vector, at the end


@dataclass
class BatchOut:
    outputs: list[ReqOutput]


@dataclass
class SchedulerStats:
    """Live figures of the scheduler, for metrics and the dashboard."""

    num_running: int = 0
    num_queued: int = 0
    num_slots: int = 0
    free_slots: int = 0
    cached_slots: int = 0
    evictable_slots: int = 0
    running_slots: int = 0
    radix_nodes: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generation_tokens_total: int = 0
    evicted_tokens_total: int = 0
    retractions_total: int = 0
    peak_running: int = 0  # the most requests running in one step since start
    jump_forward_tokens_total: int = 0
    spec_verify_steps_total: int = 0  # request-steps that verified drafts
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    requests_finished: dict = field(default_factory=dict)
    aborted_total: int = 0
    forward_steps: int = 0
    recent_hit_rate: float = 0.0
    cache_estimates: dict = field(
        default_factory=dict
    )  # "0.5x"/"2x"/"4x" -> estimated recent hit rate
    cache_estimate_seconds: float = 0.0  # spent on those estimates
    gen_throughput: float = 0.0
    queue_times: list = field(default_factory=list)
    hicache: dict = field(
        default_factory=dict
    )  # mem.hicache.TierStats and tier sizes, when enabled
    # a hybrid model's state snapshots, window layers' KV kept apart (KVManager.hybrid_figures)
    hybrid_memory: dict = field(default_factory=dict)
    # vision-language models: image tokens admitted and read from the cache, tower runs,
    # encoder-cache hits (SchedulerMetrics, VisionEncoder.figures)
    images: dict = field(default_factory=dict)
    kv_transfer_waiting: int = 0  # disaggregated: requests waiting for their KV to move
    kv_transfers_total: int = 0
    kv_transfer_failures_total: int = 0
    kv_transfer_bytes_total: int = 0  # written by a prefill server
    kv_transfer_seconds_total: float = 0.0  # a prefill server's transfers, from prompt end
    kv_received_tokens_total: int = 0  # prompt tokens a decode server received

    @property
    def cache_hit_rate(self) -> float:
        return (
            self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        )


@dataclass
class ControlReq:
    """api -> scheduler: a question the scheduler answers with a ControlReply."""

    kind: str
    token: str
    arg: int = 0
    text: str = ""  # a path or a mode, for the controls that take one


@dataclass
class ControlReply:
    kind: str
    token: str
    data: dict


@dataclass
class SchedulerReady:
    info: WorkerInfo
    model_name: str
    lora_adapters: tuple[str, ...] = ()  # the adapters served at start-up, by name
