"""N-gram speculative decoding: the drafter, exact verification, and the real model and server."""

import json

import pytest
import torch
from conftest import PROMPTS
from server_utils import start_server, wait_idle

from radixserve.messages import SamplingBatch
from radixserve.scheduler.speculative import NgramDrafter, SpecState, StepCost, budget_drafts
from radixserve.worker.sampler import verify

PASSAGES = [
    "The Apollo 11 mission launched on July 16, 1969. Neil Armstrong and Buzz Aldrin landed the "
    "lunar "
    "module Eagle on July 20, while Michael Collins stayed in orbit aboard Columbia.",
    "Photosynthesis turns light, water and carbon dioxide into glucose and oxygen. It happens in "
    "the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light.",
    "The Rhine rises in the Swiss Alps, flows through Lake Constance, forms part of the border "
    "between "
    "France and Germany, and reaches the North Sea in the Netherlands.",
    "A radix tree stores strings by their shared prefixes; each edge holds a run of symbols and a "
    "lookup walks down from the root, matching as much as it can.",
]
TEMPLATES = [
    "Repeat the following text exactly.\n\n{p}\n\nText:",
    "{p}\n\nQuote the first sentence of the text above.",
    "Context: {p}\nQuestion: What does the context say? Answer by quoting it.\nAnswer:",
    "Summarize in one line: {p}",
]


def copy_prompts() -> list[str]:
    """64 prompts: 16 that invite copying their context, and 48 others."""
    quoting = [t.format(p=p) for t in TEMPLATES for p in PASSAGES]
    others = [f"{p} (variant {i})" for i in range(10) for p in PROMPTS][:48]
    return quoting + others


