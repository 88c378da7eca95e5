"""Property-based HTTP fuzzing of a real server (hypothesis): 1,020 generated requests
to /generate, /v1/completions and /v1/chat/completions and 240 to /v1/responses and
/v1/messages, mixing plausible values with arbitrary JSON in every field. Each answer must
be a 2xx or a 4xx with a message (never a 5xx, never a hang); afterwards a greedy request
answers as before and the KV invariant holds.

Deterministic (derandomized) so CI runs the same requests every time; generated tokens are
kept few (small max_new_tokens, a 96-token context) so the suite stays quick.
"""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import start_server, wait_idle

EXAMPLES = 340  # per route: 1,020 requests in all
REQUEST_TIMEOUT_S = 120  # a request that takes longer counts as a hang

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def either(plausible):
    """Mostly a plausible value, sometimes arbitrary JSON: with several fields per body, most
    bodies then get past validation and exercise scheduling, sampling and streaming."""
    return st.one_of(*[plausible] * 9, anything)


SAMPLING = {
    "max_new_tokens": st.integers(0, 8),
    "min_new_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**64),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 50000), max_size=3),
    "stop_regex": st.sampled_from(
        ["a+", "(a+)+b", "[", "\\d", "(?<=x)y", "(" * 80 + "a" + ")" * 80]
    ),
    "regex": st.sampled_from(["a", "[0-9]+", "(", "yes|no", "(" * 80 + "a" + ")" * 80]),
    "json_schema": st.sampled_from(
        [{"type": "object"}, "{", {"type": "integer"}, "[" * 100 + "]" * 100]
    ),
    "ebnf": st.sampled_from(['root ::= "a"', "root ::="]),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "81", "-1", "99999999", "x"]), st.floats(-150, 150), max_size=2
    ),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
# the output length is always drawn (small, or arbitrary JSON): left out, a request would run to
# the context's end
sampling_params = st.fixed_dictionaries(
    {"max_new_tokens": either(SAMPLING["max_new_tokens"])},
    optional={k: either(v) for k, v in SAMPLING.items() if k != "max_new_tokens"},
)
token_ids = st.lists(st.integers(-5, 50000), max_size=12)
prompt_text = st.text(max_size=40)

generate_prompt = st.one_of(
    st.fixed_dictionaries(
        {"text": either(st.one_of(prompt_text, st.lists(prompt_text, min_size=1, max_size=3)))}
    ),
    st.fixed_dictionaries(
        {"input_ids": either(st.one_of(token_ids, st.lists(token_ids, min_size=1, max_size=2)))}
    ),
    st.dictionaries(st.sampled_from(["text", "input_ids"]), anything),
)
generate_options = st.fixed_dictionaries(
    {},
    optional={
        "sampling_params": st.one_of(
            *[sampling_params] * 8, st.lists(sampling_params, max_size=2), anything
        ),
        "stream": either(st.booleans()),
        "return_logprob": either(st.booleans()),
        "top_logprobs_num": either(st.integers(0, 5)),
        "logprob_start_len": either(st.integers(-2, 5)),
        "rid": either(st.text(min_size=1, max_size=8)),
    },
)
generate_bodies = st.builds(
    lambda prompt, options: {**prompt, **options}, generate_prompt, generate_options
)

OPENAI = {
    "max_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=2)),
    "stream": st.booleans(),
    "seed": st.integers(0, 2**64),
    "logprobs": st.integers(0, 25),
    "presence_penalty": st.floats(-3, 3),
    "response_format": st.sampled_from(
        [{"type": "json_object"}, {"type": "json_schema"}, {"type": "text"}, {"type": "xml"}]
    ),
    "stream_options": st.just({"include_usage": True}),
    "tools": st.just([]),
    "best_of": st.just(1),
}
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": either(
            st.one_of(prompt_text, token_ids, st.lists(prompt_text, min_size=1, max_size=2))
        ),
        "max_tokens": either(OPENAI["max_tokens"]),
    },
    optional={k: either(v) for k, v in OPENAI.items() if k != "max_tokens"},
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["system", "user", "assistant"])),
            "content": either(
                st.one_of(
                    prompt_text,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "image_url"]), "text": prompt_text}
                        ),
                        max_size=2,
                    ),
                )
            ),
        }
    ),
    min_size=1,
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": either(messages), "max_tokens": either(OPENAI["max_tokens"])},
    optional={k: either(v) for k, v in OPENAI.items() if k not in ("best_of", "max_tokens")},
)

