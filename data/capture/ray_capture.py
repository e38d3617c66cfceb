"""Capture on many workers (`python -m data capture --ray auto|local:N|ADDRESS [--workers N]`): one Ray actor per
shard, each running the one-store capture (data/capture/run.py `capture`) on its share of the requests into its
own store of a store set.

- The set is the folder the one store would be: runs/<bench>/<model>/traces/, holding shard-00/, shard-01/, ...
  (data/store/layout.py `shard_name`), each an ordinary trace store (meta.json says `"shard": {"index", "of",
  "split"}`). The readers take the folder as one stream ordered by each request's `finished_at`
  (data/store/storeset.py).
- The split is round robin: request i (in serving order) goes to shard i % N. A larger --limit, or traffic grown
  at its end, then extends every shard at its end, which the one-store resume already does; contiguous ranges
  would move requests between shards. N is fixed by the set's first capture (a rerun with another --workers is
  refused: the shards would hold other requests).
- Each actor is one engine: `--engine vllm` (a vLLM engine in the actor's process; its engine core is that
  process's child) or the harness. An actor takes one GPU where the cluster has GPUs, else one CPU.
- Resumable per shard: a rerun runs the same capture on every shard, which resumes an unfinished store at its
  last commit and leaves a finished one as it is (no engine starts for it).
- Nothing of our own schedules, moves data or retries: actors, ray.wait and ray.get. An actor that dies (its
  process killed, a node lost) is reported in one line naming its shard once the other shards have finished;
  what it committed stays, and the rerun resumes it.
"""

from __future__ import annotations

import io
import os
import sys
import time
from contextlib import redirect_stderr
from dataclasses import dataclass, field, replace
from pathlib import Path

from data.capture.run import (
    CaptureConfig,
    check_config,
    check_store_folder,
    set_members,
)
from data.errors import OilbirdError, os_error_line
from data.raycluster import RayTarget, cluster_size, ray_session, worker_env
from data.store.layout import model_slug, shard_name, store_dir
from data.store.reader import read_meta

# Test hook (tests/test_scale_raycapture.py): "<shard>:<commits>" ends that shard's actor process (os._exit)
# right after its <commits>-th commit, as a lost worker would.
EXIT_AFTER_ENV = "OILBIRD_RAY_CAPTURE_EXIT_AFTER"


@dataclass
class ShardOutcome:
    """What a shard's actor hands back: its store, its time, its notes (the capture's
    stderr lines, which Ray would otherwise keep in its worker logs), or its one-line error."""

    index: int
    path: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    lost: bool = False  # the actor died: its store is as its last commit left it, and a rerun resumes it


class ShardCapture:
    """The actor: one shard's capture, in its own process (and, with vLLM, its engine in that process's child)."""

    def capture(self, cfg: CaptureConfig, max_line_bytes: str | None) -> ShardOutcome:
        from data.benchmarks.jsonl import line_bound
        from data.capture.run import capture

        _exit_hook(cfg.shard[0])
        out, err = ShardOutcome(cfg.shard[0]), io.StringIO()
        t0 = time.perf_counter()
        try:
            with redirect_stderr(err), line_bound(max_line_bytes):
                out.path = capture(cfg)
        except OilbirdError as e:
            out.error = str(e)
        except OSError as e:  # a full disk, a folder removed: the store is intact at its last commit
            out.error = os_error_line(e)
        out.seconds = time.perf_counter() - t0
        out.notes = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        return out


def _exit_hook(index: int) -> None:
    spec = os.environ.get(EXIT_AFTER_ENV, "")
    shard, _, commits = spec.partition(":")
    if not spec or int(shard) != index:
        return
    from data.store.writer import StoreWriter

    real, done = StoreWriter.append, {"n": 0}

    def append_then_exit(self, *a, **k):
        real(self, *a, **k)
        done["n"] += 1
        if done["n"] >= int(commits):
            os._exit(1)

    StoreWriter.append = append_then_exit


def set_path(cfg: CaptureConfig) -> Path:
    """Where the set goes: the folder the one store would be (the model's slug as `_cmd_capture` builds it)."""
    return store_dir(cfg.out, cfg.bench, model_slug(cfg.model))


def check_ray_capture(cfg: CaptureConfig, workers: int | None, requests: int) -> Path:
    """What is refused before Ray starts (one line each); returns the set's folder."""
    if cfg.agree_with:
        raise OilbirdError("--agree-with compares one store with another; with --ray each shard is a store: "
                           "capture without --ray to record the agreement")
    check_config(cfg)
    if workers is not None and workers < 1:
        raise OilbirdError(f"--workers must be at least 1 (got {workers})")
    if workers is not None and workers > requests:
        raise OilbirdError(f"--workers {workers} is more than the {requests} request(s) to capture: a shard would "
                           f"be empty; use --workers {requests} or fewer")
    path = set_path(cfg)
    check_store_folder(path, sharded=True)
    held = set_shards(path)
    if held and workers is not None and held != workers:
        raise OilbirdError(f"{path} holds a store set split round robin over {held} shards: --workers {workers} "
                           f"would give its requests to other shards; rerun with --workers {held} (or without it), "
                           "or pass --out for another folder")
    return path


