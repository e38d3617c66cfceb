"""The census definitions, written once. Everything else in census/ implements these.

Requests are replayed in serving order (the store's request index). Request r has a prompt
p_1..p_P and generated tokens x_0..x_{n-1}; the store keeps, per generated token, the layer-l state
computed with it as input (it predicts the next token) and the model's top-8 next-token ids there,
and per request the state and top-8 at the last prompt token (they predict x_0).

Pool. The pool seen by request r is the generated tokens of the requests before it (`past`, the
default) or of every other request (`warm`), in both cases without the requests whose prompt_hash
equals r's (an identical prompt replays the same greedy trace) and without the requests of another
tenant (a tenant never drafts from another tenant's traces). Prompts are never pooled.

Store budget (--store-budget, past only). The past pool is bounded: request r draws from requests
s(r) .. r-1 only, with s(r) from data/index/budget.py's window_starts over every request's generated
length (the single definition the decoder and the replay read too), still without same-prompt and
other-tenant traces. A budget in MB is turned into tokens at the bytes a pooled token costs: 2 d + 4
with the exact key (a float16 state and an int32 token), the index's code bytes + 4 with --index.
Every key reads the same bounded pool.

Index (--index). The semantic key may search a data/index/stateindex.py index (sq8, pq64, ...) instead of
the exact cosine: the pool is the same, request r's entries join the index only after r's queries
(past), and sem_hit / sem_best_cos use the index's own ranking and score. `exact` (the default) is
the definition below.

Pool entries. Every generated token x_j of a pooled request q is predicted by one entry:
  input  = the token fed at that step (the last prompt token for j = 0, else x_{j-1}),
  state  = the state computed at that input (prompt_last_hidden for j = 0, else hidden[j-1]),
  topk   = the model's top-8 there (prompt_last_topk, else topk[j-1]),
  next   = x_j, the token that followed.
Entry (q, j) has the global index offsets[q] + j: the row of x_j. A store row i therefore serves
twice: its token is entry i's `next`, and its state/topk are entry i+1's. An entry whose state is
null is not an entry (only the last token of a trace has a null state, and it predicts nothing).
The request's own entry at t (input = the last context token, state = the query, topk = the model's
own guess at x_t) is never a candidate source: own-context entries count only for j < t.

At generated position t of request r: context = prompt + x_0..x_{t-1}; target = x_t;
last context token y = x_{t-1} (the last prompt token at t = 0); query state = the state that
predicts x_t (hidden[t-1], prompt_last_hidden at t = 0) = entry (r, t)'s state.

available        (x_t, ..., x_{t+h-1}) occurs verbatim inside one pooled trace (h = horizon, 2);
                 near the end of the trace the shorter future that remains (x_t alone at the end).
producible       the exact-match oracle: for L = min(max_suffix, longest pool match) down to
                 min_suffix, take the pool occurrences of the context's last L tokens that have a
                 following token in the same trace; add their distinct followers in order of
                 frequency (ties: smaller token id first) to the candidate list, skipping ones
                 already in it; stop as soon as it holds `candidates` (8) tokens. Producible when
                 x_t is in the list.
oracle_suffix_len  the L at which x_t entered the list; when it never did, the longest L that
                 contributed any candidate (the matched suffix length used); 0 when none did.
longest_match_len  the longest suffix of the context, of any length from 0 up to max_suffix, that
                 occurs in the pool (anywhere in a trace, followed or not). Capped at the oracle's
                 reach so "context still matched" reads the same at successes and at gaps.
gap              available and not producible.
sem_hit          semantic key: the `candidates` pool entries whose states have the highest cosine
                 with the query state (ties: the later entry in serving order first); hit when
                 x_t is among their `next` tokens. Null when the query state is missing.
sem_best_cos     the highest of those cosines (null when the pool has no entry).
emb_hit          static-embedding key: the same with the model's input embedding: query E[y],
                 entry key E[input]; ties (the same token, or identical rows) broken by smaller
                 token id, then the later entry. Null for the whole run when the embedding matrix
                 could not be loaded.
adj_hit          token-adjacency key (Token Recycling): the most recent earlier entry whose input is
                 y, looked up first in the own context (entries j < t), then in the pool (the
                 latest in serving order); hit when x_t is in its first min(candidates, 8) topk
                 ids. Only the last prompt token and generated tokens carry a stored topk, so the
                 adjacency of any other prompt token is found only in the pool.
novel_prev       y occurs nowhere in the pool (equivalently longest_match_len = 0).
payload_len      at recovered gap positions (gap and sem_hit), the longest prefix of
                 x_t, x_{t+1}, ... occurring verbatim in one pooled trace, capped at payload_cap;
                 null elsewhere.
neighbour_match_len  at the same positions, the longest common prefix of x_t, x_{t+1}, ... and
                 the continuation (next, and what followed it in its trace) of one of the
                 retrieved semantic neighbours whose next is x_t (the best of them), capped at
                 payload_cap; null elsewhere.

All cosines are exact (float64 over the stored float16 values); see knn.py for how the float32
search keeps that exact.

Sampled traces. Every definition above reads the stored tokens as the targets and the stored text as the
pool, whatever chose them; they hold exactly for what the store holds. For a greedy store that is greedy
decoding. For sampled requests (requests.parquet `sampling` "sampled": data/store/sampling.py) the figures
describe the sampled text, the contexts and pool this run drew: an indicator of x_t alone (producible,
sem_hit, emb_hit, adj_hit: x_t among candidates that the context and pool fix) has as its expectation, given
them, the probability that a token drawn there falls among the candidates; available and payload_len read
the drawn future too. None of them says what a greedy verifier would accept there (the greedy text is not in
the store). The one line the census says about such a store, and what replay estimates over it:
docs/replay.md, "Sampled traces".
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from data.errors import OilbirdError
from data.store.statefiles import StateFiles

POOL_MODES = ("past", "warm")

POSITION_COLUMNS: dict[str, pl.DataType] = {
    "request": pl.Int32,
    "position": pl.Int32,
    "target": pl.Int32,
    "available": pl.Boolean,
    "producible": pl.Boolean,
    "gap": pl.Boolean,
    "oracle_suffix_len": pl.Int32,
    "longest_match_len": pl.Int32,
    "sem_hit": pl.Boolean,
    "sem_best_cos": pl.Float64,
    "emb_hit": pl.Boolean,
    "adj_hit": pl.Boolean,
    "novel_prev": pl.Boolean,
    "payload_len": pl.Int32,
    "neighbour_match_len": pl.Int32,
}


@dataclass
class CensusConfig:
    pool: str = "past"  # past: strictly earlier requests; warm: every other request
    horizon: int = 2  # tokens of future that must occur verbatim for `available`
    min_suffix: int = 2  # the oracle backs off down to this suffix length
    max_suffix: int = 16  # the oracle's longest suffix (and the cap of longest_match_len)
    candidates: int = 8  # candidate budget of every key
    payload_cap: int = 32  # cap of payload_len / neighbour_match_len
    bootstrap: int = 2000  # request-level bootstrap draws (0: no bootstrap intervals)
    seed: int = 0  # bootstrap seed
    device: str | None = None  # kNN device; default cuda when available
    index: str = "exact"  # semantic key's index: exact (census/knn.py) or a data/index/stateindex.py spec (sq8, pq64, ...)
    index_train: int | None = None  # states an index collects before it trains (None: the spec's own need)
    recall_sample: int = 1024  # positions (and gap positions) sampled to check an index against exact
    store_budget: str | None = None  # bounded past pool: tokens (200k) or megabytes (64MB); None: unbounded

    def validate(self) -> "CensusConfig":
        from data.index.budget import (
            parse_budget,  # here, not at the top: data.index.stateindex imports torch
        )
        from data.index.stateindex import parse_index_spec

        if self.pool not in POOL_MODES:
            raise OilbirdError(f"unknown pool mode '{self.pool}'; use past or warm")
        if parse_index_spec(self.index).auto:  # d is checked again once the store is read
            raise OilbirdError("--index auto is the decoder's serving index (exact, then pruned as the pool grows); "
                               "the census measures exact search or a named faiss spec (e.g. ivf256,flat)")
        if parse_budget(self.store_budget) is not None and self.pool != "past":
            raise OilbirdError(f"--store-budget bounds the past pool; pool {self.pool} has no serving order to bound")
        if self.recall_sample < 1:
            raise OilbirdError(f"--recall-sample must be >= 1 (got {self.recall_sample})")
        if self.index_train is not None and self.index_train < 1:
            raise OilbirdError(f"--index-train must be >= 1 (got {self.index_train})")
        if self.horizon < 1:
            raise OilbirdError(f"--horizon must be >= 1 (got {self.horizon})")
        if not 1 <= self.min_suffix <= self.max_suffix:
            raise OilbirdError(f"need 1 <= --min-suffix <= --max-suffix (got {self.min_suffix}, {self.max_suffix})")
        if self.candidates < 1:
            raise OilbirdError(f"--candidates must be >= 1 (got {self.candidates})")
        if self.payload_cap < 1:
            raise OilbirdError(f"--payload-cap must be >= 1 (got {self.payload_cap})")
        if self.bootstrap < 0:
            raise OilbirdError(f"--bootstrap must be >= 0 (got {self.bootstrap})")
        if self.device:  # an unknown device, or cuda on a CPU build, is one line here, not a torch traceback
            from data.capture.models import pick_device

            pick_device(self.device)
        return self

    @property
    def count_len(self) -> int:
        """Longest string whose pool count the census reads."""
        return max(self.max_suffix + 1, self.horizon, self.payload_cap)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("device")
        return d


@dataclass
class Trace:
    """One request in memory (tests and small tools); `CensusInput.from_traces` flattens a list."""

    prompt: list[int]
    output: list[int]
    hidden: np.ndarray  # [n, d]: row i = state with output[i] as input
    topk: np.ndarray  # [n, 8]
    prompt_last_hidden: np.ndarray  # [d]
    prompt_last_topk: np.ndarray  # [8]
    prompt_hash: str
    hidden_valid: np.ndarray | None = None  # [n] bool; default: every row but the last
    tenant: str = ""  # requests of different tenants never share a pool


@dataclass
class CensusInput:
    """Everything the census reads, flat: the trace store's layout (data/store/reader.py)."""

    prompts: list[np.ndarray]  # per request, int64
    tokens: np.ndarray  # [N] generated tokens, requests concatenated in serving order
    offsets: np.ndarray  # [R + 1]: request r's rows are offsets[r]:offsets[r+1]
    hidden: np.ndarray  # [N, d] state with tokens[i] as input
    hidden_valid: np.ndarray  # [N] bool
    topk: np.ndarray  # [N, K]
    prompt_last_hidden: np.ndarray  # [R, d]
    prompt_last_topk: np.ndarray  # [R, K]
    prompt_hash: list[str]
    meta: dict = field(default_factory=dict)
    tenant: list[str] | None = None  # per request (None: one tenant)
    # where the states lie when they were left in the store's files (hidden is then [0, d]; row i's state is
    # states' row i): the census on Ray reads each shard's own (data/store/statefiles.py, census/ray_census.py)
    states: StateFiles | None = None

    def with_states(self) -> "CensusInput":
        """This input with its states read (itself when they are in memory)."""
        if self.states is None:
            return self
        hidden, valid = self.states.read_rows(np.arange(self.n_positions))
        if not np.array_equal(valid, self.hidden_valid):
            raise OilbirdError("the store's state validity changed after the census read it; rerun the census")
        return dataclasses.replace(self, hidden=hidden, states=None)

    @property
    def n_requests(self) -> int:
        return len(self.prompts)

    @property
    def n_positions(self) -> int:
        return int(self.offsets[-1])

    @property
    def d_model(self) -> int:
        return int(self.hidden.shape[1])

    def check(self) -> "CensusInput":
        R = self.n_requests
        if R == 0:
            raise OilbirdError("the trace set holds no requests; nothing to census")
        if self.n_positions == 0:
            raise OilbirdError("the trace set holds no generated tokens; nothing to census")
        if len(self.offsets) != R + 1 or len(self.prompt_hash) != R:
            raise OilbirdError("trace set is inconsistent: offsets / prompt_hash do not match the requests")
        for r, p in enumerate(self.prompts):
            if len(p) == 0:
                raise OilbirdError(f"request {r} has an empty prompt; the census needs a last context token")
        if (self.tokens < 0).any() or any((p < 0).any() for p in self.prompts):
            raise OilbirdError("trace set holds negative token ids")
        if self.tenant is not None and len(self.tenant) != R:
            raise OilbirdError("trace set is inconsistent: one tenant per request expected")
        return self

    def tenant_groups(self) -> list[np.ndarray]:
        """Request indices per tenant, in serving order (one group when there is one tenant)."""
        if self.tenant is None or len(set(self.tenant)) <= 1:
            return [np.arange(self.n_requests)]
        names = np.array([str(t) for t in self.tenant], dtype=object)
        return [np.nonzero(names == t)[0] for t in dict.fromkeys(names.tolist())]

    def subset(self, requests: np.ndarray) -> tuple["CensusInput", np.ndarray]:
        """The input restricted to some requests (in serving order), and the store row of each of its rows."""
        rows = np.concatenate([np.arange(self.offsets[q], self.offsets[q + 1]) for q in requests]).astype(np.int64)
        lens = np.diff(self.offsets)[requests]
        sub = CensusInput(
            prompts=[self.prompts[q] for q in requests], tokens=self.tokens[rows],
            offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            hidden=self.hidden if self.states is not None else self.hidden[rows],
            hidden_valid=self.hidden_valid[rows], topk=self.topk[rows],
            prompt_last_hidden=self.prompt_last_hidden[requests], prompt_last_topk=self.prompt_last_topk[requests],
            prompt_hash=[self.prompt_hash[q] for q in requests], meta=self.meta,
            tenant=None if self.tenant is None else [self.tenant[q] for q in requests],
            states=None if self.states is None else self.states.permuted(rows))
        return sub, rows

    @classmethod
    def from_traces(cls, traces: list[Trace], meta: dict | None = None) -> "CensusInput":
        if not traces:
            raise OilbirdError("the trace set holds no requests; nothing to census")
        d = int(np.asarray(traces[0].prompt_last_hidden).shape[-1])
        K = int(np.asarray(traces[0].prompt_last_topk).shape[-1])
        lens = [len(tr.output) for tr in traces]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

        def valid_of(tr: Trace) -> np.ndarray:
            if tr.hidden_valid is not None:
                return np.asarray(tr.hidden_valid, bool)[:len(tr.output)]
            v = np.ones(len(tr.output), bool)
            v[-1:] = False
            return v

        n = int(offsets[-1])
        return cls(
            prompts=[np.asarray(tr.prompt, np.int64) for tr in traces],
            tokens=np.concatenate([np.asarray(tr.output, np.int64) for tr in traces]) if n else np.zeros(0, np.int64),
            offsets=offsets,
            hidden=np.concatenate([np.asarray(tr.hidden).reshape(-1, d)[:len(tr.output)] for tr in traces])
            if n else np.zeros((0, d), np.float32),
            hidden_valid=np.concatenate([valid_of(tr) for tr in traces]) if n else np.zeros(0, bool),
            topk=np.concatenate([np.asarray(tr.topk, np.int64).reshape(-1, K)[:len(tr.output)] for tr in traces])
            if n else np.zeros((0, K), np.int64),
            prompt_last_hidden=np.stack([np.asarray(tr.prompt_last_hidden) for tr in traces]),
            prompt_last_topk=np.stack([np.asarray(tr.prompt_last_topk, np.int64) for tr in traces]),
            prompt_hash=[str(tr.prompt_hash) for tr in traces],
            meta=dict(meta or {}),
            tenant=[str(tr.tenant or "") for tr in traces] if any(tr.tenant for tr in traces) else None,
        )

    @classmethod
    def from_store(cls, store) -> "CensusInput":
        """Adapter from data.store.reader.TraceStore (read with load_hidden=True)."""
        tenant = None
        if "tenant" in store.requests.columns:  # stores written before the column have one tenant
            tenant = [str(t or "") for t in store.requests["tenant"].to_list()]
        return cls(
            prompts=[np.asarray(p, np.int64) for p in store.requests["prompt_tokens"].to_list()],
            tokens=store.positions["token"].to_numpy().astype(np.int64),
            offsets=np.asarray(store.offsets, np.int64),
            hidden=store.hidden,
            hidden_valid=np.asarray(store.hidden_valid, bool),
            topk=store.topk.astype(np.int64),
            prompt_last_hidden=store.prompt_last_hidden,
            prompt_last_topk=store.prompt_last_topk.astype(np.int64),
            prompt_hash=store.requests["prompt_hash"].to_list(),
            meta=dict(store.meta),
            tenant=tenant,
            states=store.state_files,
        )


