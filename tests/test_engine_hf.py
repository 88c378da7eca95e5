"""The engine against HF transformers on the same weights (real model, CPU)."""

import pytest
import torch
from conftest import PROMPTS

from radixserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def expect_hf(engine_results, tokenizer, hf_greedy, prompts=PROMPTS, n=16):
    for prompt, result in zip(prompts, engine_results):
        assert result["output_ids"] == hf_greedy(tokenizer.encode(prompt), n), prompt


def test_greedy_batch_of_mixed_lengths_matches_hf(engine, tokenizer, hf_greedy):
    results = engine.generate(PROMPTS, GREEDY)
    expect_hf(results, tokenizer, hf_greedy)
    assert all(r["meta_info"]["completion_tokens"] == 16 for r in results)
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [
        len(tokenizer.encode(p)) for p in PROMPTS
    ]
    engine.check_memory()


def test_prompt_logprobs_close_to_hf(engine, tokenizer, hf_model):
    prompt = PROMPTS[4]
    ids = tokenizer.encode(prompt)
    result = engine.generate(
        prompt,
        {"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    got = result["meta_info"]["input_token_logprobs"]
    assert got[0][0] is None and [t for _, t, _ in got] == ids
    expected = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert torch.allclose(
        torch.tensor([lp for lp, _, _ in got[1:]]), torch.tensor(expected), atol=2e-3
    )
    top = result["meta_info"]["input_top_logprobs"][1]
    assert [t for _, t, _ in top] == ref[0].topk(3).indices.tolist()
    out_lp = result["meta_info"]["output_token_logprobs"][0][0]
    assert abs(out_lp - ref[-1].max().item()) < 2e-3
    engine.check_memory()


def test_prefix_hits_give_same_output(engine, tokenizer, hf_greedy):
    first = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in first]
    assert all(
        r["meta_info"]["cached_tokens"] >= r["meta_info"]["prompt_tokens"] - 1 for r in again
    )
    branches = [PROMPTS[4] + " Answer briefly.", PROMPTS[4] + " Use ten words."]
    results = engine.generate(branches, GREEDY)
    assert all(r["meta_info"]["cached_tokens"] >= 60 for r in results)
    expect_hf(results, tokenizer, hf_greedy, branches)
    engine.check_memory()


@pytest.mark.parametrize("page_size,chunk", [(1, 8), (4, 16), (16, 32)])
def test_chunked_prefill_and_pages_match_hf(page_size, chunk, tokenizer, hf_greedy):
    with Engine(
        max_total_tokens=4096,
        page_size=page_size,
        chunked_prefill_size=chunk,
        dtype="float32",
        max_prefill_tokens=chunk * 2,
    ) as eng:
        results = eng.generate(PROMPTS, GREEDY)
        expect_hf(results, tokenizer, hf_greedy)
        again = eng.generate(PROMPTS[4], GREEDY)
        assert again["output_ids"] == results[4]["output_ids"]
        assert again["meta_info"]["cached_tokens"] > 0
        eng.check_memory()


def test_tiny_pool_evicts_and_retracts_yet_matches_hf(tokenizer, hf_greedy):
    with Engine(
        max_total_tokens=160, max_running_requests=8, chunked_prefill_size=32, dtype="float32"
    ) as eng:
        prompts = [p for p in PROMPTS if len(tokenizer.encode(p)) < 40] * 2
        results = eng.generate(prompts, dict(GREEDY, max_new_tokens=40))
        expect_hf(results, tokenizer, hf_greedy, prompts, n=40)
        stats = eng.get_stats()
        assert stats.retractions_total > 0
        assert stats.evicted_tokens_total > 0
        eng.check_memory()


def test_disabled_radix_cache_still_correct(tokenizer, hf_greedy):
    with Engine(max_total_tokens=2048, disable_radix_cache=True, dtype="float32") as eng:
        first = eng.generate(PROMPTS[:2], GREEDY)
        again = eng.generate(PROMPTS[:2], GREEDY)
        expect_hf(first, tokenizer, hf_greedy, PROMPTS[:2])
        assert [r["meta_info"]["cached_tokens"] for r in again] == [0, 0]
        stats = eng.get_stats()
        assert stats.cached_slots == 0 and stats.free_slots == stats.num_slots


def test_bfloat16_stays_close_to_hf(tokenizer, hf_greedy, hf_model):
    """bf16 (the CPU default where AMX-BF16 exists) tracks the fp32 oracle closely."""
    with Engine(max_total_tokens=1024, dtype="bfloat16") as eng:
        result = eng.generate(
            PROMPTS[0],
            {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
        )
    ids = tokenizer.encode(PROMPTS[0])
    assert result["output_ids"][:2] == hf_greedy(ids, 4)[:2]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    got = torch.tensor([lp for lp, _, _ in result["meta_info"]["input_token_logprobs"][1:]])
    expected = torch.tensor([ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)])
    assert (got - expected).abs().max() < 0.35


def test_engine_takes_the_sampling_params_it_exports(engine, tokenizer, hf_greedy):
    from radixserve import SamplingParams

    result = engine.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    )
    assert result["output_ids"] == hf_greedy(tokenizer.encode(PROMPTS[0]), 8)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(PROMPTS[0], SamplingParams(temperature=-1.0))
