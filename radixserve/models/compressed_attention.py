"""DeepSeek-V4's attention: one shared key-and-value head (K = V) over a sliding window of the
latest tokens, plus compressed entries that each sum a window of `compress_rate` tokens
("heavily compressed", HCA), or overlapping windows of which a lightning indexer picks each
query's best `index_topk` ("compressed sparse", CSA). A learnt sink logit per head; the
rotary turns neighbouring pairs of each head's last dims, and is turned back on the output at
the query's position; the heads leave through a grouped low-rank projection.

Every token's pool row holds its key and the compressor's inputs for it (the projected keys and
gates, `model_config.compressed_row_layout`), so a compressed entry is a function of the rows of
its window: a prefix from the radix cache sees the entries a fresh one computes. Each step
computes the entries its requests see from those rows (in torch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionBackend, LayerAttention
from ..model_config import compressed_row_layout
from .decoder import Rope
from .layers import Linear, RMSNorm, unweighted_rms
from .rotary import RotaryEmbedding

SLIDING, SPARSE, HEAVY = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The last `2 x cos.shape[-1]` dims of x turned as neighbouring pairs; the rest kept."""
    width = 2 * cos.shape[-1]
    kept, rope = x[..., :-width], x[..., -width:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]
    turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat([kept, turned.to(x.dtype)], dim=-1)


def additive_mask(seen: torch.Tensor) -> torch.Tensor:
    """0 where a query sees a key, -inf where it does not."""
    return torch.zeros(seen.shape, device=seen.device).masked_fill(~seen, float("-inf"))


class GroupedLinear(nn.Module):
    """A block-diagonal projection: each of `groups` slices of the input through its own
    `[out / groups, in / groups]` block of `weight` (the checkpoint's `o_a_proj`)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, groups, in / groups]` -> `[T, out]`."""
        blocks = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("tgi,goi->tgo", x, blocks).flatten(1)


