"""The census's semantic and static-embedding keys: one top-k contract over the pool's rows.

`SemanticKey` is the exact key (census/knn.py: one batched exact top-k per request against the
pool's rows); `IndexedKey` answers the same contract from a data/index/stateindex.py index (--index);
`EmbeddingKey` is the static-embedding key (the model's input embedding of the input token).
"""

from __future__ import annotations

import numpy as np
import torch

from census.definitions import CensusConfig
from census.knn import exact_cosines, float32_margin, row_norms, topk_exact, unit_rows
from census.pool import TokenEntries
from data.index.stateindex import IndexSpec, StateIndex


def exact_describe(d: int, queries: int) -> dict:
    """The exact key's summary.json "index" block (census/ray_census.py builds it from shard counts too)."""
    return {"spec": "exact", "factory": None, "trained": True, "train_size": 0, "bytes_per_state": 2.0 * d,
            "fixed_bytes": 0, "queries": queries, "warmup_queries": 0}


class SemanticKey:
    """The semantic key: unit rows of every entry state in one device tensor. Request r's queries
    are its own entries' states (entry (r, t) holds the state that predicts x_t); its pool is a
    prefix of the rows (past) or all of them (warm), with excluded traces masked."""

    def __init__(self, ent, dev: torch.device):
        self.ent = ent
        self.norm, unit = unit_rows(ent.state, ent.valid)
        self.ok = ent.valid & (self.norm > 0)
        self.pool = torch.from_numpy(unit).to(dev)
        self.pool_ok = torch.from_numpy(self.ok).to(dev)
        self.dev = dev
        self.later_first = -np.arange(len(self.ok), dtype=np.int64)
        self.margin = float32_margin(ent.state.shape[1])
        self.queries = 0

    def topk(self, off: int, n: int, hi: int, excluded: list[tuple[int, int]], k: int, lo: int = 0):
        """(entry index [n, k], exact cosine [n, k], query present [n]) for request rows off..off+n.
        lo: rows below it left the pool (a store budget; also in `excluded` as (0, lo)): only lo..hi is scored."""
        query_ok = self.ok[off:off + n]
        rows = off + np.nonzero(query_ok)[0]  # a missing query state asks nothing
        idx = np.full((n, k), -1, np.int64)
        cos = np.full((n, k), np.nan)
        idx[query_ok], cos[query_ok] = self.topk_rows(rows, hi, excluded, k, lo)
        return idx, cos, query_ok

    def topk_rows(self, rows: np.ndarray, hi: int, excluded: list[tuple[int, int]], k: int, lo: int = 0):
        """Exact top-k for the given query rows (each with a state) over rows lo..hi-1, outside excluded.

        Only the window lo..hi is scored (a store budget's pool costs its size, not the store's): the
        float32 shortlist then comes from another matrix shape, but the ranking is the float64 one
        (census/knn.py), so the answer is the same as scoring every row below hi with lo masked."""
        ok = self.pool_ok[lo:hi].clone()
        for a, b in excluded:
            a, b = max(a, lo), min(b, hi)
            if b > a:
                ok[a - lo:b - lo] = False
        self.queries += len(rows)
        state, norm = self.ent.state, self.norm
        idx, cos = topk_exact(
            self.pool[torch.from_numpy(rows).to(self.dev)], self.pool[lo:hi], ok, k,
            lambda qi, pi: exact_cosines(state[rows[qi]], norm[rows[qi]], state[pi + lo], norm[pi + lo]),
            self.later_first[lo:hi], self.margin)
        idx[idx >= 0] += lo
        return idx, cos

    def finish(self, off: int, n: int) -> None:
        """Request rows off..off+n join the pool: nothing to do, every row is in the tensor."""

    def describe(self) -> dict:
        return exact_describe(int(self.ent.state.shape[1]), self.queries)


