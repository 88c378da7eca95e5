"""Slot allocation over the KV pool, in pages of `page_size` slots.

Page 0 is never handed out: its slots are the padding target of batched gathers.
A sequence owns whole pages; `alloc_extend` first fills the unused tail of the
sequence's last page, then takes new pages.
"""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_pages: int, page_size: int = 1):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages: list[int] = list(range(num_pages, 0, -1))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def available(self) -> int:
        """Free slots."""
        return len(self._free_pages) * self.page_size

    def can_alloc_pages(self, n: int) -> bool:
        return n <= len(self._free_pages)

    def alloc_pages(self, n: int) -> list[int] | None:
        if n > len(self._free_pages):
            return None
        taken = self._free_pages[len(self._free_pages) - n :]
        del self._free_pages[len(self._free_pages) - n :]
        return taken

    def pages_needed(self, seq_len: int, n: int) -> int:
        """New pages that `n` more tokens need after `seq_len` tokens."""
        room = (-seq_len) % self.page_size
        return -(-max(n - room, 0) // self.page_size)

    def alloc_extend(self, seq_len: int, last_slot: int | None, n: int) -> list[int] | None:
        """Slots for `n` more tokens of a sequence of `seq_len` tokens; None if out of memory."""
        ps = self.page_size
        room = (-seq_len) % ps
        take = min(room, n)
        pages = self.alloc_pages(self.pages_needed(seq_len, n))
        if pages is None:
            return None
        slots = [last_slot + 1 + i for i in range(take)] if take else []
        slots += [p * ps + i for p in pages for i in range(ps)][: n - take]
        return slots

    def free(self, slots: list[int]) -> None:
        """Free the pages that start in `slots` (a sequence's own, page-aligned run)."""
        ps = self.page_size
        self._free_pages.extend(s // ps for s in slots if s % ps == 0)

    def held_slots(self, num_tokens: int) -> int:
        """Slots held by a page-aligned run of `num_tokens` tokens."""
        return -(-num_tokens // self.page_size) * self.page_size


class ReqToTokenRows:
    """Free list of request rows in the worker's request-to-token table."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)
