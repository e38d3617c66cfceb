"""The cross-benchmark table: Avail, Gap, Recall per benchmark, from each census summary.json.

A benchmark whose census is missing, or was computed from an earlier state of its store, is censused
first. Without a store: with `capture` (`python -m census grid --capture`, `make grid`) the store is
captured with the grid's settings (`GridCapture`: the cap, the batch width, and the per-benchmark
first-N limit of data/benchmarks/registry.py GRID_LIMITS, said on stderr); otherwise it is an error naming the
capture to run. A partial store (a killed capture) resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from census.definitions import CensusConfig
from data.errors import OilbirdError

COLUMNS = ("available", "gap", "recall")


@dataclass
class GridCapture:
    """How `--capture` makes a missing store: the make targets' settings (Makefile MAX_NEW, BATCH)."""

    max_new_tokens: int = 256  # SmolLM2 on CPU rambles to the cap; 256 keeps each capture near 20 min
    batch_size: int = 32  # rows decoded together (tokens equal to batch 1; docs/capture.md)
    limits: bool = True  # the per-benchmark first-N limits of GRID_LIMITS; False: whole benchmarks


def _store_complete(path: Path, want: int | None) -> bool:
    """The benchmark's store holds `want` requests (a store set there, served traffic: complete as it is)."""
    from data.store.reader import read_meta
    from data.store.storeset import holds_traces, set_members

    if not holds_traces(path):
        return False
    if not (path / "meta.json").exists():
        return all(read_meta(m).get("complete") for m in set_members(path))
    try:
        meta = read_meta(path)
    except OilbirdError:
        return False
    return bool(meta.get("complete")) and (want is None or int(meta.get("n_requests") or 0) >= want)


def ensure_store(bench: str, model: str, out: str | Path, capture: GridCapture | None, progress: bool,
                 loaded: dict) -> None:
    """The benchmark's trace store exists (captured or resumed here when `capture` is given)."""
    import sys

    from data.benchmarks.registry import grid_limit, grid_limit_note, load_requests
    from data.store.layout import model_slug, store_dir
    from data.store.storeset import holds_traces

    path = store_dir(out, bench, model_slug(model))
    limit = grid_limit(bench) if capture is not None and capture.limits else None
    if capture is None:
        if not holds_traces(path):  # a store, or a store set (data/store/storeset.py)
            raise OilbirdError(f"no census and no trace store for {bench} / {model_slug(model)} under {out}: "
                               f"run `make census BENCH={bench} MODEL={model}` or `python -m census grid --capture`")
        return
    print(grid_limit_note(bench) if capture.limits else f"capture {bench}: every request (--no-limits)",
          file=sys.stderr)
    if _store_complete(path, limit or len(load_requests(bench))):  # a shorter store is extended
        return
    from data.capture.models import load_model
    from data.capture.run import CaptureConfig
    from data.capture.run import capture as run_capture

    if "lm" not in loaded:
        loaded["lm"] = load_model(model)
    run_capture(CaptureConfig(bench=bench, model=model, limit=limit, max_new_tokens=capture.max_new_tokens,
                              batch_size=capture.batch_size, out=str(out), progress=progress), loaded["lm"])


def current(bench: str, model: str, cfg: CensusConfig, out: str | Path) -> dict | None:
    """The census summary of the store as it is now, or None when missing or stale."""
    from data.store.layout import census_dir, model_slug, store_dir
    from data.store.storeset import current_summary

    folder = census_dir(out, bench, model_slug(model), cfg.pool)
    s = current_summary(folder / "summary.json", store_dir(out, bench, model_slug(model)), config=cfg.as_dict())
    return s if s is not None and (folder / "positions.parquet").exists() else None


def load_or_run(bench: str, model: str, cfg: CensusConfig, out: str | Path, progress: bool = True) -> dict:
    """The census summary of the store as it is now: read when current, else computed."""
    from census.output import run_census

    s = current(bench, model, cfg, out)
    return s if s is not None else run_census(bench, model, cfg, out, progress=progress)[1]


