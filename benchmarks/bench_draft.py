"""`make bench-draft`: drafting time per pass of every decision arm, and the semantic key's query time and
recall against exact search, at pool sizes from 4k to 1M states.

The workload. The store's last --serve requests (default 48) are served, in order, through each arm by
the replay loop (decoder/loop.py `speculate` with decoder/replay/traces.py `TraceVerifier`; pool past: each
served trace joins the pool when its request ends). Before serving, the pool is warmed with the OTHER
requests' traces until it holds --pool-sizes states (default 4096, 16384, 65536, 262144, 1048576): a
prefix of them (serving order) for a size below what one copy holds, else disguised copies of them
(benchmarks/tiling.py: permuted vocabulary, rotated and noised states, distinct prompt hashes; one
random stream per tile and per trace, so a trace's copy is the same at every size) interleaved in
serving order, the last copy a prefix. No served request, nor any copy of one, is ever in the warm
pool. The arms without a semantic key get the same traces without states. Each (size, arm) starts
from fresh drafters, one at a time (a float16 pool of 1M states is 1.2 GB).

Measured per (arm, size):
  draft_ms_per_pass   each pass's drafting time (`Cycle.draft_s`; measurement-only work left out):
                      median, p99, mean;
  query_ms            (arms with the key) every key pass, the pool's `key` timed around the bound method
                      of that pool: the kNN query and, when it fires, its chains (one kernel call on a
                      pruned pool, data/index/keyscan.c; the knn_recall shadow's time left out): median, p99,
                      mean;
  recall_vs_exact     (arms with the key) up to --recall-sample of those queries (a seeded reservoir),
                      each against an exact float32 search over the same pool rows with the same
                      same-prompt exclusion, after the run: tie-aware recall@k (data/index/knnrecall.py);
  index               the structure answering the key at that size (`pool.index_info()`'s
                      active_index, else its index spec);
  tau                 committed tokens per pass (a check that the arm drafts what it should).
ArcticInference's SuffixDecodingCache (`arctic_inference.suffix_decoding`) runs through the same loop on
the same requests and pools when it imports (tree mode, spec factor 4, min token prob 0.1); otherwise
its row says it is absent and why.

Then the whole store (benchmarks/draft_rounds.py, --whole-rounds 3, in a fresh spawned interpreter):
oilbird, oilbird-no-semantic and the key as it was (exact search asked on every pass) replayed over
every request of the store in rounds, arms interleaved, the order rotated each round: tau and drafting per pass per arm, the
drafting ratio per round. Per pool size, `draft_ratio_by_size` keeps oilbird's drafting over
oilbird-no-semantic's as information.

Targets (printed PASS / FAIL, never an exit status): the key's query median <= 0.3 ms at 65,536
states and <= 1 ms at 1,048,576 states, each with recall >= 0.95 against exact; over the whole
store, oilbird's drafting per pass <= 1.5x oilbird-no-semantic's by mean and by median (medians of
the per-round ratios), and oilbird's tau >= 0.99 x the key as it was.

Writes runs/<bench>/<model>/bench/draft.json (rewritten after every row; "complete" once all ran; its
"device" says which query path ran: the compiled kernel or the numpy fallback) and prints a table. docs/benchmarks.md explains the columns.

Usage: python benchmarks/bench_draft.py [--bench apibank] [--model smollm2-135m] [--out runs] [--limit N]
  [--serve 48] [--pool-sizes 4096,16384,65536,262144,1048576] [--arms suffix,lexical,oilbird,oilbird-no-semantic]
  [--index SPEC] [--knn-recall-every 8] [--index-train-size 0] [--nodes 60] [--noise 0.02]
  [--recall-sample 300] [--seed 0] [--threads N] [--no-arctic] [--quiet]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/tiling.py, also when imported by a test

from draft_arctic import ARCTIC, ARCTIC_SETTINGS, ArcticDrafter, load_arctic  # noqa: E402
from draft_report import format_table, format_targets, format_whole, ms_distribution, ms_text  # noqa: E402
from draft_rounds import BEFORE_ARM, whole_store, whole_store_targets  # noqa: E402
from tiling import Disguise, make_disguise, noise_scale, store_vocab  # noqa: E402

from data.errors import OilbirdError, cli_entry  # noqa: E402
from data.index.knnrecall import DEFINITION as RECALL_DEFINITION, TIE_TOLERANCE, kth_largest, recall_hits  # noqa: E402
from data.index.stateindex import unit  # noqa: E402
from data.store.files import atomic_write_json  # noqa: E402
from data.store.layout import bench_dir, model_slug, store_dir  # noqa: E402
from data.store.reader import open_store  # noqa: E402
from data.store.schema import prompt_hash  # noqa: E402
from decoder.loop import Generation, serve_requests, speculate  # noqa: E402
from decoder.policy import DECISION_ARMS, OFF_ARM, ON_ARM  # noqa: E402
from decoder.pools import PoolSettings, TenantPools, check_index  # noqa: E402
from decoder.replay.traces import Trace, TraceVerifier, load_traces, uses_states  # noqa: E402

BENCH_ARMS = ("suffix", "lexical", ON_ARM, OFF_ARM)  # the arms timed per pool size (ArcticInference's row beside)

DEFAULT_SIZES = (4096, 16384, 65536, 262144, 1048576)
TARGET_QUERY_MS = {65536: 0.3, 1048576: 1.0}  # pool states -> the key's median query time, ms
TARGET_RECALL = 0.95  # ... with at least this tie-aware recall against exact
TARGET_DRAFT_RATIO = 1.5  # oilbird's drafting per pass over oilbird-no-semantic's (whole store), mean and median
TARGET_TAU = 0.99  # oilbird's tau over the whole store, at least this x the key as it was (BEFORE_ARM)
RECALL_CHUNK = 65536  # pool rows scored at once by the exact search


# ---------------------------------------------------------------- the workload

@dataclass
class Workload:
    """The served traces and the warm traces (one copy), with what tiling them needs."""

    served: list[Trace]
    served_rows: list[int]  # their request numbers in the store
    warm: list[Trace]
    valid: list[np.ndarray]  # per warm trace: rows with a state
    vocab: int
    d: int
    scale: float  # the disguise noise's standard deviation
    seed: int
    disguises: dict[int, Disguise] = field(default_factory=dict)

    @property
    def counts(self) -> list[int]:
        return [int(v.sum()) for v in self.valid]

    def disguise(self, tile: int) -> Disguise:
        if tile not in self.disguises:  # one stream per tile: tile k's disguise is the same at every size
            self.disguises[tile] = make_disguise(tile, np.random.default_rng([self.seed, tile]), self.d, self.vocab)
        return self.disguises[tile]

    def warm_trace(self, tile: int, r: int, cut: int | None, states: bool) -> tuple:
        """Warm trace r of tile `tile` as add_warm takes it (prompt, output, states or None, tenant), cut
        after its `cut`-th state when given."""
        tr, valid = self.warm[r], self.valid[r]
        n = len(tr.tokens) if cut is None else int(np.flatnonzero(valid)[cut - 1]) + 1
        dis = self.disguise(tile)
        hidden = None
        if states:
            hidden = tr.hidden[:n]
            if not dis.identity:  # one stream per (tile, trace): the same copy at every size
                hidden = dis.states(hidden, self.scale, np.random.default_rng([self.seed, tile, r, 1]))
                hidden[~valid[:n]] = 0  # a row without a state stays without one
        return dis.tokens(tr.prompt).tolist(), dis.tokens(tr.tokens[:n]).tolist(), hidden, tr.tenant


def has_state(hidden: np.ndarray) -> np.ndarray:
    """Rows holding a state (the pools skip all-zero rows)."""
    return np.abs(np.asarray(hidden, np.float32)).sum(axis=1) > 0


def warm_plan(counts: Sequence[int], target: int) -> tuple[list[tuple[int, int, int | None]], int]:
    """(tile, warm trace, states kept or None for all) in serving order holding exactly `target` states,
    and the number of tiles: whole copies, then a prefix of one more (tile 0 alone when one copy is
    enough), interleaved (trace r of every tile, then r + 1)."""
    total = int(sum(counts))
    if total <= 0:
        raise OilbirdError("the warm requests hold no states to fill a pool with")
    tiles = max(1, math.ceil(target / total))
    left = target - (tiles - 1) * total  # the last tile's share, 1..total
    last_items, cut = 0, None
    for r, c in enumerate(counts):
        if left <= 0:
            break
        last_items = r + 1
        if c >= left:
            cut = left if c > left else None
            left = 0
        else:
            left -= c
    plan = []
    for r in range(len(counts)):
        for k in range(tiles):
            if k < tiles - 1:
                plan.append((k, r, None))
            elif r < last_items:
                plan.append((k, r, cut if r == last_items - 1 else None))
    return plan, tiles


# ---------------------------------------------------------------- measuring the key

@dataclass
class QuerySample:
    probe: "KeyProbe"
    state: np.ndarray  # float32 [d], as the pool got it
    n: int  # pool rows when it was asked
    excluded: Hashable  # the prompt hash whose rows the pool masked
    rows: np.ndarray  # the rows it returned
    k: int


class Reservoir:
    """A seeded uniform sample of up to `size` queries of one run (reservoir sampling)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seen, self.items = size, 0, []
        self.rng = random.Random(seed)

    def offer(self, probe: "KeyProbe", state, k: int, rows) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(None)
            slot = len(self.items) - 1
        else:
            slot = self.rng.randrange(self.seen)
            if slot >= self.size:
                return
        self.items[slot] = QuerySample(probe, np.array(state, np.float32).reshape(-1), int(probe.pool.n),
                                       probe.current, np.array(rows, np.int64).reshape(-1), int(k))


