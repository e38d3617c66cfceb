"""What a run's verification passes add up to, for the live decoder and replay alike (one definition).

Input: per request, its passes (`loop.Cycle`: nodes drafted, draft nodes accepted and committed,
tokens committed, the sources of every accepted node, drafting and update time). Output:

  tau                         committed tokens / passes, with a request-bootstrap interval
  accepted_by_source          accepted draft tokens per source (a token proposed by several sources
                              counts for each), drafted_by_source, acceptance_rate_by_source
  sole_source_share           the paper's definition: accepted tokens that only the semantic source
                              proposed, over ALL committed tokens (bonus tokens in the denominator)
  sole_source_share_of_draft  the same tokens over accepted draft tokens (bonus tokens left out)
  nodes_per_pass, draft_s_per_pass, update_s_per_pass   distributions
  by_depth                    per depth d of the accepted path (d = 1..32): the share of passes that
                              accept at least d draft tokens, and the accepted tokens at depth d per
                              source and proposed by the semantic source alone (where the key's gain lands)

Intervals resample whole requests (data.stats.RequestBootstrap); a statistic that is a ratio of
per-request sums is computed on the same draws, so paired comparisons (`paired_ratio`) resample
the requests of both arms jointly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from data.stats import RequestBootstrap

SEMANTIC_SOURCE = "semantic"  # the semantic key's source label

SOLE_DEFINITION = "accepted tokens only the semantic source proposed / all committed tokens (bonus tokens included)"
SOLE_DRAFT_DEFINITION = "accepted tokens only the semantic source proposed / accepted draft tokens (bonus tokens left out)"


def per_request_sums(per_request: Sequence[Sequence]) -> dict[str, np.ndarray]:
    """Per request: committed tokens, passes, accepted draft tokens, sole-semantic tokens."""
    out = {k: np.zeros(len(per_request)) for k in ("tokens", "passes", "accepted", "sole")}
    for r, cycles in enumerate(per_request):
        out["tokens"][r] = sum(c.committed for c in cycles)
        out["passes"][r] = len(cycles)
        out["accepted"][r] = sum(c.accepted for c in cycles)
        out["sole"][r] = sum(1 for c in cycles for label in c.sources if label == SEMANTIC_SOURCE)
    return out


def _distribution(values: np.ndarray, *quantiles: int) -> dict:
    if not len(values):
        return {"mean": None, **{f"p{q}": None for q in quantiles}, "max": None}
    return {"mean": float(values.mean()), **{f"p{q}": float(np.percentile(values, q)) for q in quantiles},
            "max": float(values.max())}


def _share(num: np.ndarray, den: np.ndarray, boot: RequestBootstrap | None, den_name: str, definition: str) -> dict:
    n, d = float(num.sum()), float(den.sum())
    return {"value": n / d if d else None, "interval": boot.interval(np.divide, num, den) if boot else None,
            "sole": int(n), den_name: int(d), "definition": definition}


def pass_statistics(per_request: Sequence[Sequence], has_key: bool, boot: RequestBootstrap | None) -> dict:
    """The summary block every decoder and replay summary.json shares (see the module docstring)."""
    sums = per_request_sums(per_request)
    cycles = [c for cs in per_request for c in cs]
    accepted: dict[str, int] = {}
    drafted: dict[str, int] = {}
    for c in cycles:
        for label in c.sources:
            for src in label.split("|"):
                accepted[src] = accepted.get(src, 0) + 1
        for src, k in c.node_sources.items():
            drafted[src] = drafted.get(src, 0) + k
    tokens, passes = sums["tokens"].sum(), sums["passes"].sum()
    return {
        "generated_tokens": int(tokens),
        "passes": int(passes),
        "tau": float(tokens / passes) if passes else None,
        "tau_interval": boot.interval(np.divide, sums["tokens"], sums["passes"]) if boot else None,
        "accepted_draft_tokens": int(sums["accepted"].sum()),
        "accepted_by_source": dict(sorted(accepted.items())),
        "drafted_by_source": dict(sorted(drafted.items())),
        "acceptance_rate_by_source": {s: accepted.get(s, 0) / k for s, k in sorted(drafted.items()) if k},
        "sole_source_share": _share(sums["sole"], sums["tokens"], boot, "tokens", SOLE_DEFINITION)
        if has_key else None,
        "sole_source_share_of_draft": _share(sums["sole"], sums["accepted"], boot, "accepted", SOLE_DRAFT_DEFINITION)
        if has_key else None,
        "mean_nodes": float(np.mean([c.nodes for c in cycles])) if cycles else 0.0,
        # accepted draft tokens per verified node: what a node the engine pays for returns
        "accepted_per_node": float(sums["accepted"].sum() / max(1, sum(c.nodes for c in cycles))) if cycles else None,
        "nodes_per_pass": _distribution(np.array([c.nodes for c in cycles], float), 50),
        "draft_s_per_pass": _distribution(np.array([c.draft_s for c in cycles], float), 50, 99),
        "update_s_per_pass": _distribution(np.array([c.update_s for c in cycles], float), 50, 99),
        "by_depth": depth_profile(cycles),
    }


DEPTHS = 32  # by_depth covers depths 1..DEPTHS of the accepted path
DEPTH_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the depths the printed and rendered tables show


def depth_profile(cycles: Sequence, depths: int = DEPTHS) -> dict:
    """Per depth d (1-based) of the accepted path: `reach[d-1]` = passes accepting >= d draft tokens /
    passes; `by_source[src][d-1]` = accepted tokens at depth d the source proposed (a token several
    sources proposed counts for each); `sole_semantic[d-1]` = those only the semantic source proposed."""
    reach = np.zeros(depths, np.int64)
    sole = np.zeros(depths, np.int64)
    by_source: dict[str, np.ndarray] = {}
    for c in cycles:
        reach[:min(c.accepted, depths)] += 1
        for d, label in enumerate(c.sources[:depths]):
            for src in label.split("|"):
                by_source.setdefault(src, np.zeros(depths, np.int64))[d] += 1
            sole[d] += label == SEMANTIC_SOURCE
    n = max(len(cycles), 1)
    return {"depths": depths, "passes": len(cycles), "reach": (reach / n).round(6).tolist(),
            "by_source": {k: v.tolist() for k, v in sorted(by_source.items())}, "sole_semantic": sole.tolist()}


def paired_ratio(num: np.ndarray, den: np.ndarray, boot: RequestBootstrap | None) -> tuple[float | None, list | None]:
    """sum(num) / sum(den) over requests and its interval, both arms' requests resampled jointly."""
    total = float(np.sum(den))
    value = float(np.sum(num)) / total if total else None
    return value, boot.interval(np.divide, num, den) if boot else None
