"""Tensor parallelism: three ranks (gloo) serve the bundled model (9 query / 3 KV heads): rank 0 in
the scheduler process, ranks 1 and 2 in worker processes that receive each step by broadcast."""
import pytest

from conftest import PROMPTS
from radixserve.config import ModelConfig
from radixserve.distributed import TPGroup
from server_utils import start_server


def test_shard_config_splits_heads_and_refuses_uneven_splits():
    cfg = ModelConfig(vocab_size=100, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64)
    local = TPGroup(1, 3).shard_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    with pytest.raises(ValueError, match="does not divide the model's num_heads"):
        TPGroup(0, 2).shard_config(cfg)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tp"), "--tp-size", "3", "--max-total-tokens", "2048")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_three_ranks_match_hf(server, tokenizer, hf_greedy):
    prompts = PROMPTS[:3]
    with server.client() as client:
        out = client.post("/generate", json={"text": prompts, "sampling_params": {
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}).json()
        for prompt, result in zip(prompts, out):
            assert result["output_ids"] == hf_greedy(tokenizer.encode(prompt), 12)
        again = client.post("/generate", json={"text": prompts[0] + " and", "sampling_params": {
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == hf_greedy(tokenizer.encode(prompts[0] + " and"), 8)
        info = client.get("/get_server_info").json()
    assert sorted(name for name in info["processes"] if name.startswith("worker")) == [
        "worker (tp rank 1)", "worker (tp rank 2)"]
    assert info["tp_size"] == 3


def test_offline_engine_points_to_the_server_for_tp():
    from radixserve import Engine

    with pytest.raises(ValueError, match="--tp-size"):
        Engine(tp_size=3)
