"""`enable_torch_compile`: the whole forward through torch.compile (extend, mixed and decode steps,
attention as an opaque op) gives the eager tokens, and the start-up warm-up compiles every shape
serving needs (no recompiles mid-run)."""

import random

import pytest
import torch
from scheduler_runs import greedy_run

from radixserve.config import EngineArgs
from radixserve.models.source import resolve_model
from radixserve.worker.model_runner import ModelRunner

ARGS = EngineArgs(
    model="dummy:tiny",
    dtype="float32",
    attention_backend="torch_native",
    max_total_tokens=4096,
    max_running_requests=8,
    chunked_prefill_size=64,
    context_length=512,
)


def test_compiled_forward_matches_eager_without_recompiling(tmp_path, monkeypatch):
    counters = pytest.importorskip("torch._dynamo.utils").counters
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor")
    )  # a cold cache, as on a fresh machine
    # inductor's precompiled headers go under the system temp folder whatever that variable says
    codecache = pytest.importorskip("torch._inductor.codecache")
    headers = tmp_path / "inductor" / "precompiled_headers"
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(headers), raising=False)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(headers / "locks"), raising=False)
    torch._dynamo.reset()
    source = resolve_model(ARGS.model)
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(3 + 9 * i)] for i in range(5)]
    lengths = [10 + i for i in range(5)]
    expected_tokens, expected_lps = greedy_run(ARGS, ModelRunner(source, ARGS), prompts, lengths)
    counters.clear()
    compiled = ModelRunner(source, ARGS.with_(enable_torch_compile=True))
    graphs_at_start = counters["stats"]["unique_graphs"]
    assert graphs_at_start >= 1
    tokens, lps = greedy_run(
        ARGS, compiled, prompts, lengths
    )  # chunked prompts, mixed steps, decode batches 5..1
    assert counters["stats"]["unique_graphs"] == graphs_at_start
    assert tokens == expected_tokens
    for rid in expected_lps:
        assert lps[rid] == pytest.approx(expected_lps[rid], abs=1e-4)
