"""The census, end to end: per-position answers (census_positions), the summary, and the outputs.

census_positions replays the requests in serving order, tenant by tenant (a tenant's requests form
an input of their own, and their rows keep their store request index). For each request it reads
the pool as it stands (past mode: the automaton holds exactly the earlier requests; warm mode: it
holds all of them; with a store budget, the traces that left the window are subtracted), answers
every generated position, then (past mode) adds the request's generated tokens to the automaton
and, with an index, its states to the index. The exact semantic and static-embedding keys are one
batched top-k per request against the pool's rows (pool rows of request q are a contiguous range,
so the past pool is a prefix, the evicted traces the range below the window, and an excluded trace
a masked range).
"""

from __future__ import annotations

import bisect
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from census.definitions import _first_rows, POSITION_COLUMNS, CensusConfig, CensusInput, build_entries, entry_valid
from census.index import PoolView, SuffixAutomaton
from census.knn import (exact_cosines, float32_margin, pick_device, row_norms, set_exact_matmul, topk_exact,
                        unit_rows)
from census.summary import summarize
from data.budget import LOW_WATER, Budget, parse_budget, window_starts
from data.errors import OilbirdError
from data.models import model_slug, same_model
from data.stateindex import IndexSpec, check_trainable, parse_index_spec
from data.store import (atomic_write_json, atomic_write_table, clean_leftovers, fault_point, is_stale, make_tmp_dir,
                        open_store, store_dir, store_fingerprint)


# ---------------------------------------------------------------- pool bookkeeping

class TokenEntries:
    """token -> its valid entries in serving order, with 'latest before hi, outside ranges'."""

    def __init__(self, tokens: np.ndarray, valid: np.ndarray):
        idx = np.nonzero(valid)[0]
        order = np.argsort(tokens[idx], kind="stable")
        idx = idx[order]
        toks = tokens[idx]
        cuts = np.nonzero(np.diff(toks))[0] + 1
        self.lists: dict[int, list[int]] = {
            int(t): grp.tolist() for t, grp in zip(toks[np.r_[0, cuts]] if len(toks) else [], np.split(idx, cuts))
        }

    def latest(self, token: int, hi: int, excluded: list[tuple[int, int]]):
        """Entries of `token` below hi, outside the excluded [a, b) ranges (sorted, disjoint), latest first."""
        lst = self.lists.get(int(token))
        if not lst:
            return
        starts = [a for a, _ in excluded]
        i = bisect.bisect_left(lst, hi) - 1
        while i >= 0:
            e = lst[i]
            k = bisect.bisect_right(starts, e) - 1
            if k >= 0 and e < excluded[k][1]:
                i = bisect.bisect_left(lst, excluded[k][0]) - 1
                continue
            yield e
            i -= 1


@dataclass
class RequestPool:
    """Request r's pool, in entry rows of its input: rows lo..hi-1 minus the excluded ranges."""

    start: int  # first request of the window (0 without a store budget)
    lo: int  # rows below lo left the pool (offsets[start])
    hi: int  # rows from hi on are not pooled (past: offsets[r]; warm: every row is)
    members: list[int]  # same-prompt requests inside the window, left out (warm: r's whole group)
    excluded: list[tuple[int, int]]  # rows left out, sorted: (0, lo) when lo > 0, then the members'


class PoolPlan:
    """Which rows every request of one input draws from (definitions.py: pool, store budget)."""

    def __init__(self, data: CensusInput, mode: str, starts: np.ndarray):
        self.mode, self.offsets, self.starts = mode, data.offsets, np.asarray(starts, np.int64)
        self.hashes = list(data.prompt_hash)
        self.n_rows = data.n_positions
        self.by_hash: dict[str, list[int]] = {}
        for q, h in enumerate(self.hashes):
            self.by_hash.setdefault(h, []).append(q)

    def at(self, r: int) -> RequestPool:
        off = self.offsets
        group = self.by_hash[self.hashes[r]]
        if self.mode == "warm":
            start, hi, members = 0, self.n_rows, group
        else:
            start, hi = int(self.starts[r]), int(off[r])
            members = group[bisect.bisect_left(group, start):bisect.bisect_left(group, r)]
        lo = int(off[start])
        excluded = ([(0, lo)] if lo > 0 else []) + [(int(off[q]), int(off[q + 1])) for q in members]
        return RequestPool(start, lo, hi, members, excluded)

    def pool_tokens(self, r: int) -> int:
        p = self.at(r)
        return p.hi - p.lo - sum(min(b, p.hi) - a for a, b in p.excluded if p.lo <= a < p.hi)


