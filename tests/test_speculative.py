"""N-gram speculative decoding: the drafter, exact verification, and the real model and server."""
import json

import pytest
import torch

from conftest import PROMPTS
from server_utils import start_server, wait_idle
from radixserve.messages import SamplingBatch
from radixserve.scheduler.speculative import NgramDrafter, SpecState
from radixserve.worker.sampler import verify

PASSAGES = [
    "The Apollo 11 mission launched on July 16, 1969. Neil Armstrong and Buzz Aldrin landed the lunar "
    "module Eagle on July 20, while Michael Collins stayed in orbit aboard Columbia.",
    "Photosynthesis turns light, water and carbon dioxide into glucose and oxygen. It happens in the "
    "chloroplasts of plant cells, where chlorophyll absorbs mostly red and blue light.",
    "The Rhine rises in the Swiss Alps, flows through Lake Constance, forms part of the border between "
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


def greedy_batch(*sizes_and_temps) -> SamplingBatch:
    n = len(sizes_and_temps)
    temps = list(sizes_and_temps)
    return SamplingBatch(temps, [1.0] * n, [-1] * n, [0.0] * n, [None] * n, [0] * n, [0.0] * n, [0.0] * n,
                         [1.0] * n, [None] * n, [None] * n, [None] * n)


# ---- the drafter ----------------------------------------------------------------

def test_drafts_follow_the_latest_earlier_occurrence_of_the_last_tokens():
    drafter = NgramDrafter(max_drafts=4)
    state = drafter.new_state()
    tokens = [1, 2, 3, 4, 5, 6, 7, 9, 2, 3, 4]
    assert drafter.propose(state, tokens, output_len=5, batch_size=1) == [5, 6, 7, 9]
    state.k = 2
    assert drafter.propose(state, tokens + [5, 6, 7], output_len=8, batch_size=1) == [9, 2]
    assert drafter.propose(state, [10, 11, 12, 13], output_len=1, batch_size=1) == []


def test_outputs_of_finished_requests_draft_for_later_ones():
    drafter = NgramDrafter(max_drafts=3)
    drafter.remember([40, 41, 42, 43, 44, 45])
    assert drafter.propose(drafter.new_state(), [7, 8, 41, 42, 43], output_len=3, batch_size=1) == [44, 45]


def test_draft_length_adapts_and_misses_pause_speculation():
    state = SpecState(max_drafts=4)
    state.k = 2
    state.record(proposed=2, accepted=2, output_len=10)
    assert state.k == 3
    state.record(proposed=3, accepted=1, output_len=12)
    assert state.k == 2
    state.record(proposed=2, accepted=0, output_len=13)
    state.record(proposed=1, accepted=0, output_len=14)
    assert state.paused_until > 14 and state.k == 1
    drafter = NgramDrafter(max_drafts=4)
    assert drafter.propose(state, [1, 2, 3, 1, 2, 3], output_len=15, batch_size=1) == []
    assert state.accept_length == pytest.approx(1 + 3 / 4)


def test_a_large_batch_needs_a_higher_acceptance_to_speculate():
    drafter = NgramDrafter(max_drafts=4)
    state = drafter.new_state()
    state.accept_rate = 0.2
    tokens = [1, 2, 3, 4, 1, 2, 3]
    assert drafter.propose(state, tokens, output_len=4, batch_size=2) == [4, 1, 2, 3]  # 0.2 >= 2 x 0.05
    state.paused_until = 0
    assert drafter.propose(state, tokens, output_len=4, batch_size=8) == []  # 0.2 < 8 x 0.05


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
    logits = probs.log().repeat(2 * n, 1)  # each request: a row for the draft, one for the bonus token
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

@pytest.fixture(scope="module")
def outputs_both_ways():
    from radixserve import Engine

    prompts = copy_prompts()
    greedy = {"temperature": 0, "max_new_tokens": 24}
    seeded = [{"temperature": 0.8, "top_p": 0.95, "seed": 7 + i, "max_new_tokens": 24} for i in range(8)]
    results = {}
    for algorithm in (None, "ngram"):
        kw = {"speculative_algorithm": algorithm} if algorithm else {}
        with Engine(max_total_tokens=16384, max_running_requests=16, dtype="float32", **kw) as eng:
            out = eng.generate(prompts, greedy)
            sampled = [eng.generate(prompts[i], seeded[i]) for i in range(8)]
            eng.check_memory()
            results[algorithm] = (out, sampled, eng.get_stats())
    return results


def test_greedy_output_is_unchanged_by_speculation_on_64_prompts(outputs_both_ways):
    plain, spec = outputs_both_ways[None][0], outputs_both_ways["ngram"][0]
    assert len(plain) == 64
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    stats = outputs_both_ways["ngram"][2]
    assert stats.spec_accepted_tokens_total > 40, stats  # the quoting prompts were speculated on
    quoted = [o["meta_info"] for o in spec[:4]]
    assert all(m["spec_verify_ct"] >= 1 and m["spec_accept_length"] > 1.5 for m in quoted), quoted


def test_seeded_sampling_gives_the_same_tokens_with_speculation(outputs_both_ways):
    """Each position is drawn with the seed and step it has without speculation, so a seeded
    request's tokens are the same (the exactness of the distribution, on the real model)."""
    plain, spec = outputs_both_ways[None][1], outputs_both_ways["ngram"][1]
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert any(o["meta_info"].get("spec_verify_ct") for o in spec)


# ---- the server -----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("spec"), "--max-total-tokens", "2048",
                       "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_server_speculates_with_stops_streams_logprobs_and_n(server, tokenizer, hf_greedy):
    prompt = TEMPLATES[0].format(p=PASSAGES[0])
    with server.client() as c:
        full = c.post("/generate", json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40}}).json()
        assert full["output_ids"] == hf_greedy(tokenizer.encode(prompt), 40)
        assert full["meta_info"]["spec_accept_length"] > 2, full["meta_info"]
        stop = full["text"].split()[5]
        stopped = c.post("/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": 40, "stop": [stop]}}).json()
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert full["text"].startswith(stopped["text"]) and stop not in stopped["text"]
        short = c.post("/generate", json={"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 7}}).json()
        assert short["output_ids"] == full["output_ids"][:7]
        chunks = []
        with c.stream("POST", "/generate", json={"text": prompt, "stream": True,
                                                 "sampling_params": {"temperature": 0, "max_new_tokens": 40}}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks.append(json.loads(line[5:]))
        assert chunks[-1]["text"] == full["text"]
        with_lp = c.post("/generate", json={"text": prompt, "return_logprob": True,
                                            "sampling_params": {"temperature": 0, "max_new_tokens": 12}}).json()
        assert with_lp["output_ids"] == full["output_ids"][:12]
        assert len(with_lp["meta_info"]["output_token_logprobs"]) == 12
        several = c.post("/generate", json={"text": prompt, "sampling_params": {
            "temperature": 0.7, "n": 3, "max_new_tokens": 16}}).json()
        assert len(several) == 3 and all(len(s["output_ids"]) <= 16 for s in several)
        wait_idle(c)
        metrics = c.get("/metrics").text
        accepted = [line for line in metrics.splitlines() if line.startswith("radixserve:spec_accepted_tokens_total")]
        assert accepted and float(accepted[0].split()[-1]) > 0, accepted


def test_unknown_speculative_algorithm_is_refused():
    from radixserve.config import EngineArgs

    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineArgs(speculative_algorithm="draft")
