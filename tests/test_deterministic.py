"""`--enable-deterministic-inference`: one prompt's greedy tokens and logprobs are the same bit
for bit alone, again from the radix cache, after a restart from the disk tier, inside a batch
of 8 prompts of mixed lengths and with another chunked-prefill size; in float32 and bf16.

The model's MLP is wide enough (down projection over 1536 inputs) that torch's bf16 GEMM gives
a row other bits when it shares the call with 100 rows or more, and the prompt is long enough
that its chunks and its cached tail reach the attention kernels' other paths."""

import random

import pytest
import torch
import transformers as hf

from radixserve import Engine

RNG = random.Random(7)
PROMPT = [RNG.randrange(5, 500) for _ in range(330)]
OTHERS = [[RNG.randrange(5, 500) for _ in range(n)] for n in (17, 250, 90, 5, 400, 130, 61)]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deterministic") / "model"
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = hf.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(0, 0.1 if "norm" in name else 0.2)
    model.save_pretrained(path)
    return str(path)


def answer(result: dict) -> tuple[list[int], list[float]]:
    logprobs = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
    return result["output_ids"], logprobs


def run(engine: Engine, prompts: list[list[int]]) -> tuple[dict, tuple]:
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return results[0], answer(results[0])


def assert_one_answer(common: dict, disk) -> None:
    """The prompt's answer alone, again from the radix cache, after a restart from the disk
    tier (in folder `disk`), inside a batch of 8 and in chunks of 48: the same bit for bit."""
    tiers = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(disk),
        hicache_write_policy="write_through",
    )
    seen = {}
    with Engine(chunked_prefill_size=64, **common, **tiers) as engine:
        _, seen["alone"] = run(engine, [PROMPT])
        meta, seen["radix cache"] = run(engine, [PROMPT])
        assert meta["meta_info"]["cached_tokens"] >= len(PROMPT) - 64
        engine.scheduler.kv.hicache.storage.flush()
    with Engine(chunked_prefill_size=64, **common, **tiers) as engine:
        meta, seen["disk tier"] = run(engine, [PROMPT])
        assert meta["meta_info"]["cached_tokens"] >= len(PROMPT) - 64
    with Engine(chunked_prefill_size=64, **common) as engine:
        _, seen["batch of 8"] = run(engine, [PROMPT, *OTHERS])
    with Engine(chunked_prefill_size=48, **common) as engine:
        _, seen["chunks of 48"] = run(engine, [PROMPT])
    differing = [name for name, got in seen.items() if got != seen["alone"]]
    assert not differing, {name: seen[name] for name in ["alone", *differing]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_batch_and_chunking_never_change_an_answer(model_dir, tmp_path, dtype):
    common = dict(model=model_dir, dtype=dtype, max_total_tokens=4096)
    assert_one_answer({**common, "enable_deterministic_inference": True}, tmp_path / "disk")


def test_options_it_cannot_keep_deterministic_are_refused(model_dir):
    with pytest.raises(ValueError, match="enable_torch_compile with enable_deterministic"):
        Engine(model=model_dir, enable_deterministic_inference=True, enable_torch_compile=True)


@pytest.mark.parametrize(
    "family, dtype",
    [("qwen3_5_text", "float32"), ("qwen3_5_text", "bfloat16"), ("nemotron_h", "float32")],
)
def test_a_hybrids_answer_never_changes_with_cache_batch_or_chunking(tmp_path, family, dtype):
    """A hybrid's recurrent layers (Gated DeltaNet and short convolutions; Mamba2) run a token
    at a time: resumed from a snapshot (in device memory or on disk), inside a batch of 8 or in
    other chunks, its answer is the same bit for bit (its states float32, its model float32 or
    bf16)."""
    import test_model_families as families
    from test_hybrid_models import COMMON, FAMILIES

    config_cls, model_cls, extra = FAMILIES[family]
    table = {family: (config_cls, model_cls, {**extra, "head_dim": 32})}  # the kernels' least
    _, path = families.build_checkpoint(tmp_path, family, table, COMMON)
    common = dict(model=str(path), dtype=dtype, max_total_tokens=4096, mamba_track_interval=24)
    assert_one_answer({**common, "enable_deterministic_inference": True}, tmp_path / "disk")