class KeyProbe:
    """Measurement only, on one drafter with a semantic pool: times every `pool.key` (the key's pass: the kNN
    query and, when it fires, its chains, one kernel call on a pruned pool; the bound method of that instance
    is wrapped; the knn_recall shadow's seconds are left out, as the loop leaves them out of drafting), offers
    each query to the recall sample, and notes the pool rows each prompt hash added (the same-prompt exclusion
    the exact search must repeat)."""

    def __init__(self, drafter, sample: Reservoir | None) -> None:
        self.pool = drafter.pool
        drafter.overlap = False  # the key inline (key_overlap off), through the `pool.key` timed here: these rows
        #                          time the query itself; the whole-store block measures the overlap
        self.times: list[float] = []
        self.spans: dict[Hashable, list[tuple[int, int]]] = {}
        self.current: Hashable = None  # the prompt hash of the request being served
        pool, key, add = self.pool, self.pool.key, drafter.add_trace

        def timed_key(state, k, *args, **kwargs):
            shadow0 = getattr(pool, "shadow_s", 0.0)
            t0 = time.perf_counter()
            out = key(state, k, *args, **kwargs)
            self.times.append(time.perf_counter() - t0 - (getattr(pool, "shadow_s", 0.0) - shadow0))
            if sample is not None:
                sample.offer(self, state, k, out[1])
            return out

        def add_trace(output, prompt_hash=None, hidden=None, *args, **kwargs):
            n0 = pool.n
            add(output, prompt_hash, hidden, *args, **kwargs)
            if prompt_hash is not None and pool.n > n0:
                self.spans.setdefault(prompt_hash, []).append((n0, pool.n))

        pool.key = timed_key
        drafter.add_trace = add_trace