def constrained_requests() -> list[dict]:
    """Requests whose sampling depends on more than the position's logits: output logprobs,
    penalties (they change with every output token) and grammars (a bitmask per position)."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    greedy = {"temperature": 0, "max_new_tokens": 30}
    return [
        dict(sampling_params=greedy, return_logprob=True, top_logprobs_num=2),
        dict(sampling_params=dict(greedy, frequency_penalty=0.5, presence_penalty=0.3)),
        dict(sampling_params=dict(greedy, repetition_penalty=1.3)),
        dict(
            sampling_params=dict(
                greedy,
                regex=r"The Apollo 11 mission launched on (July|June) [0-9]+, 1969\. [A-Za-z ,.]+",
            )
        ),
        dict(sampling_params=dict(greedy, json_schema=json.dumps(schema))),
        # the context's words follow "launched on", but this grammar wants a number there:
        # drafts copied from the context are cut where the grammar refuses them
        dict(
            sampling_params=dict(
                greedy, regex=r"The Apollo 11 mission launched on [0-9]+ [a-z ]+\."
            )
        ),
    ]


def greedy_batch(*sizes_and_temps) -> SamplingBatch:
    n = len(sizes_and_temps)
    temps = list(sizes_and_temps)
    return SamplingBatch(
        temps,
        [1.0] * n,
        [-1] * n,
        [0.0] * n,
        [None] * n,
        [0] * n,
        [0.0] * n,
        [0.0] * n,
        [1.0] * n,
        [None] * n,
        [None] * n,
        [None] * n,
    )


# ---- the drafter ----------------------------------------------------------------


def test_drafts_follow_the_latest_earlier_occurrence_of_the_last_tokens():
    drafter = NgramDrafter(max_drafts=4)
    state = SpecState()
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4]
    assert drafter.propose(state, tokens, output_len=5, limit=8) == [5, 6, 7, 9]
    assert drafter.propose(state, tokens + [5, 6, 7], output_len=8, limit=2) == [9, 2]
    assert drafter.propose(state, [10, 11, 12, 13], output_len=1, limit=8) == []


def test_outputs_of_finished_requests_draft_for_later_ones():
    drafter = NgramDrafter(max_drafts=3)
    drafter.remember([40, 41, 42, 43, 44, 45])
    assert drafter.propose(SpecState(), [7, 8, 41, 42, 43], output_len=3, limit=8) == [44, 45]


def test_acceptance_is_tracked_per_draft_and_misses_pause_speculation():
    state = SpecState()
    state.record(proposed=4, accepted=4, output_len=10)
    state.record(proposed=4, accepted=1, output_len=12)
    assert state.accept_rate == pytest.approx((0.64 + 0.8 * 4 + 1) / (1.28 + 0.8 * 4 + 2))
    state.record(proposed=2, accepted=0, output_len=13)
    state.record(proposed=1, accepted=0, output_len=14)
    assert state.paused_until > 14
    assert (
        NgramDrafter(max_drafts=4).propose(state, [1, 2, 3, 1, 2, 3], output_len=15, limit=8) == []
    )
    assert (state.verify_steps, state.accepted_total) == (4, 5)


def test_step_cost_follows_the_measured_steps_of_each_row_count():
    cost = StepCost()
    assert cost.seconds(4) == pytest.approx(0.025 + 0.0025 * 4)  # the prior, before any step
    for rows, seconds in [(1, 0.024), (8, 0.040), (8, 0.040), (12, 0.060), (264, 1.0)]:
        cost.observe(rows, seconds)
    assert cost.seconds(8) == pytest.approx(0.040)
    assert cost.seconds(10) == pytest.approx(0.050)  # between measured counts: linear
    assert cost.seconds(300) == pytest.approx(
        1.0 + 36 * (1.0 - 0.060) / 252
    )  # past the last: its slope
    cost.observe(8, 0.090)
    assert cost.seconds(8) == pytest.approx(
        0.040
    )  # one step slowed by something else does not move it
    for _ in range(3):
        cost.observe(8, 0.050)
    assert cost.seconds(8) == pytest.approx(0.050)  # a run of slower steps (drift) does


def test_draft_budget_takes_the_best_count_where_the_curve_dips():
    """One request on a 2-core Zen 1: 6 rows fill one GEMM tile and cost less than 4 or 5."""
    cost = StepCost()
    for rows, seconds in [
        (1, 0.022),
        (2, 0.025),
        (3, 0.027),
        (4, 0.032),
        (5, 0.036),
        (6, 0.031),
        (9, 0.047),
    ]:
        cost.observe(rows, seconds)
    state = SpecState(accepted_ema=0.9, tried_ema=1.0)
    budget_drafts([(state, list(range(5)))], 1, cost)
    assert len(state.drafts) == 5


def test_draft_budget_keeps_what_pays_for_its_rows():
    cost = StepCost()
    for rows in [1, 8, 3, 40, 12, 1, 25, 7, 16, 2]:
        cost.observe(rows, 0.024 + 0.0025 * rows)

    def kept(rate: float, batch: int, proposed: int = 8) -> list[int]:
        states = [SpecState(accepted_ema=rate, tried_ema=1.0) for _ in range(batch)]
        budget_drafts([(s, list(range(proposed))) for s in states], batch, cost)
        return [len(s.drafts) for s in states]

    assert kept(0.9, 1) == [8]  # one request copying well: every draft is worth a row
    assert kept(0.3, 1) == [1]  # 0.3 of a token is worth 2.5 ms at ~27 ms a token; 0.09 is not
    assert sum(kept(0.9, 8)) < 8 * 8  # at batch 8 a row costs more than the later drafts bring
    assert kept(0.05, 8) == [0] * 8
    free = StepCost()
    for rows in [1, 8, 3, 40, 12, 1, 25, 7, 16, 2]:
        free.observe(rows, 0.01)  # a GPU: rows cost nothing
    states = [SpecState(accepted_ema=0.3, tried_ema=1.0) for _ in range(8)]
    budget_drafts([(s, list(range(5))) for s in states], 8, free)
    assert all(len(s.drafts) == 5 for s in states)


def test_no_draft_pays_where_a_row_costs_a_decode_rows_share():
    """Measured on a 2-core Zen 1 (float32): 24 ms a step at 1 row, 40 ms at 8, then 5 ms for
    each row more. A line through all steps puts the 9th row at ~3 ms and keeps good drafts; the
    curve says a verify row costs as much as a token of the plain step, so even drafts accepted
    95% of the time lose at batch 8, and at batch 1 they still pay."""
    cost = StepCost()
    for rows, seconds in [
        (1, 0.024),
        (2, 0.027),
        (4, 0.031),
        (8, 0.040),
        (9, 0.045),
        (12, 0.060),
        (16, 0.080),
    ]:
        cost.observe(rows, seconds)
    at_eight = [SpecState(accepted_ema=0.95, tried_ema=1.0) for _ in range(8)]
    budget_drafts([(s, list(range(4))) for s in at_eight], 8, cost)
    assert [len(s.drafts) for s in at_eight] == [0] * 8
    alone = SpecState(accepted_ema=0.95, tried_ema=1.0)
    budget_drafts([(alone, list(range(4)))], 1, cost)
    assert len(alone.drafts) == 4


def test_draft_budget_counts_a_draft_models_steps():
    """A draft model's step is paid once per draft depth for the whole batch: a draft as costly
    as the model is never worth it; a cheap one is, for requests it drafts well for."""
    cost = StepCost()
    for rows in [1, 8, 3, 40, 12, 1, 25, 7, 16, 2]:
        cost.observe(rows, 0.024 + 0.0025 * rows)

    def kept(rate: float, batch: int, depth_seconds: float) -> list[int]:
        states = [SpecState(accepted_ema=rate, tried_ema=1.0) for _ in range(batch)]
        budget_drafts([(s, [0] * 6) for s in states], batch, cost, depth_seconds)
        return [len(s.drafts) for s in states]

    assert kept(0.9, 1, 0.0) == [6]
    assert kept(0.9, 1, 0.026) == [0]  # each draft costs a whole step of the model
    assert (
        1 <= kept(0.9, 1, 0.01)[0] < 6
    )  # cheaper: the first drafts pay, the unlikely last ones not
    deep = kept(0.9, 8, 0.004)  # one draft step serves the whole batch: all draft to one depth
    assert len(set(deep)) == 1 and deep[0] >= 1, deep


# ---- verification ---------------------------------------------------------------


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement():
    vocab = 10
    argmaxes = [3, 5, 7, 1, 2, 4]  # rows: request 0 (3 drafts), request 1 (1 draft)
    logits = torch.full((len(argmaxes), vocab), -5.0)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    next_ids, accepted, rows = verify(logits, greedy_batch(0.0, 0.0), [[3, 5, 9], [2]])
    assert accepted == [[3, 5], [2]] and next_ids == [7, 4] and rows == [2, 5]
    next_ids, accepted, rows = verify(logits[:4], greedy_batch(0.0), [[3, 5, 7]])
    assert accepted == [[3, 5, 7]] and next_ids == [1] and rows == [3]


def test_rejection_sampling_keeps_the_output_distribution():
    """The first token a verify step emits must follow the model's distribution whatever the
    draft: chi-square over 40k draws, for a likely and an unlikely draft."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 40_000
    logits = probs.log().repeat(
        2 * n, 1
    )  # each request: a row for the draft, one for the bonus token
    for draft in (0, 3):
        torch.manual_seed(draft)
        next_ids, accepted, _ = verify(logits, greedy_batch(*[1.0] * n), [[draft]] * n)
        first = torch.tensor([a[0] if a else t for a, t in zip(accepted, next_ids)])
        observed = torch.bincount(first, minlength=5).double()
        expected = probs.double() * n
        chi2 = (((observed - expected) ** 2) / expected).sum().item()
        assert chi2 < 18.5, (draft, observed.tolist())  # p = 0.001 at 4 degrees of freedom
        assert abs(sum(bool(a) for a in accepted) / n - probs[draft].item()) < 0.01


