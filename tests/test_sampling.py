"""Each sampling parameter does what it says (real model)."""

import math

import pytest
import torch

from radixserve import SamplingParams
from radixserve.messages import SamplingBatch
from radixserve.worker.sampler import sample

PROMPT = "List three colors:"


def batch(n, **overrides):
    fields = dict(
        temperatures=[1.0] * n,
        top_ps=[1.0] * n,
        top_ks=[-1] * n,
        min_ps=[0.0] * n,
        seeds=[None] * n,
        steps=[0] * n,
        frequency_penalties=[0.0] * n,
        presence_penalties=[0.0] * n,
        repetition_penalties=[1.0] * n,
        penalty_outputs=[None] * n,
        penalty_prompts=[None] * n,
        suppressed_ids=[None] * n,
    )
    fields.update(overrides)
    return SamplingBatch(**fields)


def test_sampler_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 400))
    draws = sample(logits, batch(400, top_ks=[2] * 400))
    assert set(draws.tolist()) <= {0, 1}
    draws = sample(logits, batch(400, top_ps=[0.6] * 400))
    assert set(draws.tolist()) <= {0, 1} and 1 in draws.tolist()
    draws = sample(logits, batch(400, min_ps=[0.5] * 400))
    assert set(draws.tolist()) <= {0, 1}
    draws = sample(logits, batch(400, temperatures=[0.0] * 400))
    assert set(draws.tolist()) == {0}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_every_token_forbidden_takes_its_fallback(temperature):
    logits = torch.tensor([[0.1, 2.0, 0.3, 0.0], [0.1, 2.0, 0.3, 0.0]])
    mask_only_3 = [0b1000]  # a grammar that allows only token 3 ...
    draws = sample(
        logits,
        batch(
            2,
            temperatures=[temperature] * 2,
            token_masks=[mask_only_3, None],
            suppressed_ids=[[3], None],
            fallback_ids=[2, 2],
        ),
    )  # ... which min_new_tokens bans
    assert draws[0].item() == 2  # not NaN probabilities, not a crash
    assert temperature > 0 or draws[1].item() == 1  # the other row samples as usual


def test_sampler_penalties_and_suppression():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert (
        sample(
            logits, batch(1, temperatures=[0.0], frequency_penalties=[1.0], penalty_outputs=[[0]])
        ).item()
        == 1
    )
    assert (
        sample(
            logits, batch(1, temperatures=[0.0], presence_penalties=[0.5], penalty_outputs=[[0, 0]])
        ).item()
        == 1
    )
    assert (
        sample(
            logits,
            batch(
                1,
                temperatures=[0.0],
                repetition_penalties=[1.2],
                penalty_outputs=[[]],
                penalty_prompts=[[0]],
            ),
        ).item()
        == 1
    )
    assert sample(logits, batch(1, temperatures=[0.0], suppressed_ids=[[0, 1]])).item() == 2


def test_a_vanishing_temperature_samples_greedily(engine):
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 6})
    tiny = engine.generate(
        PROMPT, {"temperature": 1e-39, "max_new_tokens": 6}
    )  # 1/T overflows float32
    assert tiny["output_ids"] == greedy["output_ids"]


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "max_new_tokens": 12, "seed": 1234}
    a = engine.generate(PROMPT, params)
    b = engine.generate([PROMPT, "Unrelated prompt here"], [params, {"max_new_tokens": 5}])[0]
    assert a["output_ids"] == b["output_ids"]
    c = engine.generate(PROMPT, dict(params, seed=99))
    assert c["output_ids"] != a["output_ids"]


def test_n_samples_share_the_prompt(engine):
    results = engine.generate(
        "Tell me a story about a dragon named " * 8,
        {"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 5},
    )
    assert len(results) == 4
    assert len({tuple(r["output_ids"]) for r in results}) > 1
    assert sum(r["meta_info"]["cached_tokens"] for r in results) > 0
    engine.check_memory()


def test_stop_strings_trim_the_text(engine):
    base = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 20})
    text = base["text"]
    stop = text.strip()[2:5]
    result = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 20, "stop": stop})
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in result["text"] and text.startswith(result["text"])


