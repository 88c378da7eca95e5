"""The per-request states of a model's recurrent layers (`RecurrentStates`), by request row and
snapshot slot, and how a step's segments run through a recurrent op from and into them: a
decode step all rows at once, a prompt segment through the op's chunked form, a segment of
drafts to verify a token at a time (keeping each token's state). The ops are in `recurrent`."""

from __future__ import annotations

from functools import partial

import torch

from ..attention import AttentionInputs
from ..messages import StateTensor
from .recurrent import (
    causal_conv1d,
    causal_conv1d_step,
    delta_step_in_place,
    gated_delta_rule,
    gated_delta_rule_step,
)


# ---- the state of running requests ---------------------------------------------------
class RecurrentStates:
    """Each recurrent layer's states for every running request, by the request's row (its row of
    `req_to_token`), allocated at the first step for every row and kept by (kind, layer). A
    step's segment that starts at position 0 starts from a zero state; one that continues a
    request (a later prompt chunk, a decode token) starts from the state its previous step left
    in the row. A cached prefix is resumed from a snapshot: `snapshot_slots` slots after the
    rows hold states copied there (`copy`) at the ends of cached prefixes
    (`scheduler/snapshots.py`).

    Speculative decoding: the rows in `verifying` (`start_step`) run their segment (the newest
    token and its drafts) a token at a time, keeping the state after each, and `keep_verified`
    then puts the state after the tokens the step kept into the row."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], torch.Tensor] = {}  # (kind, layer) -> [slots, ...]
        self.rows = 0  # the requests' rows (--max-running-requests)
        self.snapshot_slots = 0
        self.ssm_dtype = torch.float32  # how recurrent states are stored (--mamba-ssm-dtype)
        self.verifying: frozenset[int] = frozenset()  # rows whose step verifies drafts
        # (kind, layer) -> row -> its states after each token of the step's segment
        self.after_each: dict[tuple[str, int], dict[int, torch.Tensor]] = {}

    def start_step(self, verifying: frozenset[int]) -> None:
        """The next step verifies drafts in these rows."""
        self.verifying = verifying
        self.after_each = {}

    @torch.inference_mode()
    def keep_verified(self, row: int, tokens: int) -> None:
        """`row` keeps its state after the first `tokens` tokens of its verified segment."""
        for key, rows in self.after_each.items():
            if (states := rows.pop(row, None)) is not None:
                self.held[key][row] = states[tokens - 1]

    def _tensor(self, key: tuple[str, int], shape, dtype, device) -> torch.Tensor:
        """Layer and kind `key`'s states, a slot for each row and snapshot, made on first use."""
        states = self.held.get(key)
        if states is None:
            slots = self.rows + self.snapshot_slots
            states = torch.zeros((slots, *shape), dtype=dtype, device=device)
            self.held[key] = states
        return states

    def row_bytes(self, row: int) -> tuple[list[StateTensor], torch.Tensor]:
        """Every layer's state in `row` as raw bytes in one buffer (what a prefill server sends
        a decode server), and what each part of it is."""
        keys = sorted(self.held)
        layout = [
            StateTensor(
                kind, layer, tuple(self.held[kind, layer].shape[1:]), _name(self.held[kind, layer])
            )
            for kind, layer in keys
        ]
        parts = [_raw(self.held[key][row]) for key in keys]
        return layout, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    @torch.inference_mode()
    def put_row(self, row: int, layout: list[StateTensor], data: torch.Tensor, device) -> None:
        """Fill `row` from another server's `row_bytes`; ValueError when its states are not
        this model's (another model, --mamba-ssm-dtype or dtype)."""
        offset = 0
        for part in layout:
            dtype = getattr(torch, part.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"a state of dtype {part.dtype!r}")
            states = self._tensor((part.kind, part.layer), part.shape, dtype, device)
            if tuple(states.shape[1:]) != tuple(part.shape) or states.dtype != dtype:
                raise ValueError(
                    f"the {part.kind} state of layer {part.layer} is {tuple(part.shape)} "
                    f"{part.dtype} there, {tuple(states.shape[1:])} {_name(states)} here"
                )
            target = _raw(states[row])
            target.copy_(data[offset : offset + target.numel()])
            offset += target.numel()
        if offset != data.numel() or len(layout) != len(self.held):
            raise ValueError(
                f"the states sent take {data.numel()} bytes in {len(layout)} tensors, this "
                f"model's {offset} bytes in {len(self.held)}"
            )

    def copy(self, src: int, dst: int) -> None:
        """Every layer's state in slot `src` into slot `dst`."""
        for states in self.held.values():
            states[dst] = states[src]

    def resume(
        self,
        kind: str,
        layer: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        inputs: AttentionInputs,
        step,
        whole,
        *tensors: torch.Tensor,
        in_place=None,
    ) -> torch.Tensor:
        """Run a recurrent op (`each_request`) over the step's segments, from and into this
        layer's states of that kind, each of `shape`; `in_place(states, rows, *tensors)`: a
        decode step on float32 states by row (the CPU kernels), where there is one."""
        states = self._tensor((kind, layer), shape, dtype, tensors[0].device)
        if in_place is not None and states.dtype == torch.float32 and is_decode_step(inputs):
            return in_place(states, inputs.rows, *tensors)
        verified = self.after_each.setdefault((kind, layer), {}) if self.verifying else None
        return each_request(
            states, inputs, step, whole, *tensors, verifying=self.verifying, verified=verified
        )

    def convolve(
        self,
        layer: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        inputs: AttentionInputs,
    ) -> torch.Tensor:
        """`x` [tokens, channels], the step's segments one after another; returns the causal
        convolution of each segment, continued from its request's state, and keeps the state
        each segment leaves."""
        return self.resume(
            "conv",
            layer,
            (x.shape[1], weight.shape[1] - 1),
            x.dtype,
            inputs,
            lambda x, s: causal_conv1d_step(x, weight, bias, s),
            lambda x, s: causal_conv1d(x, weight, bias, s),
            x,
        )

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        inputs: AttentionInputs,
        kernels=None,
    ) -> torch.Tensor:
        """The gated delta rule over the step's segments (`q`, `k` [tokens, key heads, key
        dim], `v` [tokens, value heads, value dim], `g`, `beta` [tokens, value heads]; `g`
        [tokens, value heads, key dim] decays each key channel on its own), each continued
        from its request's state, which it then keeps (stored as `ssm_dtype`, computed in
        float32). The CPU kernel steps decode where the decay is per head."""
        shape = (v.shape[1], k.shape[2], v.shape[2])
        return self.resume(
            "delta",
            layer,
            shape,
            self.ssm_dtype,
            inputs,
            gated_delta_rule_step,
            gated_delta_rule,
            q,
            k,
            v,
            g,
            beta,
            in_place=None
            if kernels is None or g.dim() == 3
            else partial(delta_step_in_place, kernels),
        )


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.view(torch.uint8).view(-1)


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def is_decode_step(inputs: AttentionInputs) -> bool:
    """One new token for every request, each continuing its state."""
    return inputs.max_extend_len == 1 and bool((inputs.prefix_lens > 0).all())


