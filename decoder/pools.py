"""Whose traces a request drafts from: the semantic key's index, the bounded pool, the tenants.

Three settings, shared by the decoder (`python -m decoder`) and replay (`python -m decoder replay`):

  --index SPEC        the semantic key's index (data/index/stateindex.py). `auto` (default) is the
                      float16 matrix of decoder/drafters/semantic.py, every row scored while the
                      pool is small, then only the candidates of an inverted file trained on the
                      pool (data/index/pruner.py); `exact` always scores every row; a faiss spec keeps
                      the states in a faiss `StateIndex`. It reaches every arm with a semantic
                      pool through `make_drafter(shared={"index": ...})`.
  --store-budget B    the pool holds at most B generated tokens (or B megabytes at data.index.budget's
                      `bytes_per_token`), whole traces in serving order:
                      request r drafts only from requests s(r) .. r-1 with s = data.index.budget's
                      `window_starts` (the one definition: when a join takes the pool above B the
                      oldest traces leave until it holds <= 7/8 B). Past pool only.
  tenants             a request's `tenant` (data.benchmarks.request.Request, the store's `tenant` column;
                      "" when absent): one drafter per tenant, so no request ever drafts from
                      another tenant's traces (nor from its adjacency rows or ring buffer). The
                      budget window is global, over serving order (data/index/budget.py); each tenant's
                      drafter holds its own traces inside it.

`TenantPools` is the one implementation, used by the one request runner (decoder/loop.py
`serve_requests`) for live decoding and replay alike: `begin(r, tenant)` before request r moves the
window (evicting with `Drafter.evict_traces`) and returns the tenant's drafter; `end(...)` records
what the finished request added; `add_warm` feeds warm traces before serving.
"""

from __future__ import annotations

import collections
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from data.errors import OilbirdError
from data.index.budget import bytes_per_token, check_budget, parse_budget, window_starts
from data.index.stateindex import DEFAULT_INDEX, IndexSpec, parse_index_spec
from data.store.schema import prompt_hash
from decoder.calibration import merge_summaries
from decoder.draft import Drafter

INDEX_HELP = ("the semantic key's index: auto (default: exact float16 scoring while the pool is small, then an "
              "inverted file trained on the pool prunes the rows scored), exact (every row), or a faiss spec: "
              "flat, sq8, pq64, pca128,sq8, opq64,pq64, ivf1024,pq64 (nprobe=N), hnsw32 (efsearch=N)")
SETTINGS = ("knn_recall_every", "knn_recall_k")  # drafter stats that are settings: merged by max, not summed


@dataclass(frozen=True)
class PoolSettings:
    """The pool as a run configures it (defaults: the auto index, unbounded)."""

    index: str = DEFAULT_INDEX  # --index: the semantic key's index spec (data/index/stateindex.py)
    budget_tokens: int | None = None  # --store-budget in tokens; None = unbounded
    knn_recall_every: int = 8  # auto or faiss index: every Nth inexact query is repeated exactly (knn_recall); 0 = off
    index_train_size: int = 0  # states a faiss coder collects before training (0: the spec's own need)
    key_device: str = "cpu"  # where the key's states live and its queries run: the model's GPU when it has one
    step_cost: object = None  # the engine's profile (decoder/cost/model.py CostModel) that sizes the drafts of the arms
    #                           with size auto; None: flat (every candidate kept)
    key_overlap: str = "auto"  # the key's query on the kernel's worker thread (OilbirdConfig.key_overlap); off where
    #                            sibling processes already use every core (replay's workers: see run_replay)

    def shared(self) -> dict:
        """The Config fields every arm with a semantic pool takes (make_drafter's `shared`)."""
        return {"index": self.index, "knn_recall_every": self.knn_recall_every,
                "index_train_size": self.index_train_size, "key_device": self.key_device,
                "step_cost": self.step_cost, "key_overlap": self.key_overlap}


def key_device(model_device) -> str:
    """The semantic key's device for a model on `model_device`: its GPU (the float16 rows there, one fused
    score, mask and top-k per query, one copy back), else the CPU (where the auto index prunes)."""
    kind = getattr(model_device, "type", str(model_device).split(":")[0])
    return str(model_device) if kind == "cuda" else "cpu"


