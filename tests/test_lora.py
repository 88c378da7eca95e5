"""Multi-LoRA serving: a tiny random base and two random peft adapters (nonzero B), checked
against HF + peft with each adapter merged; one batch mixes the base and both adapters, and
the radix cache never hands one adapter's KV to another."""

import copy

import peft
import pytest
import torch
from quant_checkpoints import random_llama
from server_utils import start_server
from test_model_families import hf_greedy

from radixserve import Engine

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 180)), [7, 7, 7] + list(range(200, 260))]
NEW_TOKENS = 10
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
ADAPTERS = {  # name -> (rank, alpha, targets)
    "a1": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "a2": (4, 4, ["q_proj", "v_proj", "down_proj"]),
}


def write_adapter(base, path, rank, alpha, targets, seed):
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "lora_" in name:
                tensor.normal_(0, 0.15)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = random_llama()
    base.save_pretrained(root / "base")
    merged = {None: base}
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items(), start=1):
        merged[name] = write_adapter(base, root / name, rank, alpha, targets, seed)
    paths = tuple(f"{name}={root / name}" for name in ADAPTERS)
    with Engine(
        model=str(root / "base"),
        lora_paths=paths,
        max_total_tokens=2048,
        chunked_prefill_size=32,
        dtype="float32",
    ) as eng:
        yield eng, merged, root


def test_one_batch_mixing_base_and_adapters_matches_hf_with_each_merged(served):
    eng, merged, _ = served
    names = [None, *ADAPTERS]
    batch = [(ids, name) for ids in PROMPTS for name in names]
    results = eng.generate(
        input_ids=[ids for ids, _ in batch],
        sampling_params=GREEDY,
        lora_path=[name for _, name in batch],
    )
    want = [hf_greedy(merged[name], ids, NEW_TOKENS) for ids, name in batch]
    assert [r["output_ids"] for r in results] == want
    outputs = {name: [] for name in names}
    for (_, name), r in zip(batch, results):
        outputs[name].append(r["output_ids"])
    assert outputs["a1"] != outputs[None] and outputs["a2"] != outputs[None]
    eng.check_memory()


def test_the_prefix_cache_never_mixes_adapters(served):
    eng, _, _ = served
    prompt = list(range(300, 364))

    def cached(name):
        result = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
        return result["meta_info"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a2") == 0
    assert cached(None) == 0
    assert cached("a1") == len(prompt) - 1
    assert cached("a2") == len(prompt) - 1


def test_an_unknown_adapter_is_named(served):
    eng, _, _ = served
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="nope")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"max_lora_rank": 4}, "rank 8 is over --max-lora-rank 4"),
        ({"other_base": True}, "this base needs A"),
    ],
)
def test_a_bad_adapter_is_refused_at_load(served, tmp_path, change, message):
    _, merged, root = served
    path = root / "a1"
    if change.pop("other_base", False):
        other = random_llama()
        other.config.intermediate_size = 192
        wide = type(other)(other.config)
        write_adapter(wide, tmp_path / "wide", 8, 16, ["gate_proj"], 3)
        path = tmp_path / "wide"
    with pytest.raises(ValueError, match=message):
        Engine(
            model=str(root / "base"), lora_paths=(f"a1={path}",), dtype="float32", **change
        ).shutdown()


def test_the_server_serves_adapters_by_lora_path_and_by_model_name(served):
    eng, merged, root = served
    paths = [f"{name}={root / name}" for name in ADAPTERS]
    server = start_server(
        root, "--model", str(root / "base"), "--lora-paths", *paths, "--chunked-prefill-size", "32"
    )
    try:
        with server.client(timeout=120) as client:
            ids = PROMPTS[1]
            r = client.post(
                "/generate",
                json={
                    "input_ids": [ids, ids, ids],
                    "sampling_params": GREEDY,
                    "lora_path": [None, "a1", "a2"],
                },
            )
            assert r.status_code == 200, r.text
            got = [item["output_ids"] for item in r.json()]
            assert got == [hf_greedy(merged[n], ids, NEW_TOKENS) for n in (None, "a1", "a2")]
            completion = client.post(
                "/v1/completions",
                json={"model": "a2", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0},
            )
            assert completion.status_code == 200, completion.text
            bad = client.post("/generate", json={"input_ids": ids, "lora_path": "a3"})
            assert bad.status_code == 400 and "'a3'" in bad.text
            models = client.get("/v1/models").json()["data"]
            assert [(m["id"], m["parent"]) for m in models[1:]] == [
                ("a1", models[0]["id"]),
                ("a2", models[0]["id"]),
            ]
            again = client.post(
                "/generate",
                json={"input_ids": ids, "sampling_params": GREEDY, "lora_path": "a2"},
            ).json()
            assert again["output_ids"] == got[2]
            assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
    finally:
        assert server.stop() == 0, server.log()
