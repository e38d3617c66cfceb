"""The census on Ray (`python -m census ... --ray auto|local:N|ADDRESS`): the parts in shards, one Ray task each.

The split (docs/scale.md says why). The census walks each tenant's requests in serving order, and
request r's answers depend only on the pool as of r (the earlier requests, less same-prompt and
evicted traces). So a tenant's requests are cut into contiguous ranges [a, b); the shard of [a, b)
builds the pool as of request a (it adds requests < a to the lexical automaton without censusing
them, census/positions.py `census_part` with `first`) and censuses [a, b). In past mode a shard
holds only requests s(a)..b-1 (`slice_part`; s(a) the store-budget window's start, 0 unbounded):
later requests are never its pool, earlier ones left it. The exact
semantic key is stateless between requests (one top-k over the pool's rows per request), and its
ranking is defined on float64 rescored cosines, so a shard's answer is the whole run's to the digit.

Everything that is not per position stays in the driver: the recall sample, the frame's order, the
index and pool blocks, the summary (census/positions.py `census_run` with a `runner`), so the
outputs are the single-process census's. A trained index (`--index ivf...`, `pq64`, ...) is refused
here in one line: its answers depend on when it trained and on every state added before, which a
shard would have to replay in full (docs/scale.md).

The driver opens the store without its states (data/store/reader.py `defer_hidden`): each shard reads
the states of its own rows from the store's Parquet parts (data/store/statefiles.py, each part checked
against the sha256 the driver verified), so the driver neither parses nor ships 2d bytes per position,
most of its serial cost at scale (docs/scale.md); on a cluster of several nodes, the store must be
at the same path on each (a shared filesystem). Ray does the scheduling, the transport (the parts,
states aside, go through its object store once, read without a copy by every worker on a node) and
the retries: a worker lost mid-run is a system failure Ray retries (`max_retries`), and a shard is a
pure function of its inputs, so a retry gives the same frame. Each worker runs on one thread (torch,
faiss, OMP), so 1 vs 2 workers measures the split.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from census.definitions import CensusConfig, CensusInput
from census.keys import exact_describe
from census.pool import Part, PoolPlan, Setup
from data.errors import OilbirdError
from data.raycluster import (  # noqa: F401  (parse_ray, import_ray, start_ray, ray_session: the census's --ray)
    THREAD_ENV,
    RayTarget,
    gather,
    import_ray,
    parse_ray,
    ray_session,
    start_ray,
    worker_env,
)

SHARDS_PER_CPU = 4  # more shards than workers: Ray's queue evens out shards of unequal cost
# A pooled row costs a query one float32 dot product; a position's other answers cost about what this
# many rows do (docs/scale.md, one thread at d = 576: lexical, adjacency and payload 26 us per position,
# 21.5 ns per pooled row, so ~1,200 rows; rounded up for the shard's warm-up, 11 us per row of its slice).
LEXICAL_ROWS = 2000
# Test hook: with this set to a path, the first shard to start creates the file and exits the worker
# process (os._exit), as a lost worker would; the retry finds the file and runs (tests/test_scale_raycensus.py).
CRASH_ONCE_ENV = "OILBIRD_RAY_CRASH_ONCE"


def check_ray_config(cfg: CensusConfig) -> None:
    """What --ray cannot census identically, refused before any work (module docstring)."""
    from data.index.stateindex import parse_index_spec

    if not parse_index_spec(cfg.index).exact:
        raise OilbirdError(f"--ray censuses with the exact semantic key only: --index {cfg.index} trains on the "
                           "pool as it grows, which a shard cannot rebuild identically; drop --index, or --ray "
                           "(docs/scale.md)")


def census_worker_env() -> dict:
    """The census workers' runtime_env: one thread each (and the lost-worker test hook), on
    data/raycluster.py's (this checkout's packages first on their path)."""
    extra = dict(THREAD_ENV)
    if os.environ.get(CRASH_ONCE_ENV):
        extra[CRASH_ONCE_ENV] = os.environ[CRASH_ONCE_ENV]
    return worker_env(extra)


@dataclass
class Shard:
    """Requests [first, last) of part `part` (an index into the setup's parts)."""

    part: int
    first: int
    last: int
    positions: int


def plan_shards(setup: Setup, shards: int) -> list[Shard]:
    """About `shards` shards of equal estimated cost, cut at request boundaries inside each part.

    Cost of request r: n_r x (pool rows + LEXICAL_ROWS): the exact key scores each position against
    every pooled row, the lexical answers cost about the same per position whatever the pool."""
    costs = []
    for part in setup.parts:
        n = np.diff(part.data.offsets).astype(np.float64)
        pool = np.array([part.plan.pool_tokens(r) for r in range(part.data.n_requests)], np.float64)
        costs.append(n * (pool + LEXICAL_ROWS))
    total = sum(float(c.sum()) for c in costs) or 1.0
    out = []
    for p, (part, cost) in enumerate(zip(setup.parts, costs)):
        if not part.data.n_positions:  # a tenant with no generated token has nothing to census
            continue
        k = max(1, min(int(round(shards * float(cost.sum()) / total)), int((cost > 0).sum())))
        cum = np.cumsum(cost)
        cuts = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k, side="left") + 1
        bounds = np.unique(np.concatenate([[0], cuts, [part.data.n_requests]]))
        off = part.data.offsets
        out += [Shard(p, int(a), int(b), int(off[b] - off[a])) for a, b in zip(bounds[:-1], bounds[1:])
                if off[b] > off[a]]
    return out