def check_index(text: str | None, d: int | None) -> IndexSpec:
    """The parsed --index spec (one line on a bad one, or when faiss is missing for a faiss spec)."""
    spec = parse_index_spec(text or DEFAULT_INDEX, d)
    if spec.factory is not None:  # auto without faiss stays exact (its active_index says so)
        if importlib.util.find_spec("faiss") is None:
            raise OilbirdError(f"--index {spec.text} needs faiss (pip install faiss-cpu); "
                               "--index exact needs nothing")
    return spec


def warmup_note(spec: IndexSpec, train_size: int, most_states: float) -> str | None:
    """A note when a trained coder can never train: the pool never holds the states it collects first,
    so every query is answered exactly from its warm-up buffer (what `warmup_queries` then counts)."""
    need = max(spec.train_min, train_size or spec.train_size)
    if spec.exact or spec.auto or need == 0 or most_states >= need:
        return None
    return (f"index {spec.text} trains once it holds {need} states and the pool never holds more than "
            f"{int(most_states)}: every query is answered exactly from its warm-up buffer (warmup_queries)")


def resolve_budget(text: str | None, spec: IndexSpec, d: int, pool: str = "past",
                   warm: bool = False) -> tuple[int | None, dict | None]:
    """(budget in tokens or None, its summary.json block) for a --store-budget value."""
    budget = parse_budget(text)
    if budget is None:
        return None, None
    if warm or pool != "past":
        raise OilbirdError(f"--store-budget bounds the past pool; it cannot be combined with a warm pool "
                           f"({'--warm-from' if warm else '--pool ' + pool})")
    per_token = bytes_per_token(spec, d) if budget.tokens is None else None
    tokens = budget.in_tokens(per_token)
    if tokens < 1:
        raise OilbirdError(f"--store-budget {text}: less than one token at {per_token:.0f} bytes per token")
    # a budget in MB is turned into tokens at the stated bytes per token, recorded beside it
    if not spec.evictable:
        raise OilbirdError(f"--index {spec.text} cannot evict (faiss HNSW has no removal): a --store-budget "
                           "needs a flat-code or ivf spec")
    return tokens, {"text": str(text), "tokens": tokens, "megabytes": budget.megabytes,
                    "bytes_per_token": per_token}


class TenantPools:
    """One drafter per tenant, each holding its tenant's traces inside the budget window (module docstring)."""

    def __init__(self, make: Callable[[], Drafter], budget_tokens: int | None = None) -> None:
        self.make = make
        self.budget = budget_tokens
        self.drafters: dict[str, Drafter] = {}
        self.lengths: list[int] = []  # tokens each finished request added to its pool, serving order
        self.start = 0  # the first request of the current window
        self.held = 0  # tokens of requests start .. served-1 (every tenant's)
        self.pooled: dict[str, collections.deque] = {}  # tenant -> its pooled requests, oldest first
        self.starts: list[int] = []  # s(r) per request begun
        self.max_pool_tokens = 0
        self.evictions = 0  # window moves
        self.evicted = 0  # traces dropped

    def drafter(self, tenant: str) -> Drafter:
        if tenant not in self.drafters:
            self.drafters[tenant] = self.make()
            self.pooled[tenant] = collections.deque()
        return self.drafters[tenant]

    def add_warm(self, traces: Iterable[tuple[Sequence[int], Sequence[int], Any, str]]) -> None:
        """Warm traces (prompt, output, states, tenant), each into its own tenant's drafter, before serving
        (a warm pool has no budget window)."""
        for prompt, output, hidden, tenant in traces:
            self.held += len(output)
            self.drafter(tenant).add_trace(list(output), prompt_hash(prompt), hidden)

    def begin(self, r: int, tenant: str) -> Drafter:
        """Before serving request r: move the window to s(r), evict, return the tenant's drafter."""
        if r != len(self.lengths):
            raise ValueError(f"request {r} begun after {len(self.lengths)} finished: serve in order")
        if self.budget is not None and self.held > self.budget:
            # the window only moves when a join took the pool above the budget; data.index.budget says where to
            s = self.start + int(window_starts(self.lengths[self.start:] + [0], self.budget)[-1])
            for t, q in self.pooled.items():
                n = 0
                while q and q[0] < s:
                    q.popleft()
                    n += 1
                if n:
                    self.drafters[t].evict_traces(n)
                    self.evicted += n
            self.held -= sum(self.lengths[self.start:s])
            self.start = s
            self.evictions += 1
        self.starts.append(self.start)
        self.max_pool_tokens = max(self.max_pool_tokens, self.held)
        return self.drafter(tenant)

    def end(self, r: int, tenant: str, n_tokens: int) -> None:
        """Request r's trace joined its tenant's pool (after the drafter's add_trace)."""
        check_budget(self.budget, [n_tokens])
        self.lengths.append(int(n_tokens))
        self.pooled[tenant].append(r)
        self.held += int(n_tokens)

    def counters(self) -> dict | None:
        """The drafters' counters, added up over tenants (None when no drafter has any)."""
        return merge_stats([d.counters() for d in self.drafters.values()])

    def summary(self) -> dict:
        """summary.json's pool fields: tenants, the budget in tokens, the largest pool (tokens, every
        tenant's) any request was served beside, and how often the window moved."""
        return {"tenants": len(self.drafters), "store_budget_tokens": self.budget,
                "max_pool_tokens": self.max_pool_tokens, "pool_evictions": self.evictions,
                "evicted_traces": self.evicted}