def census_task(bench: str, model: str, cfg: CensusConfig, out: str) -> dict:
    """One benchmark's whole census in a Ray worker (`python -m census grid --ray`): its summary."""
    import torch

    from census.output import run_census

    torch.set_num_threads(1)
    return run_census(bench, model, cfg, out, progress=False)[1]


def census_benches(benches: list[str], model: str, cfg: CensusConfig, out: str, progress: bool,
                   max_retries: int = 3) -> list[dict]:
    """One Ray task per benchmark (the grid's censuses), in the running Ray session: their summaries."""
    from census.ray_census import census_worker_env
    from data.raycluster import gather, import_ray

    ray = import_ray()
    task = ray.remote(census_task).options(num_cpus=1, max_retries=max_retries, runtime_env=census_worker_env())
    out = str(Path(out).resolve())  # a worker's working folder is not the driver's
    refs = [task.remote(b, model, cfg, out) for b in benches]
    return gather(ray, refs, [f"census of {b}" for b in benches], "grid censuses", "bench", progress)


def grid_table(benches: list[str], model: str, cfg: CensusConfig, out: str | Path = "runs",
               progress: bool = True, capture: GridCapture | None = None, ray: str | None = None) -> dict:
    """The grid's rows. ray (auto, local:N, an address): the censuses missing or stale run as one Ray
    task per benchmark (`census_benches`), after every capture; the rows are the same."""
    from data.benchmarks.registry import get_benchmark
    from data.store.layout import model_slug, store_dir
    from data.store.storeset import holds_traces, read_store_meta

    if capture is not None:
        for bench in benches:
            get_benchmark(bench)  # an unknown name fails before hours of capture of the others
    rows, loaded = [], {}
    if ray is not None:
        from census.ray_census import parse_ray, ray_session

        target = parse_ray(ray)
        for bench in benches:
            ensure_store(bench, model, out, capture, progress, loaded)
        todo = [b for b in dict.fromkeys(benches) if current(b, model, cfg, out) is None]
        if todo:
            with ray_session(target):
                census_benches(todo, model, cfg, str(out), progress)
    for bench in benches:
        ensure_store(bench, model, out, capture if ray is None else None, progress, loaded)
        s = load_or_run(bench, model, cfg, out, progress)
        meta_path = store_dir(out, bench, model_slug(model))
        meta = read_store_meta(meta_path) if holds_traces(meta_path) else {}
        rows.append({"bench": bench, "positions": s["positions"], "requests": s["requests"],
                     "requests_total": meta.get("requests_total"), "limit": meta.get("limit"),
                     "max_new_tokens": meta.get("max_new_tokens"), **{c: s[c] for c in COLUMNS}})
    return {"model": model, "pool": cfg.pool, "rows": rows}


def format_grid(grid: dict) -> str:
    def cell(p, digits):
        if not p or p.get("value") is None:
            return "n/a"
        return f"{100 * p['value']:.{digits}f}"

    def ci(p):
        b = (p or {}).get("bootstrap")
        return f"{100 * b[0]:.1f}-{100 * b[1]:.1f}" if b else "n/a"

    def reqs(r):
        total = r.get("requests_total")
        return f"{r['requests']}/{total}" if total and total != r["requests"] else str(r["requests"])

    head = f"{'Benchmark':<20} {'requests':>9} {'Avail.':>7} {'Gap':>6} {'Recall':>7}   {'Gap 95% (boot)':>15} {'Recall 95% (boot)':>18} {'positions':>9} {'gap n':>6}"
    lines = [f"census grid: {grid['model']}, pool {grid['pool']} (percent of generated positions; "
             "Recall = share of gap positions the semantic key recovers)", head, "-" * len(head)]
    for r in grid["rows"]:
        lines.append(f"{r['bench']:<20} {reqs(r):>9} {cell(r['available'], 1):>7} {cell(r['gap'], 1):>6} {cell(r['recall'], 1):>7}"
                     f"   {ci(r['gap']):>15} {ci(r['recall']):>18} {r['positions']:>9} {r['gap']['k']:>6}")
    return "\n".join(lines)
