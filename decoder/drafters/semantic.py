"""The semantic key and the recycled pool: pure chain functions beside three small stores.

`SemanticPool` is the trace store under its cosine index (the paper's eq. 1): one row per
generated token that carries a state, the state L2-normalised in float16, kept in one matrix that
grows by doubling (amortised O(1) per row). A query is one float16 mat-vec and a top-k (torch; for
a single query this beats faiss on CPU). Row r points at the token x_i its state was computed on
(state i = the state with x_i as input, so it predicted x_{i+1}); its trace's tokens sit in one flat
array, so a chain is a slice. Traces are grouped by prompt hash; the group being served is masked
out of every query (a request never drafts from a copy of itself).

`semantic_chains` turns the top-k neighbours into chains, eq. (2): neighbour i with similarity s
contributes gamma_i = x[i+2 : i+2+D(s)] (D tokens; the paper's inclusive x_{i+2 : i+1+D}). The
+2: the query state h_t is the state that predicted the anchor, so h_i ~ h_t puts x_{i+1} at the
anchor and x_{i+2} at the first drafted position. Chains shorter than 2 tokens and repeats are
dropped.

`RejectedPool` is the rejected-branch ring buffer (paper (i b)): a record per node verification
rejected, keyed by (the state before the node, its token), valued by the continuation the model
endorses from there (`rejected_records`), retrieved where the anchor token is the record's token
and cos(h_t, key state) >= 0.8.

`SelfCalibration` mutes the key where its drafts are rarely accepted:
  - outcome: one per pass in which the key bought at least one node (added a node no other source
    had placed); a hit when any node it bought was accepted;
  - window: the last `window` (32) outcomes;
  - threshold: once the window is full and its hit rate is below `min_hit_rate` (1/32: not one hit
    in 32 buying passes), the key is muted. Deliberately lenient: a hit is worth several tokens
    while a miss costs only reserved nodes, and on stories260k traffic (names minted into a
    repeated frame; 12% of buying passes hit) a 2-in-16 rule muted a key that paid (tau 4.03 vs
    4.16 unmuted), 1-in-32 gave 4.14;
  - recovery: a muted key skips the next `cooldown` (64) passes that would have queried it, then
    returns on probation with an empty window (it needs another full window to be muted again).
The state is global across requests (a traffic's regime is a property of the traffic).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from data.stateindex import unit
from decoder.draft import ROOT, VerifyResult
from decoder.drafters.pld import NgramIndex

DEPTH_SCHEDULE = ((0.90, 48), (0.82, 8))  # D(s): the first (threshold, depth) whose threshold s reaches
RANK_DEPTHS = (16, 8, 4, 2, 2, 2, 2, 2)  # --fixed-depth: copy depth by neighbour rank (0 = nearest)
MIN_CHUNK = 1024  # rows the matrices start with; they double when full

Chain = list[int]


def copy_depth(s: float, schedule: Sequence[tuple[float, int]] = DEPTH_SCHEDULE) -> int:
    """D(s): 48 tokens if s >= 0.90, 8 if s >= 0.82, else 0 (skip the neighbour)."""
    for threshold, depth in schedule:
        if s >= threshold:
            return depth
    return 0


def _grow(t: torch.Tensor | None, rows: int, d: int) -> torch.Tensor:
    """A float16 [capacity, d] matrix holding `t`'s rows, with capacity >= rows (doubling)."""
    if t is not None and t.shape[0] >= rows:
        return t
    cap = max(MIN_CHUNK, 2 * (t.shape[0] if t is not None else 0), rows)
    out = torch.zeros((cap, d), dtype=torch.float16)
    if t is not None:
        out[: t.shape[0]] = t
    return out


def _grow_np(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] >= rows:
        return a
    out = np.zeros(max(MIN_CHUNK, 2 * a.shape[0], rows), a.dtype)
    out[: a.shape[0]] = a
    return out


def semantic_chains(scores: Sequence[float], flat: Sequence[int], ends: Sequence[int], tokens: np.ndarray,
                    depth: Callable[[float, int], int], offset: int = 2, min_len: int = 2) -> list[Chain]:
    """Chains of the neighbours, in the given (decreasing similarity) order.

    Neighbour j sits at flat token index flat[j] of a trace ending (exclusive) at ends[j]; its chain
    is tokens[flat + offset : flat + offset + depth(s, rank)], cut at the trace end, kept when at
    least `min_len` long and not already proposed.
    """
    chains, seen = [], set()
    for rank, (s, f, end) in enumerate(zip(scores, flat, ends)):
        d = depth(float(s), rank)
        if d <= 0:
            continue
        lo = int(f) + offset
        chain = tokens[lo : min(lo + d, int(end))].tolist()
        key = tuple(chain)
        if len(chain) >= min_len and key not in seen:
            seen.add(key)
            chains.append(chain)
    return chains