def slice_part(part: Part, start: int, last: int) -> Part:
    """Requests [start, last) of the part as a part of their own (views of its rows), for a shard
    whose every pool lies inside them (past mode: `start` is the window start of its first request,
    0 without a store budget; requests from `last` on are never in the pool of one before it).

    Request r's pool is the same traces, now at rows shifted by offsets[start]: the lexical answers
    are counts over those traces (census/index.py), the exact key ranks by cosine then by later row
    (a shift keeps the order), the adjacency and embedding keys by serving order: all unchanged."""
    data = part.data
    if start == 0 and last >= data.n_requests:
        return part
    a, b = int(data.offsets[start]), int(data.offsets[last])
    sub = CensusInput(prompts=data.prompts[start:last], tokens=data.tokens[a:b],
                      offsets=data.offsets[start:last + 1] - a, hidden=data.hidden[a:b],
                      hidden_valid=data.hidden_valid[a:b], topk=data.topk[a:b],
                      prompt_last_hidden=data.prompt_last_hidden[start:last],
                      prompt_last_topk=data.prompt_last_topk[start:last], prompt_hash=data.prompt_hash[start:last],
                      meta=data.meta, tenant=None if data.tenant is None else data.tenant[start:last],
                      states=None if data.states is None else data.states.permuted(np.arange(a, b)))
    return Part(sub, part.requests[start:last], part.rows[a:b],
                PoolPlan(sub, part.plan.mode, part.plan.starts[start:last] - start))


@dataclass
class ShardResult:
    """What a shard task returns: its rows, and what the bench reads off it."""

    frame: pl.DataFrame  # the positions of its requests, in order (definitions.POSITION_COLUMNS)
    queries: int  # semantic-key queries asked (the index block's count)
    parts_s: dict[str, float]  # seconds per part of the work (census_run's timings)
    seconds: float
    cpu_s: float  # the worker's CPU seconds on it (robust to other load on the machine, unlike `seconds`)
    peak_rss_bytes: int  # the worker process's peak resident memory so far
    pid: int


def census_shard(part: Part, cfg: CensusConfig, spec, embeddings, first: int, last: int) -> ShardResult:
    """One shard, in a Ray worker (a pure function of its inputs, so a retry returns the same)."""
    marker = os.environ.get(CRASH_ONCE_ENV)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os._exit(1)  # the first attempt of the first shard dies as a lost worker would
        except FileExistsError:
            pass
    import torch

    from census.knn import set_exact_matmul
    from census.positions import census_part
    from data.capture.models import pick_device

    torch.set_num_threads(1)
    try:
        import faiss

        faiss.omp_set_num_threads(1)
    except ImportError:
        pass
    t0, cpu0 = time.perf_counter(), time.process_time()
    timings: dict[str, float] = {}
    clock = [t0]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - clock[0]
        clock[0] = now

    set_exact_matmul()
    if cfg.pool == "past":  # only the rows its pools can hold (warm: every request pools every other)
        start = int(part.plan.starts[first])
        part, first, last = slice_part(part, start, last), first - start, last - start
    if part.data.states is not None:  # the driver left the states in the store: this shard reads its own rows
        part = dataclasses.replace(part, data=part.data.with_states())
        lap("read_states")
    df, key, _ = census_part(part, cfg, spec, embeddings, np.zeros(0, np.int64), pick_device(cfg.device),
                             False, lap, first=first, last=last)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return ShardResult(df, int(key.queries), timings, time.perf_counter() - t0, time.process_time() - cpu0, int(rss),
                       os.getpid())


