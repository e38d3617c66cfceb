"""Finding and reading the results under runs/ that the reports render.

Layout read (written by the census and the decoder; only files are read, no code imported):
  runs/<bench>/<model>/traces/meta.json            the store's meta (model name for the tokenizer)
  runs/<bench>/<model>/census/summary.json         census, strictly-past pool
  runs/<bench>/<model>/census/positions.parquet
  runs/<bench>/<model>/census-<pool>/...           census with another pool mode (e.g. warm)
  runs/<bench>/<model>/decode/<arm>/summary.json   decoder, one folder per arm
  runs/<bench>/<model>/decode/<arm>/cycles.parquet

A census or an arm counts as a result when its summary.json exists. A summary.json that is not a
JSON object, or a positions.parquet that cannot be read, is an error naming the file (nothing is
rendered from half a result); optional blocks and columns that are missing are reported on the page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from census.stats import wilson  # noqa: F401  (re-exported for the pages)
from data.errors import OilbirdError

# positions.parquet columns the pages use (README, "Census outputs"); others are ignored.
POSITION_COLUMNS = ("request", "position", "target", "available", "producible", "gap", "oracle_suffix_len",
                    "longest_match_len", "sem_hit", "sem_best_cos", "emb_hit", "adj_hit", "novel_prev")
SEMANTIC_SOURCE = "semantic"  # the decoder's label for the semantic draft source


@dataclass
class Census:
    folder: Path
    pool: str  # "past" for census/, else the suffix of census-<pool>/
    summary: dict
    positions: pl.DataFrame | None  # None when positions.parquet is missing
    missing_columns: tuple[str, ...] = ()


@dataclass
class Arm:
    name: str
    folder: Path
    summary: dict
    sole_source: dict | None = None  # {share, sole, accepted, from}: see sole_source_share


@dataclass
class Result:
    """Everything under runs/<bench>/<model>/ that a page shows."""

    bench: str  # folder name under runs/
    model: str  # folder name under runs/<bench>/
    folder: Path
    meta: dict | None  # traces/meta.json, None if absent
    censuses: list[Census] = field(default_factory=list)  # census/ first, then census-* by name
    arms: list[Arm] = field(default_factory=list)  # ar first, then by name

    @property
    def census(self) -> Census | None:
        return self.censuses[0] if self.censuses else None

    @property
    def slug(self) -> str:
        return f"{self.bench}__{self.model}"

    @property
    def model_name(self) -> str:
        """The model as the run names it (alias, hub id or path), for display and the tokenizer."""
        for source in (self.meta, self.census.summary if self.census else None,
                       self.arms[0].summary if self.arms else None):
            if source and isinstance(source.get("model"), str) and source["model"]:
                return source["model"]
        return self.model


def unreadable(path: Path, e: Exception) -> OilbirdError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return OilbirdError(f"cannot read {path}: {type(e).__name__}: {first}")


def read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise unreadable(path, e)
    if not isinstance(obj, dict):
        raise OilbirdError(f"{path} is not a JSON object")
    return obj


def read_positions(path: Path) -> tuple[pl.DataFrame | None, tuple[str, ...]]:
    """The used columns of positions.parquet (sorted by request, position) and the missing ones."""
    if not path.exists():
        return None, POSITION_COLUMNS
    try:
        names = pl.read_parquet_schema(path)
        present = [c for c in POSITION_COLUMNS if c in names]
        df = pl.read_parquet(path, columns=present)
    except Exception as e:  # polars raises several types for a corrupt file
        raise unreadable(path, e)
    missing = tuple(c for c in POSITION_COLUMNS if c not in present)
    if "request" in present and "position" in present:
        df = df.sort(["request", "position"])
    return df, missing


def sole_source_share(summary: dict, cycles_path: Path) -> dict | None:
    """Accepted tokens that only the semantic source proposed, over all accepted tokens.

    Read from summary.json when the decoder wrote it (`sole_source_share`: a number, or
    {value | share, sole | k, accepted | n}); otherwise counted from cycles.parquet (`sources`: one
    label per accepted node, the proposing sources joined by '|'), but only for an arm whose
    accepted tokens credit the semantic source at all. None when neither applies.
    """
    for key in ("sole_source_share", "semantic_sole_source_share"):
        raw = summary.get(key)
        counts = raw if isinstance(raw, dict) else {}
        share = counts.get("value", counts.get("share")) if counts else raw
        if isinstance(share, (int, float)) and not isinstance(share, bool) and math.isfinite(share):
            return {"share": float(share), "sole": counts.get("sole", counts.get("k")),
                    "accepted": counts.get("accepted", counts.get("n")), "from": "summary.json"}
    by_source = summary.get("accepted_by_source")
    if not isinstance(by_source, dict) or SEMANTIC_SOURCE not in by_source or not cycles_path.exists():
        return None
    try:
        labels = pl.read_parquet(cycles_path, columns=["sources"])["sources"].explode().drop_nulls()
    except Exception as e:
        raise unreadable(cycles_path, e)
    accepted = int(labels.len())
    sole = int((labels == SEMANTIC_SOURCE).sum())
    return {"share": sole / accepted if accepted else None, "sole": sole, "accepted": accepted,
            "from": "cycles.parquet"}


def load_result(folder: Path) -> Result | None:
    """The census and decoder results of runs/<bench>/<model>/, or None when it holds neither."""
    meta_path = folder / "traces" / "meta.json"
    meta = None
    if meta_path.exists():
        try:
            meta = read_json(meta_path)
        except OilbirdError:
            meta = None  # only the tokenizer needs it; the page says token ids are shown instead
    result = Result(bench=folder.parent.name, model=folder.name, folder=folder, meta=meta)
    census_dirs = sorted((p for p in folder.iterdir()
                          if p.is_dir() and (p.name == "census" or p.name.startswith("census-"))),
                         key=lambda p: (p.name != "census", p.name))  # census/ (strictly past) first
    for cdir in census_dirs:
        if not (cdir / "summary.json").exists():
            continue
        summary = read_json(cdir / "summary.json")
        positions, missing = read_positions(cdir / "positions.parquet")
        pool = str(summary.get("pool") or ("past" if cdir.name == "census" else cdir.name.removeprefix("census-")))
        result.censuses.append(Census(cdir, pool, summary, positions, missing))
    decode = folder / "decode"
    if decode.is_dir():
        arm_dirs = sorted((p for p in decode.iterdir() if p.is_dir() and not p.name.startswith(".")
                           and (p / "summary.json").exists()), key=lambda p: (p.name != "ar", p.name))
        for adir in arm_dirs:
            summary = read_json(adir / "summary.json")
            result.arms.append(Arm(str(summary.get("arm") or adir.name), adir, summary,
                                   sole_source_share(summary, adir / "cycles.parquet")))
    return result if result.censuses or result.arms else None


def find_results(runs: Path) -> list[Result]:
    """Every runs/<bench>/<model>/ with a census or decoder result, sorted by (bench, model)."""
    runs = Path(runs)
    if not runs.is_dir():
        raise OilbirdError(f"no results folder at {runs}: run `make census BENCH=...` (or `python -m census`) first")
    out = []
    for bench in sorted(p for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for model in sorted(p for p in bench.iterdir() if p.is_dir() and not p.name.startswith(".")):
            result = load_result(model)
            if result is not None:
                out.append(result)
    return out
