"""The C++ decoder loop (radixserve_kernels/cpu_decoder.cpp) against the Python layers it
replaces, on the bundled model in float32: the same kernels in the same order, so the same bits, in
prefill,
mixed and decode steps (the end-to-end HF comparisons run through it too: test_engine_hf.py)."""

from __future__ import annotations

import pytest
import torch

from radixserve.config import EngineArgs
from radixserve.messages import ForwardBatch, ForwardMode, SamplingBatch
from radixserve.models.source import resolve_model
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.step_inputs import StepInputs
from radixserve_kernels.cpu_ops import load

pytestmark = pytest.mark.skipif(load() is None, reason="CPU kernels unavailable (no compiler)")

ROW_SLOTS = 64  # request row r owns slots 1 + r * ROW_SLOTS ...


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(
        resolve_model(None),
        EngineArgs(max_total_tokens=4 * ROW_SLOTS + 8, max_running_requests=4, dtype="float32"),
    )


def step(mode: ForwardMode, requests: list[tuple[int, int, list[int]]]) -> ForwardBatch:
    """`requests`: (row, tokens already cached, new token ids) each."""
    ids, positions, slots, rows, seq_lens, extend_lens, writes = [], [], [], [], [], [], []
    for row, cached, new in requests:
        base = 1 + row * ROW_SLOTS
        ids += new
        positions += range(cached, cached + len(new))
        slots += range(base + cached, base + cached + len(new))
        rows.append(row)
        seq_lens.append(cached + len(new))
        extend_lens.append(len(new))
        writes.append((row, 0, list(range(base, base + cached))))
    return ForwardBatch(
        mode,
        ids,
        positions,
        slots,
        rows,
        seq_lens,
        extend_lens,
        writes,
        SamplingBatch.greedy(len(rows)),
        [None] * len(rows),
    )


def hidden_states(runner: ModelRunner, fb: ForwardBatch, fused: bool) -> torch.Tensor:
    decoder = runner.model.cpu_decoder
    if not fused:
        runner.model.cpu_decoder = None
    try:
        with torch.inference_mode():
            return runner.run_model(StepInputs.from_batch(fb, runner.device))[1].clone()
    finally:
        runner.model.cpu_decoder = decoder


def test_the_float32_cpu_model_runs_its_layers_in_one_call(runner):
    assert runner.model.cpu_decoder is not None


@pytest.mark.parametrize(
    "mode,requests",
    [
        (ForwardMode.EXTEND, [(0, 0, list(range(100, 117))), (1, 0, list(range(300, 305)))]),
        (ForwardMode.MIXED, [(0, 17, [42]), (1, 5, [7, 8, 9]), (2, 0, list(range(500, 520)))]),
        (ForwardMode.DECODE, [(0, 18, [11]), (1, 8, [12]), (2, 20, [13])]),
    ],
)
def test_fused_layers_give_the_python_layers_bits(runner, mode, requests):
    # Each case stores its tokens' K/V before attending, at the same slots either way, and the
    # cases run in order so that later ones attend over the K/V of earlier ones.
    fb = step(mode, requests)
    python = hidden_states(runner, fb, fused=False)
    fused = hidden_states(runner, fb, fused=True)
    assert runner.backend.kernel_groups(), (
        "the step's attention did not go through the paged kernels"
    )
    assert fused.shape == (sum(len(new) for _, _, new in requests), runner.config.hidden_size)
    assert torch.equal(fused, python)


@pytest.fixture(scope="module")
def bf16_runner() -> ModelRunner:
    return ModelRunner(
        resolve_model(None),
        EngineArgs(max_total_tokens=4 * ROW_SLOTS + 8, max_running_requests=4, dtype="bfloat16"),
    )


def test_the_bf16_model_runs_in_one_call_closer_to_float32_than_its_python_layers(
    runner, bf16_runner
):
    """bf16 weights and K/V with a float32 residual stream (cpu_decoder.cpp): the hidden states
    of a prefill, then a decode step, stay nearer the float32 model's than those of the Python
    layers, which round every activation to bf16."""
    assert bf16_runner.model.cpu_decoder is not None
    assert bf16_runner.pool.k[0].dtype == torch.bfloat16
    prefill = step(ForwardMode.EXTEND, [(0, 0, list(range(100, 140))), (1, 0, [5, 6, 7])])
    decode = step(ForwardMode.DECODE, [(0, 40, [11]), (1, 3, [12])])
    for fb in (prefill, decode):
        reference = hidden_states(runner, fb, fused=True)
        python = hidden_states(bf16_runner, fb, fused=False).float()
        fused = hidden_states(bf16_runner, fb, fused=True)
        assert bf16_runner.backend.kernel_groups()
        assert fused.dtype == torch.float32

        def error(x):
            return ((x - reference).norm() / reference.norm()).item()

        assert error(fused) < 0.05
        assert error(fused) < error(python)
