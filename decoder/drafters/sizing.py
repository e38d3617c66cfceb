"""The tree (or chain) that maximises expected tokens per second, as pure functions over a priced draft.

A draft node's path probability is the product of its own and its ancestors' P(accepted | parent accepted)
(decoder/calibration.py): the probability that verification accepts it. Expected tokens of a pass that
verifies a set S of nodes closed under parents = 1 (the bonus) + sum of S's path probabilities (siblings
hold distinct tokens, so at most one path is accepted at each level and the sum counts each accepted node
once). Its seconds: the engine's step with |S| draft tokens at this context and batch size, from the
engine's profile (`StepCost`, over decoder/cost/model.py's CostModel).

  tree   keep the nodes in order of path probability (ties: the earlier node; a parent's path probability is
         never below its child's, so every prefix of that order is closed under parents) and choose the count
         n in 0..N maximising (1 + sum of the first n path probabilities) / step_s[n];
  chain  (one list per row, as vLLM verifies) from the anchor, at each node the child with the highest
         probability (ties: the earlier node), up to k nodes; then the same rule cuts it: n in 0..k.

The drafting time is left out of the ratio: it does not depend on n (the candidates are built before the
cut), and on the engines measured it is under 2% of a step (docs/replay.md).
With a flat profile (a step costs the same whatever n) the ratio grows with every node of positive
probability, so the whole candidate tree is kept: the fixed budget's tree.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from decoder.draft import ROOT, best_path


def path_probs(parents: Sequence[int], probs: Sequence[float]) -> np.ndarray:
    """P(node accepted) = its probability times its parent's path probability (parents precede children)."""
    out = np.empty(len(parents), np.float64)
    for i, (p, q) in enumerate(zip(parents, probs)):
        out[i] = q if p == ROOT else q * out[p]
    return out


def best_count(gains: np.ndarray, step_s: np.ndarray) -> int:
    """argmax over n in 0..len(gains) of (1 + sum(gains[:n])) / step_s[n] (ties: the larger n: a node whose path
    probability is too small to change the sum in float64 costs nothing where the step does not grow, and is
    left out wherever it does)."""
    n = min(len(gains), len(step_s) - 1)
    value = np.concatenate([[1.0], 1.0 + np.cumsum(gains[:n])]) / step_s[:n + 1]
    return n - int(np.argmax(value[::-1]))


def select_tree(path: np.ndarray, step_s: np.ndarray) -> list[int]:
    """The nodes to verify, given every node's path probability (`path_probs`), in draft order so parents still
    precede children: module docstring, tree."""
    if not len(path):
        return []
    order = np.lexsort((np.arange(len(path)), -path))  # by path probability, ties to the earlier node
    n = best_count(path[order], step_s)
    return sorted(order[:n].tolist())


def select_chain(parents: Sequence[int], probs: Sequence[float], path: np.ndarray, step_s: np.ndarray,
                 k: int) -> list[int]:
    """The chain to verify (module docstring, chain), given the nodes' probabilities and path probabilities."""
    chain = best_path(parents, probs, k)  # the most probable child at each node (decoder/draft.py)
    return chain[:best_count(path[chain], step_s)] if chain else []


class StepCost:
    """Seconds of one engine step verifying n = 0..cap draft tokens per row at a context, from a profile at one
    batch size (decoder/cost/model.py CostModel); tables cached per 16 tokens of context.

    The table stops at the most draft nodes the profile measured (a shorter table: the rule then chooses among
    measured counts only, never a size priced by extrapolation, decoder/cost/pricing.py); a context outside the
    measured ones takes the nearest measured context's costs (CostModel clamps): the choice of a size, which a
    server must make on any traffic, is never refused."""

    ROUND = 16

    def __init__(self, cost=None, batch: int = 1) -> None:
        self.cost = None if cost is None else cost.at_batch(batch)
        self.batch = batch
        self._tables: dict[tuple[int, int], np.ndarray] = {}

    def describe(self) -> str:
        """What sizes the draft, for summary.json: the profile's engine and batch size, or flat."""
        if self.cost is None:
            return "flat"
        return f"{self.cost.meta.get('engine', 'harness')} profile, batch {self.batch}"

    def table(self, cap: int, past_len: int) -> np.ndarray:
        if self.cost is not None:
            cap = min(cap, self.cost.nodes_range()[1])
        key = (cap, past_len // self.ROUND)
        t = self._tables.get(key)
        if t is None:
            if self.cost is None:
                t = np.ones(cap + 1)
            else:
                t = np.asarray(self.cost.verify_s(np.arange(cap + 1), key[1] * self.ROUND), np.float64)
            self._tables[key] = t
        return t