def each_request(
    states: torch.Tensor,
    inputs: AttentionInputs,
    step,
    whole,
    *tensors,
    verifying: frozenset[int] = frozenset(),
    verified: dict[int, torch.Tensor] | None = None,
):
    """Run a recurrent op over a step's segments (`tensors`, tokens first, one segment per
    request), each from its request's state in `states` (by row; zeros where the segment starts
    at position 0), keeping the state it leaves. A decode step (one continued token each) runs
    `step(*tensors, states)` on all rows at once; otherwise each segment runs
    `whole(*segment, state) -> (output, state)`, but the segment of a row in `verifying` (a
    token and its drafts) runs `step` a token at a time and leaves its states after each in
    `verified[row]`."""
    prefixes = inputs.prefix_lens
    if is_decode_step(inputs):
        picked = states[inputs.rows]
        picked = picked.float() if picked.dtype in (torch.bfloat16, torch.float16) else picked
        out = step(*tensors, picked)
        states[inputs.rows] = picked.to(states.dtype)
        return out
    outputs, start = [], 0
    for row, length, prefix in zip(
        inputs.rows.tolist(), inputs.extend_lens.tolist(), prefixes.tolist()
    ):
        segment = [t[start : start + length] for t in tensors]
        if row in verifying:
            out, verified[row] = each_token(step, segment, states[row])
            states[row] = verified[row][-1]
        else:
            out, states[row] = whole(*segment, states[row] if prefix > 0 else None)
        outputs.append(out)
        start += length
    return torch.cat(outputs)


def each_token(step, segment: list[torch.Tensor], state: torch.Tensor):
    """One segment through the one-step form, a token at a time from `state` (left as it was):
    its output, and its states after each token `[tokens, ...]` (in `state`'s dtype)."""
    current = state[None].clone().float()
    outputs, after = [], []
    for t in range(segment[0].shape[0]):
        outputs.append(step(*[x[t : t + 1] for x in segment], current))
        after.append(current[0].to(state.dtype, copy=True))
    return torch.cat(outputs), torch.stack(after)
