"""Token Recycling (Luo et al. 2024): an adjacency table filled by the verification forwards.

Table: vocab x 8 int32, -1 = empty. After every verification forward, the row of the token at
each position of the tree (the anchor and every drafted node, accepted or not) is replaced by
the model's top-8 there; when one token sits at several positions the last one wins (anchor
first, then the nodes in draft order).

Drafting expands the table breadth-first along a static tree template: template node t is the
`rank[t]`-th entry of its parent's row (the anchor's row for depth 1). A node whose entry is
empty is left out with its subtree.

Default template: the N most probable paths when the rank-r entry of a row is accepted with the
fixed prior RANK_PRIOR (r = 0..7) and ranks along a path are independent; the top-N paths by
product probability form a tree (a prefix scores at least its extensions), the static tree that
maximizes expected accepted length under that prior, ordered breadth-first. The prior was chosen
so that at N = 80 the tree has the shape of Token Recycling's published 80-node template (nodes
per depth: ours 8/23/28/13/6/1/1, theirs 8/21/25/15/8/3); N = 60 (the default budget) gives
8/18/17/9/6/1/1. A draft of budget B uses the B-node template.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from decoder.draft import ROOT, Draft, Drafter

K = 8
RANK_PRIOR = (0.5, 0.15, 0.08, 0.05, 0.04, 0.03, 0.025, 0.02)
MAX_TEMPLATE_DEPTH = 8


@lru_cache(maxsize=32)
def default_template(n_nodes: int, max_depth: int = MAX_TEMPLATE_DEPTH) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parents, ranks) of the n most probable rank paths, breadth-first; parents index the template (-1 = anchor)."""
    heap = [(-RANK_PRIOR[r], (r,)) for r in range(K)]
    heapq.heapify(heap)
    paths: list[tuple[int, ...]] = []
    while heap and len(paths) < n_nodes:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        if len(path) < max_depth:
            for r in range(K):
                heapq.heappush(heap, (neg * RANK_PRIOR[r], path + (r,)))
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else ROOT for p in paths)
    ranks = tuple(p[-1] for p in paths)
    return parents, ranks


class AdjacencyTable:
    """token -> the model's top-8 next tokens the last time that token was verified."""

    def __init__(self, vocab_size: int, k: int = K) -> None:
        self.table = np.full((vocab_size, k), -1, dtype=np.int32)

    def update(self, tokens: Sequence[int] | np.ndarray, topk: np.ndarray) -> None:
        """Row tokens[i] := topk[i]; for repeated tokens the last occurrence wins.

        A row of topk starting with -1 is unknown (replay: the model's output at a rejected node is
        not in the trace store) and is skipped."""
        tokens = np.asarray(tokens, dtype=np.int64)
        topk = np.asarray(topk)
        rows, k = self.table.shape
        keep = (tokens >= 0) & (tokens < rows) & (topk[:, 0] >= 0)
        tokens, topk = tokens[keep], topk[keep][:, :k]
        rev = tokens[::-1]
        _, first_in_rev = np.unique(rev, return_index=True)
        last = len(tokens) - 1 - first_in_rev
        self.table[tokens[last], : topk.shape[1]] = topk[last]

    def knows(self, token: int) -> bool:
        """Whether `token` has successors in the table (it was verified at least once)."""
        return 0 <= token < self.table.shape[0] and bool((self.table[token] >= 0).any())

    def observe(self, anchor: int, draft_tokens: Sequence[int], topk: np.ndarray) -> None:
        """One verification forward: topk[0] is at the anchor, topk[1 + i] at draft node i."""
        self.update([anchor, *draft_tokens], topk[: 1 + len(draft_tokens)])

    def expand(self, anchor: int, parents: Sequence[int], ranks: Sequence[int], budget: int,
               source: str = "recycling") -> Draft:
        """Breadth-first expansion of the template from `anchor` (template parents precede children)."""
        draft = Draft()
        table = self.table
        if not 0 <= anchor < table.shape[0]:
            return draft
        node_of = [-1] * len(parents)  # template node -> draft node (-1: left out)
        depth = [0] * len(parents)  # template node -> depth below the anchor - 1 (the evidence's position)
        rows: dict[int, list[int]] = {}
        for t, (tp, r) in enumerate(zip(parents, ranks)):
            if len(draft) >= budget:
                break
            if tp == ROOT:
                base, base_tok = ROOT, anchor
            else:
                base = node_of[tp]
                if base < 0:
                    continue
                base_tok = draft.tokens[base]
                depth[t] = depth[tp] + 1
            row = rows.get(base_tok)
            if row is None:
                row = rows[base_tok] = table[base_tok].tolist()
            tok = row[r]
            if tok < 0 or draft.child(base, tok) is not None:
                continue
            node_of[t] = draft.add_node(base, tok, source, r, depth[t])  # evidence: the rank, the depth
        return draft


@dataclass
class RecyclingConfig:
    template_nodes: int = 0  # template size; 0 = the draft budget


class RecyclingDrafter(Drafter):
    """Arm `recycling`: the adjacency table expanded along the static template. No trace pool: the table
    is filled by verifications (not by traces), bounded by the vocabulary, and persists across requests
    (as in Token Recycling), so the contract's add_trace / evict_traces / begin_request defaults apply."""

    name = "recycling"
    Config = RecyclingConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: RecyclingConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or RecyclingConfig()
        self.table = AdjacencyTable(vocab_size)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        parents, ranks = default_template(self.config.template_nodes or budget)
        return self.table.expand(int(context[-1]), parents, ranks, budget, self.name)

    def observe(self, context: Sequence[int], result) -> None:
        self.table.observe(int(context[-1]), result.draft.tokens, result.topk)