class SemanticPool:
    """Per-position states of finished traces (normalised), their tokens, their prompt groups.

    `index` names the cosine index (data/stateindex.py). "exact" (default) is the float16 matrix
    above. Any other spec keeps the states in a `data.stateindex.StateIndex` (faiss) instead, with
    row numbers as ids (they only grow; `row_base` is the id of the first row still held) and the
    excluded prompt group passed as id ranges. With `recall_every` > 0 a faiss pool also keeps the
    float16 matrix as a shadow, measurement only (left out of `nbytes`): every `recall_every`-th
    query answered by the trained index is repeated exactly over the same rows and recall@k of the
    rows is counted (`recall_hits` / `recall_total`), its time kept apart in `shadow_s`.

    `evict_traces(n)` drops the oldest n traces (one per `add_trace` call, empty ones included):
    the --store-budget window (data/budget.py). The arrays are compacted, so memory follows the
    pool; a faiss index drops its rows with `evict_below`.
    """

    def __init__(self, index: str = "exact", recall_every: int = 0, train_size: int | None = None) -> None:
        from data.stateindex import parse_index_spec

        self.spec = parse_index_spec(index)  # checked again with the state width at the first row
        self.recall_every = max(0, int(recall_every)) if not self.spec.exact else 0
        self.train_size = train_size
        self.index = None  # StateIndex of a faiss spec, built at the first row (it needs d)
        self.row_base = 0  # StateIndex id of local row 0 (rows evicted so far)
        self.d: int | None = None
        self.matrix: torch.Tensor | None = None  # [capacity, d] float16; rows [0, n) in use (the shadow for faiss)
        self.n = 0
        self.row_flat = np.zeros(0, np.int64)  # row -> flat index of the token its state was computed on
        self.row_end = np.zeros(0, np.int64)  # row -> flat end (exclusive) of its trace
        self.tokens = np.zeros(0, np.int32)  # every trace's generated tokens, back to back
        self.n_tokens = 0
        self._group_of: dict[Hashable, int] = {}
        self._group_rows: dict[int, list[tuple[int, int]]] = {}  # group -> row spans
        self.trace_keys: list[np.ndarray] = []  # per trace: its request-level key (normalised float32)
        self.trace_group: list[int] = []
        self.trace_span: list[tuple[int, int]] = []  # per trace: flat [lo, hi)
        self._traces: list[tuple[int, int, int, int, bool]] = []  # per add_trace: flat lo, hi, row lo, hi, keyed
        self._excluded_group = -1
        self._excluded_rows: torch.Tensor | None = None
        self._excluded_at = -1  # pool size the exclusion index was built for
        self.queries = 0  # queries answered by a trained faiss index (the recall sample is drawn from these)
        self.recall_queries = self.recall_hits = self.recall_total = self.recall_k = 0
        self.shadow_s = 0.0

    def group(self, prompt_hash: Hashable | None) -> int:
        if prompt_hash is None:  # never excluded: a group of its own
            prompt_hash = ("anonymous", len(self._group_of))
        return self._group_of.setdefault(prompt_hash, len(self._group_of))

    def add_trace(self, tokens: Sequence[int], hidden: np.ndarray | None, prompt_hash: Hashable | None = None,
                  key_state: np.ndarray | None = None) -> int:
        """Append a finished trace; rows for its positions with a (non-zero) state. Returns rows added."""
        n_tok = len(tokens)
        lo = self.n_tokens
        if n_tok == 0:
            self._traces.append((lo, lo, self.n, self.n, False))
            return 0
        self.tokens = _grow_np(self.tokens, lo + n_tok)
        self.tokens[lo : lo + n_tok] = np.asarray(tokens, np.int32)
        self.n_tokens += n_tok
        g = self.group(prompt_hash)
        if hidden is None or len(hidden) == 0:
            self._traces.append((lo, lo + n_tok, self.n, self.n, False))
            return 0
        states = unit(np.asarray(hidden)[:n_tok])
        valid = np.flatnonzero(np.abs(states).sum(axis=1) > 0)
        if self.d is None:
            self.d = states.shape[1]
        if states.shape[1] != self.d:
            raise ValueError(f"state width {states.shape[1]} differs from the pool's {self.d}")
        key = unit(key_state) if key_state is not None else (states[valid[0]] if len(valid) else None)
        if key is not None:
            self.trace_keys.append(np.asarray(key, np.float32).reshape(-1))
            self.trace_group.append(g)
            self.trace_span.append((lo, lo + n_tok))
        k = len(valid)
        r0 = self.n
        self._traces.append((lo, lo + n_tok, r0, r0 + k, key is not None))
        if k == 0:
            return 0
        if self.spec.exact or self.recall_every:
            self.matrix = _grow(self.matrix, r0 + k, self.d)
            self.matrix[r0 : r0 + k] = torch.from_numpy(states[valid]).to(torch.float16)
        if not self.spec.exact:
            if self.index is None:
                from data.stateindex import StateIndex, parse_index_spec

                self.spec = parse_index_spec(self.spec.text, self.d)
                self.index = StateIndex(self.spec, self.d, self.train_size)
            ids = np.arange(self.row_base + r0, self.row_base + r0 + k, dtype=np.int64)
            self.index.add(states[valid], ids)
        self.row_flat = _grow_np(self.row_flat, r0 + k)
        self.row_end = _grow_np(self.row_end, r0 + k)
        self.row_flat[r0 : r0 + k] = lo + valid
        self.row_end[r0 : r0 + k] = lo + n_tok
        self.n += k
        self._group_rows.setdefault(g, []).append((r0, r0 + k))
        return k

    def exclude(self, prompt_hash: Hashable | None) -> None:
        """Mask the traces of this prompt out of every query until the next call."""
        self._excluded_group = self._group_of.get(prompt_hash, -1) if prompt_hash is not None else -1
        self._excluded_at = -1

    def _excluded(self) -> torch.Tensor | None:
        if self._excluded_at != self.n:
            spans = self._group_rows.get(self._excluded_group, [])
            rows = [r for lo, hi in spans for r in range(lo, hi)]
            self._excluded_rows = torch.tensor(rows, dtype=torch.long) if rows else None
            self._excluded_at = self.n
        return self._excluded_rows

    def query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(similarities, rows) of the k nearest rows by cosine, decreasing; excluded rows never appear."""
        if self.n == 0 or k <= 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        if self.index is None:
            return self._exact_query(state, k)
        base = self.row_base
        spans = [(lo + base, hi + base) for lo, hi in self._group_rows.get(self._excluded_group, [])]
        ids, scores = self.index.search(np.asarray(state, np.float32).reshape(1, -1), k, lo=base, exclude=spans)
        keep = ids[0] >= 0
        s, rows = scores[0][keep].astype(np.float32), ids[0][keep] - base
        if self.index.trained:
            self.queries += 1
            if self.recall_every and (self.queries - 1) % self.recall_every == 0:
                self._shadow(state, k, rows)
        return s, rows

    def _exact_query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = torch.from_numpy(unit(state).reshape(-1)).to(torch.float16)
        scores = self.matrix[: self.n] @ q
        excluded = self._excluded()
        if excluded is not None:
            scores[excluded] = -float("inf")
        top = scores.topk(min(k, self.n))
        s = top.values.float().numpy()
        keep = np.isfinite(s)
        return s[keep], top.indices.numpy()[keep]

    def _shadow(self, state: np.ndarray, k: int, rows: np.ndarray) -> None:
        """recall@k of `rows` against the exact float16 query over the same rows (measurement only)."""
        import time

        t0 = time.perf_counter()
        truth = self._exact_query(state, k)[1]
        self.recall_queries += 1
        self.recall_k = max(self.recall_k, k)
        self.recall_hits += len(set(truth.tolist()) & set(rows.tolist()))
        self.recall_total += len(truth)
        self.shadow_s += time.perf_counter() - t0

    def evict_traces(self, count: int) -> None:
        """Drop the oldest `count` traces (their tokens, rows, keys); row numbers of the rest shift down."""
        count = min(count, len(self._traces))
        if count <= 0:
            return
        kept = self._traces[count:]
        t0 = kept[0][0] if kept else self.n_tokens
        r0 = kept[0][2] if kept else self.n
        dropped_keys = sum(keyed for *_, keyed in self._traces[:count])
        self._traces = [(a - t0, b - t0, c - r0, d - r0, keyed) for a, b, c, d, keyed in kept]
        n_tok, n = self.n_tokens - t0, self.n - r0
        self.tokens = self.tokens[t0 : self.n_tokens].copy() if n_tok else np.zeros(0, np.int32)
        self.n_tokens = n_tok
        self.row_flat = self.row_flat[r0 : self.n] - t0
        self.row_end = self.row_end[r0 : self.n] - t0
        if self.matrix is not None:  # rebuilt, not sliced: a view would keep the evicted rows alive
            old, self.matrix = self.matrix, None
            if n:
                self.matrix = _grow(None, n, self.d)
                self.matrix[:n] = old[r0 : r0 + n]
        if self.index is not None:
            self.index.evict_below(self.row_base + r0)
        self.row_base += r0
        self.n = n
        spans = {g: [(a - r0, b - r0) for a, b in sp if a >= r0] for g, sp in self._group_rows.items()}
        self._group_rows = {g: sp for g, sp in spans.items() if sp}  # a span is one whole trace: kept or gone
        self.trace_keys = self.trace_keys[dropped_keys:]
        self.trace_group = self.trace_group[dropped_keys:]
        self.trace_span = [(a - t0, b - t0) for a, b in self.trace_span[dropped_keys:]]
        self._excluded_at = -1

    def nearest_traces(self, state: np.ndarray, top: int) -> list[tuple[float, int]]:
        """The request-level key: (similarity, trace) of the `top` traces nearest by their trace key."""
        if not self.trace_keys or top <= 0:
            return []
        keys = np.stack(self.trace_keys)
        s = keys @ unit(state).reshape(-1)
        s[np.asarray(self.trace_group) == self._excluded_group] = -np.inf
        order = np.argsort(-s, kind="stable")[:top]
        return [(float(s[t]), int(t)) for t in order if np.isfinite(s[t])]

    def trace_tokens(self, trace: int) -> list[int]:
        lo, hi = self.trace_span[trace]
        return self.tokens[lo:hi].tolist()

    def bytes_per_state(self) -> float | None:
        """Bytes one state costs in the index: 2 d for the float16 matrix, the faiss index's own count
        (data.stateindex: serialized bytes per kept state, float32 during its warm-up) otherwise."""
        if self.d is None:
            return None
        if self.index is None:
            return 2.0 * self.d
        return float(self.index.bytes_per_state()) if self.n else None

    def index_info(self) -> dict:
        """The index's figures for summary.json (raw sums, so per-tenant pools can be added up)."""
        idx = self.index
        return {
            "index": self.spec.text,
            "bytes_per_state": self.bytes_per_state(),
            "index_fixed_bytes": idx.fixed_bytes() if idx is not None else 0,
            "index_trained": idx.trained if idx is not None else None,
            "warmup_queries": idx.warmup_queries if idx is not None else 0,
            "knn_recall_queries": self.recall_queries,
            "knn_recall_hits": self.recall_hits,
            "knn_recall_total": self.recall_total,
            "knn_recall_every": self.recall_every,
            "knn_recall_k": self.recall_k,
            "knn_shadow_s": self.shadow_s,
        }

    def nbytes(self) -> int:
        """Bytes of the store as used: states (float16, or the faiss index's codes and fixed part), tokens
        (int32), row pointers (int64)."""
        d = self.d or 0
        if self.index is None:
            return self.n * (2 * d + 16) + 4 * self.n_tokens
        per_state = self.bytes_per_state() or 0.0
        return int(round(self.n * (per_state + 16))) + self.index.fixed_bytes() + 4 * self.n_tokens


