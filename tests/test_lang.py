"""radixserve.lang against the in-process engine and against a real server."""

import json

import jsonschema
import pytest
from server_utils import start_server

from radixserve.lang import (
    EngineBackend,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    system,
    tool_call,
    user,
    user_begin,
    user_end,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("lang"), "--max-total-tokens", "8192")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(params=["engine", "server"])
def backend(request, engine):
    if request.param == "engine":
        return EngineBackend(engine)
    return RuntimeEndpoint(request.getfixturevalue("server").url)


@function
def multi_turn(s, q1, q2):
    s += system("You are a helpful assistant. Answer in one short sentence.")
    s += user(q1)
    s += assistant(gen("a1", max_tokens=16, temperature=0))
    s += user(q2)
    s += assistant(gen("a2", max_tokens=16, temperature=0))


def test_gen_roles_and_messages(backend, engine):
    state = multi_turn.run(q1="What is the capital of France?", q2="And of Italy?", backend=backend)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["a1"] and state["a1"]
    prompt_before_a1 = state.text().split(state["a1"])[0]
    direct = engine.generate(prompt_before_a1, {"temperature": 0, "max_new_tokens": 16})
    assert direct["text"] == state["a1"]
    assert state.text().startswith("<|im_start|>system\nYou are a helpful")
    assert state.report.cached_tokens > 0 and state.report.calls == 2


@function
def classify(s, text):
    s += user_begin()
    s += "Is this review positive or negative?\n" + text
    s += user_end()
    s += "<|im_start|>assistant\nAnswer: "
    s += select("label", choices=["positive", "negative"])


def _normalized_choice_logprob(engine, prompt: str, choice: str) -> float:
    """Mean logprob of the tokens of prompt+choice after the prompt's last intact token."""
    a, b = engine.encode(prompt), engine.encode(prompt + choice)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    r = engine.generate(
        prompt + choice, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    lps = [lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][n:]]
    return sum(lps) / len(lps)


def test_select_agrees_with_engine_logprobs(backend, engine):
    state = classify.run(text="I loved every minute, wonderful film!", backend=backend)
    prompt = state.text()[: -len(state["label"])]
    scores = {c: _normalized_choice_logprob(engine, prompt, c) for c in ["positive", "negative"]}
    assert state["label"] == max(scores, key=scores.get)
    assert state["label__scores"][0] == pytest.approx(scores["positive"], abs=1e-3)


@function
def tree_of_thought(s, question):
    s += user(question)
    s += "<|im_start|>assistant\nLet me think of three approaches.\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Approach {i + 1}:" + gen("idea", max_tokens=12, temperature=0.8, seed=i)
    forks.join()
    s += "Best: " + forks[0]["idea"]


def test_fork_join_shares_the_prefix(backend):
    state = tree_of_thought.run(
        question="How can I learn to play chess quickly? " * 4, backend=backend
    )
    assert "Best: " in state.text()
    assert state.report.calls == 4  # the cached prefix + three branches
    assert state.report.cached_tokens >= 3 * 40


@function
def failing(s, n):
    if n == 2:
        raise RuntimeError("program two fails")
    s += "Count: " + str(n) + gen("next", max_tokens=3, temperature=0)


def test_run_batch_keeps_order_and_isolates_errors(backend):
    states = failing.run_batch([{"n": i} for i in range(4)], backend=backend, num_threads=3)
    assert [s.error is None for s in states] == [True, True, False, True]
    assert all(states[i].text().startswith(f"Count: {i}") for i in (0, 1, 3))
    assert "program two fails" in str(states[2].error)


@function
def profile(s, name):
    s += f"Facts about {name}. Born in year: " + gen(
        "year", max_tokens=6, regex="1[89][0-9]{2}", temperature=0
    )
    s += "\nAs JSON: " + gen(
        "card",
        max_tokens=40,
        temperature=0,
        json_schema={
            "type": "object",
            "properties": {"job": {"type": "string", "maxLength": 16}},
            "required": ["job"],
        },
    )


def test_constrained_gen(backend):
    import json
    import re

    state = profile.run(name="Ada Lovelace", backend=backend)
    assert re.fullmatch(r"1[89][0-9]{2}", state["year"])
    assert set(json.loads(state["card"])) == {"job"}


def test_streaming_text(backend):
    state = multi_turn.run(q1="Say hello.", q2="Again.", backend=backend, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 4 and "".join(chunks) == state.text()


def test_bad_usage_errors_clearly(engine):
    @function
    def unbalanced(s):
        s += user_end()

    with pytest.raises(ValueError, match="user_end"):
        unbalanced.run(backend=EngineBackend(engine))
    with pytest.raises(ValueError, match="choices"):
        select("x", [])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["CET", "UTC"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@function
def tool_agent(s, question, seed):
    s += system("You help with weather and time.", tools=TOOLS)
    s += user(question)
    s += assistant(tool_call("calls", temperature=1.0, seed=seed))
    call = s["calls"][0]
    s += user(f"The tool {call['name']} answered: 21 C, sunny. Answer the question.")
    s += assistant(gen("answer", max_tokens=12, temperature=0))
    s += user("And the time in Rome?")
    s += assistant(tool_call("more", parallel=True, temperature=1.0, seed=seed))


def test_tool_calls_in_a_program_always_validate(backend):
    """Sampled calls (temperature 1.0) from the tools given to system(): each parses and
    validates; a parallel call is a list; the later calls reuse the cached history."""
    states = tool_agent.run_batch(
        [{"question": "Weather in Paris?", "seed": seed} for seed in range(4)], backend=backend
    )
    for state in states:
        assert state.error is None, state.error
        assert len(state["calls"]) == 1 and state["more"]
        for call in state["calls"] + state["more"]:
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
        blocks = state.text().split("<tool_call>")[
            -2:
        ]  # the calls stay in the text as hermes blocks
        assert all(b.count("</tool_call>") == 1 for b in blocks)
        assert json.loads(blocks[0].split("</tool_call>")[0])["name"] == state["calls"][0]["name"]
        assert state.report.cached_tokens > 0


def test_tool_call_without_tools_is_an_error(engine):
    @function
    def no_tools(s):
        s += user("hi")
        s += assistant(tool_call("calls"))

    state = no_tools.run_batch([{}], backend=EngineBackend(engine))[0]
    assert isinstance(state.error, ValueError) and "needs tools" in str(state.error)