class LexicalPool:
    """The automata a request's pool is read from: `main` holds every trace the mode pools so far
    (past: the requests before this one; warm: all of them); subtracted from it are `evicted` (the
    traces below the budget window, grown as the window moves) and one automaton per prompt_hash
    holding the group's traces inside the window (rebuilt when a member leaves the window: it is
    then in `evicted`, and must not be subtracted twice)."""

    def __init__(self, mode: str, count_len: int, hashes: list[str], outputs: list[np.ndarray]):
        self.mode, self.count_len, self.hashes, self.outputs = mode, count_len, hashes, outputs
        self.main = SuffixAutomaton(count_len)
        self.evicted = SuffixAutomaton(count_len)
        self.groups: dict[str, tuple[SuffixAutomaton, list[int]]] = {}
        if mode == "warm":
            for out in outputs:
                self.main.add_trace(out)

    def view(self, r: int, pool: RequestPool) -> PoolView:
        while self.evicted.n_traces < pool.start:  # the window start only moves forward
            self.evicted.add_trace(self.outputs[self.evicted.n_traces])
        subtracted = [self.evicted]
        if pool.members:
            h = self.hashes[r]
            sam, held = self.groups.get(h, (None, []))
            if sam is None or pool.members[:len(held)] != held:  # a member left the window
                sam, held = SuffixAutomaton(self.count_len), []
            for q in pool.members[len(held):]:  # otherwise members only grow, in order
                sam.add_trace(self.outputs[q])
                held.append(q)
            self.groups[h] = (sam, held)
            subtracted.append(sam)
        return PoolView(self.main, subtracted)

    def finish_request(self, r: int) -> None:
        if self.mode == "past":
            self.main.add_trace(self.outputs[r])


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
        lo is read off `excluded` here (its (0, lo) range)."""
        query_ok = self.ok[off:off + n]
        rows = off + np.nonzero(query_ok)[0]  # a missing query state asks nothing
        idx = np.full((n, k), -1, np.int64)
        cos = np.full((n, k), np.nan)
        idx[query_ok], cos[query_ok] = self.topk_rows(rows, hi, excluded, k)
        return idx, cos, query_ok

    def topk_rows(self, rows: np.ndarray, hi: int, excluded: list[tuple[int, int]], k: int):
        """Exact top-k for the given query rows (each with a state) over rows below hi, outside excluded."""
        ok = self.pool_ok[:hi].clone()
        for a, b in excluded:
            ok[a:min(b, hi)] = False
        self.queries += len(rows)
        state, norm = self.ent.state, self.norm
        return topk_exact(
            self.pool[torch.from_numpy(rows).to(self.dev)], self.pool[:hi], ok, k,
            lambda qi, pi: exact_cosines(state[rows[qi]], norm[rows[qi]], state[pi], norm[pi]),
            self.later_first[:hi], self.margin)

    def finish(self, off: int, n: int) -> None:
        """Request rows off..off+n join the pool: nothing to do, every row is in the tensor."""

    def describe(self) -> dict:
        d = int(self.ent.state.shape[1])
        return {"spec": "exact", "factory": None, "trained": True, "train_size": 0, "bytes_per_state": 2.0 * d,
                "fixed_bytes": 0, "queries": self.queries, "warmup_queries": 0}


class IndexedKey:
    """The semantic key over a data/stateindex.py index, with SemanticKey's topk contract (the
    cosine column holds the index's own score). Past mode adds request r's states (ids = entry
    rows) only after r's queries; warm mode adds every state up front. A store budget evicts the
    rows below the window; same-prompt traces are left out by id range."""

    def __init__(self, ent, spec: IndexSpec, train_size: int | None, warm: bool):
        from data.stateindex import StateIndex

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


def adjacency_hits(ent, token_entries: TokenEntries, off: int, out: np.ndarray, hi: int,
                   excluded: list[tuple[int, int]], width: int) -> np.ndarray:
    """adj_hit over one request: the topk of the latest earlier entry with the same input."""
    hit = np.zeros(len(out), bool)
    own_latest: dict[int, int] = {}
    pool_latest: dict[int, int] = {}
    for t in range(len(out)):
        y = int(ent.input[off + t])
        e = own_latest.get(y)
        if e is None:
            e = pool_latest.get(y)
            if e is None:
                e = pool_latest[y] = next(token_entries.latest(y, hi, excluded), -1)
        if e >= 0:
            hit[t] = int(out[t]) in ent.topk[e, :width]
        if ent.valid[off + t]:  # entry t becomes an earlier occurrence for the positions after it
            own_latest[y] = off + t
    return hit


def payload_lengths(view: PoolView, ent, tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray,
                    sem_idx: np.ndarray, recovered: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """payload_len and neighbour_match_len at the recovered gap positions (-1 elsewhere)."""
    payload = np.full(len(out), -1, np.int64)
    neighbour = np.full(len(out), -1, np.int64)
    for t in np.nonzero(recovered)[0]:
        fut = out[t:t + cap]
        payload[t] = view.prefix_len(fut, cap)
        best = 0
        for e in sem_idx[t]:
            if e >= 0 and ent.next[e] == out[t]:
                cont = tokens[e:min(int(offsets[ent.request[e] + 1]), e + len(fut))]
                diff = np.nonzero(cont != fut[:len(cont)])[0]
                best = max(best, int(diff[0]) if len(diff) else len(cont))
        neighbour[t] = best
    return payload, neighbour


# ---------------------------------------------------------------- set-up: index, budget, tenants

@dataclass
class Part:
    """The requests of one tenant as an input of their own (every request when there is one tenant)."""

    data: CensusInput
    requests: np.ndarray  # store request index of each of its requests
    rows: np.ndarray  # store row of each of its rows
    plan: PoolPlan


@dataclass
class Setup:
    """What every pass over one input shares."""

    spec: IndexSpec
    budget: Budget | None
    budget_tokens: int | None  # None: unbounded
    bytes_per_token: float  # what a pooled token costs (a budget in MB is read with it)
    starts: np.ndarray  # window start of every request (data/budget.py)
    parts: list[Part]


def code_bytes(spec: IndexSpec, d: int) -> float:
    """Bytes one state costs in the index (codes only; codebooks and projections are fixed costs)."""
    if spec.exact:
        return 2.0 * d  # float16
    try:
        import faiss
    except ImportError:
        raise OilbirdError(f"--index {spec.text} needs faiss: pip install -e '.[faiss]' "
                           "(or use --index exact)") from None

    index = faiss.index_factory(d, spec.factory, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return float(ivf.code_size + 8)  # an inverted list keeps a code and an int64 id per state
    try:
        return float(index.sa_code_size())
    except RuntimeError:  # hnsw: its storage's code plus the level-0 links (int32)
        inner = index
        while not hasattr(inner, "hnsw") and hasattr(inner, "index"):
            inner = faiss.downcast_index(inner.index)
        return float(faiss.downcast_index(inner.storage).sa_code_size() + 4 * inner.hnsw.nb_neighbors(0))


def bytes_per_token(spec: IndexSpec, d: int) -> float:
    """A pooled token costs its state (or code) and its int32 token id."""
    return code_bytes(spec, d) + 4.0


def prepare(data: CensusInput, cfg: CensusConfig) -> Setup:
    """Validate, read the index spec and the budget, and split the input by tenant."""
    cfg.validate()
    data.check()
    d = data.d_model
    spec = parse_index_spec(cfg.index, d)
    budget = parse_budget(cfg.store_budget)
    bpt = bytes_per_token(spec, d)
    budget_tokens = budget.in_tokens(bpt) if budget is not None else None
    if budget_tokens is not None and not spec.evictable:
        raise OilbirdError(f"index {spec.text} cannot evict (faiss HNSW has no removal): it cannot serve "
                           "--store-budget; use a flat-code or ivf spec")
    starts = window_starts(np.diff(data.offsets), budget_tokens)  # one line when a trace exceeds the budget
    if not spec.exact:
        check_trainable(spec, int(entry_valid(data).sum()))
    parts = []
    for reqs in data.tenant_groups():
        if len(reqs) == data.n_requests:
            sub, rows = data, np.arange(data.n_positions)
        else:
            sub, rows = data.subset(reqs)
        # the window is the store's (data/budget.py); inside a tenant it starts at its first request >= s(r)
        sub_starts = np.searchsorted(reqs, starts[reqs])
        parts.append(Part(sub, reqs, rows, PoolPlan(sub, cfg.pool, sub_starts)))
    return Setup(spec, budget, budget_tokens, bpt, starts, parts)


def local_rows(part: Part, rows: np.ndarray) -> np.ndarray:
    """Positions (in the part's rows) of those store rows that belong to the part."""
    return np.nonzero(np.isin(part.rows, rows))[0]


# ---------------------------------------------------------------- the census

@dataclass
class CensusResult:
    positions: pl.DataFrame  # one row per generated position (definitions.POSITION_COLUMNS)
    index: dict  # summary.json's "index" block
    pool: dict  # summary.json's "pool_bounds" block


def census_positions(data: CensusInput, cfg: CensusConfig, embeddings: np.ndarray | None = None,
                     progress: bool = False, timings: dict[str, float] | None = None) -> pl.DataFrame:
    """One row per generated position (columns: definitions.POSITION_COLUMNS).

    embeddings: the model's input embedding matrix [vocab, d] for the static-embedding key (None:
    emb_hit is null). timings, when given, accumulates seconds per part of the work."""
    return census_run(data, cfg, embeddings, progress, timings).positions


def census_run(data: CensusInput, cfg: CensusConfig, embeddings: np.ndarray | None = None,
               progress: bool = False, timings: dict[str, float] | None = None) -> CensusResult:
    """census_positions, with the index block (recall against exact) and the pool block."""
    timings = {} if timings is None else timings
    clock = [time.perf_counter()]

    def lap(part: str) -> None:
        now = time.perf_counter()
        timings[part] = timings.get(part, 0.0) + now - clock[0]
        clock[0] = now

    setup = prepare(data, cfg)
    dev = pick_device(cfg.device)
    set_exact_matmul()
    rng = np.random.default_rng(cfg.seed)
    knn_rows = np.zeros(0, np.int64)
    if not setup.spec.exact:  # the positions whose index neighbours are checked against the exact ones
        valid = np.nonzero(entry_valid(data))[0]
        knn_rows = np.sort(rng.choice(valid, min(len(valid), cfg.recall_sample), replace=False))
    frames, keys, knn_ids = [], [], []
    for part in setup.parts:
        if not part.data.n_positions:  # a tenant with no generated token has nothing to census
            continue
        df, key, ids = census_part(part, cfg, setup.spec, embeddings, local_rows(part, knn_rows), dev, progress, lap)
        frames.append(df)
        keys.append(key)
        knn_ids.append(ids)
    df = frames[0] if len(frames) == 1 else pl.concat(frames).sort(["request", "position"])
    lap("frame")
    index = index_block(setup, cfg, df, keys, knn_rows, knn_ids, rng, dev)
    lap("recall_check")
    pool_tokens = [part.plan.pool_tokens(r) for part in setup.parts for r in range(part.data.n_requests)]
    pool = {"store_budget": setup.budget.text if setup.budget else None, "budget_tokens": setup.budget_tokens,
            "bytes_per_token": setup.bytes_per_token, "low_water": LOW_WATER if setup.budget else None,
            "mean_pool_tokens": float(np.mean(pool_tokens)), "tenants": len(setup.parts)}
    return CensusResult(df, index, pool)


def census_part(part: Part, cfg: CensusConfig, spec: IndexSpec, embeddings: np.ndarray | None,
                sample: np.ndarray, dev: torch.device, progress: bool, lap: Callable[[str], None]):
    """The census of one tenant's requests: (positions frame with store request indices, the
    semantic key, the key's top-k ids at the `sample` rows [len(sample), candidates])."""
    data = part.data
    ent = build_entries(data)
    R = data.n_requests
    offsets = data.offsets
    C = cfg.candidates
    adj_width = min(C, ent.topk.shape[1])
    outputs = [data.tokens[offsets[r]:offsets[r + 1]] for r in range(R)]
    hashes = list(data.prompt_hash)

    sem = make_key(ent, spec, cfg, dev)
    sample_ids = np.full((len(sample), C), -1, np.int64)
    emb = None
    if embeddings is not None:
        E = np.asarray(embeddings)
        top_token = max(int(ent.input.max()), int(data.tokens.max()))
        if E.ndim != 2 or E.shape[0] <= top_token:
            raise OilbirdError(f"embedding matrix {tuple(E.shape)} does not cover token id {top_token}: wrong model")
        emb = EmbeddingKey(E, ent, dev, C)

    token_entries = TokenEntries(ent.input, ent.valid)
    lex = LexicalPool(cfg.pool, cfg.count_len, hashes, outputs)

    cols = {name: [] for name in POSITION_COLUMNS}
    lap("prepare")
    for r in tqdm(range(R), desc="census", unit="req", disable=not progress, leave=False):
        off, n = int(offsets[r]), int(offsets[r + 1] - offsets[r])
        pool = part.plan.at(r)
        hi, excluded = pool.hi, pool.excluded
        out = outputs[r]
        if n == 0:
            lex.finish_request(r)
            continue

        # lexical: available / producible / suffix lengths
        view = lex.view(r, pool)
        lx = view.lexical_pass(data.prompts[r], out, horizon=cfg.horizon, min_suffix=cfg.min_suffix,
                               max_suffix=cfg.max_suffix, candidates=C)
        lap("lexical")

        # semantic key: top-C pool entries by cosine with the query state (exact, or the index's)
        sem_idx, sem_cos, sem_query_ok = sem.topk(off, n, hi, excluded, C, pool.lo)
        sem_next = np.where(sem_idx >= 0, ent.next[np.maximum(sem_idx, 0)], -1)
        sem_hit = (sem_next == out[:, None]).any(axis=1)
        a, b = np.searchsorted(sample, [off, off + n])
        sample_ids[a:b] = sem_idx[sample[a:b] - off]
        lap("semantic")

        # static-embedding key
        emb_hit = None
        if emb is not None:
            emb_hit = emb.hits(ent, token_entries, off, n, out, hi, excluded, pool.lo)
            lap("static_embedding")

        adj_hit = adjacency_hits(ent, token_entries, off, out, hi, excluded, adj_width)
        gap = lx.available & ~lx.producible
        payload, neighbour = payload_lengths(view, ent, data.tokens, offsets, out, sem_idx,
                                             gap & sem_hit & sem_query_ok, cfg.payload_cap)

        cols["request"].append(np.full(n, part.requests[r]))
        cols["position"].append(np.arange(n))
        cols["target"].append(out)
        cols["available"].append(lx.available)
        cols["producible"].append(lx.producible)
        cols["gap"].append(gap)
        cols["oracle_suffix_len"].append(lx.oracle_suffix_len)
        cols["longest_match_len"].append(lx.longest_match_len)
        cols["sem_hit"].append(np.where(sem_query_ok, sem_hit, None))
        cols["sem_best_cos"].append(np.where(sem_query_ok & ~np.isnan(sem_cos[:, 0]), sem_cos[:, 0], None))
        cols["emb_hit"].append(np.full(n, None) if emb_hit is None else emb_hit)
        cols["adj_hit"].append(adj_hit)
        cols["novel_prev"].append(lx.longest_match_len == 0)
        cols["payload_len"].append(np.where(payload >= 0, payload, None))
        cols["neighbour_match_len"].append(np.where(neighbour >= 0, neighbour, None))
        lap("adjacency_payload")
        lex.finish_request(r)
        lap("lexical")
        sem.finish(off, n)
        lap("semantic")

    df = pl.DataFrame({name: pl.Series(name, np.concatenate(cols[name]).tolist() if cols[name] else [], dtype=dtype)
                       for name, dtype in POSITION_COLUMNS.items()})
    return df, sem, sample_ids


# ---------------------------------------------------------------- the index against exact

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


# ---------------------------------------------------------------- the store, the outputs

def census_dir(out: str | Path, bench: str, slug: str, pool: str = "past") -> Path:
    base = store_dir(out, bench, slug).parent
    return base / ("census" if pool == "past" else f"census-{pool}")


def load_embeddings(meta: dict) -> tuple[np.ndarray | None, str | None]:
    """The model's input embedding matrix, or (None, why not) when the model cannot be loaded here.
    A model that loads but is not the one the store was captured with is refused (one line)."""
    try:
        from data.models import load_model

        lm = load_model(meta["model"], dtype="float32", device="cpu")
    except Exception as e:  # any failure to load only costs the static-embedding key
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"static-embedding key not computed: cannot load model '{meta.get('model')}' ({first})"
    if meta.get("model_fingerprint") and lm.fingerprint != meta["model_fingerprint"]:
        raise OilbirdError(f"model '{meta['model']}' loads with fingerprint {lm.fingerprint}, but the trace store was "
                           f"captured with {meta['model_fingerprint']}: the store's meta.json names the wrong model, "
                           "or the model changed since the capture; recapture with --force")
    if int(meta.get("d_model") or lm.d_model) != lm.d_model:
        raise OilbirdError(f"model '{meta['model']}' has d_model {lm.d_model}, the trace store {meta['d_model']}: "
                           "wrong model for this store")
    return lm.model.get_input_embeddings().weight.detach().float().cpu().numpy(), None


def check_store_model(meta: dict, model: str, path: Path) -> None:
    """--model must name the model the store was captured with (alias, directory or hub id)."""
    captured = [meta.get("model"), meta.get("model_path")]
    if not any(c and same_model(str(c), model) for c in captured):
        raise OilbirdError(f"trace store {path} was captured with model '{meta.get('model')}', not '{model}': "
                           "it sits in another model's folder, or its meta.json was edited; recapture with "
                           f"--model {model}")


def write_census(target: Path, df: pl.DataFrame, summary: dict) -> None:
    """positions.parquet and summary.json as one unit: both are written into a fresh folder beside
    `target`, which then replaces it, so census/ holds the old pair or the new pair, never one of
    each. A kill leaves at most a dot-named leftover, removed by the next census."""
    _restore_or_clean(target)
    tmp = make_tmp_dir(target)
    old = None
    try:
        atomic_write_table(tmp / "positions.parquet", df.to_arrow())
        fault_point("census_after_positions")
        atomic_write_json(tmp / "summary.json", summary)
        if target.exists():
            old = target.with_name(f".{target.name}.{os.getpid()}.x.old")
            target.rename(old)
        fault_point("census_mid_swap")
        tmp.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)  # put the previous census back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _restore_or_clean(target: Path) -> None:
    """Leftovers of a census killed while writing: a temporary folder (dropped), and the previous
    census moved aside for the swap (put back when nothing replaced it, else dropped)."""
    for aside in sorted(target.parent.glob(f".{target.name}.*.old")):
        if not target.exists() and aside.is_dir() and is_stale(aside):
            aside.rename(target)
    clean_leftovers(target.parent, f".{target.name}.*.tmp")
    clean_leftovers(target.parent, f".{target.name}.*.old")


