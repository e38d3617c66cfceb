"""The semantic key: pure chain functions beside its store.

`SemanticPool` is the trace store under its cosine index (the paper's eq. 1): one row per
generated token that carries a state, the state L2-normalised in float16, kept in one matrix that
grows by doubling (amortised O(1) per row). A small pool's query is one float16 mat-vec and a top-k;
past a few thousand rows the default `auto` index scores only the candidates of an inverted file
(data/index/pruner.py), exactly, from the same matrix. Row r points at the token x_i its state was computed on
(state i = the state with x_i as input, so it predicted x_{i+1}); its trace's tokens sit in one flat
array, so a chain is a slice. Traces are grouped by prompt hash; the group being served is masked
out of every query (a request never drafts from a copy of itself).

`semantic_chains` turns the top-k neighbours into chains, eq. (2): neighbour i with similarity s
contributes gamma_i = x[i+2 : i+2+D(s)] (D tokens; the paper's inclusive x_{i+2 : i+1+D}). The
+2: the query state h_t is the state that predicted the anchor, so h_i ~ h_t puts x_{i+1} at the
anchor and x_{i+2} at the first drafted position. Chains shorter than 2 tokens and repeats are
dropped.

The rejected-branch ring buffer (paper (i b)) is decoder/drafters/rollouts.py.

When the key is asked at all is decoder/drafters/keygate.py's (self-calibration, per-request patience).
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from data.index import keyscan
from data.index.knnrecall import recall_hits
from data.index.pruner import IvfPruner, PrunerConfig
from data.index.stateindex import DEFAULT_INDEX, parse_index_spec, unit, unit_vector
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


def _grow(t: torch.Tensor | None, rows: int, d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float16 [capacity, d] matrix on `device` holding `t`'s rows, with capacity >= rows (doubling)."""
    if t is not None and t.shape[0] >= rows:
        return t
    cap = max(MIN_CHUNK, 2 * (t.shape[0] if t is not None else 0), rows)
    out = torch.zeros((cap, d), dtype=torch.float16, device=device)
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
    rows = zip(np.asarray(scores, np.float64).tolist(), np.asarray(flat).tolist(), np.asarray(ends).tolist())
    for rank, (s, f, end) in enumerate(rows):  # plain Python numbers: this loop runs on every key pass
        d = depth(s, rank)
        if d <= 0:
            continue
        lo = f + offset
        hi = min(lo + d, end)
        if hi - lo < min_len:
            continue
        chain = tokens[lo:hi].tolist()
        key = tuple(chain)
        if key not in seen:
            seen.add(key)
            chains.append(chain)
    return chains


