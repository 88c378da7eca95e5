"""Host memory in huge-page mappings: the packed weights' copies and the KV pool's zeros."""

import torch

from radixserve.mem.huge_pages import HUGE_PAGE, anonymous_zeros, into_huge_pages


def test_copies_hold_the_same_values_back_to_back_and_aligned():
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=gen),
        torch.randint(0, 100, (7,), generator=gen),
        torch.randn(300, 17, generator=gen).to(torch.bfloat16),
        torch.randn(0, 4, generator=gen),
    ]
    copies = into_huge_pages(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    copies[0].zero_()  # copies, not views of the originals, and writable
    assert tensors[0].abs().sum() > 0
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies[:3]]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, copies[1:3]))  # no overlap


def test_anonymous_zeros_are_zero_and_writable():
    pool = anonymous_zeros((5000, 3, 64), torch.float32)
    assert pool.shape == (5000, 3, 64) and not pool.any()
    pool[4999, 2, 63] = 1.5
    assert pool.sum().item() == 1.5
