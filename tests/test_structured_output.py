"""Structured output (regex, JSON schema, EBNF through xgrammar) on the bundled model."""

import copy
import json
import re

import pytest
import torch

from radixserve.worker.sampler import apply_token_masks

xgrammar = pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_token_masks_match_xgrammar_reference():
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    words = torch.randint(-(2**31), 2**31 - 1, (2, 4), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected[:2], words)
    got = logits.clone()
    apply_token_masks(got, [words[0].tolist(), words[1].tolist(), None])
    assert torch.equal(got[:2], expected[:2])
    assert torch.equal(got[2], logits[2])


def test_regex_json_schema_and_ebnf(engine):
    outs = engine.generate(
        ["Give a person as JSON:", "Is the sky blue? Answer:", "A date:", "Say hi:"],
        [
            {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(PERSON)},
            {"temperature": 0, "max_new_tokens": 8, "regex": "(yes|no)"},
            {"temperature": 0, "max_new_tokens": 16, "regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
            {
                "temperature": 0,
                "max_new_tokens": 16,
                "ebnf": 'root ::= "hello" " " ("world" | "there")',
            },
        ],
    )
    person = json.loads(outs[0]["text"])
    assert (
        set(person) == {"name", "age"}
        and isinstance(person["age"], int)
        and isinstance(person["name"], str)
    )
    assert outs[1]["text"] in ("yes", "no")
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", outs[2]["text"])
    assert outs[3]["text"] in ("hello world", "hello there")
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    engine.check_memory()


def test_sampled_outputs_follow_the_grammar(engine):
    pattern = r"[0-9]{3}-[a-z]{2}"
    outs = engine.generate(
        "A code:", {"temperature": 1.0, "max_new_tokens": 16, "regex": pattern, "n": 4, "seed": 7}
    )
    assert len(outs) == 4
    assert all(re.fullmatch(pattern, o["text"]) for o in outs), [o["text"] for o in outs]
    free = engine.generate("A code:", {"temperature": 0, "max_new_tokens": 6})
    assert not re.fullmatch(pattern, free["text"])  # the constraint, not the model, made the shape


def test_cut_short_by_max_new_tokens(engine):
    out = engine.generate(
        "Give a person as JSON:", {"temperature": 0, "max_new_tokens": 3, "json_schema": PERSON}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"ebnf": "root ::= undefined_rule"}, "invalid ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "at most one"),
        ({"regex": 5}, "regex must be a non-empty string"),
    ],
)
def test_bad_grammars_are_refused(engine, params, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate("x", dict(params, max_new_tokens=4))
    engine.check_memory()


def test_jump_forward_appends_forced_text_without_decode_steps():
    from radixserve import Engine

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "city": {"enum": ["Paris", "Lyon", "Nice"]},
            "age": {"type": "integer", "maximum": 120},
        },
        "required": ["name", "city", "age"],
    }
    params = {"temperature": 0, "max_new_tokens": 60, "json_schema": schema}
    with Engine(
        dtype="float32", max_total_tokens=2048, max_running_requests=4, enable_jump_forward=True
    ) as eng:
        before = copy.copy(eng.get_stats())
        out = eng.generate("A French person as JSON:", params)
        after = copy.copy(eng.get_stats())
        person = json.loads(out["text"])
        assert set(person) == {"name", "city", "age"} and person["city"] in (
            "Paris",
            "Lyon",
            "Nice",
        )
        assert out["text"].startswith('{"name": "')
        steps = after.forward_steps - before.forward_steps
        forced = after.jump_forward_tokens_total - before.jump_forward_tokens_total
        assert forced >= 8 and steps <= out["meta_info"]["completion_tokens"] - forced + 1
        with_logprobs = eng.generate("A French person as JSON:", params, return_logprob=True)
        assert (
            len(with_logprobs["meta_info"]["output_token_logprobs"])
            == with_logprobs["meta_info"]["completion_tokens"]
        )
        assert (
            eng.get_stats().jump_forward_tokens_total == after.jump_forward_tokens_total
        )  # none with logprobs
        eng.check_memory()


def test_grammars_survive_retraction_with_jump_forward():
    """A pool too small for every request: some are retracted mid-output and re-prefilled with
    their forced tokens; every output still follows its grammar and no KV slot leaks."""
    from radixserve import Engine

    schema = {
        "type": "object",
        "required": ["name", "tags"],
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        },
    }
    pattern = r"(cat|dog)( (cat|dog)){3,8}"
    prompts = [f"Record {i}: describe a product with tags as JSON. " * 3 for i in range(12)]
    params = [
        dict(temperature=0.8, seed=i, max_new_tokens=80, json_schema=schema)
        if i % 3
        else dict(temperature=0, max_new_tokens=60, regex=pattern)
        for i in range(12)
    ]
    with Engine(
        dtype="float32",
        max_total_tokens=360,
        max_running_requests=12,
        chunked_prefill_size=64,
        enable_jump_forward=True,
        new_token_ratio=0.01,
        min_new_token_ratio=0.0,
    ) as eng:
        outs = eng.generate(prompts, params)
        assert eng.get_stats().retractions_total > 0
        eng.check_memory()
    for i, out in enumerate(outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        if i % 3:
            assert set(json.loads(out["text"])) == {"name", "tags"}
        else:
            assert re.fullmatch(pattern, out["text"])
