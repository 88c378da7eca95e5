"""M-RoPE positions (Qwen2-VL and after): text tokens count on in all three axes; an image's
tokens take (time, row, column) offsets from where it starts, and the text after it goes on
from the largest of them. A request's later tokens are its index plus `delta`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MRopePositions:
    rows: tuple[list[int], list[int], list[int]]  # (time, height, width) of each prompt token
    delta: int  # position - index of every token after the prompt

    def at(self, index: int) -> tuple[int, int, int]:
        if index < len(self.rows[0]):
            return self.rows[0][index], self.rows[1][index], self.rows[2][index]
        p = index + self.delta
        return p, p, p


def mrope_positions(
    prompt_len: int, images: list[tuple[int, tuple[int, int, int]]], merge_size: int
) -> MRopePositions:
    """`images`: each image's first token in the prompt and its (t, h, w) patch grid, in order."""
    t_rows, h_rows, w_rows = [], [], []
    index, pos = 0, 0
    for offset, (t, h, w) in images:
        text = offset - index
        for rows in (t_rows, h_rows, w_rows):
            rows.extend(range(pos, pos + text))
        pos += text
        gh, gw = h // merge_size, w // merge_size
        for frame in range(t):
            for row in range(gh):
                t_rows.extend([pos + frame] * gw)
                h_rows.extend([pos + row] * gw)
                w_rows.extend(range(pos, pos + gw))
        index = offset + t * gh * gw
        pos += max(gh, gw)
    text = prompt_len - index
    for rows in (t_rows, h_rows, w_rows):
        rows.extend(range(pos, pos + text))
    pos += text
    return MRopePositions((t_rows, h_rows, w_rows), pos - prompt_len)
