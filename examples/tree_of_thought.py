"""Tree of thought: fork branches that share the question's cached prefix, then judge them."""

from _backend import backend

from radixserve.lang import function, gen, select, user


@function
def tree_of_thought(s, question, branches=3):
    s += user(question)
    s += "<|im_start|>assistant\nHere are different ways to answer.\n"
    forks = s.fork(branches)
    for i, f in enumerate(forks):
        f += f"Idea {i + 1}:" + gen("idea", max_tokens=32, temperature=0.9, seed=i, stop=["\n"])
    forks.join()
    for i, f in enumerate(forks):
        s += f"Idea {i + 1}:{f['idea']}\n"
    s += (
        "The best idea is Idea "
        + select("best", choices=[str(i + 1) for i in range(branches)])
        + "."
    )


if __name__ == "__main__":
    state = tree_of_thought.run(question="How can a city reduce traffic jams?", backend=backend())
    print(state.text())
    print(f"cached {state.report.cached_tokens}/{state.report.prompt_tokens} prompt tokens")
