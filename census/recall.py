"""The index against the exact key: recall@C of its neighbours and its gap recall (summary.json's "index").

For an --index other than exact, the census checks, at sampled positions, the index's top-C
neighbours against the exact ones over the same pool (`exact_topk_at`), and the gap recall the
index reached against the exact key's at sampled gap positions.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch

from census.definitions import CensusConfig, CensusInput, _first_rows, entry_valid
from census.keys import combined_describe
from census.knn import unit_rows
from census.pool import Part, Setup, local_rows


def entry_states(data: CensusInput, rows: np.ndarray, first: np.ndarray) -> np.ndarray:
    """float32 entry states at some rows (build_entries' `state`, without copying the whole store)."""
    rows = np.asarray(rows, np.int64)
    out = np.asarray(data.hidden[np.maximum(rows - 1, 0)], np.float32)
    f = first[rows]
    if f.any():
        req = np.searchsorted(data.offsets, rows[f], side="right") - 1
        out[f] = np.asarray(data.prompt_last_hidden, np.float32)[req]
    return out


def exact_topk_at(part: Part, rows: np.ndarray, k: int, dev: torch.device,
                  chunk: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k entry ids (float32 cosines) at some of the part's rows, each over its own
    request's pool (-1 where the query state is missing), and the entries' next tokens.

    One pass over the pool in chunks of rows with every sampled query at once, so the check of a
    1M-position census holds one chunk, not a float32 copy of the store; near-ties may order
    differently from the census's float64-rescored ranking (this is a recall estimate)."""
    data = part.data
    first = _first_rows(data)
    valid = entry_valid(data)
    rows = np.asarray(rows, np.int64)
    q = unit_rows(entry_states(data, rows, first))[1]
    asked = valid[rows] & (np.abs(q).sum(axis=1) > 0)
    req = np.searchsorted(data.offsets, rows, side="right") - 1
    pools = [part.plan.at(int(r)) for r in req]
    lo = np.array([p.lo for p in pools], np.int64)
    hi = np.array([p.hi for p in pools], np.int64)
    nq = len(rows)
    best_s = np.full((nq, k), -np.inf, np.float32)
    best_i = np.full((nq, k), -1, np.int64)
    Q = torch.from_numpy(q).to(dev)
    top = int(hi[asked].max()) if asked.any() else 0
    for a in range(0, top, chunk):
        b = min(top, a + chunk)
        ids = np.arange(a, b)
        c = unit_rows(entry_states(data, ids, first), valid[a:b])[1]
        s = (Q @ torch.from_numpy(c).to(dev).T).cpu().numpy()
        bad = (ids[None, :] < lo[:, None]) | (ids[None, :] >= hi[:, None]) | ~asked[:, None] \
            | (np.abs(c).sum(axis=1) == 0)[None, :]
        for i, p in enumerate(pools):
            for ea, eb in p.excluded:
                if ea < b and eb > a:
                    bad[i, max(ea, a) - a:min(eb, b) - a] = True
        s[bad] = -np.inf
        kk = min(k, b - a)
        part_i = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        cand_s = np.concatenate([best_s, np.take_along_axis(s, part_i, 1)], axis=1)
        cand_i = np.concatenate([best_i, part_i + a], axis=1)
        order = np.lexsort((-cand_i, -cand_s), axis=-1)[:, :k]  # ties: the later entry first
        best_s = np.take_along_axis(cand_s, order, 1)
        best_i = np.take_along_axis(cand_i, order, 1)
    best_i[~np.isfinite(best_s)] = -1
    return best_i, data.tokens.astype(np.int64)


def knn_recall(index_ids: np.ndarray, exact_ids: np.ndarray) -> tuple[float | None, int]:
    """Mean share of the exact top-k ids the index also returned (positions with an exact neighbour)."""
    shares = []
    for got, want in zip(index_ids, exact_ids):
        want = set(want[want >= 0].tolist())
        if want:
            shares.append(len(want & set(got[got >= 0].tolist())) / len(want))
    return (float(np.mean(shares)) if shares else None), len(shares)


def index_block(setup: Setup, cfg: CensusConfig, df: pl.DataFrame, keys: list, knn_rows: np.ndarray,
                knn_ids: list[np.ndarray], rng: np.random.Generator, dev: torch.device) -> dict:
    """summary.json's "index": the key's describe(), bytes per token, and (for an index) recall@C of
    its neighbours against the exact ones at sampled positions, and its gap recall against the exact
    key's at sampled gap positions (a missing query state counts as a miss)."""
    block = combined_describe(keys)
    block["bytes_per_token"] = setup.bytes_per_token
    gap_rows = np.nonzero(df["gap"].to_numpy())[0]  # the frame's rows are the store's rows, in order
    gap_sample = np.sort(rng.choice(gap_rows, min(len(gap_rows), cfg.recall_sample), replace=False))
    hit = df["sem_hit"].fill_null(False).to_numpy().astype(bool)
    if setup.spec.exact:  # the key is its own reference
        rate = float(hit[gap_sample].mean()) if len(gap_sample) else None
        block.update(knn_recall=1.0, knn_sample=0, gap_sample=int(len(gap_sample)), gap_recall_exact=rate,
                     gap_recall_index=rate, gap_recall_ratio=1.0 if rate else None)
        return block
    target = df["target"].to_numpy()
    exact_hit = np.zeros(len(gap_sample), bool)
    got, want = [], []
    for part, ids in zip([p for p in setup.parts if p.data.n_positions], knn_ids):
        k_local, g_local = local_rows(part, knn_rows), local_rows(part, gap_sample)
        rows = np.union1d(k_local, g_local)
        if not len(rows):
            continue
        exact, nxt = exact_topk_at(part, rows, cfg.candidates, dev)
        got.append(ids)
        want.append(exact[np.searchsorted(rows, k_local)])
        g_exact = exact[np.searchsorted(rows, g_local)]
        g_at = np.searchsorted(gap_sample, part.rows[g_local])
        exact_hit[g_at] = ((np.where(g_exact >= 0, nxt[np.maximum(g_exact, 0)], -1)
                            == target[gap_sample[g_at]][:, None]).any(axis=1))
    recall, n = knn_recall(np.concatenate(got) if got else np.zeros((0, cfg.candidates), np.int64),
                           np.concatenate(want) if want else np.zeros((0, cfg.candidates), np.int64))
    r_exact = float(exact_hit.mean()) if len(gap_sample) else None
    r_index = float(hit[gap_sample].mean()) if len(gap_sample) else None
    block.update(knn_recall=recall, knn_sample=n, gap_sample=int(len(gap_sample)), gap_recall_exact=r_exact,
                 gap_recall_index=r_index, gap_recall_ratio=r_index / r_exact if r_exact else None)
    if not block.get("trained"):
        block["note"] = (f"index {setup.spec.text} never trained (fewer than its {block.get('train_size')} "
                         "training states reached it): every query was answered exactly from its warm-up buffer")
    return block
