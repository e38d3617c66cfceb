"""The `runs/` layout: every path under the results root is built here, and nowhere else.

  runs/<bench>/<model>/traces/              the trace store (data/store/reader.py), or a store set captured on
                                            Ray: traces/shard-00/, shard-01/, ... (data/capture/ray_capture.py)
  runs/<bench>/<model>/census/              census, strictly-past pool; census-<pool>/ for another pool
  runs/<bench>/<model>/decode/<arm>/        the live decoder, one folder per arm
  runs/<bench>/<model>/replay/<arm>/        replay, strictly-past pool; replay-<pool>/ for another pool;
                                            nodes-<N>/ inside an arm when several node budgets ran
  runs/<bench>/<model>/sweeps/              `python -m census sweep-index|sweep-budget`
  runs/<bench>/<model>/ablations/           `python -m decoder ablations` (ablations.json)
  runs/<bench>/<model>/bench-replay[-live]/ the benchmarks' cut replays (never over replay/)
  runs/<bench>/<model>/bench/               benchmark results (bench/draft.json: benchmarks/bench_draft.py)
  runs/grid/<model>/census_grid[_<pool>].*  `python -m census grid`
  runs/profiles/<model>-<device>.json       the verification-cost profile (decoder/cost/profile.py)
  reports/html/                             `python -m reports` (outside runs/)

Every folder name made from user input goes through `component`, which refuses one that would
leave its parent ('', '.', '..', a path separator): `--model /path/sub/..` must not put a store in
`runs/<bench>/traces` over another benchmark's (issue 23). `check_writable` refuses, before any
work, an output folder that cannot be written (a file, /proc, an immutable or read-only folder).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from data.errors import OilbirdError

RUNS = "runs"  # the default results root
REPORTS_HTML = "reports/html"  # the default output of `python -m reports`

TRACES = "traces"
DECODE = "decode"
SWEEPS = "sweeps"
ABLATIONS = "ablations"
ABLATIONS_FILE = "ablations/ablations.json"  # relative to runs/<bench>/<model>/
GRID = "grid"
BENCH = "bench"
PROFILES = "profiles"
NODES_DIR = re.compile(r"nodes-(\d+)")  # replay/<arm>/nodes-<N>/: one folder per node budget
SHARD_DIR = re.compile(r"shard-(\d+)")  # traces/shard-<i>/: one store of a set captured on Ray


def component(name: str, what: str) -> str:
    """`name` as one folder name, or one line saying why it cannot be one."""
    seps = {os.sep, os.altsep} - {None}
    if name in ("", ".", "..") or any(s in name for s in seps) or "\0" in name:
        raise OilbirdError(f"{what} {name!r} cannot name a folder under the results root "
                           "(empty, '.', '..' or a path separator)")
    return name


def model_slug(name: str) -> str:
    """A filesystem-safe name for runs/<bench>/<model>/ (aliases stay as they are)."""
    name = name.rstrip("/")
    if os.path.isdir(name) and not name.startswith(("smollm2", "stories")):
        name = Path(name).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def bench_folder(bench: str) -> str:
    """The folder of a benchmark under runs/: its name with ':' and '/' replaced. A `jsonl:PATH`
    bench is named `<stem>-<8 hex of sha256 of the absolute path>`: the whole path as a folder name
    can exceed the 255-byte limit."""
    if bench.startswith("jsonl:"):
        file = Path(bench[len("jsonl:"):]).expanduser()
        digest = hashlib.sha256(os.path.abspath(file).encode("utf-8", "surrogatepass")).hexdigest()[:8]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file.stem).strip("._")[:64] or "jsonl"
        return f"{stem}-{digest}"
    return component(_legacy_folder(bench), "benchmark")


def _legacy_folder(bench: str) -> str:
    return bench.replace(":", "_").replace("/", "_")


def model_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>. A `jsonl:PATH` store made under the older folder name (the path with
    / and : replaced) is still found there."""
    slug = component(slug, "model slug")
    path = Path(out) / bench_folder(bench) / slug
    if bench.startswith("jsonl:"):
        legacy = Path(out) / _legacy_folder(bench) / slug
        if not (path / TRACES).exists() and os.path.isdir(legacy / TRACES):  # False (no error) for a too-long name
            return legacy
    return path


