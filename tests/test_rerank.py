"""/v1/rerank and /v1/score on a sequence-classification checkpoint (a tiny random HF
cross-encoder with SmolLM2's tokenizer), against HF's own scores in float32: each
(query, document) pair tokenized as HF pairs them, scored by the `score` head on its last
token, through a sigmoid."""

import shutil
import subprocess
import sys

import pytest
import torch
import transformers as hf
from server_utils import start_server

QUERY = "Which planet is the largest?"
DOCUMENTS = [
    "Jupiter is the largest planet of the solar system, a gas giant of hydrogen and helium.",
    "Paris is the capital of France.",
    "Saturn has rings made of ice and rock, and it is the second largest planet.",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_cross_encoder(path, model_dir, num_labels: int = 1):
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=2,
    )
    model = hf.LlamaForSequenceClassification(config)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.normal_(0, 0.1 if "norm" in name else 1.0 if name == "score.weight" else 0.2)
    model.eval().save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, path / name)
    return model


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("rerank") / "cross-encoder"
    return path, build_cross_encoder(path, model_dir)


@pytest.fixture(scope="module")
def server(cross_encoder):
    path, _ = cross_encoder
    srv = start_server(
        path.parent,
        "--model",
        str(path),
        "--is-embedding",
        "--chunked-prefill-size",
        "16",
        "--max-total-tokens",
        "2048",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


def hf_scores(model, tokenizer, query, documents) -> list[float]:
    out = []
    for document in documents:
        ids = tokenizer(query, document)["input_ids"]
        with torch.no_grad():
            logit = model(torch.tensor([ids])).logits[0, 0]
        out.append(torch.sigmoid(logit).item())
    return out


def test_rerank_orders_documents_by_hf_scores(server, cross_encoder, tokenizer):
    _, model = cross_encoder
    want = hf_scores(model, tokenizer, QUERY, DOCUMENTS)
    with server.client() as client:
        for _ in range(2):  # fresh, then with the query's prefix cached
            r = client.post(
                "/v1/rerank",
                json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": True},
            )
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])[:2]
            assert [x["index"] for x in results] == order
            for x in results:
                assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)
                assert x["document"] == {"text": DOCUMENTS[x["index"]]}
        assert r.json()["usage"]["prompt_tokens"] > 0


def test_score_pairs_one_text_with_many(server, cross_encoder, tokenizer):
    _, model = cross_encoder
    want = hf_scores(model, tokenizer, QUERY, DOCUMENTS[:2])
    with server.client() as client:
        r = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:2]})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1]
        assert [d["score"] for d in data] == pytest.approx(want, abs=1e-4)
        embedding = client.post("/v1/embeddings", json={"input": "hi"})
        assert embedding.status_code == 400 and "rerank" in embedding.text, embedding.text
        generation = client.post("/generate", json={"text": "hi"})
        assert generation.status_code == 400 and "rerank" in generation.text, generation.text


@pytest.mark.parametrize(
    "route, body, needle",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": [{"text": 1}]}, "documents"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
    ],
)
def test_bad_rerank_and_score_requests_are_400s(server, route, body, needle):
    with server.client() as client:
        r = client.post(route, json=body)
    assert r.status_code == 400 and needle in r.text, r.text


def test_a_generation_model_refuses_rerank(tmp_path):
    srv = start_server(tmp_path, "--max-total-tokens", "1024")
    try:
        with srv.client() as client:
            r = client.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 400 and "ForSequenceClassification" in r.text, r.text
    finally:
        assert srv.stop() == 0


def test_a_classifier_without_is_embedding_is_refused_in_one_line(tmp_path, model_dir):
    path = tmp_path / "two-labels"
    build_cross_encoder(path, model_dir, num_labels=2)
    for extra, needle in [([], "--is-embedding"), (["--is-embedding"], "num_labels")]:
        out = subprocess.run(
            [sys.executable, "-m", "radixserve.cli", "serve", "--model", str(path), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