def read_input(bench: str, model: str, out: str | Path) -> tuple[Path, dict, CensusInput]:
    """The trace store of runs/<bench>/<model> as a census input: (store path, meta, input)."""
    slug = model_slug(model)
    path = store_dir(out, bench, slug)
    if not (path / "meta.json").exists():
        raise OilbirdError(f"no trace store for {bench} / {slug} at {path}: run `python -m data capture "
                           f"--bench {bench} --model {model} --out {out}` first (or `make census BENCH={bench}`)")
    store = open_store(path)
    check_store_model(store.meta, model, path)
    meta = dict(store.meta, n_requests=store.n_requests)  # counted from the rows, not taken from meta.json
    return path, meta, CensusInput.from_store(store).check()


def run_census(bench: str, model: str, cfg: CensusConfig, out: str | Path = "runs", *,
               embeddings: np.ndarray | None | str = "load", progress: bool = True) -> tuple[Path, dict]:
    """Read runs/<bench>/<model>/traces, write census/positions.parquet and summary.json as one unit."""
    cfg.validate()
    slug = model_slug(model)
    target = census_dir(out, bench, slug, cfg.pool)
    if (store_dir(out, bench, slug) / "meta.json").exists():
        _restore_or_clean(target)  # leftovers of a census killed while writing
    t0 = time.perf_counter()
    path, meta, data = read_input(bench, model, out)
    t_read = time.perf_counter() - t0
    notes = []
    if isinstance(embeddings, str):
        embeddings, why = load_embeddings(meta)
        if why:
            notes.append(why)
    t1 = time.perf_counter()
    parts: dict[str, float] = {}
    result = census_run(data, cfg, embeddings=embeddings, progress=progress, timings=parts)
    df = result.positions
    t_census = time.perf_counter() - t1
    if result.index.get("note"):
        notes.append(result.index["note"])
    summary = summarize(df, cfg, meta=meta, notes=notes, emb_available=embeddings is not None)
    summary["store"] = str(path)
    summary["store_fingerprint"] = store_fingerprint(meta)
    summary["index"] = result.index
    summary["pool_bounds"] = result.pool
    summary["timing"] = {"read_s": round(t_read, 3), "census_s": round(t_census, 3),
                         "positions_per_s": round(len(df) / max(t_census, 1e-9), 1),
                         "parts_s": {k: round(v, 3) for k, v in parts.items()},
                         "device": str(pick_device(cfg.device))}
    write_census(target, df, summary)
    return target, summary