class IndexedKey:
    """The semantic key over a data/index/stateindex.py index, with SemanticKey's topk contract (the
    cosine column holds the index's own score). Past mode adds request r's states (ids = entry
    rows) only after r's queries; warm mode adds every state up front. A store budget evicts the
    rows below the window; same-prompt traces are left out by id range."""

    def __init__(self, ent, spec: IndexSpec, train_size: int | None, warm: bool):
        self.ent = ent
        self.ok = ent.valid & (row_norms(ent.state) > 0)  # the exact key's rule: no zero state joins or asks
        self.index = StateIndex(spec, int(ent.state.shape[1]), train_size)
        self.warm = warm
        self.trained_at: int | None = None  # first row whose query the trained index answered
        if warm:
            self._add(0, len(self.ok))

    def _add(self, a: int, b: int, chunk: int = 1 << 16) -> None:
        rows = a + np.nonzero(self.ok[a:b])[0]
        for i in range(0, len(rows), chunk):  # chunked: a float32 copy of the whole store would not fit
            part = rows[i:i + chunk]
            self.index.add(self.ent.state[part], part)

    def topk(self, off: int, n: int, hi: int, excluded: list[tuple[int, int]], k: int, lo: int = 0):
        query_ok = self.ok[off:off + n]
        rows = off + np.nonzero(query_ok)[0]
        idx = np.full((n, k), -1, np.int64)
        score = np.full((n, k), np.nan)
        if lo:
            self.index.evict_below(lo)  # the window only moves forward
        if self.trained_at is None and self.index.trained:
            self.trained_at = off
        ids, s = self.index.search(self.ent.state[rows], k, lo=lo, exclude=[(a, b) for a, b in excluded if a >= lo])
        idx[query_ok], score[query_ok] = ids, s.astype(np.float64)
        return idx, score, query_ok

    def finish(self, off: int, n: int) -> None:
        if not self.warm:  # strictly past: r's states join after r's queries
            self._add(off, off + n)

    def describe(self) -> dict:
        return self.index.describe()


def make_key(ent, spec: IndexSpec, cfg: CensusConfig, dev: torch.device):
    return SemanticKey(ent, dev) if spec.exact else IndexedKey(ent, spec, cfg.index_train, cfg.pool == "warm")


def combined_describe(keys: list) -> dict:
    """One describe() for the per-tenant keys: sums of counts, bytes per state weighted by states held."""
    ds = [k.describe() for k in keys]
    if len(ds) == 1:
        return ds[0]
    held = [int(k.index.ntotal) if isinstance(k, IndexedKey) else len(k.ok) for k in keys]
    out = dict(ds[0])
    for name in ("queries", "warmup_queries", "fixed_bytes"):
        out[name] = sum(d[name] for d in ds)
    out["trained"] = all(d["trained"] for d in ds)
    bps = [(d["bytes_per_state"], h) for d, h in zip(ds, held) if h and np.isfinite(d["bytes_per_state"])]
    out["bytes_per_state"] = round(sum(b * h for b, h in bps) / sum(h for _, h in bps), 2) if bps else None
    out["indexes"] = len(ds)
    return out


