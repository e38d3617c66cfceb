"""Prompt lookup decoding (Saxena 2023): copy what followed the context's last n-gram earlier in it.

The index maps every n-gram (n <= max_ngram) of the context to the end position of its most
recent occurrence, excluding the context's final position (whose n-grams are the query). It is
extended by the tokens committed since the last call, O(max_ngram) per token, so a cycle never
rescans the context. The longest n wins; within it, the most recent occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from decoder.draft import Draft
from decoder.drafters.sam import extends


@dataclass
class PldConfig:
    max_ngram: int = 3  # longest n-gram matched (then n-1, ..., 1)
    max_copy: int = 10  # tokens copied after the match


class NgramIndex:
    """n-gram -> end position of its most recent occurrence, over context positions before the last."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # end positions 0..indexed-1 are in `last`

    def sync(self, context: Sequence[int]) -> None:
        seen = len(self.tokens)
        if not extends(context, self.tokens):
            self.tokens, self.last, self.indexed, seen = [], {}, 0, 0
        self.tokens.extend(int(t) for t in context[seen:])
        toks, last = self.tokens, self.last
        for j in range(self.indexed, len(toks) - 1):
            for k in range(1, min(self.max_ngram, j + 1) + 1):
                last[tuple(toks[j - k + 1 : j + 1])] = j
        self.indexed = max(self.indexed, len(toks) - 1)

    def lookup(self, max_copy: int) -> list[int]:
        """What followed the most recent earlier occurrence of the longest matching suffix n-gram."""
        toks = self.tokens
        for k in range(min(self.max_ngram, len(toks)), 0, -1):
            j = self.last.get(tuple(toks[len(toks) - k :]))
            if j is not None:
                return toks[j + 1 : j + 1 + max_copy]
        return []


class PldDrafter:
    """Arm `pld`: one chain copied from the current request's own context."""

    name = "pld"
    Config = PldConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: PldConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or PldConfig()
        self.index = NgramIndex(self.config.max_ngram)

    def add_trace(self, output_tokens: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        pass  # prompt lookup reads only the current request

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        self.index = NgramIndex(self.config.max_ngram)
        self.index.sync(prompt)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.index.sync(context)
        draft = Draft()
        draft.add_chain(self.index.lookup(min(self.config.max_copy, budget)), self.name, budget)
        return draft

    def observe(self, context: Sequence[int], result) -> None:
        pass

    def end_request(self, prompt: Sequence[int], output: Sequence[int], hidden: np.ndarray | None) -> None:
        pass
