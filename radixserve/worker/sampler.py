"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeded draws.

Stateless: everything a request needs (its output so far, its seed and step)
comes in the batch, so results do not depend on batch composition. Runs on the logits'
device (on a GPU the full logits never come to the host; only the sampled ids do).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from ..messages import SamplingBatch
from ..sampling_params import GREEDY_BELOW


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits `[B, V]` float32 -> token ids `[B]`."""
    rows = [
        b
        for b, (t, k) in enumerate(zip(sb.temperatures, sb.top_ks))
        if t >= GREEDY_BELOW and k != 1
    ]
    if not rows and not _edits_logits(sb):  # all greedy, nothing to mask or bias
        return _argmax(logits)
    logits = logits.clone()
    _apply_logit_biases(logits, sb.logit_biases)
    apply_token_masks(logits, sb.token_masks)
    _apply_penalties(logits, sb)
    _apply_suppression(logits, sb)
    _allow_fallback_where_all_forbidden(logits, sb.fallback_ids)
    tokens = _argmax(logits)
    if not rows:
        return tokens
    temps = torch.tensor(
        [sb.temperatures[r] for r in rows], dtype=torch.float32, device=logits.device
    )
    probs = _filtered_probs(logits[rows] / temps.unsqueeze(1), sb, rows)
    tokens[rows] = _draw(probs, [sb.seeds[r] for r in rows], [sb.steps[r] for r in rows])
    return tokens


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; on CPU in float32 through the C++ kernel (torch's took 2-3x as long
    on 8-40 rows of the LM head's output)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        if (ops := load_cpu_kernels()) is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def verify(
    logits: torch.Tensor, sb: SamplingBatch, drafts: list[list[int]]
) -> tuple[list[int], list[list[int]], list[int]]:
    """Check each request's drafts against the model: logits hold, per request, a row for the
    token before its drafts and one per draft. A token is sampled at every row as without
    speculation (seeded draws use the step of the output position the row would fill); draft i
    is accepted while it equals the token sampled before it. With a draft that is one token, not
    a distribution, this is exact rejection sampling: the draft is kept with its probability,
    and otherwise the token drawn is one from the rest of the distribution. Greedy output is
    the same as without speculation. Returns per request the next token, the accepted drafts,
    and the logits row of the next token."""
    counts = [1 + len(d) for d in drafts]
    targets = sample(logits, _rows_of(sb, drafts)).tolist()
    next_ids, accepted, rows, row = [], [], [], 0
    for draft, count in zip(drafts, counts):
        n = 0
        while n < len(draft) and targets[row + n] == draft[n]:
            n += 1
        next_ids.append(targets[row + n])
        accepted.append(draft[:n])
        rows.append(row + n)
        row += count
    return next_ids, accepted, rows


def _rows_of(sb: SamplingBatch, drafts: list[list[int]]) -> SamplingBatch:
    """Each request's sampling settings once per logits row, as they are at the output position
    the row fills: its step, its output so far (penalties) and its grammar state (row i comes
    after drafts[:i])."""

    def per_row(name: str, values):
        if values is None or name == "draft_token_masks":
            return None
        rows = []
        for b, (value, draft) in enumerate(zip(values, drafts)):
            for i in range(1 + len(draft)):
                if name == "steps":
                    rows.append(value + i)
                elif name == "penalty_outputs" and value is not None:
                    rows.append(value + draft[:i])
                elif name == "token_masks" and value is not None and i > 0:
                    rows.append(sb.draft_token_masks[b][i - 1])
                else:
                    rows.append(value)
        return rows

    return SamplingBatch(**{f.name: per_row(f.name, getattr(sb, f.name)) for f in fields(sb)})


def _edits_logits(sb: SamplingBatch) -> bool:
    return (
        any(b for b in sb.logit_biases or [])
        or any(m is not None for m in sb.token_masks or [])
        or any(o is not None for o in sb.penalty_outputs)
        or any(sb.suppressed_ids)
    )


def apply_token_masks(logits: torch.Tensor, masks: list[list[int] | None] | None) -> None:
    """Forbid (-inf) every token whose bit is clear in its row's grammar bitmask; in place."""
    rows = [b for b, mask in enumerate(masks or []) if mask is not None]
    if not rows:
        return
    dev = logits.device
    words = torch.tensor([masks[b] for b in rows], dtype=torch.int32, device=dev)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=dev)) & 1
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=dev)
    width = min(logits.shape[-1], bits.shape[1] * 32)
    allowed[:, :width] = bits.flatten(1)[:, :width].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_logit_biases(
    logits: torch.Tensor, biases: list[list[tuple[int, float]] | None] | None
) -> None:
    for b, pairs in enumerate(biases or []):
        if pairs:
            ids, values = zip(*pairs)
            logits[b, torch.tensor(ids, dtype=torch.long, device=logits.device)] += torch.tensor(
                values, dtype=logits.dtype, device=logits.device
            )


def _apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> None:
    for b, outputs in enumerate(sb.penalty_outputs):
        if outputs is None:
            continue
        row = logits[b]
        ids = torch.tensor(outputs, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=row.numel())[: row.numel()]
        row -= sb.frequency_penalties[b] * counts + sb.presence_penalties[b] * (counts > 0)
        rep = sb.repetition_penalties[b]
        if rep != 1.0:
            seen = torch.tensor(
                sorted(set(outputs) | set(sb.penalty_prompts[b] or [])),
                dtype=torch.long,
                device=logits.device,
            )
            values = row[seen]
            row[seen] = torch.where(values > 0, values / rep, values * rep)


def _apply_suppression(logits: torch.Tensor, sb: SamplingBatch) -> None:
    for b, banned in enumerate(sb.suppressed_ids):
        if banned:
            logits[b, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")


def _allow_fallback_where_all_forbidden(
    logits: torch.Tensor, fallback_ids: list[int] | None
) -> None:
    """A row whose every token is forbidden (say a grammar that allows only EOS while
    min_new_tokens bans it) gets its fallback token back, instead of sampling from NaN
    probabilities. Without a host sync: rows with an allowed token keep their logit."""
    if fallback_ids is None:
        return
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    fallback = torch.tensor(fallback_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    logits.scatter_(
        1,
        fallback,
        torch.where(dead, torch.zeros_like(dead, dtype=logits.dtype), logits.gather(1, fallback)),
    )


def _filtered_probs(logits: torch.Tensor, sb: SamplingBatch, rows: list[int]) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    top_ks = [sb.top_ks[r] for r in rows]
    top_ps = [sb.top_ps[r] for r in rows]
    min_ps = [sb.min_ps[r] for r in rows]
    if (
        all(k == -1 for k in top_ks)
        and all(p >= 1.0 for p in top_ps)
        and all(m == 0 for m in min_ps)
    ):
        return probs
    dev = probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=dev).unsqueeze(0)
    k = torch.tensor([v if v > 0 else probs.shape[-1] for v in top_ks], device=dev).unsqueeze(1)
    drop = rank >= k
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) > torch.tensor(top_ps, device=dev).unsqueeze(1)
    drop |= sorted_probs < torch.tensor(min_ps, device=dev).unsqueeze(1) * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _draw(probs: torch.Tensor, seeds: list[int | None], steps: list[int]) -> torch.Tensor:
    out = torch.empty(len(seeds), dtype=torch.long, device=probs.device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        out[unseeded] = torch.multinomial(probs[unseeded], 1).flatten()
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        if seed is not None:
            generator = torch.Generator(probs.device).manual_seed(
                (seed * 1_000_003 + step) % (1 << 63)
            )
            out[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
    return out