def format_summary(s: dict) -> str:
    def pct(p):
        if p is None or p.get("value") is None:
            return "n/a"
        w = p.get("wilson") or [None, None]
        b = p.get("bootstrap") or [None, None]
        txt = f"{100 * p['value']:.2f}% (n={p['n']})"
        if w[0] is not None:
            txt += f"  wilson {100 * w[0]:.2f}-{100 * w[1]:.2f}"
        if b and b[0] is not None:
            txt += f"  bootstrap {100 * b[0]:.2f}-{100 * b[1]:.2f}"
        return txt

    m = s["mechanism"]
    lines = [
        f"census {s['bench']} / {s['model']} (layer {s['layer']}, pool {s['pool']}): "
        f"{s['positions']} positions, {s['requests']} requests",
        f"  available   {pct(s['available'])}",
        f"  producible  {pct(s['producible'])}",
        f"  gap         {pct(s['gap'])}",
        f"  recall      {pct(s['recall'])}  (semantic key over gap positions)",
        f"  recall emb  {pct(m['recall_static_embedding'])}",
        f"  recall adj  {pct(m['recall_adjacency'])}",
        f"  blind lexical {pct(m['blind_lexical'])}; with semantic {pct(m['blind_with_semantic'])}",
    ]
    ix, pb = s.get("index") or {}, s.get("pool_bounds") or {}
    if ix and ix.get("spec") != "exact":
        def share(v):
            return "n/a" if v is None else f"{100 * v:.1f}%"
        lines.append(f"  index {ix['spec']}: {ix.get('bytes_per_state')} bytes/state, knn recall@C "
                     f"{share(ix.get('knn_recall'))}, gap recall {share(ix.get('gap_recall_index'))} vs exact "
                     f"{share(ix.get('gap_recall_exact'))} (n={ix.get('gap_sample')})")
    if pb.get("budget_tokens") is not None:
        lines.append(f"  store budget {pb['store_budget']} = {pb['budget_tokens']} tokens; "
                     f"mean pool {pb['mean_pool_tokens']:.0f} tokens")
    if (pb.get("tenants") or 1) > 1:
        lines.append(f"  tenants {pb['tenants']} (each censused against its own traces only)")
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    return "\n".join(lines)