def exact_recall(samples: Sequence[QuerySample], tol: float = TIE_TOLERANCE, chunk: int = RECALL_CHUNK) -> dict:
    """Tie-aware recall@k (data/index/knnrecall.py) of the sampled answers against an exact float32 search over
    the rows each query's pool held (`pool.matrix`, float16 unit rows), less its excluded prompt's rows."""
    hits = wanted = queries = 0
    missing = 0
    groups: dict[int, list[QuerySample]] = {}
    for s in samples:
        groups.setdefault(id(s.probe), []).append(s)
    for ss in groups.values():
        pool = ss[0].probe.pool
        matrix = getattr(pool, "matrix", None)
        n_max = max(s.n for s in ss)
        if matrix is None or matrix.shape[0] < n_max:
            missing += len(ss)
            continue
        q = torch.from_numpy(unit(np.stack([s.state for s in ss])))  # [S, d] float32
        ns = torch.tensor([s.n for s in ss])
        spans = [ss[0].probe.spans.get(s.excluded, []) if s.excluded is not None else [] for s in ss]
        top = max(s.k for s in ss)
        best = torch.full((len(ss), top), -math.inf)
        for lo in range(0, n_max, chunk):
            hi = min(n_max, lo + chunk)
            scores = q @ matrix[lo:hi].to("cpu", torch.float32).T  # [S, hi - lo] (a pool on a GPU: copied back)
            scores[torch.arange(lo, hi)[None, :] >= ns[:, None]] = -math.inf  # rows added after the query
            for j, sp in enumerate(spans):
                for a, b in sp:
                    if a < hi and b > lo:
                        scores[j, max(a, lo) - lo:min(b, hi) - lo] = -math.inf
            best = torch.cat([best, scores.topk(min(top, hi - lo), dim=1).values], dim=1).topk(top, dim=1).values
        for j, s in enumerate(ss):
            kth, want = kth_largest(best[j].numpy(), s.k)  # the top `top` hold the k-th largest of all rows
            rows = np.unique(s.rows)
            ok = (rows >= 0) & (rows < s.n)
            for a, b in spans[j]:
                ok &= ~((rows >= a) & (rows < b))
            exact = np.full(len(rows), -np.inf)
            if ok.any():
                picked = matrix[torch.from_numpy(rows[ok]).to(matrix.device)].to("cpu", torch.float32)
                exact[ok] = (picked @ q[j]).numpy()
            hits += recall_hits(exact, kth, want, tol)
            wanted += want
            queries += 1
    out = {"value": hits / wanted if wanted else None, "queries": queries, "hits": hits, "wanted": wanted,
           "tolerance": tol, "definition": RECALL_DEFINITION}
    if missing:
        out["note"] = (f"{missing} sampled queries not checked: their pool keeps no float16 matrix of its states "
                       "(a faiss index with --knn-recall-every 0 keeps none)")
    return out