@dataclass
class Entries:
    """The pool entries of every request (see the module docstring), indexed like the store rows."""

    request: np.ndarray  # [N] request of the entry
    input: np.ndarray  # [N] the input token
    next: np.ndarray  # [N] the token that followed (= tokens)
    valid: np.ndarray  # [N] bool: the entry has a state and a topk
    state: np.ndarray  # [N, d] raw state (float16/32 as stored)
    topk: np.ndarray  # [N, K]


def _first_rows(data: CensusInput) -> np.ndarray:
    lens = np.diff(data.offsets)
    first = np.zeros(data.n_positions, bool)
    first[data.offsets[:-1][lens > 0]] = True
    return first


def entry_valid(data: CensusInput) -> np.ndarray:
    """[N] bool: the entry has a state (build_entries' `valid`, without copying the states)."""
    N = data.n_positions
    if not N:
        return np.zeros(0, bool)
    prev = np.maximum(np.arange(N) - 1, 0)
    return np.where(_first_rows(data), True, data.hidden_valid[prev]).astype(bool)


def build_entries(data: CensusInput) -> Entries:
    N, R = data.n_positions, data.n_requests
    lens = np.diff(data.offsets)
    request = np.repeat(np.arange(R), lens)
    first = _first_rows(data)
    prev = np.maximum(np.arange(N) - 1, 0)
    last_prompt = np.array([int(p[-1]) for p in data.prompts], np.int64)
    inp = np.where(first, last_prompt[request], data.tokens[prev]) if N else np.zeros(0, np.int64)
    valid = np.where(first, True, data.hidden_valid[prev]) if N else np.zeros(0, bool)
    state = data.hidden[prev].copy() if N else data.hidden.copy()
    topk = data.topk[prev].copy() if N else data.topk.copy()
    if N:
        state[first] = np.asarray(data.prompt_last_hidden, dtype=state.dtype)[request[first]]
        topk[first] = data.prompt_last_topk[request[first]]
    return Entries(request=request, input=inp.astype(np.int64), next=data.tokens.astype(np.int64),
                   valid=valid.astype(bool), state=state, topk=topk.astype(np.int64))

