"""Seeded, deterministic prompt workloads shared by the benchmarks."""
from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("system policy agent retrieve document answer question context memory tool search "
         "plan step result summary careful precise friendly user assistant cache prefix radix "
         "tree token batch schedule decode prefill latency throughput model server request").split()


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
            out += [system + _tokens(tokenizer, rng, self.question_len) for _ in range(self.prompts_per_group)]
        order = list(range(len(out)))
        rng.shuffle(order)
        return [out[i] for i in order]


def _tokens(tokenizer, rng: random.Random, n: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(n * 2))
    return tokenizer.encode(text)[:n]
