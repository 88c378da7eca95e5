"""Multi-turn chat: every turn re-sends the growing history, which the radix cache serves."""

from _backend import backend

from radixserve.lang import assistant, function, gen, system, user


@function
def chat(s, questions):
    s += system("You are a friendly tutor. Answer in two sentences.")
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer_{i}", max_tokens=48, temperature=0))


if __name__ == "__main__":
    state = chat.run(
        questions=["What is a prefix tree?", "Why is it useful for caching?", "Give one example."],
        backend=backend(),
    )
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
    print(
        f"prompt tokens {state.report.prompt_tokens}, cached {state.report.cached_tokens} "
        f"({100 * state.report.hit_rate:.0f}%)"
    )