def ngram_continuation(trace: NgramIndex, context: Sequence[int], depth: int) -> Chain:
    """What followed, in an indexed trace, the longest suffix n-gram of `context` (up to `depth` tokens;
    the trace's most recent occurrence of that n-gram)."""
    for n in range(min(trace.max_ngram, len(context)), 0, -1):
        j = trace.last.get(tuple(int(t) for t in context[len(context) - n :]))
        if j is not None:
            return trace.tokens[j + 1 : j + 1 + depth]
    return []


# ---------------------------------------------------------------- the rejected-branch pool

def rejected_records(result: VerifyResult, max_depth: int = 6) -> list[tuple[int, int, Chain]]:
    """(row of the state before the node, the node's token, the endorsed continuation) per rejected node.

    Rejected nodes: the children of the anchor and of the accepted nodes that were not accepted
    (the nodes verification judged and refused). Rows index result.hidden (0 = anchor, 1 + i = node i).
    The continuation starts with the model's argmax at the node and follows the child carrying that
    argmax while one exists, up to `max_depth` tokens. An argmax of -1 is unknown (replay: the trace
    store holds the model's outputs on the true path only): the continuation stops there, and a node
    with no known continuation gives no record.
    """
    draft = result.draft
    if not len(draft) or max_depth <= 0:
        return []
    argmax = result.argmax
    accepted = set(result.accepted_nodes)
    judged = {ROOT, *result.accepted_nodes}
    out = []
    for i, p in enumerate(draft.parents):
        if p not in judged or i in accepted:
            continue
        cont, node = [], i
        while len(cont) < max_depth:
            tok = int(argmax[1 + node])
            if tok < 0:
                break
            cont.append(tok)
            nxt = draft.child(node, tok)
            if nxt is None:
                break
            node = nxt
        if cont:
            out.append((0 if p == ROOT else 1 + p, int(draft.tokens[i]), cont))
    return out


