"""Mixture-of-experts blocks: a router picks `top_k` experts per token, and only those run.

Each expert is a gated MLP of its own linear layers; each forward groups the step's tokens by
expert and runs only the experts some token chose. Tensor parallelism shards every expert's
intermediate dimension (like a dense MLP: gate/up by output, down by input, one all-reduce),
so each rank holds a slice of all experts and the routing is the same on every rank."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from .layers import SwiGLU


@dataclass(frozen=True)
class Routing:
    """How a router turns its logits into `(weights [T, k], experts [T, k])`.

    `kind`: "softmax_topk" (softmax over all experts, then top-k: Mixtral, Qwen3-MoE),
    "topk_softmax" (top-k logits, softmax over them: gpt-oss), "topk_sigmoid" (top-k logits,
    each through a sigmoid: Command A MoE; chosen by logit plus a correction bias: Kolibri),
    "grouped_sigmoid" (sigmoid scores, plus a correction bias for the choice only, top groups
    by their two best first: DeepSeek-V3, GLM-4.5, MiniMax-M2), "grouped_softmax" (softmax
    scores, top groups by their best first: DeepSeek-V2; in one group with a correction bias:
    ERNIE 4.5), "sparsemixer" (PhiMoE's two experts, each weighted by a softmax over the
    logits within `jitter` of its own). `group_best_of`: how many of a group's best experts
    score it, where not the kind's own (Mistral 4's softmax groups by their two best).
    `softcap`: logits soft-capped to (-softcap, softcap) by tanh before scoring, where > 0
    (Laguna)."""

    kind: str
    top_k: int
    renormalize: bool = False
    num_groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0
    jitter: float = 0.0
    group_best_of: int | None = None
    softcap: float = 0.0


def route(logits: torch.Tensor, routing: Routing, correction: torch.Tensor | None = None):
    if routing.softcap > 0:
        logits = torch.tanh(logits.float() / routing.softcap) * routing.softcap
    if routing.kind == "softmax_topk":
        weights, experts = torch.softmax(logits.float(), dim=-1).topk(routing.top_k, dim=-1)
    elif routing.kind == "topk_softmax":
        top, experts = logits.topk(routing.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif routing.kind == "topk_sigmoid":
        choice = logits if correction is None else logits.float() + correction
        experts = choice.topk(routing.top_k, dim=-1).indices
        weights = logits.gather(-1, experts).float().sigmoid()
    elif routing.kind == "sparsemixer":
        return _sparsemixer(logits.float(), routing.jitter)
    elif routing.kind == "grouped_softmax":
        scores = torch.softmax(logits.float(), dim=-1)
        return _grouped(scores, correction, routing, best_of=routing.group_best_of or 1)
    else:
        scores = logits.float().sigmoid()
        return _grouped(scores, correction, routing, best_of=routing.group_best_of or 2)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _sparsemixer(logits: torch.Tensor, jitter: float):
    """PhiMoE's routing at inference: the best expert, then the best of the rest; each weighted
    by the softmax of the logits (the first one's excluded for the second) that lie within
    `2 x jitter` (relative) of it."""
    weights, experts, scores = [], [], logits
    for _ in range(2):
        best, choice = scores.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        gates = scores.masked_fill((best - logits) / factor > 2 * jitter, float("-inf"))
        weights.append(torch.softmax(gates, dim=-1).gather(-1, choice))
        experts.append(choice)
        scores = scores.scatter(-1, choice, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(experts, dim=-1)


def _grouped(scores, correction: torch.Tensor | None, routing: Routing, best_of: int):
    """Experts chosen among the top groups (a group scored by its `best_of` best experts),
    by score plus `correction`; weighted by score."""
    choice = scores + correction if correction is not None else scores
    tokens, num_experts = choice.shape
    groups = choice.view(tokens, routing.num_groups, -1)
    group_scores = groups.topk(best_of, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(routing.top_groups, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    keep = keep.unsqueeze(-1).expand_as(groups).reshape(tokens, num_experts)
    experts = choice.masked_fill(~keep, float("-inf")).topk(routing.top_k, dim=-1, sorted=False)
    experts = experts.indices
    weights = scores.gather(1, experts)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, experts


class Experts(nn.ModuleList):
    """`num_experts` gated MLPs (`SwiGLU`, or the `expert` class given), each over this rank's
    slice of their width. Their tensors load by the checkpoint's per-expert names
    (`experts.{e}.gate_proj`...), so each expert is linear layers like a dense MLP's: packed
    for the CPU kernels, int8 under --quantization, sharded by the same rules."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        tp: TPGroup,
        act: str = "silu",
        bias: bool = False,
        expert: Callable[..., SwiGLU] = SwiGLU,
    ):
        if inter % tp.size:
            raise ValueError(f"tp_size {tp.size} does not divide the experts' width ({inter})")
        super().__init__(expert(hidden, inter // tp.size, act, bias) for _ in range(num_experts))
        self.num_experts = num_experts
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # see stack_for_gpu

    @torch.no_grad()
    def stack_for_gpu(self) -> bool:
        """Stack the experts' weights as the Triton fused-MoE kernel reads them (`w13 [E,
        2 * inter, hidden]`, `w2 [E, hidden, inter]`), each expert's layers then viewing into
        them; only for SiLU experts without biases."""
        first = self[0]
        if first.act_name != "silu" or first.down_proj.bias is not None:
            return False
        w13 = torch.stack([e.gate_up_proj.weight_t.t() for e in self])
        w2 = torch.stack([e.down_proj.weight_t.t() for e in self])
        for e, expert in enumerate(self):
            expert.gate_up_proj.weight_t = nn.Parameter(w13[e].t(), requires_grad=False)
            expert.down_proj.weight_t = nn.Parameter(w2[e].t(), requires_grad=False)
        self.stacked = (w13, w2)
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
        """x `[T, hidden]`; each token's `experts [T, k]` and their `weights [T, k]`. The
        (token, choice) pairs are sorted by expert, each chosen expert runs once over its
        tokens, and the outputs go back to their pairs to be summed with the weights (an
        index_add_ per expert is far slower on CPU, bench/results/models.md)."""
        if self.stacked is not None:
            from radixserve_kernels import fused_moe

            return fused_moe(x, *self.stacked, weights, experts)
        tokens, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // k
        sorted_out = x.new_empty(tokens * k, x.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                sorted_out[start:end] = self[expert](x.index_select(0, rows[start:end]))
                start = end
        pairs = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        return (pairs.view(tokens, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


class SparseMoE(nn.Module):
    """Router (`gate`, a plain linear layer of `[E, hidden]`) and experts; `shared`: experts
    every token runs (DeepSeek); `output_scale`: the sum's scale (Command A MoE averages the
    routed and shared outputs). The caller all-reduces the output."""

    def __init__(
        self,
        hidden: int,
        experts: Experts,
        routing: Routing,
        router_bias: bool = False,
        correction_bias: bool = False,
        shared: nn.Module | None = None,
        output_scale: float = 1.0,
    ):
        super().__init__()
        self.routing, self.output_scale = routing, output_scale
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
        return out * self.output_scale if self.output_scale != 1.0 else out


class GatedSharedExpert(nn.Module):
    """An expert every token runs, scaled by the sigmoid of its own one-output gate (Qwen2-MoE,
    Qwen3-Next, Qwen3.5-MoE: `shared_expert` and `shared_expert_gate`)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu"):
        super().__init__()
        self.mlp = SwiGLU(hidden, inter, act)
        self.gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate.weight)) * self.mlp(x)


SHARED_EXPERT = re.compile(r"\.mlp\.shared_expert(_gate)?\.")


def shared_expert_name(name: str) -> str:
    """HF's `mlp.shared_expert.*` and `mlp.shared_expert_gate.*` as a `GatedSharedExpert`'s."""
    return SHARED_EXPERT.sub(lambda m: ".mlp.shared_experts." + ("gate." if m[1] else "mlp."), name)


def corrected_sigmoid_moe(
    hidden: int, experts: Experts, tp: TPGroup, top_k: int, scaling: float = 1.0,
    shared_width: int = 0, softcap: float = 0.0,
) -> SparseMoE:  # fmt: skip
    """Sigmoid scores, experts chosen by score plus a correction bias, renormalized and times
    `scaling`, beside a shared MLP `shared_width` wide where it is > 0 (AFMoE, Laguna)."""
    routing = Routing("grouped_sigmoid", top_k, True, scaling=scaling, softcap=softcap)
    shared = SwiGLU(hidden, shared_width // tp.size) if shared_width else None
    return SparseMoE(hidden, experts, routing, correction_bias=True, shared=shared)


def deepseek_routing(hf: dict) -> Routing:
    """DeepSeek's router from its config: V2's softmax scores (`topk_method` "greedy" or
    "group_limited_greedy"), else corrected sigmoid scores (V3, and Nemotron 3's), in groups."""
    v2 = hf.get("topk_method") in ("greedy", "group_limited_greedy")
    grouped = hf.get("topk_method") != "greedy"
    return Routing(
        "grouped_softmax" if v2 else "grouped_sigmoid",
        hf["num_experts_per_tok"],
        renormalize=hf.get("norm_topk_prob", not v2),
        num_groups=(hf.get("n_group") or 1) if grouped else 1,
        top_groups=(hf.get("topk_group") or 1) if grouped else 1,
        scaling=hf.get("routed_scaling_factor", 1.0),
    )


def deepseek_moe(hf: dict, hidden: int, tp: TPGroup, routing: Routing | None = None) -> SparseMoE:
    """DeepSeek's MoE block (V2, V3, and GLM-4.5's): `n_routed_experts` experts of width
    `moe_intermediate_size` routed in groups (`routing`, by default `deepseek_routing`'s; a
    correction bias with sigmoid scores), beside `n_shared_experts` every token runs (one MLP of
    their joint width)."""
    routing = routing or deepseek_routing(hf)
    inter = hf["moe_intermediate_size"]
    experts = Experts(hf["n_routed_experts"], hidden, inter, tp, hf.get("hidden_act", "silu"))
    shared_inter = inter * (hf.get("n_shared_experts") or 0)
    if shared_inter % tp.size:
        raise ValueError(f"tp_size {tp.size} does not divide the shared experts' width")
    shared = SwiGLU(hidden, shared_inter // tp.size) if shared_inter else None
    correction = routing.kind == "grouped_sigmoid"
    return SparseMoE(hidden, experts, routing, correction_bias=correction, shared=shared)


def unstack_experts(weights: Iterable[tuple[str, torch.Tensor]], inputs_first: bool = False):
    """Experts stacked as HF's own expert modules hold them (`experts.gate_up_proj [E, 2 *
    inter, hidden]`, gate rows then up rows, or a gateless expert's `up_proj [E, inter,
    hidden]`; `experts.down_proj [E, hidden, inter]`; with
    `inputs_first`, Llama 4's, each expert's matrix transposed) as each expert's tensors, named
    like a per-expert checkpoint's; other tensors pass through."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "up_proj", "down_proj"):
            yield name, tensor
            continue
        for e, one in enumerate(tensor.transpose(1, 2) if inputs_first else tensor):
            if leaf == "gate_up_proj":
                gate, up = one.chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:  # down_proj, or a gateless expert's up_proj (Nemotron-H)
                yield f"{prefix}.{e}.{leaf}.weight", one