def merge_stats(stats: list[dict]) -> dict | None:
    """Per-tenant drafter counters as one: numbers add, flags or, text the first; ratios recomputed."""
    stats = [s for s in stats if s]
    if len(stats) <= 1:
        return stats[0] if stats else None
    out: dict = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        vals = [s.get(key) for s in stats if s.get(key) is not None]
        if not vals:
            out[key] = None
        elif key in SETTINGS:
            out[key] = max(vals)
        elif key == "calibration":
            out[key] = merge_summaries(vals)
        elif all(isinstance(v, bool) for v in vals):
            out[key] = any(vals)
        elif all(isinstance(v, (int, float)) for v in vals):
            out[key] = sum(vals)
        else:
            out[key] = vals[0]
    states = [(s.get("bytes_per_state"), s.get("pool_states") or 0) for s in stats]
    weighted = [(b, n) for b, n in states if b is not None and n]
    out["bytes_per_state"] = (sum(b * n for b, n in weighted) / sum(n for _, n in weighted) if weighted
                              else next((b for b, _ in states if b is not None), None))
    if "index_trained" in out:
        flags = [s.get("index_trained") for s in stats if s.get("index_trained") is not None]
        out["index_trained"] = all(flags) if flags else None
    tokens = out.get("pool_tokens")
    out["store_bytes_per_token"] = out["store_bytes"] / tokens if tokens and "store_bytes" in out else None
    return out


def index_summary(stats: dict | None, spec: IndexSpec | str) -> dict:
    """summary.json's index block for an arm: the spec, what answered at the end (`active_index`: auto's
    phase, e.g. auto:pca128,ivf256,sq8,nprobe=4,rerank=3k), bytes per state, warm-up queries, knn_recall."""
    has_states = bool(stats) and "bytes_per_state" in stats and bool(stats.get("pool_states"))
    recall = None
    if has_states and stats.get("knn_recall_queries"):
        total = stats["knn_recall_total"]
        recall = {"value": stats["knn_recall_hits"] / total if total else None, "k": stats.get("knn_recall_k"),
                  "queries": stats["knn_recall_queries"], "every": stats.get("knn_recall_every"),
                  "hits": stats["knn_recall_hits"], "total": total,
                  "definition": "tie-aware recall@k (data/index/knnrecall.py) of the rows against an exact float16 "
                                "query over the same rows, on every Nth query the pruned or trained index answered"}
    return {"index": spec if isinstance(spec, str) else spec.text,
            "active_index": stats.get("active_index") if has_states else None,
            "bytes_per_state": stats.get("bytes_per_state") if has_states else None,
            "warmup_queries": stats.get("warmup_queries") if has_states else None,
            "index_trained": stats.get("index_trained") if has_states else None,
            "knn_recall": recall}
