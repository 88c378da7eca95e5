"""Attention over the paged KV pool on CPU (and any device, in pure torch).

A step's requests are split into a decode group (one new token each) and an extend group (several
new tokens), so that a mixed step does not pad every decode query to the longest prompt chunk. On
CPU both groups run kernels that read K/V straight from the pool
(`radixserve_kernels/cpu_attention.cpp`): paged decode, and, in float32 and bf16, paged extend
(causal new tokens after a cached prefix: prompt chunks). Requests with a few new tokens
(speculative verify rows, short chunks) join the decode kernel's group as one query per token,
which measured faster than a second, extend group (bench/results/cpu.md). Without a
compiler, a group gathers its K/V and runs one padded, masked SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve_kernels.cpu_ops import load as load_cpu_kernels

from ..mem.kv_pool import KVPool
from .base import PLAIN, AttentionInputs, LayerAttention
from .reference import ReferencePlan, plan_reference, reference_attention


@dataclass
class _Group:
    """Requests attended together: their tokens, gathered slots, mask and padding map."""

    tokens: torch.Tensor
    kv_indices: torch.Tensor | None
    kv_shape: tuple[int, int]
    mask: torch.Tensor | None
    pad_req: torch.Tensor | None = None
    pad_pos: torch.Tensor | None = None
    max_q: int = 1
    causal: bool = False  # no cached prefix: plain causal attention, no mask (the fast kernel path)
    rows: torch.Tensor | None = None  # a group through a paged kernel: its requests' table rows
    seq_lens: torch.Tensor | None = None  # decode kernel: keys each query attends over
    prefix_lens: torch.Tensor | None = (
        None  # extend kernel: cached tokens before each request's new ones
    )
    extend_lens: torch.Tensor | None = None
    widened: bool = False  # extend kernel on a float32 copy of the rows' K/V (`kv_indices`)


def _plan_group(
    inputs: AttentionInputs, members: torch.Tensor, token_starts: torch.Tensor
) -> _Group:
    seq_lens, ext = inputs.seq_lens[members], inputs.extend_lens[members]
    max_len, max_q = int(seq_lens.max()), int(ext.max())
    kv_indices = inputs.req_to_token[inputs.rows[members], :max_len].flatten()
    device = seq_lens.device
    key_pos = torch.arange(max_len, device=device).view(1, 1, max_len)
    q_pos = torch.arange(max_q, device=device).view(1, -1, 1)
    limit = (seq_lens - ext).view(-1, 1, 1) + q_pos
    mask = ((key_pos <= limit) & (key_pos < seq_lens.view(-1, 1, 1))).unsqueeze(1)
    pad_req = torch.repeat_interleave(torch.arange(len(members), device=device), ext)
    local_starts = torch.cumsum(ext, 0) - ext
    pad_pos = torch.arange(len(pad_req), device=device) - local_starts[pad_req]
    tokens = token_starts[members][pad_req] + pad_pos
    if max_q == 1:
        return _Group(tokens, kv_indices, (len(members), max_len), mask)
    causal = bool((seq_lens == ext).all())  # right padding is harmless: padded rows are dropped
    return _Group(
        tokens, kv_indices, (len(members), max_len), mask, pad_req, pad_pos, max_q, causal
    )


SHORT_EXTEND = 16  # new tokens up to which a request's queries run through the paged decode kernel


def _new_tokens(ext: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For requests with `ext` new tokens whose first is at step token `starts`: each new
    token's index in the step, and its offset among its request's new tokens."""
    offset = torch.arange(int(ext.sum()), device=ext.device) - torch.repeat_interleave(
        torch.cumsum(ext, 0) - ext, ext
    )
    return torch.repeat_interleave(starts, ext) + offset, offset


def _plan_paged_decode(
    inputs: AttentionInputs, members: torch.Tensor, token_starts: torch.Tensor
) -> _Group:
    """One paged-decode query per new token of `members`: token i of a request with prefix p
    attends over the first p + i + 1 slots of its row (its K/V is stored before attention)."""
    ext = inputs.extend_lens[members]
    tokens, offset = _new_tokens(ext, token_starts[members])
    prefix = torch.repeat_interleave(inputs.seq_lens[members] - ext, ext)
    return _Group(
        tokens,
        None,
        (len(members), 0),
        None,
        rows=torch.repeat_interleave(inputs.rows[members], ext),
        seq_lens=prefix + offset + 1,
    )