FUNCTION_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
response_items = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": either(st.sampled_from(["user", "assistant"]))},
            optional={"content": either(prompt_text)},
        ),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "x"])},
            optional={
                "call_id": either(st.text(max_size=4)),
                "name": either(st.just("f")),
                "arguments": either(st.just("{}")),
                "output": either(prompt_text),
            },
        ),
    ),
    max_size=3,
)
RESPONSES = {
    "instructions": prompt_text,
    "tools": st.sampled_from([[], [FUNCTION_TOOL], [{"type": "web_search"}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "temperature": st.floats(0, 2),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": st.text(max_size=6),
    "text": st.sampled_from(
        [{"format": {"type": "json_object"}}, {"format": {"type": "json_schema"}}]
    ),
}
responses_bodies = st.fixed_dictionaries(
    {
        "input": either(st.one_of(prompt_text, response_items)),
        "max_output_tokens": either(st.integers(0, 8)),
    },
    optional={k: either(v) for k, v in RESPONSES.items()},
)
blocks = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "tool_use", "tool_result", "image"])},
        optional={
            "text": either(prompt_text),
            "id": either(st.just("t")),
            "name": either(st.just("f")),
            "input": either(st.just({})),
            "tool_use_id": either(st.just("t")),
            "content": either(prompt_text),
        },
    ),
    max_size=2,
)
anthropic_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["user", "assistant"])),
            "content": either(st.one_of(prompt_text, blocks)),
        }
    ),
    min_size=1,
    max_size=3,
)
MESSAGES = {
    "system": prompt_text,
    "tools": st.sampled_from(
        [
            [],
            [{"name": "f", "input_schema": {"type": "object"}}],
            [{"type": "bash_20250124", "name": "bash"}],
        ]
    ),
    "tool_choice": st.sampled_from(
        [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"}, {"type": "none"}]
    ),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
    "temperature": st.floats(0, 1),
    "stream": st.booleans(),
}
messages_bodies = st.fixed_dictionaries(
    {"messages": either(anthropic_messages), "max_tokens": either(st.integers(0, 8))},
    optional={k: either(v) for k, v in MESSAGES.items()},
)

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("fuzz"),
        "--max-total-tokens",
        "2048",
        "--context-length",
        "96",
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "64",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def before(client):
    return greedy(client)


def greedy(client) -> str:
    r = client.post(
        "/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["text"]


def check(client, route: str, body: dict) -> None:
    """A 2xx, or a 4xx whose JSON names the problem; a stream must end with [DONE]."""
    if body.get("stream") is True:
        with client.stream("POST", route, json=body) as r:
            lines = [line for line in r.iter_lines() if line]
            status = r.status_code
        if status == 200:
            assert lines and lines[-1] == "data: [DONE]", lines[-3:]
            for line in lines[:-1]:
                json.loads(line.removeprefix("data: "))
            return
        message = json.loads("".join(lines)).get("message")
    else:
        r = client.post(route, json=body)
        status = r.status_code
        if status == 200:
            r.json()
            return
        message = r.json().get("message")
    assert 400 <= status < 500 and message, f"{route} {body!r} -> {status} {message!r}"


@FUZZ
@given(body=generate_bodies)
def test_fuzz_generate(client, before, body):
    check(client, "/generate", body)


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(client, before, body):
    check(client, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(client, before, body):
    check(client, "/v1/chat/completions", body)


def check_events(client, route: str, body: dict, last_events: tuple[str, ...]) -> None:
    """A 2xx whose named-event stream ends with one of `last_events` (or an error event), or a
    4xx whose JSON names the problem."""
    if body.get("stream") is not True:
        return check(client, route, body)
    with client.stream("POST", route, json=body) as r:
        lines = [line for line in r.iter_lines() if line]
        status = r.status_code
    if status != 200:
        message = json.loads("".join(lines)).get("message")
        assert 400 <= status < 500 and message, f"{route} {body!r} -> {status} {message!r}"
        return
    events = [
        json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")
    ]
    assert events and events[-1]["type"] in last_events + ("error",), events[-2:]


EVENT_FUZZ = settings(FUZZ, max_examples=EXAMPLES // 3)


@EVENT_FUZZ
@given(body=responses_bodies)
def test_fuzz_responses(client, before, body):
    check_events(client, "/v1/responses", body, ("response.completed", "response.incomplete"))


@EVENT_FUZZ
@given(body=messages_bodies)
def test_fuzz_messages(client, before, body):
    check_events(client, "/v1/messages", body, ("message_stop",))


def test_after_fuzzing_the_server_answers_as_before_and_holds_no_kv(client, before, server):
    assert greedy(client) == before
    assert client.get("/health").status_code == 200
    wait_idle(client, timeout=30)