# ---- the real model -------------------------------------------------------------


class FlatStepCost(StepCost):
    """A step costs the same at any row count, as when memory-bound: drafts are then always worth
    verifying, whatever this machine's load makes the measured step times, so which requests
    speculate does not change from run to run."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def seconds(self, rows: int) -> float:
        return 0.03


@pytest.fixture(scope="module")
def outputs_both_ways(draft_model_dir):
    from radixserve import Engine

    prompts = copy_prompts()
    greedy = {"temperature": 0, "max_new_tokens": 24}
    seeded = [
        {"temperature": 0.8, "top_p": 0.95, "seed": 7 + i, "max_new_tokens": 24} for i in range(8)
    ]
    results = {}
    settings = {
        None: {},
        "ngram": {"speculative_algorithm": "ngram"},
        "draft": {
            "speculative_algorithm": "draft",
            "speculative_draft_model": str(draft_model_dir),
            "speculative_num_draft_tokens": 4,
        },
    }
    for algorithm, kw in settings.items():
        with Engine(max_total_tokens=16384, max_running_requests=16, dtype="float32", **kw) as eng:
            eng.scheduler.decode.step_cost = FlatStepCost()
            if algorithm == "draft":
                # this draft costs nearly what the model does, so the draft budget would stop
                # drafting: count it free
                eng.scheduler.decode.draft_step_seconds = lambda: 0.0
            out = eng.generate(prompts, greedy)
            sampled = [eng.generate(prompts[i], seeded[i]) for i in range(8)]
            constrained = [
                eng.generate(prompts[0], **request) for request in constrained_requests()
            ]
            eng.check_memory()
            results[algorithm] = (out, sampled, eng.get_stats(), constrained)
    return results


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_greedy_output_is_unchanged_by_speculation_on_64_prompts(outputs_both_ways, algorithm):
    plain, spec = outputs_both_ways[None][0], outputs_both_ways[algorithm][0]
    assert len(plain) == 64
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    stats = outputs_both_ways[algorithm][2]
    assert stats.spec_accepted_tokens_total > 40, stats  # speculated on, and drafts were kept
    assert stats.spec_draft_tokens_total > stats.spec_accepted_tokens_total, (
        stats
    )  # and some rejected
    if algorithm == "ngram":
        quoted = [o["meta_info"] for o in spec[:4]]
        assert all(m["spec_verify_ct"] >= 1 and m["spec_accept_length"] > 1.5 for m in quoted), (
            quoted
        )


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_seeded_sampling_gives_the_same_tokens_with_speculation(outputs_both_ways, algorithm):
    """Each position is drawn with the seed and step it has without speculation, so a seeded
    request's tokens are the same (the exactness of the distribution, on the real model)."""
    plain, spec = outputs_both_ways[None][1], outputs_both_ways[algorithm][1]
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert any(o["meta_info"].get("spec_verify_ct") for o in spec)


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_speculation_survives_retraction_chunked_prefill_and_pages(
    algorithm, draft_model_dir, tokenizer, hf_greedy
):
    """A pool too small for the batch: requests are retracted mid-output and re-prefilled in
    16-token chunks over 4-token pages, while drafts are proposed and verified; the output
    still equals HF's, and no slot leaks."""
    from radixserve import Engine

    kw = (
        {"speculative_algorithm": "ngram"}
        if algorithm == "ngram"
        else {
            "speculative_algorithm": "draft",
            "speculative_draft_model": str(draft_model_dir),
            "speculative_num_draft_tokens": 3,
        }
    )
    prompts = [p for p in PROMPTS if len(tokenizer.encode(p)) < 40] * 2
    with Engine(
        max_total_tokens=192,
        max_running_requests=8,
        chunked_prefill_size=16,
        page_size=4,
        dtype="float32",
        **kw,
    ) as eng:
        eng.scheduler.decode.step_cost = FlatStepCost()
        if algorithm == "draft":
            eng.scheduler.decode.draft_step_seconds = lambda: 0.0  # see outputs_both_ways
        results = eng.generate(
            prompts, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        )
        for prompt, result in zip(prompts, results):
            assert result["output_ids"] == hf_greedy(tokenizer.encode(prompt), 40), prompt
        stats = eng.get_stats()
        assert stats.retractions_total > 0 and stats.spec_verify_steps_total > 0, stats
        eng.check_memory()