def set_shards(path: Path) -> int | None:
    """The number of shards a set's folder was split into (its members' meta.json `shard.of`: a shard whose
    actor died before it wrote anything has no folder yet), None for a new set."""
    counts = set()
    for name in set_members(path):
        shard = read_meta(path / name).get("shard")
        if not isinstance(shard, dict) or not isinstance(shard.get("of"), int):
            raise OilbirdError(f"{path / name}: a store without meta.json \"shard\", so not one of a set captured "
                               "with --ray; pass --out for another folder")
        counts.add(shard["of"])
    if len(counts) > 1:
        raise OilbirdError(f"{path}: its shard stores were split over different numbers of shards "
                           f"({', '.join(map(str, sorted(counts)))}); pass --out for another folder")
    return counts.pop() if counts else None


def _workers(target: RayTarget, size, asked: int | None, held: int, requests: int) -> int:
    """The number of shards: as asked, else the set's own, else one per GPU (or CPU) of the cluster, at most
    one per request; more than the cluster holds is refused (each actor takes one)."""
    unit, have = ("GPU", size.gpus) if size.gpus else ("CPU", size.cpus)
    n = asked or held or min(have, requests)
    if n > have:
        raise OilbirdError(f"--workers {n} is more than the Ray cluster's {have} {unit}(s) (--ray {target.text}): "
                           f"each shard's engine takes one; use --workers {have} or fewer, or a larger cluster")
    return n


def capture_on_ray(cfg: CaptureConfig, target: RayTarget, workers: int | None = None,
                   max_line_bytes: str | None = None) -> str:
    """Capture (or resume) the store set over Ray actors (module docstring); returns the set's folder."""
    from data.benchmarks.jsonl import line_bound
    from data.benchmarks.registry import load_requests

    with line_bound(max_line_bytes):
        n_requests = len(load_requests(cfg.bench, cfg.limit))  # the bench and --limit checked before Ray starts
    path = check_ray_capture(cfg, workers, n_requests)
    if target.kind == "local" and workers is not None and workers > target.cpus:
        raise OilbirdError(f"--workers {workers} is more than --ray {target.text}'s {target.cpus} CPU(s): each "
                           f"shard's engine takes one; use --workers {target.cpus} or fewer")
    with ray_session(target) as ray:
        size = cluster_size(ray)
        n = _workers(target, size, workers, set_shards(path) or 0, n_requests)
        if n > n_requests:
            raise OilbirdError(f"{n} shards for {n_requests} request(s): a shard would be empty; pass --workers "
                               f"{n_requests} or fewer")
        outcomes = _run_shards(ray, cfg, n, size.gpus > 0, path, max_line_bytes)
    failed = [o for o in outcomes if o.error]
    if failed:
        first, more = failed[0], len(failed) - 1
        also = f" (and {more} other shard(s): {', '.join(_shard_label(path, o.index, n) for o in failed[1:])})" \
            if more else ""
        resume = ("; every request a shard committed is kept, and rerunning the command resumes it"
                  if any(o.lost for o in failed) else "")
        raise OilbirdError(f"{_shard_label(path, first.index, n)}: {first.error}{also}{resume}")
    return str(path)


def _shard_label(path: Path, index: int, n: int) -> str:
    return str(path / shard_name(index, n))


def _run_shards(ray, cfg: CaptureConfig, n: int, gpus: bool, path: Path, max_line_bytes) -> list[ShardOutcome]:
    """One actor per shard; each shard's outcome as it ends (ray.wait), printed as a line; an actor that died
    becomes its shard's error."""
    from tqdm import tqdm

    extra = {EXIT_AFTER_ENV: os.environ[EXIT_AFTER_ENV]} if os.environ.get(EXIT_AFTER_ENV) else None
    actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=0,
                           runtime_env=worker_env(extra))(ShardCapture)
    actors = [actor_cls.remote() for _ in range(n)]
    shard_cfg = replace(cfg, progress=False)  # each shard prints nothing of its own: the driver reports shards
    pending = {actors[i].capture.remote(replace(shard_cfg, shard=(i, n)), max_line_bytes): i for i in range(n)}
    outcomes: list[ShardOutcome] = []
    bar = tqdm(total=n, unit="shard", desc=f"capture {cfg.bench} on Ray", disable=not cfg.progress,
               dynamic_ncols=True, file=sys.stderr)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(ready[0])
        outcome = _outcome(ray, ready[0], i, path, n)
        outcomes.append(outcome)
        ray.kill(actors[i])  # its engine and model go with its process
        for note in outcome.notes:
            tqdm.write(f"{shard_name(i, n)}: {note}", file=sys.stderr)
        if not outcome.error and cfg.progress:
            tqdm.write(f"{shard_name(i, n)}: done in {outcome.seconds:.1f} s", file=sys.stderr)
        bar.update(1)
    bar.close()
    return sorted(outcomes, key=lambda o: o.index)


def _outcome(ray, ref, index: int, path: Path, n: int) -> ShardOutcome:
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return ray.get(ref)
    except RayActorError as e:  # the process is gone (killed, out of memory, a node lost)
        why = " ".join(str(e).split())
        why = why if len(why) <= 200 else why[:197] + "..."
        return ShardOutcome(index, error=f"its Ray actor died ({why})", lost=True)
    except RayTaskError as e:  # a bug in the capture: the worker's traceback is in Ray's logs
        cause = e.cause if getattr(e, "cause", None) is not None else e
        line = " ".join(str(cause).split())[:300]
        return ShardOutcome(index, error=f"the capture failed ({type(cause).__name__}: {line}; the worker's "
                                         "traceback is in Ray's logs, /tmp/ray/session_latest/logs)")