class SemanticPool:
    """Per-position states of finished traces (normalised), their tokens, their prompt groups.

    `index` names the cosine index (data/index/stateindex.py):
      auto (default)  the float16 matrix below, scored whole while the pool is small; past
                      `PrunerConfig.prune_from` states an `IvfPruner` (data/index/pruner.py) picks candidate
                      rows and only those are scored, exactly, from the same matrix. On a GPU
                      (`device`) the matrix lives there and every row is scored (one fused score,
                      mask and top-k, one copy back).
      exact           the float16 matrix, every row scored: the reference.
      a faiss spec    the states live in a `data.index.stateindex.StateIndex` instead, with row numbers as
                      ids (they only grow; `row_base` is the id of the first row still held) and the
                      excluded prompt group passed as id ranges.
    With `recall_every` > 0 an auto or faiss pool repeats every `recall_every`-th query it did not
    answer exactly (pruned, or from a trained faiss index) over every row (a faiss pool keeps the
    float16 matrix as a shadow for it, left out of `nbytes`) and counts recall@k of the rows
    (`recall_hits` / `recall_total`), its time kept apart in `shadow_s`: measurement only.

    Rows are the matrix's: row r points at the token x_i its state was computed on, `row_flat[r]`,
    and at its trace's end, `row_end[r]`; `row_group[r]` is its prompt group. The group being served
    is masked out of every query by spans (one slice per trace), never by a loop over rows.

    `evict_traces(n)` drops the oldest n traces (one per `add_trace` call, empty ones included):
    the --store-budget window (data/index/budget.py). The arrays are compacted, so memory follows the
    pool; an index drops its rows by id.
    """

    def __init__(self, index: str = DEFAULT_INDEX, recall_every: int = 0, train_size: int | None = None,
                 device: str = "cpu", pruner: PrunerConfig | None = None) -> None:
        self.spec = parse_index_spec(index)  # checked again with the state width at the first row
        self.recall_every = max(0, int(recall_every)) if not self.spec.exact else 0
        self.train_size = train_size
        self.device = torch.device(device)
        if self.device.type != "cpu" and not (self.spec.exact or self.spec.auto):
            raise ValueError(f"index {self.spec.text} runs on the CPU; a key on {device} takes auto or exact")
        self.pruner_config = pruner or PrunerConfig()
        self.pruner = None  # IvfPruner of the auto index, once the pool has grown past prune_from
        self.pruning = self.spec.auto and self.device.type == "cpu" and importlib.util.find_spec("faiss") is not None
        self.index = None  # StateIndex of a faiss spec, built at the first row (it needs d)
        self.row_base = 0  # global id of local row 0 (rows evicted so far)
        self.d: int | None = None
        self.matrix: torch.Tensor | None = None  # [capacity, d] float16 on `device`; rows [0, n) in use
        self.n = 0
        self.row_flat = np.zeros(0, np.int64)  # row -> flat index of the token its state was computed on
        self.row_end = np.zeros(0, np.int64)  # row -> flat end (exclusive) of its trace
        self.row_group = np.zeros(0, np.int32)  # row -> prompt group
        self.tokens = np.zeros(0, np.int32)  # every trace's generated tokens, back to back
        self.n_tokens = 0
        self._group_of: dict[Hashable, int] = {}
        self._group_rows: dict[int, list[tuple[int, int]]] = {}  # group -> row spans
        self.trace_keys: list[np.ndarray] = []  # per trace: its request-level key (normalised float32)
        self.trace_group: list[int] = []
        self.trace_span: list[tuple[int, int]] = []  # per trace: flat [lo, hi)
        self._traces: list[tuple[int, int, int, int, bool]] = []  # per add_trace: flat lo, hi, row lo, hi, keyed
        self._excluded_group = -1
        self.queries = 0  # queries answered inexactly (pruned, or by a trained faiss index): the recall sample
        self.pruned_queries = 0
        self.overlapped_queries = 0  # of which answered on the kernel's worker thread (`key_start`)
        self.recall_queries = self.recall_hits = self.recall_total = self.recall_k = 0
        self.shadow_s = 0.0
        self._chain_args: list | None = None  # `chains`' settings for the kernel (`_chain_spec`)
        self._chain_out: tuple = ()  # its output buffers: the chains back to back [m * max_len], lengths [m]

    @property
    def keeps_matrix(self) -> bool:
        return self.spec.exact or self.spec.auto or bool(self.recall_every)

    def group(self, prompt_hash: Hashable | None) -> int:
        if prompt_hash is None:  # never excluded: a group of its own
            prompt_hash = ("anonymous", len(self._group_of))
        return self._group_of.setdefault(prompt_hash, len(self._group_of))

    def add_trace(self, tokens: Sequence[int], hidden: np.ndarray | None, prompt_hash: Hashable | None = None,
                  key_state: np.ndarray | None = None) -> int:
        """Append a finished trace; rows for its positions with a (non-zero) state. Returns rows added."""
        IvfPruner.drain()  # a key pass still out on the kernel's worker reads the arrays replaced below
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
        if self.keeps_matrix:
            self.matrix = _grow(self.matrix, r0 + k, self.d, self.device)
            self.matrix[r0 : r0 + k] = torch.from_numpy(states[valid]).to(self.device, torch.float16)
        if not (self.spec.exact or self.spec.auto):
            if self.index is None:
                from data.index.stateindex import StateIndex

                self.spec = parse_index_spec(self.spec.text, self.d)
                self.index = StateIndex(self.spec, self.d, self.train_size)
            self.index.add(states[valid], np.arange(self.row_base + r0, self.row_base + r0 + k, dtype=np.int64))
        self.row_flat = _grow_np(self.row_flat, r0 + k)
        self.row_end = _grow_np(self.row_end, r0 + k)
        self.row_group = _grow_np(self.row_group, r0 + k)
        self.row_flat[r0 : r0 + k] = lo + valid
        self.row_end[r0 : r0 + k] = lo + n_tok
        self.row_group[r0 : r0 + k] = g
        self.n += k
        self._group_rows.setdefault(g, []).append((r0, r0 + k))
        if self.pruning:
            self._file(r0, self.n)
        return k

    def _file(self, r0: int, r1: int) -> None:
        """The auto index: file rows [r0, r1) with the pruner, training or re-training it when due."""
        if self.pruner is None:
            self.pruner = IvfPruner(self.d, self.pruner_config)
        if self.pruner.due(self.n):
            self.pruner.train(self.matrix[: self.n], np.arange(self.row_base, self.row_base + self.n, dtype=np.int64),
                              self.row_group[: self.n])
        elif self.pruner.trained:
            self.pruner.add(self.matrix[r0:r1], np.arange(self.row_base + r0, self.row_base + r1, dtype=np.int64),
                            self.row_group[r0:r1])

    def exclude(self, prompt_hash: Hashable | None) -> None:
        """Mask the traces of this prompt out of every query until the next call."""
        self._excluded_group = self._group_of.get(prompt_hash, -1) if prompt_hash is not None else -1

    def _excluded_spans(self) -> list[tuple[int, int]]:
        return self._group_rows.get(self._excluded_group, [])

    @property
    def active_index(self) -> str:
        """The structure answering queries at the pool's present size (a spec, data/index/stateindex.py)."""
        if self.spec.auto:
            if self.pruner is not None and self.pruner.trained:
                return f"auto:{self.pruner.spec}"
            return "auto:exact" + ("" if self.device.type == "cpu" else f"@{self.device.type}")
        return self.spec.text

    def query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(similarities, rows) of the k nearest rows by cosine, decreasing; excluded rows never appear."""
        if self.n == 0 or k <= 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        if self.index is not None:
            s, rows, inexact = self._faiss_query(state, k)
        elif self.pruner is not None and self.pruner.trained:
            s, rows = self._pruned_query(state, k)
            inexact = True
        else:
            return self.exact_query(state, k)
        if inexact:
            self._sample_recall(state, k, rows)
        return s, rows

    def key(self, state: np.ndarray, k: int, theta: float, schedule: Sequence[tuple[float, int]] = DEPTH_SCHEDULE,
            rank_depths: Sequence[int] | None = None, offset: int = 2,
            min_len: int = 2) -> tuple[np.ndarray, np.ndarray, list[Chain] | None]:
        """The key's pass: `query`, then, when the best similarity reaches theta, `chains` of the neighbours
        (None when it did not fire). A pruned pool with the kernel built does both in one kernel call."""
        if self._kernel_key(k):
            self.pruned_queries += 1
            spec = self._chain_spec(schedule, rank_depths, offset, min_len, k)
            answer = self.pruner.nearest_with_chains(state, k, self.matrix, self.row_base, self.n,
                                                     self._excluded_group, spec, theta)
            return self._kernel_answer(state, k, *answer)
        s, rows = self.query(state, k)
        if not len(s) or s[0] < theta:
            return s, rows, None
        return s, rows, self.chains(s, rows, schedule, rank_depths, offset, min_len)

    def key_start(self, state: np.ndarray, k: int, theta: float,
                  schedule: Sequence[tuple[float, int]] = DEPTH_SCHEDULE, rank_depths: Sequence[int] | None = None,
                  offset: int = 2, min_len: int = 2) -> tuple:
        """`key` in two halves: this one starts the pass and `key_finish(handle)` returns what `key` returns. Where
        `key` makes one kernel call, the kernel's worker thread answers it in between (on another core, while the
        caller builds the rest of its draft); elsewhere `key` runs here. Between the two, nothing may add to or
        evict from the pool (both drain the worker first)."""
        if self._kernel_key(k):
            spec = self._chain_spec(schedule, rank_depths, offset, min_len, k)
            if self.pruner.submit_key(state, k, self.matrix, self.row_base, self.n, self._excluded_group, spec, theta):
                self.pruned_queries += 1
                self.overlapped_queries += 1
                return "worker", state, k, self.pruner.ticket
        return "answered", self.key(state, k, theta, schedule, rank_depths, offset, min_len)

    def key_finish(self, handle: tuple) -> tuple[np.ndarray, np.ndarray, list[Chain] | None]:
        if handle[0] == "answered":
            return handle[1]
        _, state, k, ticket = handle
        return self._kernel_answer(state, k, *self.pruner.collect_key(ticket))

    def _kernel_key(self, k: int) -> bool:
        """Whether the key's pass is one kernel call: a pruned pool and the kernel built."""
        return bool(self.n and k > 0 and self.index is None and self.pruner is not None and self.pruner.trained
                    and keyscan.library() is not None)

    def _kernel_answer(self, state: np.ndarray, k: int, s: np.ndarray, rows: np.ndarray,
                       count: int) -> tuple[np.ndarray, np.ndarray, list[Chain] | None]:
        self._sample_recall(state, k, rows)
        return s, rows, self._chain_lists(count) if count >= 0 else None

    def _sample_recall(self, state: np.ndarray, k: int, rows: np.ndarray) -> None:
        """An inexact answer: every `recall_every`-th one is repeated exactly (`_shadow`)."""
        self.queries += 1
        if self.recall_every and (self.queries - 1) % self.recall_every == 0:
            self._shadow(state, k, rows)

    def _faiss_query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
        base = self.row_base
        spans = [(lo + base, hi + base) for lo, hi in self._excluded_spans()]
        ids, scores = self.index.search(np.asarray(state, np.float32).reshape(1, -1), k, lo=base, exclude=spans)
        keep = ids[0] >= 0
        return scores[0][keep].astype(np.float32), ids[0][keep] - base, self.index.trained

    def _pruned_query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The auto index past prune_from: the pruner's listed rows re-scored exactly, excluded rows never
        listed (one compiled call, data/index/keyscan.c)."""
        self.pruned_queries += 1
        return self.pruner.nearest(state, k, self.matrix, self.row_base, self.n, self._excluded_group)

    def chains(self, scores: np.ndarray, rows: np.ndarray, schedule: Sequence[tuple[float, int]] = DEPTH_SCHEDULE,
               rank_depths: Sequence[int] | None = None, offset: int = 2, min_len: int = 2) -> list[Chain]:
        """`semantic_chains` of the query's neighbours (`rows`, decreasing `scores`), depth D(s) by `schedule`
        or by rank (`rank_depths`): data/index/keyscan.c's `keyscan_chains` in one call, else the Python function."""
        lib = keyscan.library()
        if lib is None or not len(rows):
            if rank_depths is not None:
                depth = lambda s, r: rank_depths[r] if r < len(rank_depths) else 0  # noqa: E731
            else:
                depth = lambda s, r: copy_depth(s, schedule)  # noqa: E731
            return semantic_chains(scores, self.row_flat[rows], self.row_end[rows], self.tokens, depth, offset, min_len)
        spec = self._chain_spec(schedule, rank_depths, offset, min_len, len(rows))
        a = keyscan.address
        count = lib.keyscan_chains(spec, a(np.ascontiguousarray(scores, np.float32)),
                                   a(np.ascontiguousarray(rows, np.int64)), len(rows))
        return self._chain_lists(count)

    def _chain_lists(self, count: int) -> list[Chain]:
        """The kernel's first `count` chains (back to back in its buffer) as lists."""
        if count <= 0:
            return []
        out, lens = self._chain_out
        lens = lens[:count].tolist()
        flat, chains, at = out[: sum(lens)].tolist(), [], 0
        for n in lens:
            chains.append(flat[at : at + n])
            at += n
        return chains

    def _chain_spec(self, schedule, rank_depths, offset: int, min_len: int, m: int) -> int:
        """The address of the kernel's `ChainSpec` for these settings and up to m neighbours, pointing at the
        pool's arrays as they are now (they are replaced when they grow)."""
        key = (tuple(schedule), tuple(rank_depths) if rank_depths is not None else None, offset, min_len)
        held = self._chain_args
        if held is None or held[0] != key or len(self._chain_out[1]) < m:
            thresholds = np.array([t for t, _ in schedule], np.float64)
            depths = np.array([d for _, d in schedule], np.int32)
            ranks = np.array(rank_depths if rank_depths is not None else [], np.int32)
            max_len = max([1, *depths.tolist(), *ranks.tolist()])
            self._chain_out = (np.zeros(max(m, 8) * max_len, np.int32), np.zeros(max(m, 8), np.int32))
            a = keyscan.address
            spec = keyscan.ChainSpec(a(thresholds), a(depths), len(depths), len(ranks), a(ranks), offset, min_len,
                                     max_len, 0, None, None, None, a(self._chain_out[0]), a(self._chain_out[1]))
            held = self._chain_args = [key, spec, ctypes.addressof(spec), (thresholds, depths, ranks), ()]
        bound = held[4]
        if not bound or bound[0] is not self.row_flat or bound[1] is not self.row_end or bound[2] is not self.tokens:
            spec = held[1]
            spec.row_flat, spec.row_end, spec.tokens = (keyscan.address(x) for x in (self.row_flat, self.row_end,
                                                                                  self.tokens))
            held[4] = (self.row_flat, self.row_end, self.tokens)
        return held[2]

    def exact_query(self, state: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Every row scored (the float16 matrix, on its device): the exact key, and the reference the
        recall of a pruned or faiss query is measured against."""
        if self.n == 0 or k <= 0 or self.matrix is None:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        q = torch.from_numpy(unit(state).reshape(-1)).to(self.device, torch.float16)
        scores = self.matrix[: self.n] @ q
        for lo, hi in self._excluded_spans():
            scores[lo:hi] = -float("inf")
        top = scores.topk(min(k, self.n))
        s, rows = top.values.float().cpu().numpy(), top.indices.cpu().numpy()  # the one copy back
        keep = np.isfinite(s)
        return s[keep], rows[keep]

    def _shadow(self, state: np.ndarray, k: int, rows: np.ndarray) -> None:
        """Tie-aware recall@k of `rows` (data/index/knnrecall.py) against the exact float16 query over the same
        rows, the same-prompt rows excluded from both (measurement only)."""
        import time

        t0 = time.perf_counter()
        truth_s, truth = self.exact_query(state, k)
        if len(truth):
            q = torch.from_numpy(unit_vector(state)).to(self.device, torch.float16)
            got = (self.matrix[torch.from_numpy(np.asarray(rows, np.int64)).to(self.device)] @ q).float().cpu().numpy()
            self.recall_hits += recall_hits(got, float(truth_s[-1]), len(truth))
        self.recall_queries += 1
        self.recall_k = max(self.recall_k, k)
        self.recall_total += len(truth)
        self.shadow_s += time.perf_counter() - t0

    def evict_traces(self, count: int) -> None:
        """Drop the oldest `count` traces (their tokens, rows, keys); row numbers of the rest shift down."""
        count = min(count, len(self._traces))
        if count <= 0:
            return
        IvfPruner.drain()
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
        self.row_group = self.row_group[r0 : self.n].copy()
        if self.matrix is not None:  # rebuilt, not sliced: a view would keep the evicted rows alive
            old, self.matrix = self.matrix, None
            if n:
                self.matrix = _grow(None, n, self.d, self.device)
                self.matrix[:n] = old[r0 : r0 + n]
        if self.index is not None:
            self.index.evict_below(self.row_base + r0)
        if self.pruner is not None:
            self.pruner.remove_below(self.row_base + r0)
        self.row_base += r0
        self.n = n
        spans = {g: [(a - r0, b - r0) for a, b in sp if a >= r0] for g, sp in self._group_rows.items()}
        self._group_rows = {g: sp for g, sp in spans.items() if sp}  # a span is one whole trace: kept or gone
        self.trace_keys = self.trace_keys[dropped_keys:]
        self.trace_group = self.trace_group[dropped_keys:]
        self.trace_span = [(a - t0, b - t0) for a, b in self.trace_span[dropped_keys:]]

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
        (data.index.stateindex: serialized bytes per kept state, float32 during its warm-up) otherwise."""
        if self.d is None:
            return None
        if self.index is None:
            pruned = self.pruner.bytes_per_state() if self.pruner is not None and self.pruner.trained else 0.0
            return 2.0 * self.d + pruned
        return float(self.index.bytes_per_state()) if self.n else None

    def index_info(self) -> dict:
        """The index's figures for summary.json (raw sums, so per-tenant pools can be added up)."""
        idx = self.index
        pruner = self.pruner
        return {
            "index": self.spec.text,
            "active_index": self.active_index,
            "pruned_queries": self.pruned_queries,
            "overlapped_queries": self.overlapped_queries,
            "index_trainings": pruner.trainings if pruner is not None else 0,
            "index_train_s": pruner.train_s if pruner is not None else 0.0,
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
            return int(round(self.n * ((self.bytes_per_state() or 2 * d) + 16))) + 4 * self.n_tokens
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
