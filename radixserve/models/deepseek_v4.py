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

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig, rope_scaling_of
from .compressed_attention import CompressedAttention, unweighted_rms
from .decoder import CausalLM, Rope
from .layers import RMSNorm, StepImages, SwiGLU
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


class HyperConnection(nn.Module):
    """From the streams `[T, n, hidden]`: `pre` weighs them into the sublayer's input, `post`
    spreads its output back, `comb` (doubly stochastic) mixes the streams themselves."""

    def __init__(self, hf: dict):
        super().__init__()
        n, hidden = hf["hc_mult"], hf["hidden_size"]
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            hf["hc_sinkhorn_iters"],
            hf["hc_eps"],
            hf["rms_norm_eps"],
        )
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor):
        n, eps = self.n, self.eps
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        pre, post, comb = F.linear(flat, self.fn.float()).split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        scale = self.scale.float()
        pre = torch.sigmoid(pre * scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post * scale[1] + post_b)
        comb = torch.softmax(comb.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    def mix(self, streams, post, comb, out: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer whose output is `out`."""
        spread = post.unsqueeze(-1) * out.float().unsqueeze(1)
        return (spread + comb.transpose(-1, -2) @ streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """The streams weighed into one, before the final norm."""

    def __init__(self, hf: dict):
        super().__init__()
        n = hf["hc_mult"]
        self.eps, self.norm_eps = hf["hc_eps"], hf["rms_norm_eps"]
        self.hc_fn = nn.Parameter(torch.empty(n, n * hf["hidden_size"]))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()
        pre = torch.sigmoid(mixes) + self.eps
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


class HyperLayer(nn.Module):
    def __init__(self, hf: dict, i: int, table: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        hidden, eps = hf["hidden_size"], hf["rms_norm_eps"]
        self.attn_hc, self.ffn_hc = HyperConnection(hf), HyperConnection(hf)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = CompressedAttention(hf, i, hf["layer_types"][i], table)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = ExpertsBlock(hf, hf["mlp_layer_types"][i] == "hash_moe", tp)

    def forward(self, streams, input_ids, ropes: list[Rope], backend: AttentionBackend):
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), ropes, backend)
        streams = self.attn_hc.mix(streams, post, comb, out)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return self.ffn_hc.mix(streams, post, comb, out)


class DeepseekV4ForCausalLM(CausalLM):
    """The rotary tables: the sliding layers' ("main") and the compressed layers' ("compress",
    which also place their entries and the indexer's queries)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        hf = cfg.hf_config
        self.tables = [rope_table(hf, kind, max_positions) for kind in ("main", "compress")]
        super().__init__(cfg, max_positions, tp)
        self.model.hc_head = HyperHead(hf)

    def make_layer(self, i: int) -> nn.Module:
        return HyperLayer(self.hf, i, self.tables[1], self.tp)

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
        x = self.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hf["hc_mult"], -1).contiguous()
        ropes = [table.cos_sin(positions, torch.float32) for table in self.rotaries]
        for layer in self.model.layers:
            streams = layer(streams, input_ids, ropes, backend)
        return self.model.norm(self.model.hc_head(streams))

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))


def rope_table(hf: dict, kind: str, max_positions: int) -> RotaryEmbedding:
    """The rotary table of `rope_parameters[kind]` over each head's last
    `head_dim x partial_rotary_factor` dims (turned as pairs)."""
    rope = hf["rope_parameters"][kind]
    width = int(hf["head_dim"] * rope.get("partial_rotary_factor", hf["partial_rotary_factor"]))
    return RotaryEmbedding(width, max_positions, rope["rope_theta"], rope_scaling_of(rope))
