"""The one draft format every source uses: a token tree, merged from the root under a node budget.

A draft is a forest hanging under the anchor (the last committed token): node i has token
`tokens[i]`, parent `parents[i]` (-1 = child of the anchor; parents always precede children),
and `sources[i]`, the set of drafters that proposed it. Merging a chain re-walks the tree from
the root (or from `attach`) and pays only for the tokens not already on that path, so two
sources proposing the same continuation share nodes and both get credit.

The evidence for a probability: `evidence[i]` maps each source of node i to (feature, position): the
source's feature bucket for the chain that proposed it (an automaton match length, a key's cosine, an
adjacency rank: decoder/drafters/features.py) and the node's place in that chain (0 = its first token).
`probs[i]`, when a drafter set it, is the estimated probability that node i is accepted given that its
parent is (decoder/calibration.py); an empty list means no estimate (a peer's draft).

`VerifyResult` is what a verification tells the drafter; `Drafter` is the contract every drafter
implements (begin_request, propose, observe / observe_split, add_trace, evict_traces, counters, untimed_s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

# The most draft nodes one verification pass may hold, in every CLI (--nodes of the live decoder, replay,
# ablations and the profile) and in vLLM's settings: the profile measures the verifier up to here, and a tree
# far beyond it only costs memory (the live decoder took --nodes 100000, grew to 19.7 GB and was OOM-killed,
# issue 35). Defined with vLLM's settings, in data, which may not import the decoder.
from data.capture.vllm_settings import MAX_NODES  # noqa: F401  (decoder.draft.MAX_NODES: every CLI's bound)

ROOT = -1  # parent index meaning "child of the anchor"


def nodes_error(nodes: int, least: int = 0, flag: str = "--nodes") -> str | None:
    """Why `nodes` is no node budget (`least`..MAX_NODES), as the one-line error's text; None when it is one."""
    if least <= nodes <= MAX_NODES:
        return None
    return f"{flag} must be {least}..{MAX_NODES} draft nodes per pass (got {nodes})"


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    sources: list[set[str]] = field(default_factory=list)
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)  # (parent, token) -> node
    evidence: list[dict[str, tuple[int, int]]] = field(default_factory=list)  # source -> (feature, position)
    probs: list[float] = field(default_factory=list)  # P(accepted | parent accepted) per node; [] = no estimate

    def __post_init__(self) -> None:
        # a draft written out by hand (tests, a peer's) carries no evidence: each source's is (0, 0)
        self.evidence.extend({s: (0, 0) for s in srcs} for srcs in self.sources[len(self.evidence):])

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        return self._children.get((parent, token))

    def add_node(self, parent: int, token: int, source: str, feature: int = 0, position: int = 0) -> int:
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.sources.append({source})
        self.evidence.append({source: (feature, position)})
        self._children[(int(parent), int(token))] = node
        return node

    def add_chain(self, chain: Sequence[int], source: str, budget: int, attach: int = ROOT,
                  feature: int | Sequence[int] = 0) -> int:
        """Merge `chain` below `attach`, walking existing nodes first; new nodes stop at `budget` total.

        Returns the number of new nodes (cost = |chain| - longest prefix already present, capped
        by the budget). Nodes walked through are credited to `source` as well; every node of the chain
        records (feature, its position in the chain) as `source`'s evidence (the first record of a source
        on a node is kept); `feature` is one for the chain or one per token.
        """
        children, sources, tokens, evidence = self._children, self.sources, self.tokens, self.evidence
        per_token = not isinstance(feature, int)
        node, added = attach, 0
        for position, tok in enumerate(chain):  # this loop runs on every pass
            f = feature[position] if per_token else feature
            nxt = children.get((node, tok))  # a numpy integer hashes and compares as its int
            if nxt is None:
                if len(tokens) >= budget:
                    break
                nxt = self.add_node(node, tok, source, f, position)
                added += 1
            else:
                sources[nxt].add(source)
                evidence[nxt].setdefault(source, (f, position))
            node = nxt
        return added

    def merge(self, other: "Draft", budget: int) -> int:
        """Merge every root-to-leaf path of `other` (keeping its per-node sources); returns nodes added."""
        added = 0
        mapped: dict[int, int] = {ROOT: ROOT}
        for i, (tok, par) in enumerate(zip(other.tokens, other.parents)):
            base = mapped.get(par)
            if base is None:
                continue  # parent did not fit in the budget
            nxt = self._children.get((base, tok))
            if nxt is None:
                if len(self.tokens) >= budget:
                    continue
                nxt = self.add_node(base, tok, next(iter(other.sources[i])))
                self.evidence[nxt] = {}
                added += 1
            self.sources[nxt] |= other.sources[i]
            for source, record in other.evidence[i].items():
                self.evidence[nxt].setdefault(source, record)
            mapped[i] = nxt
        return added

    def depths(self) -> np.ndarray:
        """Depth of every node (children of the anchor have depth 1)."""
        d = np.zeros(len(self.tokens), dtype=np.int64)
        for i, p in enumerate(self.parents):
            d[i] = 1 if p == ROOT else d[p] + 1
        return d

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def chain_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path_to(node)]


