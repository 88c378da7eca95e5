"""Tool calling through /v1/chat/completions on the real server and the bundled 135M model:
with tool_choice 'required' or a named function, decoding is constrained to the tools'
schemas, so every call parses and validates even on a model this small."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from server_utils import start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["CET", "UTC", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("tools"),
        "--max-total-tokens",
        "4096",
        "--reasoning-parser",
        "qwen3",
    )
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client, **body):
    r = client.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 256, "temperature": 0, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def assert_valid(calls):
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )


def test_required_calls_parse_and_validate(client):
    choice = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert len(choice["message"]["tool_calls"]) == 1
    assert_valid(choice["message"]["tool_calls"])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_named_function_is_the_one_called(client, temperature):
    """Sampled too: get_time's one argument is an enum, so its call always fits in max_tokens
    (a call cut off by max_tokens is not a call: finish_reason length, the text as content)."""
    choice = chat(
        client,
        tools=[WEATHER, TIME],
        temperature=temperature,
        seed=3,
        max_tokens=256,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert_valid(calls)
    assert {c["function"]["name"] for c in calls} == {"get_time"}


def test_streamed_calls_come_as_openai_deltas(client):
    body = {
        "messages": ASK,
        "max_tokens": 256,
        "temperature": 0,
        "stream": True,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(line)["choices"][0] for line in lines[:-1]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    arguments = "".join(c["function"]["arguments"] for c in calls[1:])
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not "".join(d["delta"].get("content") or "" for d in deltas)


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ADD_ASK = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_sdk_calls_close_at_temperature_zero(server, tool_choice, stream):
    """Through the OpenAI SDK, as agent frameworks call: a model that repeats its call at
    temperature 0 (this one does) cannot keep the list open: `required` ends after at most
    MAX_PARALLEL_CALLS calls, a named function after one, both with finish_reason tool_calls."""
    from radixserve.tool_calls import MAX_PARALLEL_CALLS

    sdk = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    kwargs = dict(
        model=sdk.models.list().data[0].id,
        messages=ADD_ASK,
        tools=[ADD],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=96,
    )
    if stream:
        message, finish, _ = streamed_message(
            sdk.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
    else:
        reply = sdk.chat.completions.create(**kwargs)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        finish = reply.choices[0].finish_reason
    assert finish == "tool_calls", message
    calls = message["tool_calls"]
    assert 1 <= len(calls) <= (1 if isinstance(tool_choice, dict) else MAX_PARALLEL_CALLS)
    for call in calls:
        assert call["id"].startswith("call_") and call["function"]["name"] == "add"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, ADD["function"]["parameters"])


def test_calls_before_a_max_tokens_cut_are_returned(client):
    """max_tokens cuts the list inside its second call: the first still comes back as a call."""
    body = {"messages": ADD_ASK, "temperature": 0, "tools": [ADD], "tool_choice": "required"}
    whole = client.post("/v1/chat/completions", json=body | {"max_tokens": 96}).json()
    calls = whole["choices"][0]["message"]["tool_calls"]
    assert len(calls) >= 2  # this model repeats its call at temperature 0
    per_call = whole["usage"]["completion_tokens"] // len(calls)
    cut = client.post("/v1/chat/completions", json=body | {"max_tokens": per_call * 3 // 2})
    message = cut.json()["choices"][0]["message"]
    assert message.get("tool_calls"), message
    assert message["tool_calls"][0]["function"] == calls[0]["function"]


def test_history_with_calls_and_results_and_tool_choice_none(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps({"city": "Paris", "unit": "C"}),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    choice = chat(client, messages=history, tools=[WEATHER], tool_choice="none")
    assert "tool_calls" not in choice["message"] and choice["message"]["content"]
    auto = chat(
        client, messages=history, tools=[WEATHER]
    )  # the model chooses; either shape is valid
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")
    if auto["finish_reason"] == "tool_calls":
        assert_valid(auto["message"]["tool_calls"])


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"continue_final_message": True}, "continue_final_message"),
        (
            {
                "messages": ASK + [{"role": "assistant", "content": "It"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "cannot both be true",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in tools",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "is given more than once"),
    ],
)
def test_bad_tool_requests_are_400(client, body, needle):
    r = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400 and needle in r.json()["message"], r.text


def test_auto_calls_are_well_formed_whenever_the_model_starts_one(client):
    """`auto` constrains with a structural tag: text is free, but once the model writes
    `<tool_call>` the rest must be a call that validates, then `</tool_call>`."""
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "max_tokens": 64,
            "temperature": 1.0,
            "seed": 7,
            "n": 4,
        },
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "tool_calls":
            assert_valid(choice["message"]["tool_calls"])
        elif choice["finish_reason"] == "stop":  # a finished answer holds no malformed call
            assert "<tool_call>" not in (choice["message"]["content"] or "")


def test_structural_tag_on_generate_forces_a_valid_call_once_triggered(client):
    """A trigger of `<` and a bias towards `<` (token 44) make the model enter the tag at once
    (an enum leaves the bias no string to fill)."""
    zones = {
        "type": "object",
        "properties": {"zone": {"enum": ["CET", "UTC"]}},
        "required": ["zone"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<"],
            "tags": [
                {
                    "begin": "<tool_call>",
                    "content": {
                        "type": "json_schema",
                        "json_schema": {
                            "type": "object",
                            "properties": {"name": {"const": "get_time"}, "arguments": zones},
                            "required": ["name", "arguments"],
                            "additionalProperties": False,
                        },
                    },
                    "end": "</tool_call>",
                }
            ],
            "at_least_one": False,
            "stop_after_first": True,
        },
    }
    r = client.post(
        "/generate",
        json={
            "text": "Hi",
            "sampling_params": {
                "max_new_tokens": 60,
                "temperature": 0,
                "logit_bias": {"44": 100},
                "structural_tag": tag,
            },
        },
    )
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["name"] == "get_time"
    jsonschema.validate(call["arguments"], zones)


CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}


def test_a_hundred_sampled_required_calls_all_validate(client):
    """Issue 13's bar: 100 calls sampled at temperature 1.0 with tool_choice 'required', all of
    them parse and validate (bounded schemas, so no call can be cut off by max_tokens)."""
    tools = [CITY, TIME]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    bodies = [
        {
            "messages": ASK,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 1.0,
            "seed": seed,
            "n": 10,
            "max_tokens": 96,
        }
        for seed in range(10)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: client.post("/v1/chat/completions", json=b), bodies))
    calls = []
    for r in replies:
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            calls += choice["message"]["tool_calls"]
    assert len(calls) == 100
    for call in calls:
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]]
        )


def weather(city: str, unit: str, days: int = 1) -> str:
    return json.dumps(
        {"city": city, "forecast": ["sunny"] * days, "temperature": 21 if unit == "C" else 70}
    )


def run_call(call) -> str:
    return weather(**json.loads(call.function.arguments))


def streamed_message(stream) -> tuple[dict, str, object]:
    """An assistant message rebuilt from OpenAI SDK chunks, with the finish reason and usage."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    part.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                call["id"] = part.id or call["id"]
                call["function"]["name"] += (part.function.name or "") if part.function else ""
                call["function"]["arguments"] += (
                    (part.function.arguments or "") if part.function else ""
                )
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_runs_a_tool_loop(server, stream):
    """tools -> tool_calls -> tool results -> final answer through the OpenAI Python SDK; the
    radix cache keeps each turn's history: cached prompt tokens grow turn by turn."""
    sdk = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    model = sdk.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris, in C, for 2 days?"}]
    cached = []

    def turn(**extra):
        kwargs = dict(
            model=model, messages=messages, tools=[CITY], max_tokens=48, temperature=0, **extra
        )
        if stream:
            message, finish, usage = streamed_message(
                sdk.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs
                )
            )
        else:
            reply = sdk.chat.completions.create(**kwargs)
            message = reply.choices[0].message.model_dump(
                exclude_none=True, include={"role", "content", "tool_calls"}
            )
            finish, usage = reply.choices[0].finish_reason, reply.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        return message, finish

    message, finish = turn(tool_choice="required")
    assert finish == "tool_calls" and message["tool_calls"]
    messages.append(message)
    for call in message["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, CITY["function"]["parameters"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": weather(**args)})
    message, finish = turn(tool_choice="none")
    assert finish in ("stop", "length") and message["content"] and "tool_calls" not in message
    messages += [message, {"role": "user", "content": "And in Oslo?"}]
    message, finish = turn(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert finish == "tool_calls"
    assert cached[0] < cached[1] < cached[2], cached


def test_openai_agents_sdk_runs_an_agent_with_two_tools(server):
    """The OpenAI Agents SDK, through its chat completions model, runs an agent to completion:
    its first turn must call a tool (then the SDK resets tool_choice), the tool's result goes
    back, and the run ends with a final text answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"21 C and sunny in {city}"

    @agents.function_tool
    def get_time(zone: str) -> str:
        """Current time in a time zone."""
        return f"12:00 in {zone}"

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    agent = agents.Agent(
        name="assistant",
        instructions="Answer with the tools' help.",
        tools=[get_weather, get_time],
        model=agents.OpenAIChatCompletionsModel(
            model="SmolLM2-135M-Instruct", openai_client=client
        ),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs, result.new_items
    assert isinstance(result.final_output, str) and result.final_output.strip()


THOUGHT = r"<think>[a-z ]{4,24}</think>[A-Z][a-z ]{2,24}"


def test_reasoning_comes_apart_from_the_answer(client):
    """With --reasoning-parser qwen3 an output that opens <think> is split: reasoning_content,
    then content; streamed, the deltas add up to the same two texts. (A regex makes the 135M
    model think.)"""
    raw = chat(client, regex=THOUGHT, max_tokens=60, separate_reasoning=False)["message"]
    assert "reasoning_content" not in raw and raw["content"].startswith("<think>")
    message = chat(client, regex=THOUGHT, max_tokens=60)["message"]
    assert (
        "<think>" + message["reasoning_content"] + "</think>" + message["content"] == raw["content"]
    )
    body = {"messages": ASK, "max_tokens": 60, "temperature": 0, "regex": THOUGHT, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        deltas = [
            json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            for line in r.iter_lines()
            if line and line != "data: [DONE]"
        ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    plain = chat(client, max_tokens=8)["message"]  # no <think>: all content, no reasoning field
    assert "reasoning_content" not in plain and plain["content"]


def test_continue_final_message_continues_the_assistants_text(client):
    """Assistant prefill: the last message stays open and the model writes on from its text,
    exactly as /generate does from the same rendered prompt."""
    messages = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    choice = chat(client, messages=messages, continue_final_message=True, max_tokens=8)
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        "The weather in Paris is"
    )
    native = client.post(
        "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    assert choice["message"]["content"] == native["text"]
    closed = chat(client, messages=messages, max_tokens=8)  # without it, a new assistant turn
    assert closed["message"]["content"] != choice["message"]["content"]