class RejectedPool:
    """Ring buffer of rejected nodes: (state before, token) -> continuation; oldest overwritten first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.states: np.ndarray | None = None  # [capacity, d] float32, normalised (small: numpy beats torch here)
        self.tokens = np.full(capacity, -1, np.int64)
        self.conts: list[Chain | None] = [None] * capacity
        self.owner: list[tuple[Hashable, int] | None] = [None] * capacity  # (prompt hash, request serial)
        self.by_token: dict[int, set[int]] = {}
        self.next = 0  # the slot written next
        self.size = 0

    def add(self, state: np.ndarray, token: int, cont: Chain, owner: tuple[Hashable, int] | None = None) -> None:
        if self.capacity <= 0 or not cont:
            return
        state = unit(state).reshape(-1)
        if self.states is None:
            self.states = np.zeros((self.capacity, state.shape[0]), np.float32)
        slot = self.next
        old = int(self.tokens[slot])
        if old >= 0:
            self.by_token[old].discard(slot)
        self.states[slot] = state
        self.tokens[slot] = token
        self.conts[slot] = list(cont)
        self.owner[slot] = owner
        self.by_token.setdefault(int(token), set()).add(slot)
        self.next = (slot + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def lookup(self, state: np.ndarray, token: int, theta: float = 0.8, top: int = 4,
               skip: Callable[[tuple[Hashable, int] | None], bool] | None = None) -> list[Chain]:
        """Up to `top` distinct continuations of records with this token and cos >= theta, most similar first."""
        slots = [s for s in self.by_token.get(int(token), ()) if skip is None or not skip(self.owner[s])]
        if not slots or top <= 0:
            return []
        slots.sort()
        sims = self.states[slots] @ unit(state).reshape(-1)
        order = np.argsort(-sims, kind="stable")
        chains, seen = [], set()
        for j in order:
            if sims[j] < theta or len(chains) >= top:
                break
            cont = self.conts[slots[j]]
            if tuple(cont) not in seen:
                seen.add(tuple(cont))
                chains.append(list(cont))
        return chains

    def nbytes(self) -> int:
        d = self.states.shape[1] if self.states is not None else 0
        return self.size * (4 * d + 8) + sum(4 * len(c) for c in self.conts if c)


# ---------------------------------------------------------------- self-calibration

@dataclass
class SelfCalibration:
    """Mutes the key when, over its last `window` buying passes, fewer than `min_hit_rate` had a bought
    node accepted; a muted key skips `cooldown` passes, then returns with an empty window."""

    window: int = 32
    min_hit_rate: float = 1 / 32
    cooldown: int = 64
    outcomes: collections.deque = field(init=False)  # the last `window` outcomes
    muted_for: int = 0  # passes left to skip
    mutes: int = 0  # times muted so far
    skipped: int = 0  # passes skipped so far

    def __post_init__(self) -> None:
        self.outcomes = collections.deque(maxlen=max(0, self.window))

    def allow(self) -> bool:
        """Called once per pass that would query the key: False while muted (and counts the skip)."""
        if self.window <= 0:
            return True
        if self.muted_for > 0:
            self.muted_for -= 1
            self.skipped += 1
            return False
        return True

    def record(self, hit: bool) -> None:
        """The outcome of a pass in which the key bought nodes."""
        if self.window <= 0:
            return
        self.outcomes.append(bool(hit))
        if len(self.outcomes) == self.window and sum(self.outcomes) < self.min_hit_rate * self.window:
            self.muted_for = self.cooldown
            self.mutes += 1
            self.outcomes.clear()