def test_max_new_tokens_min_new_tokens_ignore_eos(engine):
    r = engine.generate("Say hi.", {"temperature": 0, "max_new_tokens": 300})
    assert r["meta_info"]["finish_reason"]["type"] == "stop"  # the chat model ends itself
    eos = r["output_ids"][-1]
    n = len(r["output_ids"])
    longer = engine.generate(
        "Say hi.", {"temperature": 0, "max_new_tokens": n + 5, "min_new_tokens": n + 2}
    )
    assert len(longer["output_ids"]) >= n + 2 and eos not in longer["output_ids"][: n + 1]
    ignore = engine.generate(
        "Say hi.", {"temperature": 0, "max_new_tokens": n + 3, "ignore_eos": True}
    )
    assert len(ignore["output_ids"]) == n + 3
    zero = engine.generate(
        "Say hi.", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert (
        zero["output_ids"] == []
        and len(zero["meta_info"]["input_token_logprobs"]) == zero["meta_info"]["prompt_tokens"]
    )


def test_temperature_and_top_k_one_are_greedy(engine):
    greedy = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8})
    topk1 = engine.generate(PROMPT, {"temperature": 0.8, "top_k": 1, "max_new_tokens": 8})
    assert greedy["output_ids"] == topk1["output_ids"]


def test_frequency_penalty_reduces_repetition(engine):
    prompt = "Repeat after me: la la la la la la la la la la"
    plain = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    penal = engine.generate(
        prompt,
        {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "frequency_penalty": 2.0},
    )
    assert len(set(penal["output_ids"])) > len(set(plain["output_ids"]))


def test_output_logprobs_are_probabilities(engine):
    r = engine.generate(
        PROMPT,
        {"temperature": 0, "max_new_tokens": 4},
        return_logprob=True,
        top_logprobs_num=5,
        return_text_in_logprobs=True,
    )
    for (lp, tid, text), top in zip(
        r["meta_info"]["output_token_logprobs"], r["meta_info"]["output_top_logprobs"]
    ):
        assert lp <= 0 and top[0][1] == tid and math.isclose(top[0][0], lp, abs_tol=1e-5)
        assert isinstance(text, str)


def test_streaming_yields_growing_text(engine):
    chunks = list(engine.generate_stream(PROMPT, {"temperature": 0, "max_new_tokens": 10}))
    final = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 10})
    assert len(chunks) > 1 and chunks[-1]["text"] == final["text"]
    assert all(final["text"].startswith(c["text"]) for c in chunks)


@pytest.mark.parametrize(
    "bad,msg",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 0}, "n "),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"max_new_tokens": "ten"}, "max_new_tokens"),
        ({"bogus": 1}, "unknown"),
        ({"seed": 2**64 - 1, "n": 2}, "seed"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_parameters_raise(engine, bad, msg):
    with pytest.raises(ValueError, match=msg):
        engine.generate(PROMPT, bad)
    with pytest.raises(ValueError, match=msg):
        SamplingParams.from_dict(bad)


def test_bad_inputs_raise(engine):
    with pytest.raises(ValueError, match="context"):
        engine.generate(input_ids=[1] * 9000)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[[]])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate(input_ids=[1, 10**7])
    engine.check_memory()


def test_logit_bias_steers_and_bans_tokens(engine, tokenizer):
    prompt = "The capital of France is"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1})
    first = free["output_ids"][0]
    banned = engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 1, "logit_bias": {str(first): -100}}
    )
    assert banned["output_ids"][0] != first
    target = tokenizer.encode(" London")[0]
    forced = engine.generate(
        prompt,
        {"temperature": 0.7, "max_new_tokens": 3, "logit_bias": {str(target): 100}, "seed": 3},
    )
    assert forced["output_ids"] == [target] * 3
    for bad in ({"abc": 1}, {"5": 300}, [1, 2], {str(10**7): 1}):
        with pytest.raises(ValueError, match="logit_bias"):
            engine.generate(prompt, {"max_new_tokens": 1, "logit_bias": bad})


def test_stop_regex(engine):
    prompt = "Count from one: 1, 2, 3,"
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16})
    assert " 5" in free["text"], free["text"]
    out = engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 16, "stop_regex": r"\b[5-9]\b"}
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["text"] == free["text"][: free["text"].index("5")]
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(prompt, {"max_new_tokens": 1, "stop_regex": "(unclosed"})
