"""Tie-aware recall@k of an approximate nearest-neighbour answer against exact search.

The definition, written once: for a query with exact scores s (cosine of every candidate row; rows
that may not be returned, e.g. the excluded same-prompt rows, are not candidates) and an answer of
rows R, with k' = min(k, candidates) and s_k = the k'-th largest exact score,

    a returned row r is a hit  iff  s[r] >= s_k - tol          recall = hits / k'

(duplicate rows count once, a row that is not a candidate is a miss). The tolerance makes ties
fair: states are stored in float16, so an index may return any of several rows whose exact scores
are equal up to rounding, and plain set recall would call that a miss. `tol` = 1e-3 covers the
float16 rounding of unit vectors' cosines (spacing about 5e-4 near 1). A whole run's recall is the
sum of hits over the sum of k' (`recall_hits` and `tie_aware_recall` give both parts).
"""

from __future__ import annotations

import numpy as np

TIE_TOLERANCE = 1e-3
DEFINITION = ("tie-aware recall@k: a returned row counts as a hit when its exact cosine is at least the k-th "
              "largest exact cosine over the candidate rows minus 1e-3; hits / min(k, candidates), summed over "
              "queries")


def kth_largest(scores: np.ndarray, k: int) -> tuple[float, int]:
    """(the k'-th largest finite score, k' = min(k, finite scores)); (-inf, 0) when none is finite."""
    s = np.asarray(scores, np.float64).reshape(-1)
    s = s[np.isfinite(s)]
    wanted = min(int(k), len(s))
    if wanted <= 0:
        return -np.inf, 0
    return float(np.partition(s, len(s) - wanted)[len(s) - wanted]), wanted


def recall_hits(returned_exact: np.ndarray, kth: float, wanted: int, tol: float = TIE_TOLERANCE) -> int:
    """Hits among the returned rows, given their exact scores (-inf or nan: not a candidate, a miss), the
    k'-th largest exact score `kth` and k' = `wanted`; at most `wanted`."""
    s = np.asarray(returned_exact, np.float64).reshape(-1)
    hits = int(np.count_nonzero(np.isfinite(s) & (s >= kth - tol)))
    return min(hits, int(wanted))


def tie_aware_recall(exact_scores: np.ndarray, returned: np.ndarray, k: int,
                     tol: float = TIE_TOLERANCE) -> tuple[int, int]:
    """(hits, k') of one query: `exact_scores` [n] holds every row's exact score (-inf: not a candidate),
    `returned` the answer's row numbers (duplicates count once; rows outside 0..n-1 are misses)."""
    s = np.asarray(exact_scores, np.float64).reshape(-1)
    kth, wanted = kth_largest(s, k)
    rows = np.unique(np.asarray(returned, np.int64).reshape(-1))
    inside = rows[(rows >= 0) & (rows < len(s))]
    return recall_hits(s[inside], kth, wanted, tol), wanted
