"""Prefill/decode disaggregation on a tiny random llama: two prefill servers, a decode server and
`radixserve router --pd-disaggregation`, against a co-located server with the same flags. KV
moves through the Mooncake transfer engine over TCP on loopback.

The kill test runs last: it takes one prefill server down for good."""

import json
import signal
import threading
import time
from contextlib import contextmanager

import pytest
from quant_checkpoints import random_llama
from server_utils import free_port, start_router, start_server, wait_idle

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")

FLAGS = ("--chunked-prefill-size", "32", "--max-total-tokens", "4096")
PREFIX = [(7 * i + 3) % 500 + 5 for i in range(40)]
PROMPTS = [PREFIX + [100 + 9 * j + k for k in range(6)] for j in range(6)]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    random_llama().save_pretrained(root / "model")
    model = ("--model", str(root / "model"), *FLAGS)
    servers, ports = [], [free_port(), free_port()]
    try:
        colocated = start_server(root, *model)
        servers.append(colocated)
        prefills = []
        for port in ports:
            prefills.append(
                start_server(
                    root,
                    *model,
                    "--disaggregation-mode",
                    "prefill",
                    "--disaggregation-bootstrap-port",
                    str(port),
                )
            )
            servers.append(prefills[-1])
        decode = start_server(
            root,
            *model,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-timeout",
            "3",
        )
        servers.append(decode)
        prefill_flags = []
        for server, port in zip(prefills, ports):
            prefill_flags += ["--prefill", server.url, str(port)]
        router = start_router(
            root,
            "--pd-disaggregation",
            *prefill_flags,
            "--decode",
            decode.url,
            "--health-check-interval-secs",
            "1",
        )
        servers.append(router)
        yield colocated, prefills, decode, router
    finally:
        for server in reversed(servers):
            if server.proc.poll() is None:
                server.stop()


