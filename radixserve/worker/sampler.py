"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeded draws.

Stateless: everything a request needs (its output so far, its seed and step)
comes in the batch, so results do not depend on batch composition.
"""
from __future__ import annotations

import torch

from ..messages import SamplingBatch


def sample(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits `[B, V]` float32 -> token ids `[B]`."""
    logits = logits.clone()
    _apply_logit_biases(logits, sb.logit_biases)
    apply_token_masks(logits, sb.token_masks)
    _apply_penalties(logits, sb)
    _apply_suppression(logits, sb)
    temps = torch.tensor(sb.temperatures, dtype=torch.float32)
    greedy = (temps == 0) | (torch.tensor(sb.top_ks) == 1)
    tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return tokens
    rows = (~greedy).nonzero().flatten()
    probs = _filtered_probs(logits[rows] / temps[rows].unsqueeze(1), sb, rows.tolist())
    tokens[rows] = _draw(probs, [sb.seeds[r] for r in rows.tolist()], [sb.steps[r] for r in rows.tolist()])
    return tokens


def apply_token_masks(logits: torch.Tensor, masks: list[list[int] | None] | None) -> None:
    """Forbid (-inf) every token whose bit is clear in its row's grammar bitmask; in place."""
    rows = [b for b, mask in enumerate(masks or []) if mask is not None]
    if not rows:
        return
    words = torch.tensor([masks[b] for b in rows], dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
    width = min(logits.shape[-1], bits.shape[1] * 32)
    allowed[:, :width] = bits.flatten(1)[:, :width].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_logit_biases(logits: torch.Tensor, biases: list[list[tuple[int, float]] | None] | None) -> None:
    for b, pairs in enumerate(biases or []):
        if pairs:
            ids, values = zip(*pairs)
            logits[b, torch.tensor(ids, dtype=torch.long)] += torch.tensor(values, dtype=logits.dtype)


def _apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> None:
    for b, outputs in enumerate(sb.penalty_outputs):
        if outputs is None:
            continue
        row = logits[b]
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=row.numel())[: row.numel()]
        row -= sb.frequency_penalties[b] * counts + sb.presence_penalties[b] * (counts > 0)
        rep = sb.repetition_penalties[b]
        if rep != 1.0:
            seen = torch.tensor(sorted(set(outputs) | set(sb.penalty_prompts[b] or [])), dtype=torch.long)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / rep, values * rep)


def _apply_suppression(logits: torch.Tensor, sb: SamplingBatch) -> None:
    for b, banned in enumerate(sb.suppressed_ids):
        if banned:
            logits[b, torch.tensor(banned, dtype=torch.long)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, sb: SamplingBatch, rows: list[int]) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    top_ks = [sb.top_ks[r] for r in rows]
    top_ps = [sb.top_ps[r] for r in rows]
    min_ps = [sb.min_ps[r] for r in rows]
    if all(k == -1 for k in top_ks) and all(p >= 1.0 for p in top_ps) and all(m == 0 for m in min_ps):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1]).unsqueeze(0)
    k = torch.tensor([v if v > 0 else probs.shape[-1] for v in top_ks]).unsqueeze(1)
    drop = rank >= k
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) > torch.tensor(top_ps).unsqueeze(1)
    drop |= sorted_probs < torch.tensor(min_ps).unsqueeze(1) * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _draw(probs: torch.Tensor, seeds: list[int | None], steps: list[int]) -> torch.Tensor:
    out = torch.empty(len(seeds), dtype=torch.long)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        out[unseeded] = torch.multinomial(probs[unseeded], 1).flatten()
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        if seed is not None:
            generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (1 << 63))
            out[i] = torch.multinomial(probs[i], 1, generator=generator).item()
    return out