class EmbeddingKey:
    """The static-embedding key. The query is E[y]; the pool's keys are the distinct input tokens
    of its entries, held in a buffer in order of first appearance (so the past pool's tokens are a
    prefix of it). The top `keep` tokens of every query token seen so far are cached and, when
    tokens join the pool, extended by ranking only the new ones (the top-K of a union is the top-K
    of the parts' top-Ks), so each (query token, pool token) pair is scored once per census."""

    def __init__(self, E: np.ndarray, ent, dev: torch.device, candidates: int):
        first_idx = np.nonzero(ent.valid)[0]
        utok, first_pos = np.unique(ent.input[first_idx], return_index=True)
        order = np.argsort(first_idx[first_pos], kind="stable")
        self.E = E
        self.utok = utok[order]
        self.u_first = first_idx[first_pos][order]
        self.u_norm, unit = unit_rows(E[self.utok])
        self.u_ok = self.u_norm > 0
        self.pool = torch.from_numpy(unit).to(dev)
        self.dev = dev
        self.margin = float32_margin(E.shape[1])
        self.candidates = candidates
        self.keep = candidates + 8  # slack so excluded tokens can be dropped without a rescan
        self.done = 0  # every cached ranking covers buffer rows [0, done)
        self.row: dict[int, int] = {}  # query token -> its row in the cache
        self.c_idx = np.zeros((0, self.keep), np.int64)
        self.c_cos = np.zeros((0, self.keep))

    def _rank(self, ys: np.ndarray, lo: int, hi: int, k: int, ok: np.ndarray | None = None,
              floor: np.ndarray | None = None):
        """Top-k buffer rows in [lo, hi) for each query token, by (-cosine, token id); rows below
        floor (a cosine per query) may be left out."""
        q_norm, q_unit = unit_rows(self.E[ys])
        pool_ok = self.u_ok[lo:hi] if ok is None else self.u_ok[lo:hi] & ok[lo:hi]
        idx, cos = topk_exact(
            torch.from_numpy(q_unit).to(self.dev), self.pool[lo:hi], torch.from_numpy(pool_ok).to(self.dev), k,
            lambda qi, pi: exact_cosines(self.E[ys[qi]], q_norm[qi], self.E[self.utok[lo + pi]], self.u_norm[lo + pi]),
            self.utok[lo:hi].astype(np.int64), self.margin, floor)
        idx[idx >= 0] += lo
        return idx, cos

    def _merge(self, a_idx, a_cos, b_idx, b_cos):
        idx = np.concatenate([a_idx, b_idx], axis=1)
        cos = np.where(idx >= 0, np.concatenate([a_cos, b_cos], axis=1), -np.inf)
        tie = np.where(idx >= 0, self.utok[np.maximum(idx, 0)], np.iinfo(np.int64).max)
        order = np.lexsort((tie, -cos), axis=-1)[:, :self.keep]
        return np.take_along_axis(idx, order, 1), np.take_along_axis(np.where(idx >= 0, cos, np.nan), order, 1)

    def hits(self, ent, token_entries: TokenEntries, off: int, n: int, out: np.ndarray, hi: int,
             excluded: list[tuple[int, int]], lo: int = 0) -> np.ndarray:
        """emb_hit over one request (object array: True / False / None for a zero query embedding).
        lo: rows below it left the pool (store budget; `excluded` holds (0, lo) as well)."""
        C = self.candidates
        u_count = int(np.searchsorted(self.u_first, hi))
        masked = np.zeros(len(self.utok), bool)  # tokens all of whose pool entries are excluded
        if lo > 0:  # tokens with no entry left in the window: one pass over the window, not the store
            window = ent.input[lo:hi][ent.valid[lo:hi]]
            masked[:u_count] = ~np.isin(self.utok[:u_count], window)
        members = [(a, b) for a, b in excluded if b > lo]  # same-prompt traces inside the window
        if members:
            ex_tokens = np.unique(np.concatenate([ent.input[a:b] for a, b in members]))
            for i in np.nonzero(np.isin(self.utok[:u_count], ex_tokens) & ~masked[:u_count])[0]:
                masked[i] = next(token_entries.latest(int(self.utok[i]), hi, excluded), -1) < 0
        ys = ent.input[off:off + n]
        uniq_y, inverse = np.unique(ys, return_inverse=True)
        asked = np.linalg.norm(self.E[uniq_y], axis=1) > 0  # a zero embedding asks nothing
        if u_count > self.done:  # tokens joined the pool: extend every cached ranking by them
            if self.row:
                cached = np.array(list(self.row), np.int64)
                floor = np.where(self.c_idx[:, -1] >= 0, self.c_cos[:, -1], -np.inf)  # the keep-th so far
                idx, cos = self._rank(cached, self.done, u_count, self.keep, floor=floor)
                self.c_idx, self.c_cos = self._merge(self.c_idx, self.c_cos, idx, cos)
            self.done = u_count
        fresh = np.array([y for y in uniq_y[asked].tolist() if y not in self.row], np.int64)
        if len(fresh):
            idx, cos = self._rank(fresh, 0, u_count, self.keep)
            self.row.update({y: len(self.row) + j for j, y in enumerate(fresh.tolist())})
            self.c_idx = np.concatenate([self.c_idx, idx])
            self.c_cos = np.concatenate([self.c_cos, cos])
        cand_sets = {}
        for y in uniq_y[asked].tolist():
            ranked = self.c_idx[self.row[y]]
            ranked = ranked[ranked >= 0]
            usable = ranked[~masked[ranked]]
            if len(usable) < C and len(ranked) == self.keep:  # the slack ran out: rank this one afresh
                usable = self._rank(np.array([y], np.int64), 0, u_count, C, ok=~masked)[0][0]
                usable = usable[usable >= 0]
            cands: set[int] = set()
            taken = 0
            for i in usable[:C]:
                for e in token_entries.latest(int(self.utok[i]), hi, excluded):
                    cands.add(int(ent.next[e]))
                    taken += 1
                    if taken >= C:
                        break
                if taken >= C:
                    break
            cand_sets[y] = cands
        hit = np.empty(n, dtype=object)
        for t in range(n):
            y = int(uniq_y[inverse[t]])
            hit[t] = (int(out[t]) in cand_sets[y]) if asked[inverse[t]] else None
        return hit
