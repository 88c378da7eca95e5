"""DeepSeek-V3.2 and GLM-5: DeepSeek-V3's MLA with sparse attention (DSA). A small
"lightning indexer" scores every earlier token for each query (`sum_h w_h relu(q_h . k /
sqrt(d))`, its own heads, one key per token) and each query attends only to its `index_topk`
best.

The indexer's key is kept per token in the KV pool, in the same row as the MLA latent (the row
is `kv_lora_rank + qk_rope_head_dim + index_head_dim` wide; queries carry zeros there), so the
radix tree, HiCache, PD transfers and KV events carry it exactly as they carry the latent, and
a prefix from the cache selects the same tokens as a fresh one. Each query attends only to its
selection (every token it sees while that is at most `index_topk`): the layer stores its rows
and runs the sparse kernel (`cpu_sparse_attention.cpp` on CPU; `sparse_mla.py` is the Triton
one), never a dense pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve_kernels.sparse_mla_ref import sparse_latent_attention_ref

from ..attention import AttentionBackend
from ..distributed import TPGroup
from ..model_config import ModelConfig
from .decoder import DecoderLayer, Rope
from .deepseek_v3 import DeepseekV3ForCausalLM, LatentAttention, pairs_first
from .layers import Linear, fused
from .moe import unstack_experts
from .recipe import LayerNorm
from .rotary import apply_rotary


class Indexer(nn.Module):
    """`interleaved`: its rotary turns neighbouring pairs (GLM-5, Hunyuan v4), computed as
    rotate-half on the rope dims ordered evens first, in q and k alike; `rope_last`: the rotary
    turns each head's last dims (Hunyuan v4), else its first; `eps`: its key norm's."""

    def __init__(
        self,
        hf: dict,
        hidden: int,
        interleaved: bool = False,
        rope_last: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        self.interleaved, self.rope_last = interleaved, rope_last
        self.heads, self.dim, self.rope = (
            hf["index_n_heads"],
            hf["index_head_dim"],
            hf["qk_rope_head_dim"],
        )
        self.topk = hf["index_topk"]
        self.wq_b = Linear(hf["q_lora_rank"], self.heads * self.dim)
        self.wk = Linear(hidden, self.dim)
        self.k_norm = LayerNorm(self.dim, eps, bias=True)
        self.weights_proj = Linear(hidden, self.heads)

    def rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """The first (or last) `qk_rope_head_dim` dims turned by rotate-half (DeepSeek-V3.2) or
        as interleaved pairs (GLM-5, Hunyuan v4)."""
        cut = x.shape[-1] - self.rope if self.rope_last else self.rope
        head, tail = x[..., :cut], x[..., cut:]
        rope = tail if self.rope_last else head
        rope = pairs_first(rope) if self.interleaved else rope
        turned = apply_rotary(rope.contiguous(), cos, sin)
        return torch.cat([head, turned] if self.rope_last else [turned, tail], dim=-1)

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

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        tp: TPGroup,
        selections: dict,
        own: bool,
        indexer_eps: float = 1e-6,
        indexer_rope_last: bool = False,
        indexer_interleaved: bool | None = None,
    ):
        super().__init__(cfg, layer, tp)
        hf = cfg.hf_config
        self.selections, self.topk, self.index_dim = (
            selections,
            hf["index_topk"],
            hf["index_head_dim"],
        )
        interleaved = indexer_interleaved
        if interleaved is None:  # GLM-5's pairs; DeepSeek-V3.2's halves
            interleaved = hf.get("model_type") == "glm_moe_dsa"
        self.indexer = (
            Indexer(hf, cfg.hidden_size, interleaved, indexer_rope_last, indexer_eps)
            if own
            else None
        )
        self.sinks: nn.Parameter | None = None  # a learnt sink logit per head (Hunyuan v4)

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        query, key, q_resid = self.project(x, ropes)
        cos, sin = ropes[0]
        if self.indexer is not None:
            key = torch.cat([key, self.indexer.keys(x, cos, sin)], dim=-1)
        else:
            key = F.pad(key, (0, self.index_dim))
        inputs, pool = backend.inputs, backend.pool
        pool.store(self.layer, inputs.out_cache_loc, key, key.new_empty(key.shape[0], 1, 0))
        slots = self.selected_slots(x, q_resid, cos, sin, inputs, pool)
        return self.finish(self.attend_selected(query, pool, slots).flatten(1), self.gate(x))

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each head's output gate (`LatentAttention.finish`), where the family has one."""
        return None

    def selected_slots(self, x, q_resid, cos, sin, inputs, pool) -> torch.Tensor:
        """`[T, index_topk]` pool slots each of this step's queries attends to: every token it
        sees while that is at most `index_topk` (the rest -1), else the indexer's best (or, in
        a layer without an indexer, the previous indexer's choice this step)."""
        topk, width = self.topk, self.rank + self.rope_dim
        starts = (torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens).tolist()
        chosen = torch.full((x.shape[0], topk), -1, dtype=torch.long, device=x.device)
        for b in range(len(inputs.rows)):
            seq_len, n = int(inputs.seq_lens[b]), int(inputs.extend_lens[b])
            at = slice(starts[b], starts[b] + n)
            positions = torch.arange(seq_len - n, seq_len, device=x.device).unsqueeze(1)
            visible = torch.arange(seq_len, device=x.device).unsqueeze(0) <= positions
            if self.indexer is not None:
                slots = inputs.req_to_token[inputs.rows[b], :seq_len]
                index = pool.k[self.layer][slots, 0, width:]
                index = pool.read(index, pool.k_scale[self.layer], x.dtype)
                if seq_len > topk:
                    scores = self.indexer.scores(x[at], q_resid[at], cos[at], sin[at], index)
                    scores = scores.masked_fill(~visible, float("-inf"))
                    self.selections[b] = scores.topk(topk, dim=-1).indices
                else:
                    self.selections[b] = torch.arange(topk, device=x.device).expand(n, topk)
            picked = self.selections[b]  # positions; those a query does not see become -1
            row = inputs.req_to_token[inputs.rows[b]]
            chosen[at] = torch.where(picked <= positions, row[picked.clamp(max=seq_len - 1)], -1)
        return chosen

    def attend_selected(self, query: torch.Tensor, pool, slots: torch.Tensor) -> torch.Tensor:
        """Each query over its selected latents: the CPU kernel, the Triton kernel on a GPU, or
        (an FP8 pool, no compiled kernels) the torch reference."""
        rows, scale = pool.k[self.layer][:, 0], self.how.scale
        if self.sinks is not None:  # the kernels have no sinks
            rows = pool.read(rows, pool.k_scale[self.layer], torch.float32)
            out = sparse_latent_attention_ref(query, rows, slots, scale, self.rank, self.sinks)
            return out.to(query.dtype)
        if rows.is_cuda and not pool.is_fp8:
            from radixserve_kernels import sparse_latent_attention

            return sparse_latent_attention(query, rows, slots, scale, self.rank)
        q = query.float().contiguous()
        if (ops := fused(self.cpu_ops)) is not None and not pool.is_fp8:
            out = ops.sparse_latent_attention(q, rows, slots, scale, self.rank)
        else:
            rows = pool.read(rows, pool.k_scale[self.layer], torch.float32)
            out = sparse_latent_attention_ref(q, rows, slots, scale, self.rank)
        return out.to(query.dtype)


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
