"""Runs SGLang's own frontend language against a server; prints the results as JSON.

Usage: python sglang_program.py URL   (with the `sglang` package importable)
"""

import json
import sys

import sglang as sgl


@sgl.function
def qa(s, question):
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=12, temperature=0)
    s += "\nIs that correct? " + sgl.select("verdict", choices=["yes", "no"])


@sgl.function
def branches(s, topic):
    s += "List ideas about " + topic + ".\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=6, temperature=0)
    forks.join()
    s += "Chosen: " + forks[0]["idea"]


@sgl.function
def dated(s):
    s += "The Eiffel Tower was finished in the year " + sgl.gen(
        "year", max_tokens=6, regex="1[89][0-9]{2}"
    )


def main(url: str) -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    first = qa.run(question="What is the capital of France?")
    tree = branches.run(topic="saving energy at home " * 6)
    year = dated.run()
    batch = qa.run_batch([{"question": q} for q in ["2+2?", "Color of the sky?", "Largest ocean?"]])
    print(
        json.dumps(
            {
                "qa": {
                    "text": first.text(),
                    "answer": first["answer"],
                    "verdict": first["verdict"],
                },
                "tree": {"text": tree.text(), "ideas": [tree.text().count("Chosen: ")]},
                "batch": [{"text": s.text(), "answer": s["answer"]} for s in batch],
                "year": year["year"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
