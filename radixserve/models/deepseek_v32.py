"""DeepSeek-V3.2 and GLM-5: DeepSeek-V3's MLA with sparse attention (DSA). A small
"lightning indexer" scores every earlier token for each query (`sum_h w_h relu(q_h . k /
sqrt(d))`, its own heads, one key per token) and each query attends only to its `index_topk`
best.

The indexer's key is kept per token in the KV pool, in the same row as the MLA latent (the row
is `kv_lora_rank + qk_rope_head_dim + index_head_dim` wide; queries carry zeros there), so the
radix tree, HiCache, PD transfers and KV events carry it exactly as they carry the latent, and
a prefix from the cache selects the same tokens as a fresh one. A query that sees at most
`index_topk` tokens attends to all of them: the step's dense attention is exact for it; the
rows of queries that see more are attended again over their selection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import DecoderLayer, Rope
from .deepseek_v3 import DeepseekV3ForCausalLM, LatentAttention, pairs_first
from .layers import Linear, apply_rotary
from .moe import unstack_experts
from .recipe import LayerNorm


class Indexer(nn.Module):
    """`interleaved`: its rotary turns neighbouring pairs (GLM-5), computed as rotate-half on
    the rope dims ordered evens first, in q and k alike."""

    def __init__(self, hf: dict, hidden: int, interleaved: bool = False):
        super().__init__()
        self.interleaved = interleaved
        self.heads, self.dim, self.rope = (
            hf["index_n_heads"],
            hf["index_head_dim"],
            hf["qk_rope_head_dim"],
        )
        self.topk = hf["index_topk"]
        self.wq_b = Linear(hf["q_lora_rank"], self.heads * self.dim)
        self.wk = Linear(hidden, self.dim)
        self.k_norm = LayerNorm(self.dim, 1e-6, bias=True)
        self.weights_proj = Linear(hidden, self.heads)

    def rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """The first `qk_rope_head_dim` dims turned by rotate-half (DeepSeek-V3.2) or as
        interleaved pairs (GLM-5)."""
        rope = pairs_first(x[..., : self.rope]) if self.interleaved else x[..., : self.rope]
        turned = apply_rotary(rope.contiguous(), cos, sin)
        return torch.cat([turned, x[..., self.rope :]], dim=-1)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return self.rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin)  # [T, 1, dim]

    def scores(self, x, q_resid, cos, sin, keys: torch.Tensor) -> torch.Tensor:
        """Index scores `[n, L]` of n queries over L keys."""
        q = self.rotate(self.wq_b(q_resid).view(-1, self.heads, self.dim), cos, sin)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        dots = F.relu(torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * self.dim**-0.5)
        return torch.einsum("nh,nhl->nl", weights, dots)


class SparseLatentAttention(LatentAttention):
    """`selections`: the model's, this step's top-k choices by request, written by layers
    with an indexer and read by the layers that share the previous one's (GLM-5's
    `indexer_types` "shared"; their pool rows hold zeros for an indexer key)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup, selections: dict, own: bool):
        super().__init__(cfg, layer, tp)
        hf = cfg.hf_config
        self.selections, self.topk, self.index_dim = (
            selections,
            hf["index_topk"],
            hf["index_head_dim"],
        )
        interleaved = hf.get("model_type") == "glm_moe_dsa"
        self.indexer = Indexer(hf, cfg.hidden_size, interleaved) if own else None

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        query, key, q_resid = self.project(x, ropes)
        cos, sin = ropes[0]
        if self.indexer is not None:
            key = torch.cat([key, self.indexer.keys(x, cos, sin)], dim=-1)
        else:
            key = F.pad(key, (0, self.index_dim))
        query = F.pad(query, (0, self.index_dim))
        empty = key.new_empty(key.shape[0], 1, 0)
        out = backend.forward(self.layer, query, key, empty, self.how)
        return self.finish(self.attend_selected(out, query, x, q_resid, cos, sin, backend))

    def attend_selected(self, out, query, x, q_resid, cos, sin, backend) -> torch.Tensor:
        """The rows of queries that see more than `index_topk` tokens, attended again over
        their `index_topk` best by the indexer."""
        inputs, topk = backend.inputs, self.topk
        starts = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
        rows = []
        for b in range(len(inputs.rows)):
            seq_len, n = int(inputs.seq_lens[b]), int(inputs.extend_lens[b])
            first = max(seq_len - n, topk)  # the first position that sees more than topk
            if first < seq_len:
                rows.append((b, int(starts[b]) + first - (seq_len - n), first, seq_len))
        if not rows:
            return out
        out = out.clone()
        for b, row, first, seq_len in rows:
            n = seq_len - first
            slots = inputs.req_to_token[inputs.rows[b], :seq_len]
            keys = backend.pool.k[self.layer][slots, 0].float()
            main, index = keys[:, : self.rank + self.rope_dim], keys[:, self.rank + self.rope_dim :]
            at = slice(row, row + n)
            positions = torch.arange(first, seq_len).unsqueeze(1)
            visible = torch.arange(seq_len).unsqueeze(0) <= positions
            if self.indexer is not None:
                scores = self.indexer.scores(x[at], q_resid[at], cos[at], sin[at], index)
                chosen = scores.masked_fill(~visible, float("-inf")).topk(topk, dim=-1).indices
                self.selections[b] = chosen
            chosen = self.selections[b]
            allowed = torch.zeros_like(visible).scatter_(1, chosen, True) & visible
            q = query[at, :, : self.rank + self.rope_dim].float()
            attn = torch.einsum("nhc,lc->nhl", q, main) * self.how.scale
            attn = attn.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
            rows_out = torch.einsum("nhl,lc->nhc", attn, main[:, : self.rank])
            out[at] = rows_out.reshape(n, -1).to(out.dtype)
        return out


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """Also GLM-5 (`GlmMoeDsaForCausalLM`): an interleaved rotary in the indexer, and layers
    that reuse the previous indexer's choice."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = TPGroup()):
        self.selections: dict[int, torch.Tensor] = {}
        super().__init__(cfg, max_positions, tp)

    def make_layer(self, i: int) -> nn.Module:
        cfg = self.cfg
        own = (self.hf.get("indexer_types") or ["full"] * (i + 1))[i] != "shared"
        attention = SparseLatentAttention(cfg, i, self.tp, self.selections, own)
        return DecoderLayer(cfg, i, self.tp, attention, self.make_mlp(i))

    def forward(self, input_ids, positions, backend, images=None):
        self.selections.clear()
        return super().forward(input_ids, positions, backend, images)

    def load_weights(self, weights) -> None:
        super().load_weights(unstack_experts(weights))