class Compressor(nn.Module):
    """Entries of `dim` channels, one per `rate` tokens: the softmax over each window of the
    tokens' gates (plus a bias by place in the window) weighs their projected keys, channel by
    channel; normed and turned to the window's first position. `overlap` (CSA): each token
    projects twice, and entry w weighs window w-1's first halves with window w's second halves."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = Linear(hidden, width)
        self.gate_proj = Linear(hidden, width)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = RMSNorm(dim, eps)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """What each token's pool row keeps for this compressor: its keys, then its gates."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def entries(self, rows: torch.Tensor, table: RotaryEmbedding) -> torch.Tensor:
        """`[E, dim]`: the entries of the complete windows of a sequence's `rows` (this
        compressor's part of them, `[L, 2 x width]`)."""
        count = rows.shape[0] // self.rate
        kv, gate = rows[: count * self.rate].float().view(count, self.rate, 2, -1).unbind(2)
        gate = gate + self.position_bias
        if self.overlap:
            dim = self.dim
            earlier_kv = F.pad(kv[:-1, :, :dim], (0, 0, 0, 0, 1, 0))
            earlier_gate = F.pad(gate[:-1, :, :dim], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat([earlier_kv, kv[..., dim:]], dim=1)
            gate = torch.cat([earlier_gate, gate[..., dim:]], dim=1)
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
        starts = torch.arange(count, device=rows.device) * self.rate
        cos, sin = table.cos_sin(starts, torch.float32)
        return rotate_pairs(self.kv_norm(pooled), cos[:, 0], sin[:, 0]).to(rows.dtype)


class Indexer(nn.Module):
    """Scores each query against the CSA entries of its own small compressor: `sum_h w_h
    relu(q_h . k / sqrt(dim))`, w from the layer's input, q from the queries' low-rank part."""

    def __init__(self, hf: dict, rate: int):
        super().__init__()
        hidden, eps = hf["hidden_size"], hf["rms_norm_eps"]
        self.heads, self.dim, self.topk = (
            hf["index_n_heads"],
            hf["index_head_dim"],
            hf["index_topk"],
        )
        self.compressor = Compressor(hidden, self.dim, rate, True, eps)
        self.q_b_proj = Linear(hf["q_lora_rank"], self.heads * self.dim)
        self.weights_proj = Linear(hidden, self.heads)

    def scores(self, x, q_resid, rope: Rope, keys: torch.Tensor) -> torch.Tensor:
        """`[n, E]` scores of n queries over E entries."""
        q = rotate_pairs(self.q_b_proj(q_resid).view(-1, self.heads, self.dim), *rope)
        dots = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float())) * self.dim**-0.5
        weights = self.weights_proj(x).float() * self.heads**-0.5
        return torch.einsum("nh,nhe->ne", weights, dots)


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer of kind `kind` (SLIDING, SPARSE or HEAVY); `table`: the
    compressed layers' rotary table (their entries sit at their windows' first positions)."""

    def __init__(self, hf: dict, layer: int, kind: str, table: RotaryEmbedding):
        super().__init__()
        hidden, eps, lora = hf["hidden_size"], hf["rms_norm_eps"], hf["q_lora_rank"]
        self.layer, self.eps = layer, eps
        self.heads, self.dim, self.window = (
            hf["num_attention_heads"],
            hf["head_dim"],
            hf["sliding_window"],
        )
        self.rope = 0 if kind == SLIDING else 1  # which of the model's tables turns q and k
        self.table = (table,)  # a reference, not a submodule
        self.q_a_proj = Linear(hidden, lora)
        self.q_a_norm = RMSNorm(lora, eps)
        self.q_b_proj = Linear(lora, self.heads * self.dim)
        self.kv_proj = Linear(hidden, self.dim)
        self.kv_norm = RMSNorm(self.dim, eps)
        groups = hf["o_groups"]
        self.o_a_proj = GroupedLinear(
            self.heads * self.dim // groups, groups * hf["o_lora_rank"], groups
        )
        self.o_b_proj = Linear(groups * hf["o_lora_rank"], hidden)
        self.sinks = nn.Parameter(torch.zeros(self.heads))
        self.how = LayerAttention(scale=self.dim**-0.5, sinks=self.sinks)  # what it needs
        self.compressor, self.indexer = None, None
        if kind != SLIDING:
            rate = hf["compress_rates"][kind]
            self.compressor = Compressor(hidden, self.dim, rate, kind == SPARSE, eps)
            self.indexer = Indexer(hf, rate) if kind == SPARSE else None
        self.layout = compressed_row_layout(hf, kind)

    def forward(self, x: torch.Tensor, ropes: list[Rope], backend: AttentionBackend):
        cos, sin = ropes[self.rope]
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_resid).view(-1, self.heads, self.dim), self.eps)
        q = rotate_pairs(q, cos, sin)
        row = [rotate_pairs(self.kv_norm(self.kv_proj(x)), cos[:, 0], sin[:, 0])]
        row += [part.inputs(x) for part in self.compressors()]
        inputs, pool = backend.inputs, backend.pool
        key = torch.cat(row, dim=-1).unsqueeze(1)
        pool.store(self.layer, inputs.out_cache_loc, key, key.new_empty(key.shape[0], 1, 0))
        out = torch.empty_like(q)
        starts = (torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens).tolist()
        for b, start in enumerate(starts):
            seq_len, n = int(inputs.seq_lens[b]), int(inputs.extend_lens[b])
            at = slice(start, start + n)
            slots = inputs.req_to_token[inputs.rows[b], :seq_len]
            rows = pool.k[self.layer][slots, 0]
            compress_rope = (ropes[1][0][at], ropes[1][1][at])
            out[at] = self.attend(q[at], rows, seq_len, x[at], q_resid[at], compress_rope)
        out = rotate_pairs(out, cos, -sin)
        grouped = out.reshape(out.shape[0], self.o_a_proj.groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    def compressors(self) -> list[Compressor]:
        parts = [self.compressor] if self.compressor is not None else []
        return parts + ([self.indexer.compressor] if self.indexer is not None else [])

    def attend(self, q, rows, seq_len: int, x, q_resid, compress_rope: Rope) -> torch.Tensor:
        """One sequence's n queries (its last positions) over the window's keys and the
        compressed entries each may see; K = V."""
        n = q.shape[0]
        positions = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        first = max(0, seq_len - n - self.window + 1)
        keys = rows[first:, : self.dim]
        key_positions = torch.arange(first, seq_len, device=q.device).unsqueeze(0)
        seen = (key_positions <= positions) & (key_positions > positions - self.window)
        bias = additive_mask(seen)
        if self.compressor is not None and seq_len >= self.compressor.rate:
            entries, entry_bias = self.compressed(rows, positions, x, q_resid, compress_rope)
            keys, bias = torch.cat([keys, entries]), torch.cat([bias, entry_bias], dim=1)
        logits = torch.einsum("nhd,kd->nhk", q.float(), keys.float()) * self.dim**-0.5
        logits = logits + bias.unsqueeze(1)
        sinks = self.sinks.float().view(1, -1, 1).expand(n, -1, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("nhk,kd->nhd", probs, keys.float()).to(q.dtype)

    def compressed(self, rows, positions, x, q_resid, compress_rope: Rope):
        """The sequence's compressed entries `[E, dim]` and each query's bias over them: 0 for
        the entries it sees (windows complete by its position; in CSA, the indexer's best
        `index_topk` of those), -inf for the rest."""
        (start, end) = self.layout["compressor"]
        table = self.table[0]
        entries = self.compressor.entries(rows[:, start:end], table)
        seen = (
            torch.arange(entries.shape[0], device=rows.device)
            < (positions + 1) // self.compressor.rate
        )
        if self.indexer is not None:
            (start, end) = self.layout["indexer"]
            keys = self.indexer.compressor.entries(rows[:, start:end], table)
            scores = self.indexer.scores(x, q_resid, compress_rope, keys)
            scores = scores.masked_fill(~seen, float("-inf"))
            best = scores.topk(min(self.indexer.topk, keys.shape[0]), dim=-1).indices
            seen = torch.zeros_like(seen).scatter_(1, best, seen.gather(1, best))
        return entries, additive_mask(seen)
