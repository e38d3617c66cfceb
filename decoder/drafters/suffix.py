"""SuffixDecoding (Oliaro et al.): a frequency-weighted suffix tree over past responses and the request.

The index is a suffix automaton rather than an explicit suffix tree: the automaton is the
minimized trie of all substrings, so walking transitions from the state of a string s to the
state of s+c visits exactly the suffix-trie node s+c, and a state's occurrence count is the
trie node's count (the number of suffixes passing through it). The depth cap of the trie
(64) becomes a cap on match length + draft depth. One global automaton holds the pool (past
responses, matched without crossing trace boundaries), one local automaton the request
(prompt + committed tokens, including the occurrence at the very end, as in SuffixDecoding's
per-request tree); both come from `AutomatonIndex`.

Per cycle and per side: the longest suffix of the context (at most `max_match` tokens) whose
node has a continuation, then a tree grown best-first by path probability (the product of
child count / parent count along the path), adding nodes while that probability is at least
`min_token_prob` and the depth stays within `max_depth`. Each side's draft scores the sum of its
nodes' probabilities; the better-scoring side is proposed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from data.index.automaton import SuffixAutomaton
from decoder.draft import ROOT, Draft
from decoder.drafters.sam import AutomatonIndex, AutomatonPoolDrafter


@dataclass
class SuffixConfig:
    max_depth: int = 64  # suffix-tree depth: match length + draft depth
    max_match: int = 32  # longest context suffix matched, leaving max_depth - max_match to draft
    min_token_prob: float = 0.1  # a node is drafted only while its path probability stays above this


def grow_tree(sam: SuffixAutomaton, state: int, count: Callable[[int], int], budget: int,
              min_prob: float, max_depth: int, source: str = "suffix") -> tuple[Draft, float]:
    """Best-first tree under `state`: pop the most probable frontier node, draft it, push its children.

    A child's probability is its parent's times count(child) / count(parent). Returns the draft
    and its score (the sum of its nodes' probabilities).
    """
    draft, score = Draft(), 0.0
    if max_depth <= 0 or budget <= 0:
        return draft, score
    nxt = sam.next
    frontier: list[tuple[float, int, int, int, int, int]] = []  # (-prob, order, token, state, parent, depth)
    order = 0

    def push(parent_state: int, prob: float, parent: int, depth: int) -> None:
        nonlocal order
        total = count(parent_state)
        if total <= 0:
            return
        scale = prob / total
        for tok, child in nxt[parent_state].items():
            p = count(child) * scale
            if p >= min_prob:
                heapq.heappush(frontier, (-p, order, tok, child, parent, depth))
                order += 1

    push(state, 1.0, ROOT, 1)
    while frontier and len(draft) < budget:
        neg, _, tok, child, parent, depth = heapq.heappop(frontier)
        node = draft.add_node(parent, tok, source)
        score -= neg
        if depth < max_depth:
            push(child, -neg, node, depth + 1)
    return draft, score


class SuffixDrafter(AutomatonPoolDrafter):
    """Arm `suffix`: the better-scoring of the local (request) and global (pool) suffix-tree drafts."""

    name = "suffix"
    Config = SuffixConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: SuffixConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or SuffixConfig()
        self.index = AutomatonIndex()

    def candidates(self, budget: int) -> list[tuple[Draft, float]]:
        """The local and the global draft with their scores (empty sides left out)."""
        c, index = self.config, self.index
        out = []
        req = index.request
        state, matched = index.request_match()  # the longest suffix with a continuation
        if state > 0:
            state, matched = req.shorten(state, matched, c.max_match)
            out.append(grow_tree(req, state, req.count.__getitem__, budget, c.min_token_prob,
                                 c.max_depth - matched, self.name))
        pool = index.pool
        state, matched = pool.shorten(*index.pool_match(), c.max_match)
        while state > 0 and not any(index.pool_count(ch) > 0 for ch in pool.next[state].values()):
            state = pool.link[state]  # no continuation outside the excluded traces: back off
            matched = pool.length[state]
        if state > 0:
            out.append(grow_tree(pool, state, index.pool_count, budget, c.min_token_prob,
                                 c.max_depth - matched, self.name))
        return out

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.index.sync(context)
        best, best_score = Draft(), 0.0
        for draft, score in self.candidates(budget):
            if score > best_score:
                best, best_score = draft, score
        return best

    def observe(self, context: Sequence[int], result) -> None:
        pass  # the index learns from the committed context at the next propose