# ---------------------------------------------------------------- ArcticInference

# ---------------------------------------------------------------- one (arm, size)

def run_row(arm: str, size: int, w: Workload, settings: PoolSettings, nodes: int, recall_sample: int,
            progress: bool, arctic_class=None) -> dict:
    """Warm fresh drafters of `arm` to `size` states, serve the served traces, measure (module docstring)."""
    from tqdm import tqdm

    from decoder.drafters import make_drafter

    probes: dict[int, KeyProbe] = {}
    sample = Reservoir(recall_sample, seed=w.seed) if recall_sample > 0 else None
    if arm == ARCTIC:
        make = lambda: ArcticDrafter(arctic_class)  # noqa: E731
        states = False
    else:
        states = uses_states(make_drafter(arm, vocab_size=w.vocab, nodes=nodes, shared=settings.shared()))

        def make():
            drafter = make_drafter(arm, vocab_size=w.vocab, nodes=nodes, shared=settings.shared())
            if states:
                probes[id(drafter)] = KeyProbe(drafter, sample)
            return drafter

    pools = TenantPools(make)
    plan, tiles = warm_plan(w.counts, size)
    t0 = time.perf_counter()
    warm_tokens = 0
    for k, r, cut in tqdm(plan, desc=f"{arm} @ {size:,}: warm", unit="trace", leave=False, disable=not progress):
        trace = w.warm_trace(k, r, cut, states)
        warm_tokens += len(trace[1])
        pools.add_warm([trace])
    warm_s = time.perf_counter() - t0
    pooled_states = sum(int(p.pool.n) for p in probes.values())
    for p in probes.values():
        p.times.clear()  # none asked yet; kept clean all the same

    bar = tqdm(total=len(w.served), desc=f"{arm} @ {size:,}: serve", unit="req", leave=False, disable=not progress)

    def decode(i: int, drafter) -> Generation:
        tr = w.served[i]
        probe = probes.get(id(drafter))
        if probe is not None:
            probe.current = prompt_hash(tr.prompt)
        run = speculate(drafter, TraceVerifier(tr, w.vocab), tr.prompt, nodes)
        return Generation(tokens=tr.tokens, stop_reason=run.stop_reason, seconds=run.seconds, prefill_s=run.prefill_s,
                          cycles=run.cycles, hidden=tr.pool_states() if states else None)

    t0 = time.perf_counter()
    gens, _ = serve_requests([tr.prompt for tr in w.served], [tr.tenant for tr in w.served], pools, decode,
                             join=True, on_request=lambda g, s: bar.update(1))
    serve_s = time.perf_counter() - t0
    bar.close()
    cycles = [c for g in gens for c in g.cycles]
    tokens = sum(c.committed for c in cycles)
    row = {"arm": arm, "pool_states": size, "tiles": tiles, "warm_traces": len(plan), "warm_tokens": warm_tokens,
           "index": None, "draft_ms_per_pass": ms_distribution([c.draft_s for c in cycles]),
           "tau": round(tokens / len(cycles), 4) if cycles else None, "passes": len(cycles), "tokens": tokens,
           "warm_s": round(warm_s, 2), "serve_s": round(serve_s, 2)}
    if arm == ARCTIC:
        row["settings"] = dict(ARCTIC_SETTINGS)
    if len(pools.drafters) > 1:
        row["tenants"] = len(pools.drafters)
    if states:
        biggest = max(probes.values(), key=lambda p: p.pool.n)
        info = biggest.pool.index_info()
        row["index"] = info.get("active_index", info["index"])
        row["index_spec"] = info["index"]
        row["pool_states_warm"] = pooled_states
        row["pool_states_final"] = sum(int(p.pool.n) for p in probes.values())
        row["query_ms"] = ms_distribution([t for p in probes.values() for t in p.times])
        t0 = time.perf_counter()
        recall = exact_recall([s for s in sample.items if s is not None]) if sample is not None else None
        row["recall_vs_exact"] = recall["value"] if recall else None
        row["recall"] = recall
        row["recall_s"] = round(time.perf_counter() - t0, 2)
        stats = pools.counters() or {}
        row["key"] = {k: stats.get(k) for k in ("key_queries", "key_fired", "key_chains", "key_nodes", "key_hits",
                                                 "calibration_mutes", "index_trained", "warmup_queries",
                                                 "bytes_per_state", "knn_recall_queries", "knn_recall_hits",
                                                 "knn_recall_total") if k in stats}
    return row  # the pools go with this frame: the caller collects before the next row