def store_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>/traces."""
    return model_dir(out, bench, slug) / TRACES


def shard_name(index: int, shards: int) -> str:
    """The folder of shard `index` of `shards` in a store set (`capture --ray`): zero-padded to the widest
    index, so name order is shard order (a set reads its members in name order)."""
    return f"shard-{index:0{max(2, len(str(shards - 1)))}d}"


def census_name(pool: str) -> str:
    return "census" if pool == "past" else f"census-{component(pool, 'pool')}"


def census_pool(folder_name: str) -> str | None:
    """The pool of a census folder name (census_name's inverse), None for another folder."""
    if folder_name == "census":
        return "past"
    return folder_name.removeprefix("census-") if folder_name.startswith("census-") else None


def census_dir(out: str | Path, bench: str, slug: str, pool: str = "past") -> Path:
    """runs/<bench>/<model>/census (census-<pool> for other pools), beside the trace store."""
    return model_dir(out, bench, slug) / census_name(pool)


def replay_name(pool: str) -> str:
    return "replay" if pool == "past" else f"replay-{component(pool, 'pool')}"


def replay_dir(out: str | Path, bench: str, slug: str, pool: str = "past") -> Path:
    """runs/<bench>/<model>/replay (replay-<pool> for other pools), beside the trace store."""
    return model_dir(out, bench, slug) / replay_name(pool)


def nodes_name(nodes: int) -> str:
    """The folder of one node budget inside an arm's folder (NODES_DIR reads it back)."""
    return f"nodes-{int(nodes)}"


def decode_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>/decode (beside the trace store of the same benchmark and model)."""
    return model_dir(out, bench, slug) / DECODE


def sweeps_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>/sweeps."""
    return model_dir(out, bench, slug) / SWEEPS


def ablations_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>/ablations (ablations.json and the replayed arms' folders)."""
    return model_dir(out, bench, slug) / ABLATIONS


def bench_replay_dir(out: str | Path, bench: str, slug: str, live: bool = False) -> Path:
    """runs/<bench>/<model>/bench-replay (bench-replay-live): a benchmark's cut replay, beside, never
    over, the whole-store replay/ the reports read."""
    return model_dir(out, bench, slug) / ("bench-replay-live" if live else "bench-replay")


def bench_dir(out: str | Path, bench: str, slug: str) -> Path:
    """runs/<bench>/<model>/bench: the benchmarks' result files (draft.json, benchmarks/bench_draft.py)."""
    return model_dir(out, bench, slug) / BENCH


def grid_dir(out: str | Path, slug: str) -> Path:
    """runs/grid/<model>."""
    return Path(out) / GRID / component(slug, "model slug")


def grid_name(pool: str) -> str:
    """The stem of the grid files (census_grid.json / .txt; census_grid_<pool> for other pools)."""
    return "census_grid" if pool == "past" else f"census_grid_{component(pool, 'pool')}"


def default_profile_path(out: str | Path, slug: str, device_type: str) -> Path:
    """runs/profiles/<model>-<device>.json."""
    return Path(out) / PROFILES / f"{component(slug, 'model slug')}-{device_type}.json"


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """Refuse, in one line and before any work, an output folder that cannot be written: a file in the
    way, a folder under /proc, an immutable or read-only one. `path` may not exist yet: the deepest
    folder of it that exists gets a probe file, made and removed at once. Nothing else is created,
    so a command refused later for another reason leaves no empty folders behind. `flag` is the
    option the user chose the folder with, named in the message.

    Permission bits alone cannot say this (root ignores them; /proc and `chattr +i` refuse root too),
    hence the probe. Returns `path`."""
    path = Path(path)
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        if existing == path:
            raise OilbirdError(f"{path} is a file, not a folder (check {flag})")
        raise OilbirdError(f"cannot make {path}: {existing} is a file, not a folder (check {flag})")
    try:
        # the probe's name carries the pid, as every temporary name does (data/store/files.py clean_leftovers)
        fd, probe = tempfile.mkstemp(dir=existing, prefix=f".probe.{os.getpid()}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        within = "" if existing == path else f" (nothing can be made in {existing})"
        raise OilbirdError(f"cannot write {path}{within}: {e.strerror or e} (check {flag})") from None
    return path
