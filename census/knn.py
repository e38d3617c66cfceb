"""Exact cosine top-k, batched: one matrix product per request, on CUDA when available.

Ranking is defined on exact cosines (float64 over the stored values) with a deterministic
tie-break, so the answer does not depend on the device or on BLAS blocking. The search itself runs
in float32 (TF32 off): a float32 dot product of unit vectors is within delta = (d + 8) * 2^-24 of
the exact cosine (the standard gamma_d bound, plus the rounding of the normalisation), so every
member of the exact top-k has a float32 score >= s_k - 2 delta, where s_k is the k-th float32
score. Those few shortlisted pairs are rescored in float64 and ranked by (-cosine, tiebreak).

faiss is not used here: its exact index (IndexFlatIP) is this same matrix product with a heap, and
its approximate indices would break exactness; torch.topk on the product is as fast on CPU and runs
on CUDA unchanged. `--index` (keys.py's IndexedKey, data/index/stateindex.py) is where faiss comes in, to
measure what a compressed index costs against this exact key.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

CHUNK_ELEMENTS = 1 << 25  # float32 scores held at once (128 MiB)


def float32_margin(d: int) -> float:
    """2 delta: how far below the k-th float32 score an exact top-k member can fall."""
    return 2.0 * (d + 8) * 2.0 ** -24


def unit_rows(x: np.ndarray, valid: np.ndarray | None = None, chunk: int = 1 << 14) -> tuple[np.ndarray, np.ndarray]:
    """float64 norms of the raw rows, and float32 unit rows (zero rows where invalid or of norm 0)."""
    n = len(x)
    norms = np.zeros(n)
    unit = np.zeros(np.shape(x), np.float32)
    for lo in range(0, n, chunk):  # chunked: a float64 copy of a large store would not fit
        x64 = np.asarray(x[lo:lo + chunk], dtype=np.float64)
        nrm = np.sqrt(np.einsum("ij,ij->i", x64, x64))
        ok = nrm > 0
        if valid is not None:
            ok &= np.asarray(valid[lo:lo + chunk], bool)
        norms[lo:lo + chunk] = nrm
        unit[lo:lo + chunk][ok] = x64[ok] / nrm[ok, None]
    return norms, unit


def row_norms(x: np.ndarray, chunk: int = 1 << 14) -> np.ndarray:
    """float64 norms of the raw rows (unit_rows' norms, without the unit copy)."""
    norms = np.zeros(len(x))
    for lo in range(0, len(x), chunk):
        x64 = np.asarray(x[lo:lo + chunk], dtype=np.float64)
        norms[lo:lo + chunk] = np.sqrt(np.einsum("ij,ij->i", x64, x64))
    return norms


def exact_cosines(a: np.ndarray, a_norm: np.ndarray, b: np.ndarray, b_norm: np.ndarray) -> np.ndarray:
    """Row-wise float64 cosines of paired raw rows."""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    return np.einsum("ij,ij->i", a64, b64) / (a_norm * b_norm)


def topk_exact(queries: torch.Tensor, pool: torch.Tensor, pool_ok: torch.Tensor, k: int,
               rescore: Callable[[np.ndarray, np.ndarray], np.ndarray], tiebreak: np.ndarray,
               margin: float, floor: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k pool rows per query by exact cosine.

    queries [nq, d], pool [np, d]: float32 unit rows on one device; pool_ok [np] bool: rows that
    may be returned. rescore(query_rows, pool_rows) -> exact float64 cosines of those pairs.
    tiebreak [np] int64: among equal cosines the smaller value ranks first.
    floor [nq] (optional): rows whose exact cosine is below floor[i] are not wanted (they cannot
    enter a ranking held elsewhere); they may come back as -1, which saves their rescoring.
    Returns (index [nq, k] int64, -1 where the pool has fewer rows; cosine [nq, k] float64, nan).
    """
    nq = int(queries.shape[0])
    n_ok = int(pool_ok.sum().item()) if pool.shape[0] else 0
    kk = min(k, n_ok)
    index = np.full((nq, k), -1, np.int64)
    cosine = np.full((nq, k), np.nan)
    if nq == 0 or kk == 0:
        return index, cosine
    penalty = torch.zeros(pool.shape[0], dtype=torch.float32, device=pool.device)
    penalty[~pool_ok] = float("-inf")
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, int(pool.shape[0])))
    tie = np.asarray(tiebreak, np.int64)
    for lo in range(0, nq, rows_per_chunk):
        hi = min(nq, lo + rows_per_chunk)
        scores = queries[lo:hi] @ pool.T
        scores += penalty
        width = min(n_ok, kk + 8)
        low = None if floor is None else torch.as_tensor(floor[lo:hi] - margin, dtype=torch.float32,
                                                          device=scores.device)
        while True:
            vals, idx = torch.topk(scores, width, dim=1)
            threshold = vals[:, kk - 1] - margin
            if low is not None:
                threshold = torch.maximum(threshold, low)
            if width == n_ok or bool((vals[:, -1] < threshold).all()):
                break
            width = min(n_ok, width * 2)  # near-ties run past the shortlist: widen it
        vals = vals.cpu().numpy()
        idx = idx.cpu().numpy().astype(np.int64)
        short = vals >= threshold.cpu().numpy()[:, None]
        rr, cc = np.nonzero(short)
        exact = np.full(vals.shape, -np.inf)
        exact[rr, cc] = rescore(rr + lo, idx[rr, cc])
        order = np.lexsort((tie[idx], -exact), axis=-1)[:, :kk]
        chosen = np.take_along_axis(exact, order, axis=1)
        wanted = np.isfinite(chosen)
        index[lo:hi, :kk] = np.where(wanted, np.take_along_axis(idx, order, axis=1), -1)
        cosine[lo:hi, :kk] = np.where(wanted, chosen, np.nan)
    return index, cosine


def set_exact_matmul() -> None:
    """float32 products must be true float32 (no TF32) for the margin to hold."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
