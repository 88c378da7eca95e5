"""Tensor parallelism: three ranks (gloo) serve the bundled model (9 query / 3 KV heads): rank 0 in
the scheduler process, ranks 1 and 2 in worker processes that receive each step by broadcast.
The ranks span two "nodes" (two launcher processes on this machine meeting at
--dist-init-addr): node 0 serves HTTP and hosts ranks 0 and 1, node 1 hosts rank 2."""

import subprocess
import sys

import pytest
from conftest import PROMPTS
from server_utils import free_port, start_server

from radixserve.distributed import TPGroup
from radixserve.model_config import ModelConfig


def test_shard_config_splits_heads_and_refuses_uneven_splits():
    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    local = TPGroup(1, 3).shard_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    with pytest.raises(ValueError, match="does not divide the model's num_heads"):
        TPGroup(0, 2).shard_config(cfg)


@pytest.fixture(scope="module")
def server(tmp_path_factory, draft_model_dir):
    """Three ranks over two nodes; node 0 also drafts with a draft model (rank 0 only): its
    steps must leave the followers' request tables complete."""
    tmp = tmp_path_factory.mktemp("tp")
    nodes = ["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1_log = tmp / "node1.log"
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--dtype",
            "float32",
            *nodes,
            "--node-rank",
            "1",
            "--max-total-tokens",
            "2048",
        ],
        stdout=open(node1_log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        srv = start_server(
            tmp,
            *nodes,
            "--node-rank",
            "0",
            "--max-total-tokens",
            "2048",
            "--speculative-algorithm",
            "draft",
            "--speculative-draft-model",
            str(draft_model_dir),
        )
        yield srv
        assert srv.stop() == 0, srv.log()
        assert node1.wait(timeout=60) is not None  # its rank lost node 0 and the node stopped
    finally:
        if node1.poll() is None:
            node1.kill()
        print(node1_log.read_text())


def test_three_ranks_match_hf(server, tokenizer, hf_greedy):
    prompts = PROMPTS[:3]
    with server.client() as client:
        out = client.post(
            "/generate",
            json={
                "text": prompts,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            },
        ).json()
        for prompt, result in zip(prompts, out):
            assert result["output_ids"] == hf_greedy(tokenizer.encode(prompt), 12)
        again = client.post(
            "/generate",
            json={
                "text": prompts[0] + " and",
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            },
        ).json()
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == hf_greedy(tokenizer.encode(prompts[0] + " and"), 8)
        # the same prompt again: its last prompt token's KV duplicates a cached one and is swapped
        # for it, so the step after must send that table entry to every rank (drafts in between)
        repeat = client.post(
            "/generate",
            json={
                "text": prompts[1],
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            },
        ).json()
        assert repeat["output_ids"] == out[1]["output_ids"]
        assert sum(r["meta_info"].get("spec_verify_ct") or 0 for r in out + [again, repeat]) > 0
        info = client.get("/get_server_info").json()
    assert sorted(name for name in info["processes"] if name.startswith("worker")) == [
        "worker (tp rank 1)"
    ]
    assert info["tp_size"] == 3 and info["nnodes"] == 2


def test_ranks_are_spread_over_the_nodes():
    from radixserve.config import EngineArgs

    def spread(tp: int, n: int) -> list[list[int]]:
        return [
            EngineArgs(tp_size=tp, nnodes=n, node_rank=k, dist_init_addr="h:1").local_tp_ranks()
            for k in range(n)
        ]

    assert spread(3, 2) == [[0, 1], [2]]
    assert spread(4, 2) == [[0, 1], [2, 3]]
    assert spread(3, 3) == [[0], [1], [2]]
    for bad in [
        dict(tp_size=2, nnodes=3, dist_init_addr="h:1"),
        dict(tp_size=2, nnodes=2),
        dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"),
        dict(dist_init_addr="no-port"),
    ]:
        with pytest.raises(ValueError):
            EngineArgs(**bad)


def test_offline_engine_points_to_the_server_for_tp():
    from radixserve import Engine

    with pytest.raises(ValueError, match="--tp-size"):
        Engine(tp_size=3)
