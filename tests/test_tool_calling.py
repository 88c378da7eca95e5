"""Tool calling through /v1/chat/completions on the real server and the bundled 135M model:
with tool_choice 'required' or a named function, decoding is constrained to the tools'
schemas, so every call parses and validates even on a model this small."""
import json

import httpx
import jsonschema
import pytest

from server_utils import start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tools"), "--max-total-tokens", "4096")
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    assert srv.stop() == 0, srv.log()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 256, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def assert_valid(calls):
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_required_calls_parse_and_validate(client):
    choice = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 1
    assert_valid(choice["message"]["tool_calls"])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_named_function_is_the_one_called(client, temperature):
    """Sampled too: get_time's one argument is an enum, so its call always fits in max_tokens
    (a call cut off by max_tokens is not a call: finish_reason length, the text as content)."""
    choice = chat(client, tools=[WEATHER, TIME], temperature=temperature, seed=3, max_tokens=256,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert_valid(calls)
    assert {c["function"]["name"] for c in calls} == {"get_time"}


def test_streamed_calls_come_as_openai_deltas(client):
    body = {"messages": ASK, "max_tokens": 256, "temperature": 0, "stream": True, "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(line)["choices"][0] for line in lines[:-1]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    arguments = "".join(c["function"]["arguments"] for c in calls[1:])
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not "".join(d["delta"].get("content") or "" for d in deltas)


def test_history_with_calls_and_results_and_tool_choice_none(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    choice = chat(client, messages=history, tools=[WEATHER], tool_choice="none")
    assert "tool_calls" not in choice["message"] and choice["message"]["content"]
    auto = chat(client, messages=history, tools=[WEATHER])  # the model chooses; either shape is valid
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")
    if auto["finish_reason"] == "tool_calls":
        assert_valid(auto["message"]["tool_calls"])


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_tool_requests_are_400(client, body, needle):
    r = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400 and needle in r.json()["message"], r.text


def test_auto_calls_are_well_formed_whenever_the_model_starts_one(client):
    """`auto` constrains with a structural tag: text is free, but once the model writes
    `<tool_call>` the rest must be a call that validates, then `</tool_call>`."""
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 64,
                                                   "temperature": 1.0, "seed": 7, "n": 4})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "tool_calls":
            assert_valid(choice["message"]["tool_calls"])
        elif choice["finish_reason"] == "stop":  # a finished answer holds no malformed call
            assert "<tool_call>" not in (choice["message"]["content"] or "")


def test_structural_tag_on_generate_forces_a_valid_call_once_triggered(client):
    """A trigger of `<` and a bias towards `<` (token 44) make the model enter the tag at once
    (an enum leaves the bias no string to fill)."""
    zones = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
             "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"begin": "<tool_call>", "content": {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"name": {"const": "get_time"}, "arguments": zones},
            "required": ["name", "arguments"], "additionalProperties": False}}, "end": "</tool_call>"}],
        "at_least_one": False, "stop_after_first": True}}
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 60, "temperature": 0, "logit_bias": {"44": 100}, "structural_tag": tag}})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "get_time"
    jsonschema.validate(call["arguments"], zones)
