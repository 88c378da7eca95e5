"""The real server: processes, HTTP, ZeroMQ, the bundled model."""

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import PROMPTS
from server_utils import alive, start_server, wait_idle

KEY = "test-key"
LONG = PROMPTS[4] * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("srv"),
        "--max-total-tokens",
        "4096",
        "--max-running-requests",
        "16",
        "--chunked-prefill-size",
        "256",
        api_key=KEY,
    )
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def stats(client):
    return client.get("/get_server_info").json()["stats"]


def test_generate_matches_hf(client, tokenizer, hf_greedy):
    r = client.post(
        "/generate",
        json={
            "text": PROMPTS[0],
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["output_ids"] == hf_greedy(tokenizer.encode(PROMPTS[0]), 12)
    assert body["text"] == tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    meta = body["meta_info"]
    assert (
        meta["prompt_tokens"] == len(tokenizer.encode(PROMPTS[0]))
        and meta["completion_tokens"] == 12
    )
    assert meta["finish_reason"] == {"type": "length", "length": 12}


def test_batch_generate_and_input_ids(client, tokenizer, hf_greedy):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    r = client.post("/generate", json={"text": PROMPTS[:3], "sampling_params": params}).json()
    assert [x["output_ids"] for x in r] == [hf_greedy(tokenizer.encode(p), 6) for p in PROMPTS[:3]]
    ids = tokenizer.encode(PROMPTS[1])
    single = client.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
    assert single["output_ids"] == r[1]["output_ids"]


def test_stream_sse(client):
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with client.stream(
        "POST", "/generate", json={"text": PROMPTS[1], "stream": True, "sampling_params": params}
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len(chunks) >= 2 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    full = client.post("/generate", json={"text": PROMPTS[1], "sampling_params": params}).json()
    assert chunks[-1]["text"] == full["text"]


def test_stream_several_prompts(client):
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    body = {"text": [PROMPTS[0], PROMPTS[1]], "stream": True, "sampling_params": params}
    with client.stream("POST", "/generate", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    last = {}
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        last[chunk["index"]] = chunk
    full = client.post("/generate", json=dict(body, stream=False)).json()
    assert [last[i]["text"] for i in (0, 1)] == [f["text"] for f in full]
    long = {
        "text": ["First: " + LONG, "Second: " + LONG],
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=long) as r:
        for i, line in enumerate(r.iter_lines()):
            if i >= 6:
                break  # hang up while both are running
    wait_idle(client)


def test_logprobs_and_select_style_request(client, tokenizer):
    choices = [PROMPTS[3] + " 100", PROMPTS[3] + " banana"]
    r = client.post(
        "/generate",
        json={
            "text": choices,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    for res, text in zip(r, choices):
        entries = res["meta_info"]["input_token_logprobs"]
        assert len(entries) == len(tokenizer.encode(text)) and entries[0][0] is None
        assert isinstance(entries[1][2], str)
        assert res["output_ids"] == []
    assert (
        r[0]["meta_info"]["normalized_prompt_logprob"]
        > r[1]["meta_info"]["normalized_prompt_logprob"]
    )


def test_repeated_long_prompt_is_cached(client, tokenizer):
    params = {"temperature": 0, "max_new_tokens": 4}
    first = client.post("/generate", json={"text": LONG, "sampling_params": params}).json()
    second = client.post("/generate", json={"text": LONG, "sampling_params": params}).json()
    n = len(tokenizer.encode(LONG))
    assert second["meta_info"]["cached_tokens"] >= n - 1 > first["meta_info"]["cached_tokens"]
    assert second["output_ids"] == first["output_ids"]
    assert stats(client)["cached_tokens_total"] >= n - 1


def test_openai_client_chat_and_completions(server):
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    models = oai.models.list()
    model = models.data[0].id
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=10,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 10
    again = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=10,
        temperature=0,
    )
    assert again.choices[0].message.content == chat.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=10,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content
    comp = oai.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, n=2, logprobs=2, stop=["\n\n"]
    )
    assert len(comp.choices) == 2 and comp.choices[0].text == comp.choices[1].text
    assert len(comp.choices[0].logprobs.token_logprobs) >= 1
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, stop=["\n\n"], stream=True
        )
    )
    assert streamed == comp.choices[0].text


def test_echo_and_streamed_logprobs(server):
    """echo puts the prompt before the text (with logprobs, its tokens before the output's, the
    first without a logprob); streamed chunks carry the logprobs of their tokens, and add up to
    the unstreamed answer's."""
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    args = dict(model="default", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    plain = oai.completions.create(**args).choices[0]
    echoed = oai.completions.create(echo=True, **args).choices[0]
    assert echoed.text == PROMPTS[0] + plain.text
    prompt_len = len(echoed.logprobs.tokens) - len(plain.logprobs.tokens)
    assert prompt_len > 1 and echoed.logprobs.token_logprobs[0] is None
    assert "".join(echoed.logprobs.tokens[:prompt_len]) == PROMPTS[0]
    assert echoed.logprobs.token_logprobs[prompt_len:] == pytest.approx(
        plain.logprobs.token_logprobs, abs=1e-4
    )
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, echo=True, **args)]
    assert "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == echoed.logprobs.tokens
    chat_args = dict(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = oai.chat.completions.create(**chat_args).choices[0].logprobs.content
    streamed = [
        e
        for c in oai.chat.completions.create(stream=True, **chat_args)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole] and len(whole) == 6
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_structured_output_over_http(server, client):
    r = client.post(
        "/generate",
        json={
            "text": "Is the sky blue? Answer:",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "regex": "(yes|no)"},
        },
    )
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no")
    r = client.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
    assert r.status_code == 400 and "invalid regex" in r.json()["message"]
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    chat = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Name a city in France as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert set(json.loads(chat.choices[0].message.content)) == {"city"}
    chat = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].finish_reason == "length" or isinstance(
        json.loads(chat.choices[0].message.content), dict
    )
    comp = oai.completions.create(
        model="default",
        prompt="The year:",
        max_tokens=8,
        temperature=0,
        extra_body={"regex": "19[0-9]{2}"},
    )
    assert comp.choices[0].text.startswith("19") and len(comp.choices[0].text) == 4
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema"},
        },
    )
    assert r.status_code == 400 and "json_schema" in r.json()["message"]
    wait_idle(client)


