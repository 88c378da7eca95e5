"""One step's model inputs as tensors, and their packing into one tensor for TP ranks > 0
(`send_step`, `receive_step`; a vision-language step's images and 3-D positions follow it).

Rank 0 (in the scheduler process) builds `StepInputs` from the scheduler's ForwardBatch and
broadcasts them packed; the other ranks unpack and run the same forward. Sampling inputs
never leave rank 0: only it samples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..distributed import TPGroup
from ..messages import ForwardBatch, ForwardMode
from ..models.layers import StepImages

# mode, tokens, requests, table entries, logit rows, longest sequence, longest extend, extras
_HEADER = 8
# the extras' bits: a step's image features, its 3-D positions, the state copies before it
IMAGES, MROPE, STATE_COPIES = 1, 2, 4


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
    # vision-language models: the step's image features, and the tokens' (time, height, width)
    # positions `[3, T]` where a request has images (TP ranks > 0 receive them after the rest)
    images: StepImages | None = None
    mrope_positions: torch.Tensor | None = None
    # a hybrid model's state copies (src, dst) rank 0 made since the last step, `[n, 2]`: the
    # other ranks make them before this step
    state_copies: torch.Tensor | None = None
    extras: int = 0  # on TP ranks > 0, before they arrive: which of the three will

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
                self.extra_bits(),
            ],
            dtype=torch.long,
            device=self.rows.device,
        )
        return torch.cat([header] + [getattr(self, f.name) for f in fields(self)[1:-6]])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> "StepInputs":
        mode, tokens, reqs, entries, logits, longest, extend, extras = packed[:_HEADER].tolist()
        sizes = [tokens, tokens, tokens, reqs, reqs, reqs, entries, entries, entries, logits]
        values = packed[_HEADER:].split(sizes)
        return cls(ForwardMode(mode), *values, longest, extend, extras=extras)

    def copies(self) -> list[tuple[int, int]]:
        """The state copies (src, dst) to make before this step."""
        return [] if self.state_copies is None else [tuple(c) for c in self.state_copies.tolist()]

    def extra_bits(self) -> int:
        """Rank 0: which of the images, 3-D positions and state copies follow the packed step."""
        return (
            (IMAGES if self.images is not None else 0)
            | (MROPE if self.mrope_positions is not None else 0)
            | (STATE_COPIES if self.state_copies is not None else 0)
        )

    def pack_extras(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What TP ranks > 0 need besides `pack()`: one int64 tensor (the state copies, the
        images' counts, rows and blocks, then the 3-D positions) and the image features
        (embeds, then each DeepStack layer's) as float32."""
        longs, features = [], None
        if self.state_copies is not None:
            copies = self.state_copies.cpu()
            longs += [torch.tensor([copies.shape[0]]), copies.reshape(-1)]
        if self.images is not None:
            im = self.images
            counts = [im.rows.numel(), len(im.deepstack), len(im.blocks)]
            blocks = torch.tensor(im.blocks, dtype=torch.long).reshape(-1)
            longs += [torch.tensor(counts), im.rows.cpu(), blocks]
            features = torch.cat([im.embeds, *im.deepstack]).float().reshape(-1)
        if self.mrope_positions is not None:
            longs.append(self.mrope_positions.cpu().reshape(-1))
        return torch.cat(longs).to(self.rows.device), features

    def add_extras(self, longs: torch.Tensor, features: torch.Tensor | None, dtype) -> None:
        """A TP rank > 0: the state copies, images and 3-D positions `pack_extras` sent
        (features in the model's `dtype`)."""
        if self.extras & STATE_COPIES:
            count = int(longs[0])
            self.state_copies = longs[1 : 1 + 2 * count].view(count, 2)
            longs = longs[1 + 2 * count :]
        if self.extras & IMAGES:
            rows, layers, blocks = longs[:3].tolist()
            longs = longs[3:]
            embeds = features.to(dtype).view((1 + layers) * rows, -1).split(rows)
            table = [tuple(b) for b in longs[rows : rows + 4 * blocks].view(-1, 4).tolist()]
            self.images = StepImages(longs[:rows], embeds[0], list(embeds[1:]), table)
            longs = longs[rows + 4 * blocks :]
        if self.extras & MROPE:
            self.mrope_positions = longs.view(3, -1)


def send_step(tp: TPGroup, inputs: StepInputs, state_copies: list[tuple[int, int]]) -> None:
    """TP rank 0: the step to the other ranks, the state copies made since the last one (the
    list is emptied), its images and 3-D positions after it."""
    if state_copies:
        inputs.state_copies = torch.tensor(state_copies, device=inputs.rows.device)
        state_copies.clear()
    tp.send_step(inputs.pack())
    if inputs.extra_bits():
        longs, features = inputs.pack_extras()
        tp.send_step(longs)
        if features is not None:
            tp.send_step(features)


def receive_step(tp: TPGroup, device: torch.device, dtype: torch.dtype) -> StepInputs:
    """TP ranks > 0: rank 0's next step, with what follows it (image features in `dtype`)."""
    inputs = StepInputs.unpack(tp.receive_step(device))
    if inputs.extras:
        longs = tp.receive_step(device)
        features = tp.receive_step(device, torch.float32) if inputs.extras & IMAGES else None
        inputs.add_extras(longs, features, dtype)
    return inputs
