"""Seeded, deterministic prompt workloads shared by the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "system policy agent retrieve document answer question context memory tool search "
    "plan step result summary careful precise friendly user assistant cache prefix radix "
    "tree token batch schedule decode prefill latency throughput model server request"
).split()


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Groups of requests sharing one long system prompt (SGLang's generated-shared-prefix)."""

    num_groups: int = 4
    prompts_per_group: int = 8
    system_len: int = 256
    question_len: int = 32
    output_len: int = 32
    seed: int = 0

    def prompts(self, tokenizer) -> list[list[int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_groups):
            system = _tokens(tokenizer, rng, self.system_len)
            out += [
                system + _tokens(tokenizer, rng, self.question_len)
                for _ in range(self.prompts_per_group)
            ]
        order = list(range(len(out)))
        rng.shuffle(order)
        return [out[i] for i in order]


def _tokens(tokenizer, rng: random.Random, n: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(n * 2))
    return tokenizer.encode(text)[:n]


# ---- text workloads for the serving comparison (bench/serving.py) --------------------


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def shared_prefix_sessions(
    num_groups: int = 4,
    per_group: int = 8,
    system_words: int = 300,
    question_words: int = 20,
    output_len: int = 32,
    seed: int = 0,
):
    """Groups of one-shot requests sharing a long system prompt, arriving interleaved."""
    from loadgen import Session, Stage

    rng = random.Random(seed)
    sessions = []
    for g in range(num_groups):
        system = f"System prompt {g}: " + _words(rng, system_words)
        sessions += [
            Session(
                [Stage([f"{system}\nQuestion: {_words(rng, question_words)}\nAnswer:"], output_len)]
            )
            for _ in range(per_group)
        ]
    rng.shuffle(sessions)
    return sessions


def prefill_heavy_sessions(
    num_groups: int = 2,
    per_group: int = 12,
    prefix_words: int = 900,
    question_words: int = 12,
    output_len: int = 4,
    seed: int = 0,
):
    """Few-shot prompting: a long shared prefix (~1200 tokens of worked examples), a short
    question and a few output tokens. Prompt work dominates, so reusing the prefix is what
    counts."""
    from loadgen import Session, Stage

    rng = random.Random(seed)
    sessions = []
    for g in range(num_groups):
        shots = "\n".join(
            f"Example {i}: {_words(rng, prefix_words // 6)}\nAnswer: {rng.choice(WORDS)}"
            for i in range(6)
        )
        sessions += [
            Session(
                [
                    Stage(
                        [f"Task {g}.\n{shots}\nQuestion: {_words(rng, question_words)}\nAnswer:"],
                        output_len,
                    )
                ]
            )
            for _ in range(per_group)
        ]
    rng.shuffle(sessions)
    return sessions


def random_sessions(num: int = 32, words: int = 320, output_len: int = 32, seed: int = 0):
    """The control: nothing shared between requests."""
    from loadgen import Session, Stage

    rng = random.Random(seed)
    return [
        Session([Stage([f"Request {i}: " + _words(rng, words) + "\nAnswer:"], output_len)])
        for i in range(num)
    ]


def multi_turn_sessions(
    conversations: int = 8,
    turns: int = 4,
    system_words: int = 150,
    question_words: int = 15,
    output_len: int = 24,
    seed: int = 0,
):
    """Chats whose every turn re-sends the whole history."""
    from loadgen import Session, Stage

    rng = random.Random(seed)
    sessions = []
    for c in range(conversations):
        first = (
            f"Conversation {c}. "
            + _words(rng, system_words)
            + f"\nUser: {_words(rng, question_words)}\nAssistant:"
        )
        stages = [Stage([first], output_len)]
        stages += [
            Stage(["{history}\nUser: " + _words(rng, question_words) + "\nAssistant:"], output_len)
            for _ in range(turns - 1)
        ]
        sessions.append(Session(stages))
    return sessions


def agent_tree_sessions(
    trees: int = 4, branches: int = 6, context_words: int = 250, output_len: int = 24, seed: int = 0
):
    """A shared context and a plan, then branches fanning out from it concurrently."""
    from loadgen import Session, Stage

    rng = random.Random(seed)
    sessions = []
    for t in range(trees):
        root = f"Task {t}. Context: " + _words(rng, context_words) + "\nPlan:"
        fan = [
            "{history}\nBranch " + str(b) + ": " + _words(rng, 10) + "\nResult:"
            for b in range(branches)
        ]
        sessions.append(Session([Stage([root], output_len), Stage(fan, output_len)]))
    return sessions


WORKLOADS = {
    "shared_prefix": shared_prefix_sessions,
    "multi_turn": multi_turn_sessions,
    "agent_tree": agent_tree_sessions,
    "no_sharing": random_sessions,
    "prefill_heavy": prefill_heavy_sessions,
}
