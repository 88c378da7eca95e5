"""A tool-calling agent loop through the OpenAI Python SDK against a radixserve server.

    radixserve serve --reasoning-parser qwen3 &          # the bundled model on port 30000
    python examples/tool_agent.py                         # RADIXSERVE_URL to point elsewhere

The first turn must call a tool (tool_choice "required": the call is decoded under the tools'
JSON schemas, so it always parses and validates); the results go back as `tool` messages and
the model answers in text. Each turn's prompt extends the last one, so the radix cache serves
the history: the cached prompt tokens grow turn by turn.
"""

import json
import os

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
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
                "properties": {"zone": {"enum": ["CET", "UTC", "PST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def run_tool(name: str, arguments: dict) -> str:
    if name == "get_weather":
        return json.dumps(
            {
                "city": arguments["city"],
                "sky": "sunny",
                "temperature": 21,
                "unit": arguments["unit"],
            }
        )
    return json.dumps({"zone": arguments["zone"], "time": "12:00"})


def main() -> None:
    client = OpenAI(
        base_url=os.environ.get("RADIXSERVE_URL", "http://127.0.0.1:30000") + "/v1",
        api_key="unused",
    )
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for turn, tool_choice in enumerate(["required", "none"]):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=96,
            temperature=0,
        )
        message = reply.choices[0].message
        cached = reply.usage.prompt_tokens_details.cached_tokens
        print(
            f"turn {turn + 1}: {reply.choices[0].finish_reason}, {cached} of "
            f"{reply.usage.prompt_tokens} "
            f"prompt tokens from the cache"
        )
        if getattr(message, "reasoning_content", None):
            print("  reasoning:", message.reasoning_content)
        messages.append(
            message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
        )
        if not message.tool_calls:
            print("  answer:", message.content)
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
