"""A ReAct-style agent loop: think, pick a tool with select, observe, repeat."""

from _backend import backend

from radixserve.lang import function, gen, select, system, user

TOOLS = {
    "calculator": lambda q: (
        str(eval(q, {"__builtins__": {}}, {}))
        if q.replace(" ", "").replace(".", "").strip("+-*/()0123456789") == ""
        else "cannot compute that"
    ),
    "search": lambda q: "Paris is the capital of France; it has about 2.1 million inhabitants.",
    "finish": lambda q: q,
}


@function
def agent(s, task, max_steps=3):
    s += system("You solve tasks step by step using tools: calculator, search, finish.")
    s += user(task)
    s += "<|im_start|>assistant\n"
    for step in range(max_steps):
        s += (
            f"Thought {step + 1}:"
            + gen(f"thought_{step}", max_tokens=24, stop=["\n"], temperature=0)
            + "\n"
        )
        s += "Action: " + select(f"tool_{step}", choices=list(TOOLS)) + "["
        s += gen(f"input_{step}", max_tokens=16, stop=["]"], temperature=0) + "]\n"
        tool, arg = s[f"tool_{step}"], s[f"input_{step}"]
        s += f"Observation: {TOOLS[tool](arg)}\n"
        if tool == "finish":
            break


if __name__ == "__main__":
    state = agent.run(
        task="How many inhabitants does the capital of France have?", backend=backend()
    )
    print(state.text())
    print(f"cache hit rate over {state.report.calls} calls: {100 * state.report.hit_rate:.0f}%")
