"""Whose rows each request's census draws from: the pool plan, the lexical automata, the tenants.

`PoolPlan` says, per request, which entry rows its pool holds (past: the earlier requests; warm:
all of them; minus the traces below the store-budget window and the same-prompt traces: pool rows
of request q are a contiguous range, so the past pool is a prefix, the evicted traces the range
below the window, and an excluded trace a masked range). `LexicalPool` keeps the suffix automata
the lexical answers are read from; `TokenEntries` the entries of each input token (adjacency and
static-embedding keys). `prepare` reads the index spec and the budget and splits the input into
one `Part` per tenant (a tenant's requests form an input of their own).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from census.definitions import CensusConfig, CensusInput, entry_valid
from census.index import PoolView
from data.errors import OilbirdError
from data.index.automaton import SuffixAutomaton
from data.index.budget import Budget, bytes_per_token, parse_budget, window_starts
from data.index.stateindex import IndexSpec, check_trainable, parse_index_spec


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
        self.main = self.automaton()
        self.evicted = self.automaton()
        self.groups: dict[str, tuple[SuffixAutomaton, list[int]]] = {}
        if mode == "warm":
            for out in outputs:
                self.main.add_sequence(out)

    def automaton(self) -> SuffixAutomaton:
        """An empty automaton counting strings of at most count_len tokens (the census reads no positions)."""
        return SuffixAutomaton(self.count_len, positions=False)

    def view(self, r: int, pool: RequestPool) -> PoolView:
        while self.evicted.n_sequences < pool.start:  # the window start only moves forward
            self.evicted.add_sequence(self.outputs[self.evicted.n_sequences])
        subtracted = [self.evicted]
        if pool.members:
            h = self.hashes[r]
            sam, held = self.groups.get(h, (None, []))
            if sam is None or pool.members[:len(held)] != held:  # a member left the window
                sam, held = self.automaton(), []
            for q in pool.members[len(held):]:  # otherwise members only grow, in order
                sam.add_sequence(self.outputs[q])
                held.append(q)
            self.groups[h] = (sam, held)
            subtracted.append(sam)
        return PoolView(self.main, subtracted)

    def finish_request(self, r: int) -> None:
        if self.mode == "past":
            self.main.add_sequence(self.outputs[r])


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
    starts: np.ndarray  # window start of every request (data/index/budget.py)
    parts: list[Part]


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
        # the window is the store's (data/index/budget.py); inside a tenant it starts at its first request >= s(r)
        sub_starts = np.searchsorted(reqs, starts[reqs])
        parts.append(Part(sub, reqs, rows, PoolPlan(sub, cfg.pool, sub_starts)))
    return Setup(spec, budget, budget_tokens, bpt, starts, parts)


def local_rows(part: Part, rows: np.ndarray) -> np.ndarray:
    """Positions (in the part's rows) of those store rows that belong to the part."""
    return np.nonzero(np.isin(part.rows, rows))[0]
