"""The APIs agent clients speak, on the real server and the bundled model, driven by the
clients' own SDKs: OpenAI's Responses API (the OpenAI Agents SDK's default model class) and
Anthropic's Messages API (the `anthropic` SDK). Each runs a tool loop at temperature 0 whose
cached prompt tokens grow turn by turn; bad input is a 400 naming the field."""

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI
from server_utils import start_server

API_KEY = "agent-test-key"
MODEL = "SmolLM2-135M-Instruct"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
ZONE_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "Current weather in a city"}
TIME = {"name": "get_time", "description": "Current time in a time zone"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("agent_apis"), "--max-total-tokens", "4096", api_key=API_KEY
    )
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


# ---- OpenAI Responses ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_sdk_default_model_runs_an_agent_with_two_tools(server, stream):
    """The Agents SDK's default model class (Responses API): the first turn must call a tool,
    its output goes back, the run ends with text; the second turn reads the first's prompt
    from the radix cache."""
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

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    model = agents.OpenAIProvider(openai_client=client).get_model(MODEL)  # the SDK's default
    assert isinstance(model, agents.OpenAIResponsesModel)
    agent = agents.Agent(
        name="assistant",
        instructions="Answer with the tools' help.",
        tools=[get_weather, get_time],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )
    question = "What is the weather in Paris?"

    async def run():
        if not stream:
            return await agents.Runner.run(agent, question, max_turns=6)
        result = agents.Runner.run_streamed(agent, question, max_turns=6)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs, result.new_items
    assert isinstance(result.final_output, str) and result.final_output.strip()
    usages = [r.usage for r in result.raw_responses]
    assert len(usages) >= 2
    cached = [u.input_tokens_details.cached_tokens for u in usages]
    assert all(later > earlier for earlier, later in zip(cached, cached[1:])), cached
    assert cached[1] >= usages[0].input_tokens - 1, (cached, usages)


def respond(client, **body):
    r = client.post("/v1/responses", json={"temperature": 0, "max_output_tokens": 24, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_previous_response_id_continues_the_stored_conversation(client):
    first = respond(client, input="Name a color.", instructions="Be brief.")
    assert first["object"] == "response" and first["output"][0]["type"] == "message"
    second = respond(
        client, input="Name another.", instructions="Be brief.", previous_response_id=first["id"]
    )
    assert second["previous_response_id"] == first["id"]
    # the second prompt is the first's plus its answer: all of the first prompt is cached
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= (
        first["usage"]["input_tokens"] - 1
    )
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert client.get(f"/v1/responses/{second['id']}").json() == second
    assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404
    r = client.post("/v1/responses", json={"input": "hi", "previous_response_id": first["id"]})
    assert r.status_code == 400 and "previous_response_id" in r.text, r.text


def test_responses_stream_a_function_call_as_responses_events(client):
    tool = {"type": "function", **WEATHER, "parameters": CITY_SCHEMA}
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}
        ],
        "tools": [tool],
        "tool_choice": "required",
        "temperature": 0,
        "max_output_tokens": 48,
        "stream": True,
    }
    events = []
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done and done[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(done[0]["arguments"]), CITY_SCHEMA)
    final = events[-1]["response"]
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert calls and calls[0]["arguments"] == done[0]["arguments"]
    # the call's output, sent back as an input item, ends the loop with text
    follow = respond(
        client,
        previous_response_id=final["id"],
        input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "-3 C"}],
        tools=[tool],
        tool_choice="none",
    )
    assert follow["output"][0]["type"] == "message"
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] >= (
        final["usage"]["input_tokens"] - 1
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "effort"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "tool_choice": "required"}, "needs tools"),
    ],
)
def test_bad_responses_requests_are_400s_naming_the_field(client, body, needle):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400 and needle in r.text, r.text


# ---- Anthropic Messages -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_runs_a_tool_loop(server, stream):
    """tool_use -> tool_result -> an answer through the `anthropic` SDK (which sends its key
    as x-api-key); the second turn reads the first's prompt from the cache."""
    sdk = anthropic.Anthropic(base_url=server.url, api_key=API_KEY)
    tools = [{**WEATHER, "input_schema": CITY_SCHEMA}, {**TIME, "input_schema": ZONE_SCHEMA}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def turn(**extra):
        kwargs = dict(
            model=MODEL,
            max_tokens=48,
            system="Answer with the tools' help.",
            tools=tools,
            messages=messages,
            extra_body={"temperature": 0},
            **extra,
        )
        if not stream:
            return sdk.messages.create(**kwargs)
        with sdk.messages.stream(**kwargs) as events:
            for _ in events:
                pass
            return events.get_final_message()

    first = turn(tool_choice={"type": "any"})
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses, first
    for use in uses:
        jsonschema.validate(
            use.input, {"get_weather": CITY_SCHEMA, "get_time": ZONE_SCHEMA}[use.name]
        )
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "21 C"} for u in uses]
    messages.append({"role": "user", "content": results})
    second = turn()
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    prompt_first = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= prompt_first - 1, (first.usage, second.usage)
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    counted = sdk.messages.count_tokens(
        model=MODEL, system="Answer with the tools' help.", tools=tools, messages=messages
    )
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_anthropic_stop_sequence_and_length(client):
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}],
    }
    reply = client.post("/v1/messages", json=body).json()
    assert reply["stop_reason"] == "max_tokens" and reply["usage"]["output_tokens"] == 3, reply
    text = reply["content"][0]["text"]
    stop = text.strip().split()[-1]
    again = client.post("/v1/messages", json=body | {"max_tokens": 24, "stop_sequences": [stop]})
    assert again.json()["stop_reason"] == "stop_sequence", again.text
    assert again.json()["stop_sequence"] == stop


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"service_tier": "auto"}, "service_tier"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"tool_choice": {"type": "tool"}}, "name"),
    ],
)
def test_bad_anthropic_requests_are_400s_naming_the_field(client, body, needle):
    base = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/messages", json=base | body)
    assert r.status_code == 400 and needle in r.text, r.text


def test_the_api_key_is_checked_in_either_header(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers, status in [
        ({"x-api-key": API_KEY}, 200),
        ({"authorization": f"Bearer {API_KEY}"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({}, 401),
    ]:
        r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (headers, r.text)


def test_a_generation_server_refuses_embeddings_naming_the_flag(client):
    r = client.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "--is-embedding" in r.text, r.text
