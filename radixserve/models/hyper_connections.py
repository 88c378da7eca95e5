"""Hyper-connections (DeepSeek-V4's mHC, Hunyuan v4's): the residual stream widened to
`hc_mult` streams `[T, n, hidden]`. Before each sublayer `pre` weighs the streams into its
input; after it `post` spreads its output back over them, beside the streams themselves, mixed
by a doubly-stochastic `comb` (Sinkhorn-Knopp) where the family mixes them. The weights come
from the streams through one projection of their RMS-normed concatenation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from .decoder import CausalLM, Rope
from .layers import RMSNorm, unweighted_rms


class HyperConnection(nn.Module):
    """`mix_streams`: the streams are mixed by `comb` (DeepSeek-V4), else kept as they are
    (Hunyuan v4); `post` is `post_scale x sigmoid(...) + post_eps`."""

    def __init__(
        self, hf: dict, mix_streams: bool = True, post_scale: float = 2.0, post_eps: float = 0.0
    ):
        super().__init__()
        n, hidden = hf["hc_mult"], hf["hidden_size"]
        self.n, self.eps, self.norm_eps = n, hf["hc_eps"], hf["rms_norm_eps"]
        self.mix_streams, self.post_scale, self.post_eps = mix_streams, post_scale, post_eps
        self.iters = hf["hc_sinkhorn_iters"] if mix_streams else 0
        width = (2 + n) * n if mix_streams else 2 * n
        self.fn = nn.Parameter(torch.empty(width, n * hidden))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3 if mix_streams else 2))

    def forward(self, streams: torch.Tensor):
        """(post `[T, n]`, comb `[T, n, n]` or None, the sublayer's input `[T, hidden]`)."""
        n, eps = self.n, self.eps
        flat = unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
        post = self.post_scale * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = None
        if self.mix_streams:
            comb = self.sinkhorn(mixes[:, 2 * n :] * scale[2] + base[2 * n :])
        collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
        return post + self.post_eps, comb, collapsed

    def sinkhorn(self, logits: torch.Tensor) -> torch.Tensor:
        """`[T, n, n]`: a softmax per row, then columns and rows normalized in turn."""
        eps = self.eps
        comb = torch.softmax(logits.view(-1, self.n, self.n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return comb

    def mix(self, streams, post, comb, out: torch.Tensor) -> torch.Tensor:
        """The streams after a sublayer whose output is `out`."""
        kept = streams.float() if comb is None else comb.transpose(-1, -2) @ streams.float()
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + kept).to(streams.dtype)


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
    """Attention, then the MLP, each on the norm of its connection's input; `by_token`: the
    MLP also takes the token ids (DeepSeek-V4's hash-routed experts). The MLP's partial sums
    are all-reduced over tensor-parallel ranks (the attention reduces its own)."""

    def __init__(self, hf: dict, attention, mlp, connections, tp: TPGroup, by_token: bool = False):
        super().__init__()
        hidden, eps = hf["hidden_size"], hf["rms_norm_eps"]
        self.attn_hc, self.ffn_hc = connections
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.tp, self.by_token = tp, by_token

    def forward(self, streams, input_ids, ropes: list[Rope], backend: AttentionBackend):
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), ropes, backend)
        streams = self.attn_hc.mix(streams, post, comb, out)
        post, comb, collapsed = self.ffn_hc(streams)
        normed = self.post_attention_layernorm(collapsed)
        out = self.mlp(normed, input_ids) if self.by_token else self.mlp(normed)
        return self.ffn_hc.mix(streams, post, comb, self.tp.all_reduce(out))


def run_streams(model: CausalLM, input_ids, ropes: list[Rope], backend) -> torch.Tensor:
    """A hyper-connected model's final-normed hidden states: the embedding copied to every
    stream, its layers (`HyperLayer`), the streams weighed into one (`model.model.hc_head`)."""
    x = model.embed(input_ids)
    streams = x.unsqueeze(1).expand(-1, model.hf["hc_mult"], -1).contiguous()
    for layer in model.model.layers:
        streams = layer(streams, input_ids, ropes, backend)
    return model.model.norm(model.model.hc_head(streams))