def test_openai_logit_bias(client, tokenizer):
    target = tokenizer.encode(" London")[0]
    r = client.post(
        "/v1/completions",
        json={
            "prompt": "The capital of France is",
            "max_tokens": 2,
            "temperature": 0,
            "logit_bias": {str(target): 100},
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " London London"
    r = client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"1": 500}})
    assert r.status_code == 400 and "logit_bias" in r.json()["message"]


def test_disconnect_mid_stream_aborts_and_frees(client):
    params = {"max_new_tokens": 2000, "ignore_eos": True}
    with client.stream(
        "POST", "/generate", json={"text": LONG, "stream": True, "sampling_params": params}
    ) as r:
        seen = 0
        for line in r.iter_lines():
            seen += bool(line)
            if seen >= 3:
                break
    wait_idle(client)
    assert stats(client)["aborted_total"] >= 1


def test_disconnect_while_waiting_aborts(server, client):
    with server.client(timeout=1.0) as short:
        with pytest.raises(httpx.TimeoutException):
            short.post(
                "/generate",
                json={
                    "text": LONG,
                    "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                },
            )
    wait_idle(client)


@pytest.mark.parametrize(
    "body,needle",
    [
        (b"{not json", "malformed JSON"),
        (b'{"text": 5}', "text"),
        (b'{"text": "hi", "sampling_params": {"temperature": -1}}', "temperature"),
        (b'{"text": "hi", "sampling_params": {"max_new_tokens": 1e9}}', "max_new_tokens"),
        (b'{"text": "hi", "sampling_params": {"top_p": "high"}}', "top_p"),
        (b'{"text": "hi", "sampling_params": {"n": 1000}}', "n "),
        (b'{"text": "hi", "sampling_params": {"colour": 1}}', "unknown"),
        (b'{"text": ""}', "empty"),
        (b'{"input_ids": [1, 99999999]}', "input_ids"),
        (b'{"text": "hi", "input_ids": [1]}', "exactly one"),
        (b"[1, 2]", "object"),
    ],
)
def test_bad_generate_inputs_are_400(client, body, needle):
    r = client.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert needle in r.json()["message"]


def test_too_long_prompt_and_bad_openai_inputs(client):
    r = client.post("/generate", json={"input_ids": [5] * 5000})
    assert r.status_code == 400 and "accepts at most" in r.json()["message"]
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens" in r.json()["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "route,body,needle",
    [
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 10**9}},
            "max_new_tokens: this server holds 4096 tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens: this server"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
            "max_completion_tokens: this server",
        ),
        ("/generate", {"text": "hi", "priority": 3}, "--enable-priority-scheduling"),
        ("/v1/completions", {"prompt": "hi", "priority": 1}, "--enable-priority-scheduling"),
    ],
)
def test_lengths_beyond_the_context_and_unserved_priorities_are_400(client, route, body, needle):
    r = client.post(route, json=body)
    assert r.status_code == 400 and needle in r.json()["message"], r.text
    assert wait_idle(client)["running_slots"] == 0


def test_a_default_length_is_capped_not_refused(client):
    r = client.post("/generate", json={"input_ids": [5] * 4000})  # default 128 > room left
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] <= 96


