"""A model-free executor that still exercises every slot the scheduler hands out.

The "KV pool" stores the token id written at each slot; the next token is a hash of
the context read back through the request-to-token table. If the scheduler maps a
slot wrongly, the context changes and so does the output, which `reference` predicts.
"""

from __future__ import annotations

import hashlib

from radixserve.messages import ForwardBatch, ForwardResult
from radixserve.worker_info import WorkerInfo

VOCAB = 1000
EOS = 999


def next_token(context: list[int]) -> int:
    digest = hashlib.blake2b(repr(context).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (VOCAB - 1)


def reference(prompt: list[int], max_new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeExecutor:
    def __init__(
        self, num_pages: int, page_size: int = 1, max_running: int = 8, max_context: int = 512
    ):
        self.info = WorkerInfo(
            num_pages,
            page_size,
            max_context,
            max_running,
            VOCAB,
            (EOS,),
            "float32",
            "cpu",
            "fake",
            1,
            0,
            "float32",
        )
        self.pool: dict[int, int] = {}
        self.table = [[0] * max_context for _ in range(max_running)]
        self.batches: list[ForwardBatch] = []

    def vision_figures(self) -> dict:
        return {}

    def forward(self, fb: ForwardBatch) -> ForwardResult:
        self.batches.append(fb)
        for row, start, slots in fb.row_writes:
            self.table[row][start : start + len(slots)] = slots
        pos = 0
        next_ids = []
        for row, seq_len, n in zip(fb.rows, fb.seq_lens, fb.extend_lens):
            for i in range(n):
                slot, position = fb.out_cache_loc[pos + i], fb.positions[pos + i]
                assert slot >= page_size_floor(self.info.page_size), "page 0 is reserved"
                self.pool[slot] = fb.input_ids[pos + i]
                self.table[row][position] = slot
            pos += n
            context = [self.pool[self.table[row][i]] for i in range(seq_len)]
            next_ids.append(next_token(context))
        return ForwardResult(next_ids, [None] * len(next_ids), [None] * len(next_ids))


def page_size_floor(page_size: int) -> int:
    return page_size
