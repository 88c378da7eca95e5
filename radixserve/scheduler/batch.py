"""A step's batch, built from its requests: token ids, positions, slots and sampling inputs.

Functions of the requests only; the one state they touch is each request's `synced` count
(how many of its slots the worker's row already holds)."""

from __future__ import annotations

from dataclasses import dataclass

from ..constrained import GrammarBackend
from ..messages import ForwardBatch, ForwardMode, ImageSlice, LogprobRequest, SamplingBatch
from ..multimodal.processing import is_image_token
from ..sampling_params import SamplingParams
from .req import Req


@dataclass
class Step:
    mode: ForwardMode
    reqs: list[Req]
    prefill_lens: list[int]  # the first len(prefill_lens) reqs run prompt chunks of these lengths
    reused_tokens: int = 0
    batch: ForwardBatch | None = None  # built in `Scheduler.step`, once the drafts are final

    @property
    def num_prefill(self) -> int:
        return len(self.prefill_lens)


@dataclass(frozen=True)
class SamplingContext:
    """What sampling inputs need beyond the requests: the ids that end a request, the token
    taken when every token is forbidden, and the grammar backend for token masks."""

    eos_ids: frozenset[int]
    fallback_id: int
    grammars: GrammarBackend | None


def decode_mode(reqs: list[Req]) -> ForwardMode:
    """Decoding requests with drafts to verify run as an extend step (several tokens each)."""
    return ForwardMode.EXTEND if any(r.drafts for r in reqs) else ForwardMode.DECODE


def decode_lens(reqs: list[Req]) -> list[int]:
    return [1 + len(r.drafts) for r in reqs]


def build_batch(
    mode: ForwardMode,
    reqs: list[Req],
    lens: list[int],
    ctx: SamplingContext,
    window_map: tuple[list[int], list[int]] | None = None,
) -> ForwardBatch:
    """Request i feeds its last `lens[i]` slots; a row's new prefix slots go as `row_writes`;
    `window_map`: the window slots of full slots, where window layers keep KV apart."""
    ids, positions, locs, writes, seq_lens, logprobs = [], [], [], [], [], []
    images: list[ImageSlice] = []
    for req, n in zip(reqs, lens):
        end = len(req.kv_slots)
        start = end - n
        if req.images:
            images += image_slices(req, start, end, len(ids))
        ids += (req.fill_ids + req.drafts)[start:end] if req.drafts else req.fill_ids[start:end]
        positions += range(start, end)
        locs += req.kv_slots[start:end]
        if req.synced < start:
            writes.append((req.row, req.synced, req.kv_slots[req.synced : start]))
        req.synced = end
        seq_lens.append(end)
        logprobs.append(logprob_request(req, start, end - len(req.drafts)))
    draft_lens = [len(r.drafts) for r in reqs] if any(r.drafts for r in reqs) else None
    pooling = [r.pooling for r in reqs] if any(r.pooling for r in reqs) else None
    lora_names = [r.lora for r in reqs] if any(r.lora for r in reqs) else None
    mrope = mrope_rows(reqs, lens) if any(r.mrope for r in reqs) else None
    return ForwardBatch(
        mode,
        ids,
        positions,
        locs,
        [r.row for r in reqs],
        seq_lens,
        lens,
        writes,
        sampling_batch(reqs, ctx),
        logprobs,
        draft_lens,
        pooling,
        lora_names,
        window_map,
        images or None,
        mrope,
    )


def image_slices(req: Req, start: int, end: int, row: int) -> list[ImageSlice]:
    """The parts of the request's images among its tokens [start, end), which sit at `row` of
    the step's tokens."""
    return [
        ImageSlice(
            row + max(im.offset, start) - start,
            im,
            max(start - im.offset, 0),
            min(end, im.end) - im.offset,
        )
        for im in req.images
        if im.offset < end and im.end > start
    ]


def mrope_rows(reqs: list[Req], lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(time, height, width) positions of the step's tokens: a request's own M-RoPE positions,
    or its plain positions on all three axes."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    for req, n in zip(reqs, lens):
        end = len(req.kv_slots)
        for index in range(end - n, end):
            p = req.mrope.at(index) if req.mrope else (index, index, index)
            for axis in range(3):
                rows[axis].append(p[axis])
    return rows


def logprob_request(req: Req, start: int, end: int) -> LogprobRequest | None:
    if not req.return_logprob:
        return None
    lp = LogprobRequest(top_k=req.top_logprobs_num, want_output=end == len(req.fill_ids))
    if req.wants_prompt_logprobs:
        lo = max(start, req.logprob_start_len - 1, 0)
        hi = min(end, len(req.input_ids) - 1)
        if lo < hi:
            lp.prompt_start, lp.prompt_targets = lo - start, req.input_ids[lo + 1 : hi + 1]
    return lp


def sampling_batch(reqs: list[Req], ctx: SamplingContext) -> SamplingBatch:
    ps = [r.params for r in reqs]
    checks_drafts = any(r.drafts and r.grammar is not None for r in reqs)
    return SamplingBatch(
        temperatures=[p.temperature for p in ps],
        top_ps=[p.top_p for p in ps],
        top_ks=[p.top_k for p in ps],
        min_ps=[p.min_p for p in ps],
        seeds=[p.seed for p in ps],
        steps=[len(r.output_ids) for r in reqs],
        frequency_penalties=[p.frequency_penalty for p in ps],
        presence_penalties=[p.presence_penalty for p in ps],
        repetition_penalties=[p.repetition_penalty for p in ps],
        penalty_outputs=[list(r.output_ids) if r.params.has_penalties else None for r in reqs],
        penalty_prompts=[penalty_prompt(r) for r in reqs],
        suppressed_ids=[suppressed_ids(r, ctx.eos_ids) for r in reqs],
        token_masks=token_masks(reqs, ctx.grammars),
        logit_biases=logit_biases(ps),
        fallback_ids=[ctx.fallback_id] * len(reqs),
        draft_token_masks=[
            r.spec.draft_masks if r.drafts and r.grammar is not None else None for r in reqs
        ]
        if checks_drafts
        else None,
    )


def penalty_prompt(req: Req) -> list[int] | None:
    """The prompt tokens a repetition penalty counts (an image's tokens are not words)."""
    if req.params.repetition_penalty == 1:
        return None
    if not req.images:
        return req.input_ids
    return [t for t in req.input_ids if not is_image_token(t)]


def token_masks(reqs: list[Req], grammars: GrammarBackend | None) -> list[list[int] | None] | None:
    if not any(r.grammar is not None for r in reqs):
        return None
    return [None if r.grammar is None else grammars.token_mask(r.grammar) for r in reqs]


def suppressed_ids(req: Req, eos_ids: frozenset[int]) -> list[int] | None:
    """Stop and EOS ids are forbidden until the request has its min_new_tokens."""
    if len(req.output_ids) >= req.params.min_new_tokens:
        return None
    stops = set(req.params.stop_token_ids)
    return sorted(stops | (set() if req.params.ignore_eos else eos_ids))


def logit_biases(ps: list[SamplingParams]) -> list[list[tuple[int, float]] | None] | None:
    if not any(p.logit_bias for p in ps):
        return None
    return [[(int(k), v) for k, v in p.logit_bias.items()] if p.logit_bias else None for p in ps]
