"""The torch reference of sparse latent attention (`sparse_mla.py` on GPUs,
`cpu_sparse_attention.cpp` on CPUs), and the path of a CPU without the compiled kernels. No
Triton here: CPU installs import it."""

from __future__ import annotations

import torch


def sparse_latent_attention_ref(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    value_dim: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in plain torch, in float32: the selected rows gathered, scored and summed;
    `sinks [heads]`: a learnt logit per head beside the rows, for a key whose value is zero."""
    chosen = slots >= 0
    keys = rows[slots.clamp(min=0)].float()  # [n, topk, row width]
    scores = torch.einsum("nhc,nkc->nhk", q.float(), keys[..., : q.shape[2]]) * scale
    scores = scores.masked_fill(~chosen.unsqueeze(1), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("nhk,nkc->nhc", probs, keys[..., :value_dim]).to(q.dtype)
