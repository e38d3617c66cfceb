"""A probability on every draft node: P(node accepted | its parent accepted), learned online from verification.

Every source that proposes a node records evidence on it (decoder/draft.py `Draft.evidence`): its feature
bucket (decoder/drafters/features.py: the automaton's match length, the branch's rank, the adjacency rank,
the key's cosine and neighbour rank) and the node's position in the proposing chain. `NodeCalibrator`
turns that into a number, and learns from every verification which numbers were right.

The estimate of one source, in three levels, each shrunk towards the one above by PRIOR_STRENGTH
pseudo-observations (a bucket seen rarely reads like its parent, one seen often like itself):
    p(source)                        = (accepted + 1) / (trials + 2)
    p(source, position)              = (accepted + m p(source)) / (trials + m)
    p(source, position, feature)     = (accepted + m p(source, position)) / (trials + m)
A node that several sources propose combines them: the noisy-or 1 - prod(1 - p_s) is the prior of a
combination bucket (its value in COMBO_BINS bins, the number of sources up to 3), learned the same way;
agreeing sources are correlated, so the noisy-or alone overstates, and the bucket corrects it.

Labels. After a verification the model's next token is known at the anchor and at every accepted node. A
candidate node whose parent is one of those is labelled: accepted iff its token is that next token. That
holds for candidates the sizing rule left out of the verified tree too (their parent's next token was
computed), so the estimates learn from nodes the tree did not pay for, and pruning does not starve a
bucket of evidence. Candidates below a rejected node say nothing (their parent was not accepted). Replay
labels the same way: the store's trace is the model's next token along the accepted path.

Evidence of calibration. Every label is first scored against the estimate made before it was seen
(prequential): per source and for the combined node estimate, ECE_BINS equal-width bins of predicted
probability, with count, summed prediction and summed outcome; the expected calibration error is
sum_b n_b / N * |mean predicted_b - mean observed_b| (`expected_calibration_error`, tested against a direct
computation).

Why our own counts rather than a library (scikit-learn's isotonic or Platt calibration): the estimates are
asked and updated on every pass, inside the drafting time (tens of microseconds), and the buckets are a
handful of small integers; a fitted model would be refitted per pass or go stale.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

import numpy as np

POSITION_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24)  # position bucket = how many of these edges are <= position
PRIOR_STRENGTH = 4.0  # pseudo-observations a level borrows from the level above
COMBO_BINS = 20  # the noisy-or's bins for a node several sources propose
ECE_BINS = 10
COMBINED = "node"  # the ECE entry of the combined per-node estimate
REFRESH_LABELS = 256  # the cached estimates are recomputed after this many labels (after every pass while the
#                       counts are young: labels / 8); one label moves a bucket of n trials by at most 1 / n


REGIME_EDGES = (1, 4, 12)  # a request's regime: its last pass accepted 0, 1-3, 4-11, 12+ tokens (+1; 0 = no pass yet)


def position_bucket(position: int) -> int:
    return bisect_right(POSITION_EDGES, position)


def regime_of(last_accepted: int | None) -> int:
    """The request's regime for the next pass: 0 before its first verification, else 1 + the bucket of how many
    draft tokens its last pass accepted (a request copying a long passage keeps accepting)."""
    return 0 if last_accepted is None else 1 + bisect_right(REGIME_EDGES, last_accepted)


def expected_calibration_error(bins: np.ndarray) -> float | None:
    """ECE of `bins` [B, 3] (count, summed prediction, summed outcome): the count-weighted mean of
    |mean prediction - mean outcome| over non-empty bins; None with no observation."""
    bins = np.asarray(bins, dtype=np.float64)
    n = bins[:, 0]
    total = n.sum()
    if total <= 0:
        return None
    full = n > 0
    return float(np.sum(np.abs(bins[full, 1] - bins[full, 2])) / total)


class NodeCalibrator:
    """Per-source, per-bucket acceptance counts; estimates for a draft's nodes; updates from labels.

    Written for the drafting pass's budget (tens of microseconds for a 60-node tree): estimates are cached per
    (source, feature, position) and recomputed once REFRESH_LABELS labels were learnt (so an estimate may lag
    its bucket by that many labels; it is still made before its own label is seen), and a node's detail is its
    sources' estimates alone, in its evidence's order (`observe` re-derives the buckets from the evidence)."""

    def __init__(self, prior_strength: float = PRIOR_STRENGTH) -> None:
        self.m = float(prior_strength)
        self.counts: dict[tuple, list[float]] = {}  # key -> [trials, accepted]
        self._cache: dict[tuple, float] = {}  # (source, feature, position) -> estimate, since the last update
        self.bins: dict[str, list[list[float]]] = {}  # source (or COMBINED) -> ECE_BINS x [count, sum p, sum y]
        self.labels = 0
        self._since_refresh = 0  # labels learnt since the cache was last cleared

    # ------------------------------------------------------------ estimates
    def _rate(self, key: tuple, prior: float) -> float:
        c = self.counts.get(key)
        return prior if c is None else (c[1] + self.m * prior) / (c[0] + self.m)

    def source_p(self, source: str, feature: int, position: int, regime: int = 0) -> float:
        """The three-level estimate (module docstring) of `source`'s node at `position` of a chain of `feature`,
        in the request's `regime` (how much its last pass accepted: `regime_of`)."""
        key = (source, position_bucket(position), regime, feature)
        c = self.counts.get((source,))
        p0 = 0.5 if c is None else (c[1] + 1.0) / (c[0] + 2.0)
        return self._rate(key, self._rate(key[:3], p0))

    def combined_p(self, ps: Sequence[float]) -> float:
        """The node's estimate from its sources' (one source: its own)."""
        if len(ps) == 1:
            return ps[0]
        key, noisy_or = _combo(ps)
        return self._rate(key, noisy_or)

    def estimate(self, evidence: Sequence[dict[str, tuple[int, int]]], regime: int = 0) -> tuple[list[float], list]:
        """(P(accepted | parent accepted) per node, per node its sources' estimates in evidence order: a float for
        a node of one source, a tuple for several), in the request's `regime`."""
        cache, source_p = self._cache, self.source_p
        probs, detail = [], []
        for ev in evidence:
            if len(ev) == 1:
                for s, (f, pos) in ev.items():
                    q = cache.get((s, f, pos, regime))
                    if q is None:
                        q = cache[(s, f, pos, regime)] = source_p(s, f, pos, regime)
                probs.append(q)
                detail.append(q)
                continue
            qs = []
            for s, (f, pos) in ev.items():
                q = cache.get((s, f, pos, regime))
                if q is None:
                    q = cache[(s, f, pos, regime)] = source_p(s, f, pos, regime)
                qs.append(q)
            probs.append(self.combined_p(qs) if qs else 0.0)
            detail.append(tuple(qs))
        return probs, detail

    # ------------------------------------------------------------ learning
    def observe(self, evidence: Sequence[dict[str, tuple[int, int]]], probs: Sequence[float], detail: Sequence,
                labels: dict[int, bool], regime: int = 0) -> None:
        """Score, then learn, the labelled nodes (`labels`: node -> accepted) of a draft that `estimate` priced
        (its evidence, the probabilities and detail it returned, the regime it was priced in)."""
        counts = self.counts
        for node, accepted in labels.items():
            y = 1.0 if accepted else 0.0
            qs = detail[node]
            qs = (qs,) if isinstance(qs, float) else qs
            for (source, (f, pos)), q in zip(evidence[node].items(), qs):
                self._score(source, q, y)
                pb = position_bucket(pos)
                for key in ((source,), (source, pb, regime), (source, pb, regime, f)):
                    c = counts.get(key)
                    if c is None:
                        c = counts[key] = [0.0, 0.0]
                    c[0] += 1.0
                    c[1] += y
            if len(qs) > 1:
                c = counts.setdefault(_combo(qs)[0], [0.0, 0.0])
                c[0] += 1.0
                c[1] += y
            self._score(COMBINED, probs[node], y)
            self.labels += 1
        self._since_refresh += len(labels)
        if self._since_refresh >= min(REFRESH_LABELS, 1 + self.labels // 8):
            self._cache.clear()  # estimates follow the counts within REFRESH_LABELS labels (every pass early on)
            self._since_refresh = 0

    def _score(self, name: str, p: float, y: float) -> None:
        bins = self.bins.get(name)
        if bins is None:
            bins = self.bins[name] = [[0.0, 0.0, 0.0] for _ in range(ECE_BINS)]
        b = bins[min(int(p * ECE_BINS), ECE_BINS - 1)]
        b[0] += 1.0
        b[1] += p
        b[2] += y

    def summary(self) -> dict:
        """summary.json's calibration block: per source (and `node`, the combined estimate) the labels, the ECE
        and the bins [count, summed prediction, summed outcome] (merged over tenants by `merge_summaries`)."""
        return _summaries({name: np.asarray(b) for name, b in self.bins.items()})


def _combo(ps: Sequence[float]) -> tuple[tuple, float]:
    """The combination bucket of a node's source estimates (sources up to 3, the noisy-or's bin) and the noisy-or."""
    miss = 1.0
    for q in ps:
        miss *= 1.0 - q
    return ("+", min(len(ps), 3), min(int((1.0 - miss) * COMBO_BINS), COMBO_BINS - 1)), 1.0 - miss


def _summaries(bins: dict[str, np.ndarray]) -> dict:
    return {name: {"labels": int(b[:, 0].sum()), "ece": expected_calibration_error(b), "bins": b.round(6).tolist()}
            for name, b in sorted(bins.items())}


def merge_summaries(blocks: Sequence[dict]) -> dict:
    """Calibration blocks of several drafters (tenants) as one: bins added, ECE recomputed."""
    bins: dict[str, np.ndarray] = {}
    for block in blocks:
        for name, entry in (block or {}).items():
            b = np.asarray(entry["bins"], dtype=np.float64)
            bins[name] = bins[name] + b if name in bins else b
    return _summaries(bins)


def accepted_labels(parents: Sequence[int], tokens: Sequence[int], next_token: dict[int, int]) -> dict[int, bool]:
    """Labels for a candidate tree: `next_token` maps a known node (-1: the anchor) to the model's next token
    after it; every candidate whose parent is known is labelled, accepted iff its token is that next token
    (a negative next token, unknown, labels nothing)."""
    out = {}
    for i, p in enumerate(parents):
        want = next_token.get(p)
        if want is not None and want >= 0:
            out[i] = tokens[i] == want
    return out