@dataclass
class ShardedExactKey:
    """The exact key's describe() for a part censused in shards: SemanticKey's, the queries summed
    over the shards (census/keys.py combined_describe reads describe() and len(ok))."""

    d: int
    ok: range  # one per row of the part (combined_describe weighs parts by it)
    queries: int

    def describe(self) -> dict:
        return exact_describe(self.d, self.queries)


@dataclass
class RayParts:
    """census_run's runner on Ray (census/positions.py PartsRunner): the shards as tasks, their
    frames back in order. `report` holds what the run measured (shards, workers, per-shard costs)."""

    shards: int | None = None  # None: SHARDS_PER_CPU x the cluster's CPUs
    progress: bool = True
    max_retries: int = 3
    report: dict = field(default_factory=dict)

    def __call__(self, setup: Setup, cfg: CensusConfig, embeddings, knn_rows: np.ndarray, timings: dict):
        t_start = time.perf_counter()
        check_ray_config(cfg)
        ray = import_ray()
        cpus = int(ray.cluster_resources().get("CPU", 1))
        plan = plan_shards(setup, self.shards or SHARDS_PER_CPU * cpus)
        task = ray.remote(census_shard).options(num_cpus=1, max_retries=self.max_retries,
                                                runtime_env=census_worker_env())
        part_ids = sorted({s.part for s in plan})
        if setup.budget_tokens is not None and cfg.pool == "past":  # each shard's window travels, not the stream
            inputs = []
            for s in plan:
                start = int(setup.parts[s.part].plan.starts[s.first])
                inputs.append((ray.put(slice_part(setup.parts[s.part], start, s.last)), s.first - start,
                               s.last - start))
        else:  # unbounded: every shard reads a prefix of the part, put once (read without a copy on a node)
            put = {p: ray.put(setup.parts[p]) for p in part_ids}
            inputs = [(put[s.part], s.first, s.last) for s in plan]
        emb = ray.put(embeddings)
        t0 = time.perf_counter()
        refs = [task.remote(ref, cfg, setup.spec, emb, a, b) for ref, a, b in inputs]
        results = gather(ray, refs, [f"census shard (part {s.part}, requests {s.first}..{s.last - 1})" for s in plan],
                         "census shards", "shard", self.progress)
        t_done = time.perf_counter()
        wall = t_done - t0
        frames, keys = [], []
        for p in part_ids:
            mine = [r for s, r in zip(plan, results) if s.part == p]
            frames.append(pl.concat([r.frame for r in mine]) if len(mine) > 1 else mine[0].frame)
            keys.append(ShardedExactKey(setup.parts[p].data.d_model, range(setup.parts[p].data.n_positions),
                                        sum(r.queries for r in mine)))
        for r in results:  # worker seconds, summed over the shards (CPU time, not wall)
            for k, v in r.parts_s.items():
                timings[k] = timings.get(k, 0.0) + v
        self.report.update(
            cpus=cpus, shards=len(plan), shards_wall_s=round(wall, 3), workers=len({r.pid for r in results}),
            # the driver's serial seconds around the shards: the plan and the puts, then the frames joined
            driver_submit_s=round(t0 - t_start, 3), driver_collect_s=round(time.perf_counter() - t_done, 3),
            shard_s=[round(r.seconds, 3) for r in results], shard_cpu_s=[round(r.cpu_s, 3) for r in results],
            shard_positions=[s.positions for s in plan], shard_requests=[[s.first, s.last] for s in plan],
            peak_rss_gib_per_worker=round(max(r.peak_rss_bytes for r in results) / 2 ** 30, 3))
        return frames, keys, [np.zeros((0, cfg.candidates), np.int64) for _ in frames]

