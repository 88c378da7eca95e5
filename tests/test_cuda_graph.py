"""Decode graphs: capture per batch size, padded replay. On CPU `EagerGraph` stands in for
`torch.cuda.CUDAGraph`, so the static buffers, padding and backend graph planning run for
real (Triton kernels under the interpreter); scripts/gpu_check.sh runs the CUDA side."""

import random

import pytest
import torch
from scheduler_runs import greedy_run

from radixserve.config import EngineArgs
from radixserve.messages import ForwardBatch, ForwardMode
from radixserve.models.source import resolve_model
from radixserve.worker.cuda_graph import PAD_SLOT, EagerGraph, capture_batch_sizes
from radixserve.worker.model_runner import ModelRunner

ARGS = EngineArgs(
    model="dummy:tiny",
    dtype="float32",
    attention_backend="triton",
    max_total_tokens=2048,
    max_running_requests=8,
    cuda_graph_max_bs=8,
    chunked_prefill_size=64,
    context_length=512,
)


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.fixture(scope="module")
def runners():
    source = resolve_model(ARGS.model)
    return ModelRunner(source, ARGS), ModelRunner(source, ARGS, graph_cls=EagerGraph)


def test_no_graphs_on_cpu_unless_asked(runners):
    eager, _ = runners
    assert eager.graphs is None
    torch_native = ModelRunner(
        resolve_model(ARGS.model),
        ARGS.with_(attention_backend="torch_native"),
        graph_cls=EagerGraph,
    )
    assert torch_native.graphs is None  # the backend cannot be captured


def test_padded_graph_replay_matches_eager_decoding(runners):
    """Five requests of different lengths finish at different times, so decode batches of
    5, 4, 3, 2 and 1 run through the graphs of sizes 8, 4, 4, 2 and 1 (padded)."""
    eager, graphed = runners
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8]
    rng = random.Random(0)
    shared = [rng.randrange(500) for _ in range(30)]
    prompts = [shared + [rng.randrange(500) for _ in range(5 + 7 * i)] for i in range(5)]
    expected_tokens, expected_lp = greedy_run(ARGS, eager, prompts, [12] * len(prompts))
    before = graphed.graphs.replays
    tokens, lps = greedy_run(ARGS, graphed, prompts, [12] * len(prompts))
    assert graphed.graphs.replays - before >= 10
    assert tokens == expected_tokens
    for rid in expected_lp:
        assert lps[rid] == pytest.approx(expected_lp[rid], abs=1e-4)


def test_padding_writes_only_the_reserved_slot(runners):
    _, graphed = runners
    pool = graphed.pool
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v)]
    ids = torch.tensor([5, 6, 7])
    rows = torch.tensor([0, 1, 2])
    slots = torch.tensor([100, 200, 300])
    graphed.req_to_token[rows, 0] = slots
    with torch.inference_mode():
        graphed.graphs.replay(
            ids, torch.zeros(3, dtype=torch.long), slots, rows, torch.ones(3, dtype=torch.long)
        )
    for (k0, v0), k, v in zip(before, pool.k, pool.v):
        changed = (
            ((k != k0).flatten(1).any(1) | (v != v0).flatten(1).any(1)).nonzero().flatten().tolist()
        )
        assert set(changed) <= {100, 200, 300, PAD_SLOT}
        assert {100, 200, 300} <= set(changed)


def test_mixed_and_prefill_steps_stay_eager(runners):
    _, graphed = runners
    assert graphed._fits_graph(_batch(ForwardMode.EXTEND, 2)) is False
    assert graphed._fits_graph(_batch(ForwardMode.MIXED, 2)) is False
    assert graphed._fits_graph(_batch(ForwardMode.DECODE, 8)) is True
    assert graphed._fits_graph(_batch(ForwardMode.DECODE, 9)) is False


def _batch(mode, n):
    return ForwardBatch(
        mode, [1] * n, [0] * n, [1] * n, list(range(n)), [1] * n, [1] * n, [], None, [None] * n
    )
