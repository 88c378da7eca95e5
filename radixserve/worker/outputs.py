"""What a step returns besides its next tokens: the logprobs of the tokens each request emits
and of its prompt, pooled hidden states for embeddings, and the drafts a verify step checks."""

from __future__ import annotations

from typing import Callable

import torch

from ..messages import ForwardBatch, TokenLogprobs
from .sampler import sample, verify

Logits = Callable[[torch.Tensor], torch.Tensor]  # hidden states -> logits (the model's head)


def drafts_of(fb: ForwardBatch) -> list[list[int]]:
    """Each request's draft tokens: the last draft_lens[b] of its chunk."""
    drafts, end = [], 0
    for n, k in zip(fb.extend_lens, fb.draft_lens):
        end += n
        drafts.append(fb.input_ids[end - k : end])
    return drafts


def next_tokens(logits: torch.Tensor, fb: ForwardBatch):
    """Each request's next token, sampled or verified against its drafts: (the tokens, the
    drafts accepted per request or None without drafts, each token's logits row)."""
    if fb.pooling is not None and None not in fb.pooling:  # nothing to sample
        return [0] * fb.batch_size, None, range(fb.batch_size)
    if fb.draft_lens is None:
        return sample(logits, fb.sampling).tolist(), None, range(fb.batch_size)
    return verify(logits, fb.sampling, drafts_of(fb))


def drafted_rows(fb: ForwardBatch) -> frozenset[int]:
    """The rows whose segment in this step ends with drafts to verify."""
    return frozenset(row for row, k in zip(fb.rows, fb.draft_lens or ()) if k)


def output_logprobs(
    logits, next_ids: list[int], accepted: list[list[int]] | None, rows, fb: ForwardBatch
) -> list[TokenLogprobs | None]:
    """Logprobs of the tokens each request emits this step, for the requests that asked:
    its next token, from logits row `rows[b]`, after a verify step preceded by its accepted
    drafts, from the rows before it."""
    wanted = [b for b, lp in enumerate(fb.logprobs) if lp is not None and lp.want_output]
    out: list[TokenLogprobs | None] = [None] * fb.batch_size
    if not wanted:
        return out
    emitted = [(accepted[b] if accepted else []) + [next_ids[b]] for b in wanted]
    picked = [
        row
        for b, tokens in zip(wanted, emitted)
        for row in range(rows[b] - len(tokens) + 1, rows[b] + 1)
    ]
    logprobs = torch.log_softmax(logits[picked], dim=-1)
    first = 0
    for b, tokens in zip(wanted, emitted):
        targets = torch.tensor(tokens, device=logits.device)
        out[b] = token_logprobs(
            logprobs[first : first + len(tokens)], targets, fb.logprobs[b].top_k
        )
        first += len(tokens)
    return out


def pooled(hidden: torch.Tensor, fb: ForwardBatch, head: Logits) -> list[torch.Tensor | None]:
    """Per pooling request, from its tokens' hidden states in this step: their sum (`mean`),
    the last one (`last`), or the classifier head's logits of the last one (`score`)."""
    out: list[torch.Tensor | None] = []
    first = 0
    for n, pooling in zip(fb.extend_lens, fb.pooling):
        states = hidden[first : first + n]
        if pooling == "mean":
            out.append(states.float().sum(0))
        elif pooling == "last":
            out.append(states[-1].float())
        elif pooling == "score":
            out.append(head(states[-1:])[0])
        else:
            out.append(None)
        first += n
    return out


def prompt_logprobs(
    hidden, extend_lens: torch.Tensor, fb: ForwardBatch, head: Logits
) -> list[TokenLogprobs | None]:
    out: list[TokenLogprobs | None] = [None] * fb.batch_size
    if all(lp is None or lp.prompt_start < 0 or not lp.prompt_targets for lp in fb.logprobs):
        return out
    starts = (torch.cumsum(extend_lens, 0) - extend_lens).tolist()
    for b, lp in enumerate(fb.logprobs):
        if lp is None or lp.prompt_start < 0 or not lp.prompt_targets:
            continue
        first = starts[b] + lp.prompt_start
        states = hidden[first : first + len(lp.prompt_targets)]
        logprobs = torch.log_softmax(head(states), dim=-1)
        targets = torch.tensor(lp.prompt_targets, device=logprobs.device)
        out[b] = token_logprobs(logprobs, targets, lp.top_k)
    return out


def token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, top_k: int) -> TokenLogprobs:
    chosen = logprobs.gather(1, targets.view(-1, 1)).flatten().tolist()
    if top_k <= 0:
        return TokenLogprobs(chosen)
    values, ids = logprobs.topk(top_k, dim=-1)
    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return TokenLogprobs(chosen, top)
