"""Intervals (census and decoder alike): Wilson score intervals for proportions, and a request-level bootstrap for anything.

Positions inside one request are not independent draws, so the Wilson interval (which treats
them as such) is optimistic; the bootstrap resamples whole requests instead. Every statistic of
one summary is computed on the same draws. A draw is a vector of integer multiplicities over the
requests (multinomial(R, 1/R)), so a statistic that is a function of per-request sums is
vectorised as fn(W @ sums); the interval is the 2.5th-97.5th percentile over the draws where the
statistic is defined (a draw whose denominator is empty is skipped).
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(k: float, n: float, z: float = Z95) -> list[float] | None:
    """Wilson score interval of k successes in n trials; None when n = 0."""
    if n <= 0:
        return None
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return [max(0.0, center - half), min(1.0, center + half)]


class RequestBootstrap:
    """B request-level resamples, as multiplicities W [B, R]; draws = 0 gives no intervals."""

    def __init__(self, n_requests: int, draws: int, seed: int):
        self.n_requests = n_requests
        if draws > 0 and n_requests > 0:
            rng = np.random.default_rng(seed)
            self.W = rng.multinomial(n_requests, np.full(n_requests, 1.0 / n_requests), size=draws)
        else:
            self.W = None

    def interval(self, fn, *per_request: np.ndarray) -> list[float] | None:
        """Percentile interval of fn(*sums) where sums[i] = W @ per_request[i]."""
        if self.W is None:
            return None
        sums = [self.W @ np.asarray(a, np.float64) for a in per_request]
        with np.errstate(divide="ignore", invalid="ignore"):
            stat = np.asarray(fn(*sums), np.float64)
        stat = stat[np.isfinite(stat)]
        if stat.size == 0:
            return None
        lo, hi = np.percentile(stat, [2.5, 97.5])
        return [float(lo), float(hi)]

    def median_interval(self, values: np.ndarray, request: np.ndarray) -> list[float] | None:
        """Percentile interval of the median of `values` (one per position, of request `request`)."""
        if self.W is None or len(values) == 0:
            return None
        order = np.argsort(values, kind="stable")
        v = np.asarray(values, np.float64)[order]
        req = np.asarray(request)[order]
        out = []
        step = max(1, (1 << 24) // max(1, len(v)))
        for lo in range(0, self.W.shape[0], step):
            w = self.W[lo:lo + step][:, req]  # multiplicity of every position in each draw
            cum = np.cumsum(w, axis=1)
            total = cum[:, -1]
            live = total > 0
            cum, total = cum[live], total[live]
            lower = (cum <= ((total - 1) // 2)[:, None]).sum(axis=1)  # rank (T-1)//2 of the expanded draw
            upper = (cum <= (total // 2)[:, None]).sum(axis=1)
            out.append((v[lower] + v[upper]) / 2)
        stat = np.concatenate(out) if out else np.zeros(0)
        if stat.size == 0:
            return None
        lo, hi = np.percentile(stat, [2.5, 97.5])
        return [float(lo), float(hi)]


def proportion(num: np.ndarray, den: np.ndarray, request: np.ndarray, boot: RequestBootstrap) -> dict:
    """{value, wilson, bootstrap, k, n} for the positions where den holds, success where num also does."""
    num = np.asarray(num, bool) & np.asarray(den, bool)
    den = np.asarray(den, bool)
    k, n = int(num.sum()), int(den.sum())
    R = boot.n_requests
    num_r = np.bincount(request, weights=num, minlength=R)
    den_r = np.bincount(request, weights=den, minlength=R)
    return {"value": k / n if n else None, "wilson": wilson(k, n), "bootstrap": boot.interval(np.divide, num_r, den_r),
            "k": k, "n": n}


def mean_of(values: np.ndarray, mask: np.ndarray, request: np.ndarray, boot: RequestBootstrap) -> dict:
    """{value, bootstrap, n}: the mean of values where mask holds."""
    mask = np.asarray(mask, bool)
    vals = np.where(mask, np.asarray(values, np.float64), 0.0)
    n = int(mask.sum())
    R = boot.n_requests
    return {"value": float(vals.sum() / n) if n else None,
            "bootstrap": boot.interval(np.divide, np.bincount(request, weights=vals, minlength=R),
                                       np.bincount(request, weights=mask, minlength=R)),
            "n": n}


def median_of(values: np.ndarray, mask: np.ndarray, request: np.ndarray, boot: RequestBootstrap) -> dict:
    mask = np.asarray(mask, bool)
    v = np.asarray(values)[mask]
    return {"value": float(np.median(v)) if len(v) else None,
            "bootstrap": boot.median_interval(v, np.asarray(request)[mask]), "n": int(mask.sum())}
