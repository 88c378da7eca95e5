"""RAG: answer from several retrieved passages; a follow-up question reuses the cached context."""

from _backend import backend

from radixserve.lang import assistant, function, gen, system, user

PASSAGES = [
    "RadixAttention keeps the KV cache of finished requests in a radix tree keyed by token ids.",
    "A new request walks the tree to find its longest cached prefix and computes only the rest.",
    "Least recently used leaves are evicted when the KV pool runs out of space.",
]


@function
def rag(s, question, follow_up):
    context = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(PASSAGES))
    s += system("Answer using only the passages below and cite them like [1].\n" + context)
    s += user(question)
    s += assistant(gen("answer", max_tokens=48, temperature=0))
    s += user(follow_up)
    s += assistant(gen("follow_up_answer", max_tokens=48, temperature=0))


if __name__ == "__main__":
    state = rag.run(
        question="How does a request reuse cached work?",
        follow_up="What happens when memory is full?",
        backend=backend(),
    )
    print(state["answer"], "\n---\n", state["follow_up_answer"])
    print(f"cache hit rate {100 * state.report.hit_rate:.0f}%")
