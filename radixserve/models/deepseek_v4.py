"""DeepSeek-V4: compressed attention (`compressed_attention`) and experts, over a residual of
`hc_mult` streams mixed by hyper-connections (mHC): before each sublayer the streams are
weighed into one input, and its output is spread back over them beside a mix of the streams
by a doubly-stochastic matrix (Sinkhorn-Knopp), all computed from the streams themselves.

Experts are routed by `sqrt(softplus(logit))` (or sigmoid) scores plus a correction bias; the
first layers (`mlp_layer_types` "hash_moe") take their experts from a fixed table by token id.
Experts and the shared expert clamp their gate and up projections to `swiglu_limit`."""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import TPGroup
from ..model_config import ModelConfig, rope_scaling_of
from .compressed_attention import CompressedAttention
from .decoder import CausalLM
from .hyper_connections import HyperConnection, HyperHead, HyperLayer, run_streams
from .layers import StepImages, SwiGLU
from .moe import Experts, unstack_experts
from .rotary import RotaryEmbedding


class LimitedSwiGLU(SwiGLU):
    """`silu(gate) * up`, the gate clamped above and up on both sides to `limit`."""

    def __init__(self, hidden, inter, act, bias, limit: float = 10.0):
        super().__init__(hidden, inter, act, bias)
        self.act_name, self.limit = "limited_silu", limit

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


# the release's tensor names (transformers saves them too) and transformers' own -> ours,
# in this order, on a name without its leading "model."
NAMES = tuple(
    (re.compile(pattern), new)
    for pattern, new in (
        (r"^embed\.", "embed_tokens."),
        (r"^head\.", "lm_head."),
        (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
        (r"\.attn_sink$", ".sinks"),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.wq_b\.", ".q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
        (r"\.w1\.", ".gate_proj."),
        (r"\.w2\.", ".down_proj."),
        (r"\.w3\.", ".up_proj."),
        (r"\.compressor\.indexer\.scorer\.", ".indexer."),
        (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.q_b_proj."),
        (r"\.compressor\.indexer\.", ".indexer.compressor."),
    )
)
SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


class Router(nn.Module):
    """Scores every expert; picks by score plus a correction bias, or (`hashed`) by the
    token's row of `tid2eid`; the picks' scores renormalized, times `routed_scaling_factor`."""

    def __init__(self, hf: dict, hashed: bool):
        super().__init__()
        experts, self.top_k = hf["n_routed_experts"], hf["num_experts_per_tok"]
        self.score, self.scaling = SCORES[hf["scoring_func"]], hf["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.empty(experts, hf["hidden_size"]))
        self.hashed, self.loaded = hashed, set()
        table = torch.zeros(hf["vocab_size"], self.top_k, dtype=torch.long) if hashed else None
        self.register_buffer("tid2eid", table)
        bias = None if hashed else nn.Parameter(torch.zeros(experts))
        self.e_score_correction_bias = bias

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        scores = self.score(F.linear(x, self.weight).float())
        if self.hashed:
            chosen = self.tid2eid[input_ids]
        else:
            chosen = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, chosen

    def load_checkpoint(self, name: str, tensor: torch.Tensor, tp: TPGroup) -> None:
        target = getattr(self, name, None)
        if target is None or target.shape != tensor.shape:
            raise ValueError(f"router tensor {name!r} has no place of that shape")
        with torch.no_grad():
            target.copy_(tensor)
        self.loaded.add(name)

    def missing_tensors(self) -> list[str]:
        names = ["weight", "tid2eid" if self.hashed else "e_score_correction_bias"]
        return [n for n in names if n not in self.loaded]


class ExpertsBlock(nn.Module):
    def __init__(self, hf: dict, hashed: bool, tp: TPGroup):
        super().__init__()
        hidden, inter = hf["hidden_size"], hf["moe_intermediate_size"]
        expert = partial(LimitedSwiGLU, limit=hf["swiglu_limit"])
        self.gate = Router(hf, hashed)
        self.experts = Experts(hf["n_routed_experts"], hidden, inter, tp, expert=expert)
        self.shared_experts = expert(hidden, inter, "silu", False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x, input_ids)
        return self.experts(x, weights, chosen) + self.shared_experts(x)


class DeepseekV4ForCausalLM(CausalLM):
    """The rotary tables: the sliding layers' ("main") and the compressed layers' ("compress",
    which also place their entries and the indexer's queries)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        hf = cfg.hf_config
        self.tables = [rope_table(hf, kind, max_positions) for kind in ("main", "compress")]
        super().__init__(cfg, max_positions, tp)
        self.model.hc_head = HyperHead(hf)

    def make_layer(self, i: int) -> nn.Module:
        hf = self.hf
        attention = CompressedAttention(hf, i, hf["layer_types"][i], self.tables[1])
        mlp = ExpertsBlock(hf, hf["mlp_layer_types"][i] == "hash_moe", self.tp)
        connections = (HyperConnection(hf), HyperConnection(hf))
        return HyperLayer(hf, attention, mlp, connections, self.tp, by_token=True)

    def make_rotaries(self, max_positions: int) -> list[RotaryEmbedding]:
        return self.tables

    def rename(self, name: str) -> str | None:
        """The release's names or transformers' (`NAMES`); the indexer's parts are ours under
        `self_attn.indexer`. The next-token predictor (`mtp.`) is not used."""
        name = name.removeprefix("model.")
        if name.startswith("mtp."):
            return None
        for pattern, new in NAMES:
            name = pattern.sub(new, name)
        return name if name.startswith("lm_head.") else f"model.{name}"

    def forward(self, input_ids, positions, backend, images: StepImages | None = None):
        ropes = [table.cos_sin(positions, torch.float32) for table in self.rotaries]
        return run_streams(self, input_ids, ropes, backend)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


def rope_table(hf: dict, kind: str, max_positions: int) -> RotaryEmbedding:
    """The rotary table of `rope_parameters[kind]` over each head's last
    `head_dim x partial_rotary_factor` dims (turned as pairs)."""
    rope = hf["rope_parameters"][kind]
    width = int(hf["head_dim"] * rope.get("partial_rotary_factor", hf["partial_rotary_factor"]))
    return RotaryEmbedding(width, max_positions, rope["rope_theta"], rope_scaling_of(rope))