def absent_row(arm: str, note: str) -> dict:
    return {"arm": arm, "pool_states": None, "index": None, "draft_ms_per_pass": None, "absent": True, "note": note}


# ---------------------------------------------------------------- targets and the table

def check_targets(rows: Sequence[dict]) -> list[dict]:
    """Each target with `holds` True / False, or None when its rows were not run."""
    on = {r["pool_states"]: r for r in rows if r["arm"] == ON_ARM and not r.get("absent")}
    out = []
    for size, limit in TARGET_QUERY_MS.items():
        t = {"name": f"key query at {size:,} states", "pool_states": size,
             "rule": f"{ON_ARM}'s query median <= {limit:g} ms with recall >= {TARGET_RECALL:g} against exact",
             "holds": None, "measured": None}
        r = on.get(size)
        if r is not None and (r.get("query_ms") or {}).get("median") is not None:
            med, rec = r["query_ms"]["median"], r.get("recall_vs_exact")
            t["measured"] = {"query_ms_median": med, "recall": rec}
            t["holds"] = bool(med <= limit and rec is not None and rec >= TARGET_RECALL)
        out.append(t)
    return out


def size_ratios(rows: Sequence[dict]) -> dict:
    """oilbird's drafting per pass over oilbird-no-semantic's at each pool size (information: the target is
    the whole store's, `draft_rounds.py`)."""
    on = {r["pool_states"]: r for r in rows if r["arm"] == ON_ARM and not r.get("absent")}
    off = {r["pool_states"]: r for r in rows if r["arm"] == OFF_ARM and not r.get("absent")}
    out = {}
    for size in sorted(set(on) & set(off)):
        a, b = on[size]["draft_ms_per_pass"], off[size]["draft_ms_per_pass"]
        if a["mean"] and b["mean"] and a["median"] and b["median"]:
            out[str(size)] = {"mean": round(a["mean"] / b["mean"], 3), "median": round(a["median"] / b["median"], 3)}
    return out


# ---------------------------------------------------------------- the command

def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise OilbirdError(f"--pool-sizes takes state counts separated by commas, e.g. 4096,65536 (got {text!r})") from None
    if not sizes or any(s < 1 for s in sizes):
        raise OilbirdError(f"--pool-sizes needs at least one positive state count (got {text!r})")
    return sorted(set(sizes))


def parse_arms(text: str) -> list[str]:
    from decoder.drafters import make_drafter

    arms = [a.strip() for a in text.split(",") if a.strip()]
    if not arms:
        raise OilbirdError(f"--arms is empty; give e.g. {','.join(DECISION_ARMS)}")
    dupes = sorted({a for a in arms if arms.count(a) > 1})
    if dupes:
        raise OilbirdError(f"--arms names {', '.join(dupes)} twice")
    for a in arms:
        if a != ARCTIC:
            make_drafter(a, vocab_size=2, nodes=1)  # an unknown arm or a bad variant: one line, before any work
    return arms


