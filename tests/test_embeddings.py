"""/v1/embeddings on servers started with --is-embedding, against HF's final hidden states of
the same checkpoint in float32: last-token pooling (the default) and mean pooling (named by a
sentence-transformers `1_Pooling/config.json`), normalized, with prompts split into chunks
and, for last-token pooling, read again from the radix cache."""

import base64
import json
import struct
import subprocess
import sys

import pytest
import torch
from server_utils import start_server

CHUNK = "32"
TEXTS = [
    "Radix trees store strings by their shared prefixes, and serving engines use them to "
    "find the longest cached prompt prefix so that attention keys and values computed for "
    "one request can be reused by the next.",
    "The capital of France is",
]


def hf_embedding(hf_model, tokenizer, text: str, pooling: str) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        states = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    vector = states.mean(0) if pooling == "mean" else states[-1]
    return torch.nn.functional.normalize(vector, dim=0)


def embed(client, **body):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def last_server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("embed_last"),
        "--is-embedding",
        "--chunked-prefill-size",
        CHUNK,
        "--max-total-tokens",
        "2048",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def pooled_copy(folder, model_dir, pooling: dict):
    """The bundled model's files, with a sentence-transformers pooling config."""
    folder.mkdir()
    for item in model_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


@pytest.fixture(scope="module")
def mean_model(tmp_path_factory, model_dir):
    folder = tmp_path_factory.mktemp("mean_model") / "smollm2-mean"
    return pooled_copy(folder, model_dir, {"pooling_mode_mean_tokens": True})


def test_last_token_embeddings_equal_hf_fresh_and_cached(last_server, hf_model, tokenizer):
    with last_server.client() as client:
        for round_ in range(2):
            reply = embed(client, input=TEXTS)
            assert [d["index"] for d in reply["data"]] == [0, 1]
            for text, item in zip(TEXTS, reply["data"]):
                got = torch.tensor(item["embedding"])
                assert got.shape == (576,)
                want = hf_embedding(hf_model, tokenizer, text, "last")
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        tokens = sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
        assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        stats = client.get("/get_server_info").json()["stats"]
        assert stats["cached_tokens_total"] > 0  # the second round read the prompts' prefixes


def test_base64_and_token_id_inputs(last_server, tokenizer):
    ids = tokenizer(TEXTS[1])["input_ids"]
    with last_server.client() as client:
        floats = embed(client, input=ids)["data"][0]["embedding"]
        packed = embed(client, input=[ids], encoding_format="base64")["data"][0]["embedding"]
    raw = base64.b64decode(packed)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input[0] is empty"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate": True}, "truncate"),
    ],
)
def test_bad_embedding_requests_are_400s(last_server, body, needle):
    with last_server.client() as client:
        r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400 and needle in r.text, r.text


def test_mean_pooling_from_the_checkpoints_config_equals_hf(
    tmp_path, mean_model, hf_model, tokenizer
):
    srv = start_server(
        tmp_path,
        "--model",
        str(mean_model),
        "--is-embedding",
        "--chunked-prefill-size",
        CHUNK,
        "--max-total-tokens",
        "2048",
    )
    try:
        with srv.client() as client:
            for _ in range(2):  # the second round must not pool from a cached prefix
                reply = embed(client, input=TEXTS)
                for text, item in zip(TEXTS, reply["data"]):
                    want = hf_embedding(hf_model, tokenizer, text, "mean")
                    torch.testing.assert_close(
                        torch.tensor(item["embedding"]), want, atol=1e-4, rtol=0
                    )
    finally:
        assert srv.stop() == 0, srv.log()


def test_an_unsupported_pooling_config_is_refused_in_one_line(tmp_path, model_dir):
    folder = pooled_copy(tmp_path / "cls", model_dir, {"pooling_mode_cls_token": True})
    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(folder)]
        + ["--is-embedding"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "pooling_mode_cls_token" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