def test_api_key_is_required(server):
    r = httpx.post(f"{server.url}/generate", json={"text": "hi"})
    assert r.status_code == 401 and "API key" in r.json()["message"]
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_info_flush_and_abort_endpoints(client):
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] is True
    server_info = client.get("/get_server_info").json()
    assert server_info["max_total_num_tokens"] == 4096 and "cache_hit_rate" in server_info["stats"]
    assert client.post("/abort_request", json={"rid": "nope"}).status_code == 404
    wait_idle(client)
    assert client.post("/flush_cache").status_code == 200
    assert stats(client)["cached_slots"] == 0


def test_child_crash_is_detected(tmp_path):
    srv = start_server(tmp_path, "--max-total-tokens", "1024")
    kids = srv.children()
    try:
        with srv.client() as c:
            scheduler = c.get("/get_server_info").json()["processes"][
                "scheduler"
            ]  # it hosts the model
        assert scheduler in kids
        os.kill(scheduler, signal.SIGKILL)
        rc = srv.proc.wait(timeout=30)
    finally:
        srv.proc.kill()
    assert rc == 1
    assert "the scheduler process died" in srv.log()
    deadline = time.time() + 10
    while any(alive(k) for k in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)]


def test_the_detokenizer_process_decodes_as_the_hf_tokenizer_does(tokenizer):
    """The detokenizer process decodes through `tokenizers` alone (no transformers import at
    start-up); its text must be the HF tokenizer's, special tokens kept or skipped, and
    split UTF-8 sequences held back until whole."""
    import random

    from radixserve.detokenizer import Detokenizer
    from radixserve.messages import ReqOutput
    from radixserve.models.source import bundled_model_dir
    from radixserve.tokenizer import TokenDecoder, load_decoder

    decoder = load_decoder(bundled_model_dir())
    assert isinstance(decoder, TokenDecoder) and len(decoder) == len(tokenizer)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    text = "Déjà vu: 数据库 🚀 <|im_end|> done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, pieces = Detokenizer(decoder), []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        pieces.append(
            detok.text_for(
                ReqOutput("r", [token], last, None, 1, i + 1, 0, skip_special_tokens=False)
            )
        )
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in piece for piece in pieces)


def test_streamed_completion_starts_with_its_first_token(client):
    """No empty chunk ahead of the first token: a client timing its first token (vLLM's bench
    serve) times the model."""
    body = {"model": "default", "prompt": PROMPTS[1], "max_tokens": 5, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [
            json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"
        ]
    assert chunks[0]["choices"][0]["text"]
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def test_tokenize_and_detokenize_round_trip(client, tokenizer):
    """vLLM's /tokenize and /detokenize (its benchmark client aligns prompts with them)."""
    text = "The capital of France is"
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == tokenizer.encode(text, add_special_tokens=False)
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": text}
    bad = client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and "tokens" in bad.text
    bad = client.post("/tokenize", json={"messages": []})
    assert bad.status_code == 400 and "prompt" in bad.text


def test_models_carry_root_parent_and_length(client):
    """`root` is the checkpoint's folder: vLLM's benchmark client loads the tokenizer from it."""
    entry = client.get("/v1/models").json()["data"][0]
    assert (Path(entry["root"]) / "tokenizer.json").is_file(), entry
    assert entry["parent"] is None and entry["max_model_len"] > 0


def test_cache_salts_never_share_a_prefix(client):
    """The same prompt under two salts (and none) is computed once per salt; the tokens agree."""
    prompt = "Tenant isolation check: " + LONG[:400]

    def run(salt=None, route="/generate"):
        if route == "/generate":
            body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
            out = client.post(route, json=body | ({"cache_salt": salt} if salt else {})).json()
            return out["meta_info"]["cached_tokens"], out["text"]
        body = {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        out = client.post(route, json=body | ({"cache_salt": salt} if salt else {})).json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    first_a, text = run("tenant-a")
    again_a, text_a = run("tenant-a")
    first_b, text_b = run("tenant-b", "/v1/completions")
    unsalted, plain = run()
    assert first_a == 0 and again_a > 50
    assert first_b == 0 and unsalted == 0
    assert text == text_a == text_b == plain
    assert run("tenant-b", "/v1/completions")[0] > 50
    for bad in ["", "x" * 300, 7]:
        r = client.post("/generate", json={"text": "hi", "cache_salt": bad})
        assert r.status_code in (400, 422) and "cache_salt" in r.text, r.text


def test_server_info_lists_the_routes(client):
    routes = client.get("/get_server_info").json()["routes"]
    for route in ["POST /generate", "POST /v1/chat/completions", "GET /v1/models"]:
        assert route in routes
    assert not [r for r in routes if r.endswith("/docs")]  # documentation pages are not routes
