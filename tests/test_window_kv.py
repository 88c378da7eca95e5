"""Sliding-window layers keep their KV in a pool of their own, freed once a token leaves the
window (`mem/window_kv.py`): the same memory serves more long requests, greedy tokens equal
HF's, and a cached prefix resumes only where the window KV before it is still held."""

import os

import pytest
import test_model_families as families
import transformers as hf

from radixserve import Engine

WINDOW = 64
GEMMA3 = {
    "gemma3": (
        hf.Gemma3TextConfig,
        hf.Gemma3ForCausalLM,
        dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=WINDOW,
            max_position_embeddings=2048,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
    )
}
KV_BUDGET = 36 * 2**20  # holds 12,288 tokens of all six layers' KV (3,072 B a token)
PROMPT, NEW_TOKENS = 1500, 4
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
LONG_ANSWER = 48  # long enough that the first request still decodes when the last joins


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return families.build_checkpoint(tmp_path_factory.mktemp("window"), "gemma3", GEMMA3, {})


def mem_fraction_for(model, budget: int) -> float:
    """The --mem-fraction that gives the KV pools `budget` bytes on this machine (0.0015 on
    one of 24 GiB)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return budget / (total - weights)


def prompts(n: int) -> list[list[int]]:
    return [[(i * 37 + j * 11) % 509 + 3 for j in range(PROMPT)] for i in range(n)]


def run_sixteen(path, fraction: float, **options) -> tuple[list[list[int]], int, int]:
    with Engine(model=str(path), dtype="float32", mem_fraction=fraction, **options) as eng:
        params = dict(GREEDY, max_new_tokens=LONG_ANSWER)
        out = eng.generate(input_ids=prompts(16), sampling_params=params)
        eng.check_memory()
        stats = eng.get_stats()
    return [r["output_ids"] for r in out], stats.peak_running, stats.retractions_total


def test_sixteen_long_requests_run_at_once_in_the_memory_of_twelve_thousand_tokens(gemma3):
    """A Gemma-3 text checkpoint (5 of 6 layers windowed at 64) with 36 MiB of KV: keeping
    every token's KV in every layer, that is 12,288 tokens and at most 9 of 16 concurrent
    1,500-token requests; with window KV freed all 16 run at once, tokens equal to HF."""
    model, path = gemma3
    fraction = mem_fraction_for(model, KV_BUDGET)
    tokens, peak, retractions = run_sixteen(path, fraction)
    assert peak == 16 and retractions == 0
    every_layer = run_sixteen(path, fraction, disable_hybrid_swa_memory=True)
    assert every_layer[1] < 10
    want = [families.hf_greedy(model, ids, LONG_ANSWER) for ids in prompts(16)[:3]]
    assert tokens[:3] == want
    assert every_layer[0] == tokens


def test_a_prefix_resumes_where_its_window_kv_is_held(gemma3):
    """The same prompt again resumes from its end (the tree keeps the window KV of each
    prompt's end); a request leaving a cached path mid-way first resumes where the window KV
    is whole and keeps it at its branch point, so the next one branching there resumes
    there. Tokens equal HF's; nothing leaks."""
    model, path = gemma3
    base = prompts(1)[0][:400]
    branches = [base[:250] + [7, 8, 9], base[:250] + [5, 6]]
    with Engine(
        model=str(path), dtype="float32", max_total_tokens=4096, chunked_prefill_size=128
    ) as eng:
        first = eng.generate(input_ids=base, sampling_params=GREEDY)
        again = eng.generate(input_ids=base, sampling_params=GREEDY)
        got = [eng.generate(input_ids=p, sampling_params=GREEDY) for p in branches]
        eng.check_memory()
    assert again["meta_info"]["cached_tokens"] == len(base) - 1
    assert [g["meta_info"]["cached_tokens"] for g in got] == [0, 250]
    want = [families.hf_greedy(model, ids, NEW_TOKENS) for ids in [base, *branches]]
    assert [first["output_ids"], *(g["output_ids"] for g in got)] == want
    assert again["output_ids"] == first["output_ids"]


def test_a_window_pool_too_small_for_the_traffic_retracts_and_stays_exact(gemma3):
    """--swa-full-tokens-ratio 0.05 of 8,192 tokens: 409 window slots against 8 concurrent
    300-token prompts (a chunk needs a slot per token): requests wait, evict and retract (6
    retractions here), all finish with the tokens of the run that keeps every token's KV,
    nothing leaks."""
    _, path = gemma3
    batch = [ids[:300] for ids in prompts(8)]
    runs = []
    for options in ({"swa_full_tokens_ratio": 0.05}, {"disable_hybrid_swa_memory": True}):
        with Engine(model=str(path), dtype="float32", max_total_tokens=8192, **options) as eng:
            out = eng.generate(input_ids=batch, sampling_params=GREEDY)
            eng.check_memory()
            runs.append(([r["output_ids"] for r in out], eng.get_stats().retractions_total))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] > 0  # the window pool was the bottleneck
    assert runs[1][1] == 0


@pytest.mark.parametrize("family", ["llama4_text", "gemma4_text", "mimo_v2_flash"])
def test_chunk_and_window_layers_of_newer_families_free_kv_behind_them(tmp_path, family):
    """Llama 4's chunked-attention layers keep their KV apart like window layers (a chunk reads
    at most `attention_chunk_size` tokens back), and so do Gemma 4's window layers, whose
    window pool holds layers of another head dim than the full pool's and is read by the
    layers that share its KV, and MiMo-V2-Flash's, with twice the full layers' KV heads and
    sinks: prompts past the window, greedy tokens equal HF's fresh and from
    the cache (tokens more than a window behind freed from the window pool), no leak."""
    model, path = families.build_checkpoint(tmp_path, family)
    want = [families.hf_greedy(model, ids, NEW_TOKENS) for ids in families.PROMPTS]
    with Engine(
        model=str(path), dtype="float32", max_total_tokens=1024, chunked_prefill_size=32
    ) as eng:
        for _ in range(2):
            out = eng.generate(input_ids=families.PROMPTS, sampling_params=GREEDY)
            assert [r["output_ids"] for r in out] == want
        eng.check_memory()
        window = eng.get_stats().hybrid_memory
    assert window["window_kv_capacity_tokens"] > 0  # the chunked layers' own pool