def set_threads(n: int) -> None:
    """torch's threads, and faiss's OpenMP threads when faiss is installed (the auto index's pruner)."""
    torch.set_num_threads(n)
    try:
        import faiss
    except ImportError:
        return
    faiss.omp_set_num_threads(n)


def faiss_threads() -> int | None:
    try:
        import faiss
    except ImportError:
        return None
    return int(faiss.omp_get_max_threads())


def device_info() -> dict:
    from data.index import keyscan
    from decoder.cost.profile import device_name

    return {"type": "cpu", "name": device_name(torch.device("cpu")), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "faiss_threads": faiss_threads(), "torch": torch.__version__,
            "key_query_path": keyscan.status(), "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}


def load_workload(path: Path, limit: int | None, serve: int, noise: float, seed: int) -> tuple[Workload, object]:
    store = open_store(path)
    traces = load_traces(store, limit, None)
    if serve < 1:
        raise OilbirdError(f"--serve must be at least 1 (got {serve})")
    if serve >= len(traces):
        raise OilbirdError(f"--serve {serve} leaves no request of the {len(traces)} to warm the pool with "
                           "(serve fewer, or capture more)")
    vocab = int(store.meta.get("vocab_size") or 0) or store_vocab(store)
    vocab = max(vocab, store_vocab(store))
    cut = len(traces) - serve
    valid = [has_state(tr.hidden) for tr in traces[:cut]]
    states = store.hidden[store.hidden_valid]
    w = Workload(served=traces[cut:], served_rows=list(range(cut, len(traces))), warm=traces[:cut], valid=valid,
                 vocab=vocab, d=int(store.d_model), scale=noise_scale(noise, states) if len(states) else 0.0, seed=seed)
    return w, store


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_draft.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--limit", type=int, default=None, help="the store's first N requests only")
    ap.add_argument("--serve", type=int, default=48, help="the last N requests are served; the others warm the pool")
    ap.add_argument("--pool-sizes", default=",".join(map(str, DEFAULT_SIZES)), help="warm pool sizes in states")
    # the published SuffixDecoding cache (a decision arm) has its own row here, `arcticinference`
    ap.add_argument("--arms", default=",".join(BENCH_ARMS))
    ap.add_argument("--index", default=PoolSettings().index, help="the semantic key's index spec (data/index/stateindex.py)")
    ap.add_argument("--knn-recall-every", type=int, default=PoolSettings().knn_recall_every)
    ap.add_argument("--index-train-size", type=int, default=PoolSettings().index_train_size)
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--noise", type=float, default=0.02, help="disguised copies' state noise, x the states' rms")
    ap.add_argument("--recall-sample", type=int, default=300, help="queries checked against exact search per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch and faiss threads (0: their defaults); on a loaded "
                    "machine one thread times the key far more steadily than two")
    ap.add_argument("--no-arctic", action="store_true", help="skip ArcticInference's row")
    ap.add_argument("--whole-rounds", type=int, default=3, help="rounds of the whole-store replay of oilbird, "
                    f"oilbird-no-semantic and {BEFORE_ARM} (0: skip)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    t_start = time.perf_counter()
    sizes = parse_sizes(args.pool_sizes)
    arms = parse_arms(args.arms)
    if args.limit is not None and args.limit < 1:
        raise OilbirdError(f"--limit must be at least 1 (got {args.limit})")
    if args.nodes < 1 or min(args.recall_sample, args.knn_recall_every, args.index_train_size, args.threads,
                             args.whole_rounds) < 0:
        raise OilbirdError("--nodes must be positive; --recall-sample, --knn-recall-every, --index-train-size, "
                           "--threads and --whole-rounds 0 or more")
    if args.threads:
        set_threads(args.threads)
    slug = model_slug(args.model)
    path = store_dir(args.out, args.bench, slug)
    if not (path / "meta.json").exists():
        raise OilbirdError(f"no trace store at {path}: run `make bench-draft BENCH={args.bench}` (it captures first) "
                           f"or `python -m data capture --bench {args.bench} --model {args.model}`")
    w, store = load_workload(path, args.limit, args.serve, args.noise, args.seed)
    spec = check_index(args.index, w.d)
    settings = PoolSettings(index=spec.text, knn_recall_every=args.knn_recall_every,
                            index_train_size=args.index_train_size)
    from decoder.drafters import make_drafter

    state_arms = [a for a in arms if uses_states(make_drafter(a, vocab_size=w.vocab, nodes=1))]
    if state_arms and not store.hidden_valid.any():
        raise OilbirdError(f"arm {state_arms[0]} needs hidden states and the store at {path} holds none")
    arctic_class, arctic_note = (None, "skipped (--no-arctic)") if args.no_arctic else load_arctic()
    ids = store.requests["id"].to_list()
    out_path = bench_dir(args.out, args.bench, slug) / "draft.json"
    result = {
        "kind": "bench-draft", "bench": args.bench, "model": store.meta.get("model"), "store": str(path),
        "store_fingerprint": store.fingerprint, "device": device_info(),
        "command": " ".join([Path(sys.argv[0]).name if argv is None else "bench_draft.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "started": started.isoformat(timespec="seconds"), "finished": None, "complete": False,
        "settings": {"arms": arms, "pool_sizes": sizes, "index": spec.text, "knn_recall_every": args.knn_recall_every,
                     "index_train_size": args.index_train_size, "nodes": args.nodes, "noise": args.noise,
                     "seed": args.seed, "recall_sample": args.recall_sample, "limit": args.limit,
                     "arctic": ARCTIC_SETTINGS if arctic_class is not None else None},
        "served": {"requests": len(w.served), "first": w.served_rows[0], "last": w.served_rows[-1],
                   "ids": [ids[r] for r in w.served_rows], "tokens": sum(len(tr.tokens) for tr in w.served)},
        "warm": {"requests": len(w.warm), "states_per_copy": int(sum(w.counts)),
                 "tokens_per_copy": sum(len(tr.tokens) for tr in w.warm)},
        "recall_definition": RECALL_DEFINITION,
        "rows": [], "targets": [], "notes": [],
    }
    if arctic_class is None:
        result["notes"].append(f"{ARCTIC}: {arctic_note}")
    del store
    print(f"{args.bench}: serving requests {w.served_rows[0]}..{w.served_rows[-1]} ({len(w.served)}, "
          f"{result['served']['tokens']:,} tokens) over warm pools of {', '.join(f'{s:,}' for s in sizes)} states "
          f"(one copy of the other {len(w.warm)} requests holds {result['warm']['states_per_copy']:,}); "
          f"arms {', '.join(arms)}; index {spec.text}", file=sys.stderr)
    run_arms = arms + ([ARCTIC] if arctic_class is not None and ARCTIC not in arms else [])
    for size in sizes:
        for arm in run_arms:
            if arm == ARCTIC and arctic_class is None:
                continue
            row = run_row(arm, size, w, settings, args.nodes, args.recall_sample, not args.quiet, arctic_class)
            gc.collect()  # the row's pools (a float16 pool of 1M states is 1.2 GB) before the next one is built
            result["rows"].append(row)
            atomic_write_json(out_path, result)  # a long run keeps what it measured so far
            if not args.quiet:
                q = row.get("query_ms") or {}
                print(f"  {arm} @ {size:,}: draft {ms_text(row['draft_ms_per_pass'], 'median')} ms/pass (median), "
                      f"query {ms_text(q, 'median')} ms, warm {row['warm_s']:.1f} s, serve {row['serve_s']:.1f} s",
                      file=sys.stderr)
    if arctic_class is None:
        result["rows"].append(absent_row(ARCTIC, arctic_note))
    result["draft_ratio_by_size"] = size_ratios(result["rows"])
    result["whole_store"] = None
    if args.whole_rounds:
        result["whole_store"] = whole_store(path, args.limit, args.whole_rounds, args.nodes, w.vocab, args.threads,
                                            args.quiet)
    result["targets"] = check_targets(result["rows"]) + whole_store_targets(result["whole_store"], TARGET_DRAFT_RATIO,
                                                                             TARGET_TAU)
    result["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    result["device"]["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    result["complete"] = True
    atomic_write_json(out_path, result)
    print(format_table(result["rows"]))
    if result["whole_store"]:
        print(format_whole(result["whole_store"]))
    for note in result["notes"]:
        print(f"note: {note}")
    print(format_targets(result["targets"]))
    print(f"wrote {out_path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