def best_path(parents: Sequence[int], score: Sequence[float], k: int) -> list[int]:
    """From the anchor, at each node the child of the highest `score` (ties: the earlier child), at most `k`
    nodes: the one chain a chain verifier (vLLM: one draft list per row) takes from a tree."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    chain, node = [], ROOT
    while len(chain) < k and node in children:
        node = max(children[node], key=lambda i: (score[i], -i))
        chain.append(node)
    return chain


def best_chain(draft: Draft, k: int) -> list[int]:
    """`best_path` by agreement: at each node the child the most sources proposed, ties to the earliest child
    (the source merged first: the host's spine). Agreement between sources is the only evidence a training-free
    tree carries about which branch the model will take (size fixed; size auto scores by probability)."""
    return best_path(draft.parents, [len(s) for s in draft.sources], k)


def subtree(draft: Draft, nodes: Sequence[int]) -> Draft:
    """The nodes `nodes` of `draft` (each one's parent listed before it, or the anchor) as a draft of their own,
    in that order, with their sources, evidence and probabilities: a chain when `nodes` is a root path."""
    new_of = {ROOT: ROOT}
    for j, i in enumerate(nodes):
        new_of[i] = j
    tokens, parents = [draft.tokens[i] for i in nodes], [new_of[draft.parents[i]] for i in nodes]
    children: dict[tuple[int, int], int] = {}
    for j, key in enumerate(zip(parents, tokens)):
        children.setdefault(key, j)  # a duplicate sibling (root-attached) keeps the first, as add_chain walks it
    # the evidence is shared, not copied: nothing adds to a drafted node's evidence after the draft is proposed
    return Draft(tokens, parents, [set(draft.sources[i]) for i in nodes], children,
                 [draft.evidence[i] for i in nodes], [draft.probs[i] for i in nodes] if draft.probs else [])


@dataclass
class VerifyResult:
    """What one verification forward tells the drafters (indices: 0 = anchor, 1 + i = draft node i)."""

    draft: Draft
    accepted_nodes: list[int]  # draft node indices on the accepted root path, in order
    bonus: int  # the model's token after the accepted path
    committed: list[int]  # accepted tokens + bonus, as appended to the context
    argmax: np.ndarray  # [1 + N] the model's next token at the anchor and at each node
    topk: np.ndarray  # [1 + N, 8] the model's top-8 next tokens at the anchor and each node
    hidden: np.ndarray | None  # [1 + N, d] capture-layer states at the anchor and each node (float32)


class Drafter:
    """The drafter contract: every drafter (decoder/drafters/*, the test drafters) derives from it, and the
    loop (decoder/loop.py), the request runner and the pools (decoder/pools.py) call nothing else.

    One request: `begin_request`, then per pass `propose` and `observe` (the loop calls `observe_split`);
    when it has finished, the runner calls `add_trace` (the trace enters the pool) and, under a
    --store-budget, `evict_traces` before a later request. The defaults are those of a drafter without a cross-request pool: it adds and evicts
    nothing, learns nothing, counts nothing and does no measurement-only work."""

    name: str = "drafter"

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        """A request starts from `prompt`: pooled traces under the same prompt hash (None: the drafter's own
        hash of the prompt) are never drafted from during it."""

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        """A draft of at most `budget` nodes continuing `context` (prompt + committed tokens)."""
        raise NotImplementedError(f"{type(self).__name__} does not propose")

    def observe(self, context: Sequence[int], result: VerifyResult) -> None:
        """Learn from a verification (context before the commit), all of it now."""

    def observe_split(self, context: Sequence[int], result: VerifyResult) -> Callable[[], None] | None:
        """`observe` in two parts, as the loop calls it (decoder/loop.py): what the next propose must read is
        learnt now; the rest is returned as a callable, which the loop runs after the next pass's launch,
        beside its verify, and before the propose after it (None: nothing left). The next propose then drafts
        without that rest; a drafter that defers keeps its drafts independent of where the rest runs. The
        default defers nothing."""
        self.observe(context, result)
        return None

    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None,
                  hidden: np.ndarray | None = None) -> None:
        """A finished request's generated tokens (and their states, the store's convention: row i = the
        state with output[i] as input, the last row zeros) enter the pool under its prompt hash (None: a
        group of its own, never excluded)."""

    def evict_traces(self, count: int) -> None:
        """Forget the oldest `count` pooled traces (one per add_trace, empty ones included): the
        --store-budget window. State that is not a trace pool stays."""

    def suspend_request(self) -> object:
        """The running request's state, for a server that interleaves requests (decoder/vllm/proposer.py:
        one drafter, many rows): after `resume_request(state)` the next `propose` and `observe` continue
        that request as if no other had run meanwhile, with the pool as it is then. A drafter that keeps
        nothing per request returns None."""
        return None

    def resume_request(self, state: object) -> None:
        """Continue the request `suspend_request` returned `state` for."""

    def counters(self) -> dict | None:
        """The drafter's counters for summary.json's drafter_stats (None: it keeps none)."""
        return None

    @property
    def untimed_s(self) -> float:
        """Seconds of measurement-only work done inside propose so far (e.g. knn_recall shadow queries):
        the loop leaves them out of the drafting time."""
        return 0.0
