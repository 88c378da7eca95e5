"""M-RoPE positions (Qwen2-VL and after): text tokens count on in all three axes; an image's
tokens take (time, row, column) offsets from where it starts (a video's frame pairs their time
offsets `time_interval` apart, truncated), and the text after it goes on from the largest of
them, plus one (as Qwen's reference and SGLang do; transformers 5 goes on from the largest
row or column offset, the same unless a video's time offsets pass them). A request's later
tokens are its index plus `delta`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    prompt_len: int, images: list[tuple[int, tuple[int, int, int], float]], merge_size: int
) -> MRopePositions:
    """`images`: each image's first token in the prompt, its (t, h, w) patch grid and the time
    offsets between its frame pairs, in order."""
    t_rows, h_rows, w_rows = [], [], []
    index, pos = 0, 0
    for offset, (t, h, w), interval in images:
        text = offset - index
        for rows in (t_rows, h_rows, w_rows):
            rows.extend(range(pos, pos + text))
        pos += text
        gh, gw = h // merge_size, w // merge_size
        times = [_time_offset(frame, interval) for frame in range(t)]
        for frame in range(t):
            for row in range(gh):
                t_rows.extend([pos + times[frame]] * gw)
                h_rows.extend([pos + row] * gw)
                w_rows.extend(range(pos, pos + gw))
        index = offset + t * gh * gw
        pos += max(times[-1] + 1, gh, gw)
    text = prompt_len - index
    for rows in (t_rows, h_rows, w_rows):
        rows.extend(range(pos, pos + text))
    pos += text
    return MRopePositions((t_rows, h_rows, w_rows), pos - prompt_len)


def _time_offset(frame: int, interval: float) -> int:
    """A frame pair's time offset as transformers computes it (in float32, truncated)."""
    return int(np.float32(frame) * np.float32(interval))
