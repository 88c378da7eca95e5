"""`enable_torch_compile`: decode steps through torch.compile give the eager tokens, and the
start-up warm-up compiles every shape serving needs (no recompiles mid-run)."""
import random

import pytest
import torch

from radixserve.config import EngineArgs
from radixserve.messages import GenerateReq
from radixserve.models.loader import resolve_model
from radixserve.scheduler.scheduler import Scheduler
from radixserve.worker.model_runner import ModelRunner

ARGS = EngineArgs(model="dummy:tiny", dtype="float32", attention_backend="torch_native", max_total_tokens=4096,
                  max_running_requests=8, chunked_prefill_size=64, max_context_len=512)


def run(runner, prompts, max_new_tokens=10):
    sched = Scheduler(ARGS, runner)
    for i, prompt in enumerate(prompts):
        sched.add_request(GenerateReq(str(i), prompt, dict(max_new_tokens=max_new_tokens + i, temperature=0,
                                                           ignore_eos=True), return_logprob=True))
    tokens, logprobs = {}, {}
    while sched.has_work():
        for out in sched.step():
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
            logprobs.setdefault(out.rid, []).extend(lp[0] for lp in out.output_logprobs or [])
        sched.check_memory()
    return tokens, logprobs


def test_compiled_decode_matches_eager_without_recompiling(tmp_path, monkeypatch):
    counters = pytest.importorskip("torch._dynamo.utils").counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a cold cache, as on a fresh machine
    torch._dynamo.reset()
    source = resolve_model(ARGS.model)
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(3 + 9 * i)] for i in range(5)]
    expected_tokens, expected_lps = run(ModelRunner(source, ARGS), prompts)
    counters.clear()
    compiled = ModelRunner(source, ARGS.with_(enable_torch_compile=True))
    graphs_at_start = counters["stats"]["unique_graphs"]
    assert graphs_at_start >= 1
    tokens, lps = run(compiled, prompts)  # decode batches of 5 down to 1 over contexts of 4 to 50 tokens
    assert counters["stats"]["unique_graphs"] == graphs_at_start
    assert tokens == expected_tokens
    for rid in expected_lps:
        assert lps[rid] == pytest.approx(expected_lps[rid], abs=1e-4)
