"""Replay's arm runs: one `replay_arm` per (arm, nodes) over the same traces, in this process, in worker
processes (`--jobs`) or as Ray tasks (`--ray`). The runs are independent of each other and each is a pure
function of the traces and its settings, so where they run changes their timings only (decoder/replay/run.py
makes the summaries from them in the driver either way).

  this process      one run after another (--jobs 1, or a single run)
  worker processes  a spawn pool of --jobs workers on this machine (decoder/replay/workers.py: how many, and that
                    they die with the replay); each reads the store itself; a bar counts replayed requests
  Ray tasks         `--ray auto|local:N|HOST:PORT` (data/raycluster.py): one task per (arm, nodes), one CPU
                    each, so Ray runs one per CPU of the cluster (hence `--jobs` is refused with `--ray`). The
                    traces are put once in Ray's object store (their arrays read without a copy by every
                    worker on a node; a node without the store's files gets them too). Ray schedules,
                    moves the data and retries a run whose worker was lost (max_retries): a retry gives the
                    same run. A bar counts finished arm runs (data/raycluster.py gather).

Each worker runs on one thread (torch, OMP): the workers share the cores. The oilbird key's overlap thread
(decoder/drafters/oilbird.py key_overlap) is turned off where every core holds a worker, as it would share
a core with a sibling (run.py's rule for worker processes; always on Ray, which fills every CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.managers import SyncManager
from pathlib import Path

import numpy as np

from data.errors import OilbirdError
from data.raycluster import (
    CONNECT_TIMEOUT_S,
    THREAD_ENV,
    cluster_size,
    gather,
    import_ray,
    parse_ray,
    probe,
    ray_session,
    worker_env,
)
from data.store.storeset import open_store_or_set
from decoder.loop import Cycle, Generation, serve_requests, speculate
from decoder.verify.passes import SEMANTIC_SOURCE
from decoder.pools import PoolSettings, TenantPools
from decoder.replay.traces import Trace, TraceVerifier, exactness, load_traces, uses_states
from decoder.replay.workers import die_with_parent

RAY_RETRIES = 3  # a lost worker's run is started again this often (Ray's max_retries) before the replay fails


# ---------------------------------------------------------------- one arm

@dataclass
class ArmReplay:
    arm: str
    nodes: int
    cycles: list[list[Cycle]]  # per request
    pool_s: np.ndarray  # pool time per request: the window's evictions and add_trace
    seconds: float  # wall time of the arm's replay
    exact: bool
    exact_reason: str
    has_key: bool
    stats: dict | None = None
    warm_s: float = 0.0
    pools: dict | None = None  # TenantPools.summary: tenants, the budget, the largest pool drafted from


def replay_arm(arm: str, traces: list[Trace], nodes: int, pool: str, vocab_size: int,
               progress=None, settings: PoolSettings | None = None) -> ArmReplay:
    """Serve every trace with fresh drafters of `arm` (one per tenant; pools empty, or warm), in order:
    the live decoder's request runner and loop, the store as the verifier.

    `settings`: the index spec and the budget window (decoder/pools.py); default exact, unbounded."""
    from decoder.drafters import make_drafter

    settings = settings or PoolSettings()
    # The store's traces and earlier arms' results are long-lived: frozen, the cyclic collector stops walking
    # them, so its full collections (about 0.1 s over API-Bank's store) stop landing in a timed drafting pass.
    gc.collect()
    gc.freeze()
    make = lambda: make_drafter(arm, vocab_size=vocab_size, nodes=nodes, shared=settings.shared())  # noqa: E731
    pools = TenantPools(make, settings.budget_tokens)
    probe = make()
    exact, reason = exactness(probe)
    states = uses_states(probe)
    t_start = time.perf_counter()
    warm_s = 0.0
    if pool == "warm":  # each tenant's drafter gets its own tenant's traces only
        pools.add_warm((tr.prompt, tr.tokens, tr.pool_states(), tr.tenant) for tr in traces)
        warm_s = time.perf_counter() - t_start

    def decode(r: int, drafter) -> Generation:
        tr = traces[r]
        run = speculate(drafter, TraceVerifier(tr, vocab_size), tr.prompt, nodes)
        hidden = tr.pool_states() if states and pool == "past" else None  # what joins the pool
        return Generation(tokens=tr.tokens, stop_reason=run.stop_reason, seconds=run.seconds,
                          prefill_s=run.prefill_s, cycles=run.cycles, hidden=hidden)

    gens, pool_s = serve_requests([tr.prompt for tr in traces], [tr.tenant for tr in traces], pools, decode,
                                  join=pool == "past", on_request=(lambda g, s: progress(1)) if progress else None)
    per_request = [g.cycles for g in gens]
    stats = pools.counters()
    has_key = bool(stats and stats.get("semantic_key")) or any(
        SEMANTIC_SOURCE in c.node_sources for cs in per_request for c in cs)
    return ArmReplay(arm, nodes, per_request, np.asarray(pool_s), time.perf_counter() - t_start, exact, reason,
                     has_key, stats, warm_s, pools.summary())


# ---------------------------------------------------------------- this process, or worker processes

def _worker(job: tuple) -> ArmReplay:
    """One (arm, nodes) in a worker process: the traces come from the store each worker reads itself."""
    arm, nodes, path, limit, cap, pool, vocab_size, queue, settings = job
    import torch

    torch.set_num_threads(1)  # one core per worker: the workers share the machine
    store = open_store_or_set(path)  # a store set merges the same way in every worker
    traces = load_traces(store, limit, cap)
    return replay_arm(arm, traces, nodes, pool, vocab_size, progress=(lambda k: queue.put(k)) if queue else None,
                      settings=settings)


def run_in_processes(jobs: list[tuple[str, int]], traces: list[Trace], path: Path, pool: str, limit: int | None,
                     max_new_tokens: int | None, vocab_size: int, settings: PoolSettings, n_workers: int,
                     progress: bool) -> dict[tuple[str, int], ArmReplay]:
    """Every (arm, nodes) of `jobs`: here one after another (n_workers 1, or a single run), else in a pool of
    n_workers processes, each reading the store at `path` (limit, max_new_tokens: as `traces` were loaded)."""
    from tqdm import tqdm

    if n_workers > 1 and len(jobs) > 1 and n_workers >= (os.cpu_count() or 1):
        # every core holds a worker: the key's worker thread would share one with a sibling and stall both (the
        # whole API-Bank store with 2 workers on 2 cores: 0.34 ms of key time a pass instead of 0.03, p99 5.7 ms)
        settings = dataclasses.replace(settings, key_overlap="off")
    total = len(jobs) * len(traces)
    bar = tqdm(total=total, unit="req", desc=f"replay {len(jobs)} arm run(s)", disable=not progress,
               dynamic_ncols=True)
    try:
        if n_workers <= 1 or len(jobs) == 1:
            out = {}
            for arm, nodes in jobs:
                bar.set_postfix(arm=arm, nodes=nodes, refresh=False)
                out[(arm, nodes)] = replay_arm(arm, traces, nodes, pool, vocab_size, progress=bar.update,
                                               settings=settings)
            return out
        ctx = multiprocessing.get_context("spawn")  # fork would copy torch/polars thread state
        manager = SyncManager(ctx=ctx)  # every helper ends with this process, even on kill -9 (decoder/replay/workers.py)
        manager.start(die_with_parent, (os.getpid(),))
        with manager:
            queue = manager.Queue()
            with ctx.Pool(n_workers, initializer=die_with_parent, initargs=(os.getpid(),)) as workers:
                pending = workers.map_async(_worker, [(arm, nodes, str(path), limit, max_new_tokens, pool,
                                                       vocab_size, queue, settings) for arm, nodes in jobs],
                                            chunksize=1)
                done = 0
                while not pending.ready() or done < total:
                    try:
                        k = queue.get(timeout=0.2)
                    except Exception:
                        if pending.ready():
                            break
                        continue
                    done += k
                    bar.update(k)
                results = pending.get()
        return {(r.arm, r.nodes): r for r in results}
    finally:
        bar.close()


# ---------------------------------------------------------------- Ray tasks

def check_ray(ray: str | None, jobs: int) -> None:
    """--ray before any work (one line each): its value, not with --jobs, the ray package, and a cluster's
    address answering (probed again when joined; a store can take minutes to read)."""
    if ray is None:
        return
    target = parse_ray(ray)
    if jobs:
        raise OilbirdError(f"--ray {ray} and --jobs {jobs}: on Ray every CPU of the cluster runs one arm run at a "
                           "time, so there is no worker count to give; drop --jobs (or --ray)")
    import_ray()
    if target.kind == "address":
        probe(target.address, CONNECT_TIMEOUT_S)


def _ray_task(arm: str, nodes: int, traces: list[Trace], pool: str, vocab_size: int,
              settings: PoolSettings) -> ArmReplay:
    """One (arm, nodes) in a Ray worker (its runtime_env sets the libraries' threads to one)."""
    import torch

    torch.set_num_threads(1)
    return replay_arm(arm, traces, nodes, pool, vocab_size, settings=settings)


def run_on_ray(ray_text: str, jobs: list[tuple[str, int]], traces: list[Trace], pool: str, vocab_size: int,
               settings: PoolSettings, progress: bool,
               max_retries: int = RAY_RETRIES) -> dict[tuple[str, int], ArmReplay]:
    """Every (arm, nodes) of `jobs` as one Ray task on the cluster `ray_text` names (module docstring)."""
    settings = dataclasses.replace(settings, key_overlap="off")  # Ray puts a task on every CPU
    with ray_session(parse_ray(ray_text)) as ray:
        task = ray.remote(_ray_task).options(num_cpus=1, max_retries=max_retries,
                                             runtime_env=worker_env(THREAD_ENV))
        print(f"replay on Ray ({ray_text}): {len(jobs)} arm run(s) as tasks on {cluster_size(ray).cpus} CPU(s)",
              file=sys.stderr)
        shared = ray.put(traces)  # once: every task reads the same object
        refs = [task.remote(arm, nodes, shared, pool, vocab_size, settings) for arm, nodes in jobs]
        results = gather(ray, refs, [f"replay of {arm} at {nodes} nodes" for arm, nodes in jobs],
                         f"replay {len(jobs)} arm run(s) on Ray", "run", progress)
    return {(r.arm, r.nodes): r for r in results}
