"""The cross-benchmark table: Avail, Gap, Recall per benchmark, from each census summary.json.

A benchmark whose summary is missing but whose trace store exists is censused first; one with
neither is an error naming the capture to run.
"""

from __future__ import annotations

from pathlib import Path

from census.definitions import CensusConfig
from data.errors import OilbirdError

COLUMNS = ("available", "gap", "recall")


def load_or_run(bench: str, model: str, cfg: CensusConfig, out: str | Path, progress: bool = True) -> dict:
    import json

    from census.run import census_dir, run_census
    from data.models import model_slug
    from data.store import store_dir

    path = census_dir(out, bench, model_slug(model), cfg.pool) / "summary.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise OilbirdError(f"{path} is not valid JSON ({e.msg}); rerun `python -m census --bench {bench}`") from None
    if not (store_dir(out, bench, model_slug(model)) / "meta.json").exists():
        raise OilbirdError(f"no census and no trace store for {bench} / {model_slug(model)} under {out}: "
                           f"run `make census BENCH={bench} MODEL={model}` first")
    return run_census(bench, model, cfg, out, progress=progress)[1]


def grid_table(benches: list[str], model: str, cfg: CensusConfig, out: str | Path = "runs",
               progress: bool = True) -> dict:
    rows = []
    for bench in benches:
        s = load_or_run(bench, model, cfg, out, progress)
        rows.append({"bench": bench, "positions": s["positions"], "requests": s["requests"],
                     **{c: s[c] for c in COLUMNS}})
    return {"model": model, "pool": cfg.pool, "rows": rows}


def format_grid(grid: dict) -> str:
    def cell(p, digits):
        if not p or p.get("value") is None:
            return "n/a"
        return f"{100 * p['value']:.{digits}f}"

    def ci(p):
        b = (p or {}).get("bootstrap")
        return f"{100 * b[0]:.1f}-{100 * b[1]:.1f}" if b else "n/a"

    head = f"{'Benchmark':<20} {'Avail.':>7} {'Gap':>6} {'Recall':>7}   {'Gap 95% (boot)':>15} {'Recall 95% (boot)':>18} {'positions':>9} {'gap n':>6}"
    lines = [f"census grid: {grid['model']}, pool {grid['pool']} (percent of generated positions; "
             "Recall = share of gap positions the semantic key recovers)", head, "-" * len(head)]
    for r in grid["rows"]:
        lines.append(f"{r['bench']:<20} {cell(r['available'], 1):>7} {cell(r['gap'], 1):>6} {cell(r['recall'], 1):>7}"
                     f"   {ci(r['gap']):>15} {ci(r['recall']):>18} {r['positions']:>9} {r['gap']['k']:>6}")
    return "\n".join(lines)