def _plan_paged_extend(
    inputs: AttentionInputs, members: torch.Tensor, token_starts: torch.Tensor
) -> _Group:
    ext = inputs.extend_lens[members]
    tokens, _ = _new_tokens(ext, token_starts[members])
    return _Group(
        tokens,
        None,
        (len(members), 0),
        None,
        rows=inputs.rows[members],
        prefix_lens=inputs.prefix_lens[members],
        extend_lens=ext,
    )


def _plan_widened(
    inputs: AttentionInputs, members: torch.Tensor, token_starts: torch.Tensor
) -> _Group:
    """The extend kernel over a float32 copy of the members' K/V: request b's keys are rows
    b * max_len ... of the copy, `kv_indices` the pool slots they come from."""
    group = _plan_paged_extend(inputs, members, token_starts)
    max_len = int(inputs.seq_lens[members].max())
    group.kv_indices = inputs.req_to_token[inputs.rows[members], :max_len].flatten()
    group.kv_shape = (len(members), max_len)
    group.rows = torch.arange(len(members), device=members.device)
    group.widened = True
    return group


class TorchNativeBackend:
    """Layers with windows, soft-capping, sinks or a latent KV attend through
    `reference_attention`; the others through the paged kernels on CPU, SDPA elsewhere.

    `deterministic` (--enable-deterministic-inference): every query, prompt or decode, runs
    through the paged extend kernel, whose result for a query depends only on its keys (fixed
    key tiles from position 0, no split that follows the batch): the same bits whatever the
    batch, the chunking or where the prefix came from. In bf16 or fp16 the kernel reads a
    float32 copy of the step's K/V."""

    def __init__(
        self,
        pool: KVPool,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        deterministic: bool = False,
        **_,
    ):
        self.pool = pool
        self.scale = head_dim**-0.5 if head_dim else None  # None: a model without attention
        self.kernels = load_cpu_kernels() if pool.device.type == "cpu" else None
        self.paged_extend = (
            self.kernels is not None
            and pool.dtype in (torch.float32, torch.bfloat16)
            and all(self.kernels.extend_supported(width) for width in pool.key_widths)
        )
        self.deterministic = deterministic
        if deterministic and (self.kernels is None or not self.kernels.extend_supported(head_dim)):
            raise ValueError(
                "enable_deterministic_inference needs radixserve's CPU kernels (a C++ compiler, "
                "a CPU device) and a head dim of 32, 64, 80, 96 or 128"
            )

    def plan(self, inputs: AttentionInputs) -> None:
        self.inputs = inputs
        self.reference_plan: ReferencePlan | None = None  # planned by the first layer needing it
        if self.deterministic:
            everyone = torch.arange(len(inputs.rows), device=inputs.rows.device)
            token_starts = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
            plan = _plan_paged_extend if self.paged_extend else _plan_widened
            self.groups = [plan(inputs, everyone, token_starts)]
            return
        if self.kernels is not None and inputs.is_decode and inputs.max_extend_len == 1:
            # one new token per request: the step is the decode kernel's group as it stands
            tokens = torch.arange(len(inputs.rows), device=inputs.rows.device)
            self.groups = [
                _Group(
                    tokens,
                    None,
                    (len(inputs.rows), 0),
                    None,
                    rows=inputs.rows,
                    seq_lens=inputs.seq_lens,
                )
            ]
            return
        token_starts = torch.cumsum(inputs.extend_lens, 0) - inputs.extend_lens
        short = inputs.extend_lens <= (1 if self.kernels is None else SHORT_EXTEND)
        decode, extend = short.nonzero().flatten(), (~short).nonzero().flatten()
        plan_decode = _plan_paged_decode if self.kernels is not None else _plan_group
        plan_extend = _plan_paged_extend if self.paged_extend else _plan_group
        self.groups = ([plan_decode(inputs, decode, token_starts)] if len(decode) else []) + (
            [plan_extend(inputs, extend, token_starts)] if len(extend) else []
        )

    def kernel_groups(self) -> list[list[torch.Tensor]] | None:
        """This step's groups as the C++ decoder (radixserve_kernels/cpu_decoder.cpp) takes them,
        when every group runs a paged kernel: (tokens, rows, seq_lens) to decode, (tokens, rows,
        prefix_lens, extend_lens) to extend; None when one gathers K/V for SDPA."""
        if not all(g.rows is not None and not g.widened for g in self.groups):
            return None
        return [
            [g.tokens, g.rows, g.seq_lens]
            if g.extend_lens is None
            else [g.tokens, g.rows, g.prefix_lens, g.extend_lens]
            for g in self.groups
        ]

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        how: LayerAttention = PLAIN,
    ) -> torch.Tensor:
        if how.features() - {"scale"}:
            self.pool.store(layer, self.inputs.out_cache_loc, k, v)
            if self.reference_plan is None:
                self.reference_plan = plan_reference(self.inputs)
            return reference_attention(self.reference_plan, q, self.pool, layer, how)
        scale = self.scale if how.scale is None else how.scale
        if self.kernels is not None and not self.pool.is_fp8:
            self.kernels.store_kv_(
                self.pool.k[layer], self.pool.v[layer], self.inputs.out_cache_loc, k, v
            )
        else:
            self.pool.store(layer, self.inputs.out_cache_loc, k, v)
        if len(self.groups) == 1:
            return self._attend(self.groups[0], layer, q, scale).flatten(1)
        out = torch.empty_like(q)
        for group in self.groups:
            out[group.tokens] = self._attend(group, layer, q[group.tokens], scale)
        return out.flatten(1)

    def _attend(self, group: _Group, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        if group.widened:
            return self._attend_widened(group, layer, q, scale)
        if group.extend_lens is not None:
            return self.kernels.paged_extend_attention(
                q,
                self.pool.k[layer],
                self.pool.v[layer],
                self.inputs.req_to_token,
                group.rows,
                group.prefix_lens,
                group.extend_lens,
                scale,
            )
        if group.rows is not None:
            return self.kernels.paged_decode_attention(
                q,
                self.pool.k[layer],
                self.pool.v[layer],
                self.inputs.req_to_token,
                group.rows,
                group.seq_lens,
                scale,
                self.pool.k_scale[layer],
                self.pool.v_scale[layer],
            )
        pool = self.pool
        keys = pool.read(self._gather(group, pool.k[layer]), pool.k_scale[layer], q.dtype)
        values = pool.read(self._gather(group, pool.v[layer]), pool.v_scale[layer], q.dtype)
        queries = self._pad(group, q).transpose(1, 2)
        mask = None if group.causal else group.mask
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=group.causal,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        return out.squeeze(1) if group.pad_req is None else out[group.pad_req, group.pad_pos]

    def _attend_widened(
        self, group: _Group, layer: int, q: torch.Tensor, scale: float
    ) -> torch.Tensor:
        pool, f32 = self.pool, torch.float32
        keys = pool.read(pool.k[layer].index_select(0, group.kv_indices), pool.k_scale[layer], f32)
        values = pool.read(
            pool.v[layer].index_select(0, group.kv_indices), pool.v_scale[layer], f32
        )
        table = torch.arange(keys.shape[0], device=q.device).view(group.kv_shape)
        out = self.kernels.paged_extend_attention(
            q.to(f32),
            keys.to(f32),
            values.to(f32),
            table,
            group.rows,
            group.prefix_lens,
            group.extend_lens,
            scale,
        )
        return out.to(q.dtype)

    @staticmethod
    def _gather(group: _Group, cache: torch.Tensor) -> torch.Tensor:
        """`[B, kv_heads, L, D]` keys of a group (index_select beats fancy indexing on CPU)."""
        return (
            cache.index_select(0, group.kv_indices)
            .view(*group.kv_shape, *cache.shape[1:])
            .transpose(1, 2)
        )

    @staticmethod
    def _pad(group: _Group, q: torch.Tensor) -> torch.Tensor:
        if group.pad_req is None:
            return q.unsqueeze(1)
        padded = q.new_zeros(group.kv_shape[0], group.max_q, *q.shape[1:])
        padded[group.pad_req, group.pad_pos] = q
        return padded
