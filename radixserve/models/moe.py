"""Mixture-of-experts blocks: a router picks `top_k` experts per token, and only those run.

Experts are stored stacked (`w13 [E, hidden, 2 * inter]`, `w2 [E, inter, hidden]`, transposed
for `x @ w`); each forward groups the step's tokens by expert and runs one matmul pair per expert
that any token chose. Tensor parallelism shards every expert's intermediate dimension (like a
dense MLP: gate/up by output, down by input, one all-reduce), so each rank holds a slice of all
experts and the routing is the same on every rank."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from ..layers import activation


@dataclass(frozen=True)
class Routing:
    """How a router turns its logits into `(weights [T, k], experts [T, k])`.

    `kind`: "softmax_topk" (softmax over all experts, then top-k: Mixtral, Qwen3-MoE),
    "topk_softmax" (top-k logits, softmax over them: gpt-oss), "grouped_sigmoid" (sigmoid
    scores, plus a correction bias for the choice only, top groups first: DeepSeek-V3)."""

    kind: str
    top_k: int
    renormalize: bool = False
    num_groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0


def route(logits: torch.Tensor, routing: Routing, correction: torch.Tensor | None = None):
    if routing.kind == "softmax_topk":
        weights, experts = torch.softmax(logits.float(), dim=-1).topk(routing.top_k, dim=-1)
    elif routing.kind == "topk_softmax":
        top, experts = logits.topk(routing.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        return _grouped_sigmoid(logits.float(), routing, correction)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _grouped_sigmoid(logits: torch.Tensor, routing: Routing, correction: torch.Tensor | None):
    scores = logits.sigmoid()
    choice = scores + correction if correction is not None else scores
    tokens, num_experts = choice.shape
    groups = choice.view(tokens, routing.num_groups, -1)
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(routing.top_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    keep = keep.unsqueeze(-1).expand_as(groups).reshape(tokens, num_experts)
    experts = choice.masked_fill(~keep, float("-inf")).topk(routing.top_k, dim=-1, sorted=False)
    experts = experts.indices
    weights = scores.gather(1, experts)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, experts


# a checkpoint's per-expert tensor names -> our part: gate/up land in w13, down in w2
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MIXTRAL_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(r"(\d+)\.(\w+)\.weight")


class Experts(nn.Module):
    """`num_experts` gated MLPs of this rank's `inter` width; `act(gate) * up` by default,
    `gated` replaces that (gpt-oss). `bias`: each expert's projections have biases."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        tp: TPGroup,
        act: str = "silu",
        bias: bool = False,
        parts: dict[str, str] = EXPERT_PARTS,
        gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        super().__init__()
        if inter % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the experts' width ({inter})")
        self.num_experts, self.inter, self.tp, self.parts = num_experts, inter // tp.size, tp, parts
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden, 2 * self.inter))
        self.w2 = nn.Parameter(torch.empty(num_experts, self.inter, hidden))
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * self.inter)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self.act = activation(act)
        self.gated = gated
        self.loaded: set[tuple[int, str]] = set()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
        """x `[T, hidden]`; each token's `experts [T, k]` and their `weights [T, k]`."""
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // experts.shape[1]
        weight_of = weights.flatten()[order].to(x.dtype)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            y = self._expert(expert, x.index_select(0, rows))
            out.index_add_(0, rows, y * weight_of[start : start + count, None])
            start += count
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.w13[e]
        if self.b13 is not None:
            gate_up = gate_up + self.b13[e]
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.gated(gate, up) if self.gated is not None else self.act(gate) * up
        y = h @ self.w2[e]
        return y + self.b2[e] if self.b2 is not None else y

    # ---- loading -----------------------------------------------------------
    def load_checkpoint(self, name: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        """One expert's `{e}.{part}.weight` (`[out, in]`, as nn.Linear stores it)."""
        match = _PER_EXPERT.fullmatch(name)
        if match is None or match.group(2) not in self.parts:
            raise ValueError("it has no place in the experts")
        expert, part = int(match.group(1)), self.parts[match.group(2)]
        if expert >= self.num_experts:
            raise ValueError(f"there are {self.num_experts} experts")
        self.load_part(expert, part, tensor.t(), tp)

    @torch.no_grad()
    def load_part(self, e: int, part: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        """`tensor` `[in, out]` (or a bias `[out]`) of one expert, unsharded."""
        is_bias = part.endswith("_bias")
        base = part.removesuffix("_bias")
        if base == "down":
            target = self.b2[e] if is_bias else self.w2[e]
            if is_bias and tp.rank > 0:
                tensor = torch.zeros_like(tensor)  # summed over ranks: added once
            elif not is_bias:
                tensor = tp.shard(tensor, 0)
        else:
            tensor = tp.shard(tensor, -1)
            offset = 0 if base == "gate" else self.inter
            whole = self.b13[e] if is_bias else self.w13[e]
            target = whole.narrow(-1, offset, self.inter)
        if target.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(target.shape)} for this rank")
        target.copy_(tensor)
        self.loaded.add((e, part))

    def missing_tensors(self) -> list[str]:
        parts = ["gate", "up", "down"]
        if self.b13 is not None:
            parts += ["gate_bias", "up_bias", "down_bias"]
        return [
            f"{e}.{p}" for e in range(self.num_experts) for p in parts if (e, p) not in self.loaded
        ]


class SparseMoE(nn.Module):
    """Router (`gate`, a plain linear layer of `[E, hidden]`) and experts; `shared`: experts
    every token runs (DeepSeek). The caller all-reduces the output."""

    def __init__(
        self,
        hidden: int,
        experts: Experts,
        routing: Routing,
        router_bias: bool = False,
        correction_bias: bool = False,
        shared: nn.Module | None = None,
    ):
        super().__init__()
        self.routing = routing
        self.gate = nn.Linear(hidden, experts.num_experts, bias=router_bias)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(experts.num_experts)) if correction_bias else None
        )
        self.experts = experts
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight, self.gate.bias)
        weights, chosen = route(logits, self.routing, self.e_score_correction_bias)
        out = self.experts(x, weights, chosen)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