def test_logprob_penalty_and_grammar_requests_speculate_exactly(outputs_both_ways):
    """Each draft row is sampled with the penalties and grammar state it has after the drafts
    before it, and its logprob comes from its own row: the same tokens and logprobs as without."""
    plain = outputs_both_ways[None][3]
    for algorithm in ("ngram", "draft"):
        spec = outputs_both_ways[algorithm][3]
        assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain], algorithm
        assert all(o["meta_info"]["spec_verify_ct"] >= 1 for o in spec), [
            o["meta_info"] for o in spec
        ]
        want, got = plain[0]["meta_info"], spec[0]["meta_info"]
        assert [t for _, t, _ in got["output_token_logprobs"]] == spec[0]["output_ids"]
        for a, b in zip(want["output_token_logprobs"], got["output_token_logprobs"]):
            assert b[0] == pytest.approx(a[0], abs=1e-4)
        assert [[t for _, t, _ in top] for top in got["output_top_logprobs"]] == [
            [t for _, t, _ in top] for top in want["output_top_logprobs"]
        ]
    ngram = outputs_both_ways["ngram"][3]
    assert all(o["meta_info"]["spec_accept_length"] > 2 for o in ngram[:2] + ngram[3:]), [
        o["meta_info"] for o in ngram
    ]
    assert ngram[4]["text"].startswith('{"text": "')  # 30 tokens cut the JSON short