def generate(client, ids, **extra):
    return client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, **extra})


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_disaggregated_requests_match_the_colocated_server_and_hit_the_cache(pd):
    colocated, prefills, decode, router = pd
    with colocated.client() as c, router.client(timeout=60) as r, decode.client() as d:
        want = [generate(c, ids).json()["output_ids"] for ids in PROMPTS]
        results = [None] * len(PROMPTS)

        def send(i):
            results[i] = generate(r, PROMPTS[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(res.status_code == 200 for res in results), [res.text for res in results]
        assert [res.json()["output_ids"] for res in results] == want
        again = [generate(r, ids).json() for ids in PROMPTS]
        assert [a["output_ids"] for a in again] == want
        assert all(a["meta_info"]["cached_tokens"] >= len(PREFIX) for a in again), again
        assert metric(d, "radixserve:computed_prompt_tokens_total") < len(PROMPTS[0])
        assert metric(d, "radixserve:kv_received_tokens_total") > 0
        board = d.get("/dashboard/data").json()
        assert board["disaggregation_mode"] == "decode"
        assert board["current"]["kv_transfers_total"] >= 2 * len(PROMPTS)
        stream = r.post(
            "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": GREEDY, "stream": True},
        )
        events = [e for e in stream.text.split("\n\n") if e.startswith("data: {")]
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["output_ids"] == want[0] and last["meta_info"]["finish_reason"], stream.text
        completion = r.post(
            "/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert completion.status_code == 200, completion.text
        written = 0.0
        for server in prefills:
            with server.client() as p:
                written += metric(p, "radixserve:kv_transfer_bytes_total")
        assert written > 0
        for server in (decode, *prefills):
            with server.client() as s:
                stats = wait_idle(s)
                assert stats["kv_transfer_waiting"] == 0


def test_a_disaggregated_server_names_what_a_request_lacks(pd):
    colocated, _, decode, _ = pd
    with decode.client() as d, colocated.client() as c:
        bare = generate(d, PROMPTS[0])
        assert bare.status_code == 400 and "bootstrap_room" in bare.text
        partial = generate(d, PROMPTS[0], bootstrap_room=5)
        assert partial.status_code == 400 and "go together" in partial.text
        fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
        stray = generate(c, PROMPTS[0], **fields)
        assert stray.status_code == 400 and "not disaggregated" in stray.text
        waiting = {**fields, "bootstrap_port": free_port(), "bootstrap_room": 91}
        first = threading.Thread(target=lambda: generate(d, PROMPTS[0], **waiting))
        first.start()  # it waits for KV that never comes (3 s)
        time.sleep(0.5)
        again = generate(d, PROMPTS[1], **waiting)
        assert again.status_code == 400 and "91 is in use" in again.text, again.text
        first.join()
        odd = generate(d, PROMPTS[0], **{**fields, "bootstrap_host": "no such host"})
        assert odd.status_code == 400 and "bootstrap_host" in odd.text
        unknown = generate(d, PROMPTS[0], **{**fields, "bootstrap_host": "nowhere.invalid"})
        assert unknown.status_code == 503, unknown.text  # it fails alone, in time
        two = d.post(
            "/generate",
            json={"input_ids": [PROMPTS[0], PROMPTS[1]], "sampling_params": GREEDY, **fields},
        )
        assert two.status_code == 400 and "one prompt" in two.text


def test_a_client_that_goes_away_mid_stream_ends_the_decode_request(pd):
    _, _, decode, router = pd
    body = {
        "input_ids": PROMPTS[3],
        "sampling_params": {**GREEDY, "max_new_tokens": 400},
        "stream": True,
    }
    with router.client(timeout=60) as r, decode.client() as d:
        aborted = wait_idle(d)["aborted_total"]
        with r.stream("POST", "/generate", json=body) as stream:
            events = 0
            for line in stream.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break
        stats = wait_idle(d)  # nothing runs, no slot is held
        assert stats["aborted_total"] == aborted + 1


def test_kv_that_never_comes_is_a_503_after_the_timeout_and_frees_the_slots(pd):
    """A decode server told of a prefill server that is not there: the request waits for the
    transfer timeout (3 s here), fails alone with a 503, and its reserved slots come back."""
    _, _, decode, _ = pd
    nowhere = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 77}
    with decode.client(timeout=30) as d:
        started = time.time()
        lost = generate(d, PROMPTS[2], **nowhere)
        assert lost.status_code == 503 and "did not arrive within 3 s" in lost.text, lost.text
        assert 2.5 < time.time() - started < 15
        stats = wait_idle(d)
        assert stats["kv_transfer_waiting"] == 0


def test_a_prefill_server_killed_mid_request_is_retried_on_the_other(pd):
    """A prefill server holds the request (paused) while the decode server has reserved its
    slots; it is killed: the router closes the decode request and retries on the other prefill
    server, the answer is whole and right, and neither side leaks a slot."""
    colocated, prefills, decode, router = pd
    victim, survivor = prefills
    prompt = [(5 * i + 1) % 500 + 3 for i in range(60)]
    with colocated.client() as c, victim.client() as v, router.client(timeout=60) as r:
        want = generate(c, prompt).json()["output_ids"]
        assert v.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
        answer = {}
        for attempt in range(6):  # until the router puts one on the paused server
            answer.clear()
            thread = threading.Thread(target=lambda: answer.update(res=generate(r, prompt)))
            thread.start()
            deadline = time.time() + 5
            while thread.is_alive() and time.time() < deadline:
                if v.get("/get_server_info").json()["stats"]["num_queued"]:
                    break
                time.sleep(0.05)
            if thread.is_alive():
                break
            thread.join()
            prompt = [t + 1 for t in prompt]
            want = generate(c, prompt).json()["output_ids"]
        else:
            pytest.fail("the router never picked the paused prefill server")
        victim.proc.send_signal(signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the request hangs"
        res = answer["res"]
        assert res.status_code == 200, res.text
        assert res.json()["output_ids"] == want
    time.sleep(3.5)  # the closed request's reserved slots come back after the transfer timeout
    for server in (decode, survivor):
        with server.client() as s:
            stats = wait_idle(s)
            assert stats["kv_transfer_waiting"] == 0


def test_a_decode_server_killed_mid_stream_fails_its_request_and_is_routed_around(pd, tmp_path):
    """A second decode server joins the router; the one streaming a request is SIGKILLed: the
    stream ends with an error instead of hanging, and the next requests, through the other
    decode server, give the co-located server's tokens. Runs last: it kills the decode server."""
    colocated, prefills, decode, router = pd
    with colocated.client() as c:
        model_dir = c.get("/get_model_info").json()["model_path"]
    spare = start_server(tmp_path, "--model", model_dir, *FLAGS, "--disaggregation-mode", "decode")
    servers = {decode.url: decode, spare.url: spare}
    try:
        with router.client(timeout=60) as r, colocated.client() as c:
            assert r.post("/add_worker", params={"url": spare.url}).status_code == 200
            want = [generate(c, ids).json()["output_ids"] for ids in PROMPTS[:3]]
            body = {
                "input_ids": PROMPTS[4],
                "sampling_params": {**GREEDY, "max_new_tokens": 400},
                "stream": True,
            }
            started = time.time()
            with r.stream("POST", "/generate", json=body) as stream:
                victim = servers.pop(stream.headers["x-radixserve-worker"])
                lines = stream.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                victim.proc.send_signal(signal.SIGKILL)
                tail = "\n".join(lines)
            assert time.time() - started < 30, "the stream hangs"
            assert "failed mid-stream" in tail, tail
            for _ in range(50):  # until the router's health check marks it down
                if not any(
                    w["url"] == victim.url and w["healthy"]
                    for w in r.get("/list_workers").json()["workers"]
                ):
                    break
                time.sleep(0.2)
            got = [generate(r, ids) for ids in PROMPTS[:3]]
            assert [g.status_code for g in got] == [200] * 3, [g.text for g in got]
            assert [g.json()["output_ids"] for g in got] == want
            (survivor,) = servers.values()
            with survivor.client() as s:
                wait_idle(s)
    finally:
        if spare.proc.poll() is None:
            spare.stop()


def test_images_and_videos_through_a_disaggregated_pair_match_hf(tmp_path, model_dir):
    """A vision-language model behind `--pd-disaggregation`: the prefill server runs the tower
    and sends the KV, the decode server expands the same prompt (the same content-hash tokens,
    the same M-RoPE positions) and decodes; an image through /generate and a video through the
    chat route equal HF's greedy tokens, the second time with the decode server's cache."""
    from test_video_inputs import chat_about_video, frame_size, video_file
    from vision_checkpoints import (
        build_vl_checkpoint,
        data_url,
        hf_greedy,
        marker,
        picture,
    )

    model, path = build_vl_checkpoint(tmp_path, "qwen2_5_vl", model_dir)
    with disaggregated_pair(tmp_path, "--model", str(path), *FLAGS) as (prefill, _, router):
        image = picture(11, (150, 120))
        ids = list(range(100, 120)) + marker(model) + list(range(300, 330))
        want, _ = hf_greedy(model, path, ids, [image], 8)
        for _ in range(2):
            r = generate(router.client(), ids, image_data=[data_url(image)])
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == want
        video = video_file(tmp_path, 12, 8, frame_size(model))
        chat_about_video(router, model, path, video, "And?")
        assert metric(prefill.client(), "radixserve:kv_transfers_total") >= 4


@contextmanager
def disaggregated_pair(tmp_path, *flags: str, decode_flags: tuple[str, ...] = ()):
    """A prefill server, a decode server and a router in front of them, with these flags
    (and `decode_flags` on the decode server)."""
    port, servers = free_port(), []
    try:
        prefill = start_server(
            tmp_path, *flags, "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(port),
        )  # fmt: skip
        servers.append(prefill)
        decode = start_server(tmp_path, *flags, *decode_flags, "--disaggregation-mode", "decode")
        servers.append(decode)
        router = start_router(
            tmp_path, "--pd-disaggregation", "--prefill", prefill.url, str(port),
            "--decode", decode.url,
        )  # fmt: skip
        servers.append(router)
        yield prefill, decode, router
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "mamba2"])
def test_hybrid_models_through_a_disaggregated_pair_match_hf_and_resume(tmp_path, family):
    """A hybrid model (Gated DeltaNet or Mamba2 beside attention; Mamba2 alone, which keeps no
    KV): the prefill server sends the prompt's KV and, after it in the same write, the state at
    the prompt's end, which the decode server continues from. HF's greedy tokens, fresh and
    again (the prefill server resumes from its state snapshots), and on a conversation's next
    turn; the decode server keeps the state where each answer ends as a snapshot of its own."""
    import test_hybrid_models as hybrids

    model, path = hybrids.build_checkpoint(tmp_path, family)
    prompts = hybrids.PROMPTS
    want = [hybrids.hf_greedy(model, ids) for ids in prompts]
    flags = ("--model", str(path), *FLAGS, "--mamba-track-interval", "24")
    with disaggregated_pair(tmp_path, *flags) as (prefill, decode, router):
        with router.client(timeout=60) as r:
            rounds = [[generate(r, ids, sampling_params=hybrids.GREEDY) for ids in prompts]]
            rounds.append([generate(r, ids, sampling_params=hybrids.GREEDY) for ids in prompts])
            turn = prompts[1] + want[1] + [11, 12, 13]
            second = generate(r, turn, sampling_params=hybrids.GREEDY).json()
        assert [[g.json()["output_ids"] for g in got] for got in rounds] == [want, want], [
            g.text for got in rounds for g in got
        ]
        assert [g.json()["meta_info"]["cached_tokens"] for g in rounds[1]] == [0, 72, 48]
        assert second["output_ids"] == hybrids.hf_greedy(model, turn)
        assert second["meta_info"]["cached_tokens"] == len(prompts[1]) + hybrids.NEW_TOKENS - 1
        with decode.client() as d:
            assert metric(d, "radixserve:kv_transfer_failures_total") == 0
            wait_idle(d)
            assert metric(d, "radixserve:state_snapshots") >= 3
        with prefill.client() as p:
            assert metric(p, "radixserve:kv_transfers_total") == 7


def test_a_decode_server_whose_states_differ_fails_the_request_by_name(tmp_path):
    """The decode server stores recurrent states in bf16, the prefill server in float32: the
    request fails alone with a 503 naming the states, and neither side holds anything after."""
    import test_hybrid_models as hybrids

    _, path = hybrids.build_checkpoint(tmp_path, "nemotron_h")
    flags, odd = ("--model", str(path), *FLAGS), ("--mamba-ssm-dtype", "bfloat16")
    with disaggregated_pair(tmp_path, *flags, decode_flags=odd) as (prefill, decode, router):
        with router.client(timeout=60) as r:
            failed = generate(r, hybrids.PROMPTS[1])
        assert failed.status_code == 503 and "request states differ" in failed.text, failed.text
        for server in (prefill, decode):
            with server.client() as s:
                wait_idle(s)
