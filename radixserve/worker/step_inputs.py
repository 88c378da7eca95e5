"""One step's model inputs as tensors, and their packing into one tensor for TP ranks > 0.

Rank 0 (in the scheduler process) builds `StepInputs` from the scheduler's ForwardBatch and
broadcasts them packed; the other ranks unpack and run the same forward. Sampling inputs
never leave rank 0: only it samples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..messages import ForwardBatch, ForwardMode
from ..models.layers import StepImages

_HEADER = 7  # mode, tokens, requests, table entries, logit rows, longest sequence, longest extend


@dataclass
class StepInputs:
    """Request b's `extend_lens[b]` tokens sit at `positions`, write their K/V to
    `out_cache_loc`, and attend over row `rows[b]` of the request-to-token table up to
    `seq_lens[b]`. Before the step, table entry (`table_rows[i]`, `table_cols[i]`) becomes
    `table_slots[i]`: the rows' new prefix slots and this step's own slots. Logits are wanted
    at the tokens `logit_index` names: each request's last, and before it its draft tokens'."""

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    table_rows: torch.Tensor
    table_cols: torch.Tensor
    table_slots: torch.Tensor
    logit_index: torch.Tensor
    max_seq_len: int
    max_extend_len: int
    # vision-language models (rank 0 only): the step's image features, and the tokens'
    # (time, height, width) positions `[3, T]` where a request has images
    images: StepImages | None = None
    mrope_positions: torch.Tensor | None = None

    @classmethod
    def from_batch(cls, fb: ForwardBatch, device: torch.device) -> "StepInputs":
        table_rows, table_cols, table_slots = [], [], []
        for row, start, slots in fb.row_writes:
            table_rows += [row] * len(slots)
            table_cols += range(start, start + len(slots))
            table_slots += slots
        for row, n in zip(fb.rows, fb.extend_lens):
            table_rows += [row] * n
        table_cols += fb.positions
        table_slots += fb.out_cache_loc
        logit_index, end = [], 0
        for n, drafts in zip(fb.extend_lens, fb.draft_lens or [0] * fb.batch_size):
            end += n
            logit_index += range(end - 1 - drafts, end)
        values = [
            fb.input_ids,
            fb.positions,
            fb.out_cache_loc,
            fb.rows,
            fb.seq_lens,
            fb.extend_lens,
            table_rows,
            table_cols,
            table_slots,
            logit_index,
        ]
        mrope = fb.mrope_positions
        return cls(
            fb.mode,
            *(torch.tensor(v, dtype=torch.long, device=device) for v in values),
            max(fb.seq_lens),
            max(fb.extend_lens),
            mrope_positions=None if mrope is None else torch.tensor(mrope, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.rows.numel()

    def pack(self) -> torch.Tensor:
        """One int64 tensor: a header of sizes, then every field's values in order."""
        header = torch.tensor(
            [
                int(self.mode),
                self.input_ids.numel(),
                self.batch_size,
                self.table_rows.numel(),
                self.logit_index.numel(),
                self.max_seq_len,
                self.max_extend_len,
            ],
            dtype=torch.long,
            device=self.rows.device,
        )
        return torch.cat([header] + [getattr(self, f.name) for f in fields(self)[1:-4]])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "StepInputs":
        mode, tokens, reqs, entries, logits, max_seq_len, max_extend_len = packed[:_HEADER].tolist()
        sizes = [tokens, tokens, tokens, reqs, reqs, reqs, entries, entries, entries, logits]
        return cls(ForwardMode(mode), *packed[_HEADER:].split(sizes), max_seq_len, max_extend_len)