# ---- the server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("spec"),
        "--max-total-tokens",
        "2048",
        "--speculative-algorithm",
        "ngram",
        "--speculative-num-draft-tokens",
        "6",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def test_server_speculates_with_stops_streams_logprobs_and_n(server, tokenizer, hf_greedy):
    prompt = TEMPLATES[0].format(p=PASSAGES[0])
    with server.client() as c:
        full = c.post(
            "/generate",
            json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40}},
        ).json()
        assert full["output_ids"] == hf_greedy(tokenizer.encode(prompt), 40)
        assert full["meta_info"]["spec_accept_length"] > 2, full["meta_info"]
        stop = full["text"].split()[5]
        stopped = c.post(
            "/generate",
            json={
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 40, "stop": [stop]},
            },
        ).json()
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert full["text"].startswith(stopped["text"]) and stop not in stopped["text"]
        short = c.post(
            "/generate",
            json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 7}},
        ).json()
        assert short["output_ids"] == full["output_ids"][:7]
        chunks = []
        with c.stream(
            "POST",
            "/generate",
            json={
                "text": prompt,
                "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 40},
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks.append(json.loads(line[5:]))
        assert chunks[-1]["text"] == full["text"]
        with_lp = c.post(
            "/generate",
            json={
                "text": prompt,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12},
            },
        ).json()
        assert with_lp["output_ids"] == full["output_ids"][:12]
        assert len(with_lp["meta_info"]["output_token_logprobs"]) == 12
        several = c.post(
            "/generate",
            json={
                "text": prompt,
                "sampling_params": {"temperature": 0.7, "n": 3, "max_new_tokens": 16},
            },
        ).json()
        assert len(several) == 3 and all(len(s["output_ids"]) <= 16 for s in several)
        wait_idle(c)
        metrics = c.get("/metrics").text
        accepted = [
            line
            for line in metrics.splitlines()
            if line.startswith("radixserve:spec_accepted_tokens_total")
        ]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted


def test_server_speculates_with_a_draft_model(draft_model_dir, tmp_path, tokenizer, hf_greedy):
    srv = start_server(
        tmp_path,
        "--max-total-tokens",
        "2048",
        "--speculative-algorithm",
        "draft",
        "--speculative-draft-model",
        str(draft_model_dir),
    )
    try:
        prompt = TEMPLATES[2].format(p=PASSAGES[1])
        with srv.client() as c:
            out = c.post(
                "/generate",
                json={
                    "text": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                },
            ).json()
            assert out["output_ids"] == hf_greedy(tokenizer.encode(prompt), 24)
            assert out["meta_info"]["spec_verify_ct"] >= 1, out[
                "meta_info"
            ]  # the first round drafts
            wait_idle(c)  # checks that no slot leaked
    finally:
        assert srv.stop() == 0, srv.log()


def test_unknown_speculative_algorithm_or_a_missing_draft_model_is_refused():
    from radixserve.config import EngineArgs

    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineArgs(speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="speculative_draft_model go together"):
        EngineArgs(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="speculative_draft_model go together"):
        EngineArgs(speculative_draft_model="dummy:tiny")


def test_a_draft_model_with_another_vocabulary_is_refused():
    from radixserve import Engine

    with pytest.raises(
        ValueError, match="--speculative-draft-model dummy:qwen2-0.5b: its vocabulary has 151936"
    ):
        Engine(speculative_algorithm="draft", speculative_draft_model="dummy:qwen2-0.5b")
