"""Few-shot classification with select, over a batch: the shared examples are cached once."""

from _backend import backend

from radixserve.lang import function, select

EXAMPLES = [
    ("The food was cold and the waiter rude.", "negative"),
    ("Absolutely loved the atmosphere!", "positive"),
    ("Terrible service, never again.", "negative"),
    ("Great value and friendly staff.", "positive"),
]


@function
def classify(s, review):
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: " + select("label", choices=["positive", "negative"])


if __name__ == "__main__":
    reviews = [
        "The pasta was delicious.",
        "I waited an hour for cold soup.",
        "Lovely place, will return.",
    ]
    states = classify.run_batch(
        [{"review": r} for r in reviews], backend=backend(), num_threads=3, progress_bar=True
    )
    for review, state in zip(reviews, states):
        print(f"{state['label']:9s} {review}  (cached {state.report.cached_tokens} tokens)")
