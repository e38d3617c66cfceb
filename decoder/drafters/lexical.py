"""The merged lexical tree (the paper's BuildLexical, section 4 (ii)): one tree, three kinds of node.

Per cycle, under one node budget, in this order:
  1. spine     - the suffix automaton's longest-match continuation (request or pool, see
                 `sam.automaton_chains`), up to `spine_max` tokens;
  2. branch    - the match state's next most frequent children, each continued from its own
                 occurrence, merged from the root (a shared prefix is walked, not bought);
  3. adjacency - the Token Recycling expansion of the anchor along the static template, merged
                 into whatever is left: its nodes already on the tree are walked and credited,
                 the rest are added breadth-first until the budget is spent.
`adjacency_reserve` nodes can be held back from steps 1-2 for step 3. Every node keeps the set of
sources that proposed it, so a token accepted on both the spine and the adjacency tree is
credited to both. With no automaton match the draft is adjacency-only (Algorithm 1's gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from decoder.draft import Draft
from decoder.drafters.features import automaton_features, rank_feature
from decoder.drafters.recycling import AdjacencyTable, default_template
from decoder.drafters.sam import AutomatonIndex, AutomatonPoolDrafter, automaton_chains

SPINE, BRANCH, ADJACENCY = "spine", "branch", "adjacency"


@dataclass
class LexicalConfig:
    spine_max: int = 32  # tokens copied after the longest automaton match
    branch_top: int = 3  # frequency branches at the match state
    branch_max: int = 32  # tokens per branch
    adjacency_reserve: int = 0  # nodes kept out of the automaton's reach for adjacency expansion


def build_lexical(index: AutomatonIndex, table: AdjacencyTable, budget: int, config: LexicalConfig,
                  chains: tuple[list[int], list[list[int]]] | None = None, match: int = 0,
                  support: Sequence[list[tuple[int, int]]] | None = None) -> Draft:
    """Spine, then frequency branches, then adjacency expansion, merged from the root under `budget`.

    `chains`: the (spine, branches) of `automaton_chains` when the caller already has them, `match` the
    spine's match length and `support` the support of every token of the spine and each branch
    (`sam.automaton_match_support`): their evidence (decoder/drafters/features.py)."""
    draft = Draft()
    if budget <= 0:
        return draft
    c = config
    spine, branches = chains if chains is not None else automaton_chains(index, c.spine_max, c.branch_top,
                                                                           c.branch_max)
    automaton_budget = max(0, budget - c.adjacency_reserve)
    if spine:
        draft.add_chain(spine, SPINE, automaton_budget,
                        feature=automaton_features(match, 0, support[0]) if support else 0)
    for rank, chain in enumerate(branches):
        if len(draft) >= automaton_budget:
            break
        feature = automaton_features(match, 1 + rank, support[1 + rank]) if support else rank_feature(rank)
        draft.add_chain(chain, BRANCH, automaton_budget, feature=feature)
    parents, ranks = default_template(budget)
    draft.merge(table.expand(index.anchor(), parents, ranks, budget, ADJACENCY), budget)
    return draft


class LexicalDrafter(AutomatonPoolDrafter):
    """Arm `lexical`: the automaton spine and branches with adjacency expansions filling the rest."""

    name = "lexical"
    Config = LexicalConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: LexicalConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or LexicalConfig()
        self.index = AutomatonIndex()
        self.table = AdjacencyTable(vocab_size)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.index.sync(context)
        return build_lexical(self.index, self.table, budget, self.config)

    def observe(self, context: Sequence[int], result) -> None:
        self.table.observe(int(context[-1]), result.draft.tokens, result.topk)
