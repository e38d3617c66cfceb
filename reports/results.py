"""Finding and reading the results under runs/ that the reports render.

Layout read (written by the census and the decoder; only files are read, no code imported):
  runs/<bench>/<model>/traces/meta.json            the store's meta (model name for the tokenizer) and its
                                                   fingerprint now (data/store/reader.py current_fingerprint: a
                                                   result that recorded another one is stale, reports/freshness.py)
  runs/<bench>/<model>/traces/<store>/meta.json    ... or a store set there (a folder of stores: their common meta and
                                                   the set's fingerprint, data/store/storeset.py)
  runs/<bench>/<model>/census/summary.json         census, strictly-past pool
  runs/<bench>/<model>/census/positions.parquet
  runs/<bench>/<model>/census-<pool>/...           census with another pool mode (e.g. warm)
  runs/<bench>/<model>/decode/<arm>/summary.json   decoder, one folder per arm
  runs/<bench>/<model>/decode/<arm>/cycles.parquet
  runs/<bench>/<model>/replay/<arm>/summary.json   replay (python -m decoder replay), strictly-past pool
  runs/<bench>/<model>/replay/<arm>/nodes-<N>/summary.json   ... one folder per node budget when the
                                                   replay ran several (then the arm folder holds only these)
  runs/<bench>/<model>/replay-warm/<arm>/...       replay with the warm pool (every other request's trace)
  runs/<bench>/<model>/sweeps/index.json           `python -m census sweep-index`: gap recall per index spec
  runs/<bench>/<model>/sweeps/budget.json          `python -m census sweep-budget`: the census per pool budget
  runs/<bench>/<model>/ablations/ablations.json    `python -m decoder ablations`: ablations, ladder, headline
  runs/<bench>/<model>/vllm/summary.json           `make bench-vllm` (benchmarks/bench_vllm.py): Oilbird inside
                                                   vLLM against vLLM's own methods, per arm and batch size

Folders whose name starts with "." are temporary (a folder being written) and are skipped.
A census or an arm counts as a result when its summary.json exists. A summary.json that is not a
JSON object, or a positions.parquet that cannot be read, is an error naming the file (nothing is
rendered from half a result); optional blocks and columns that are missing are reported on the page.
Every census, replay, live, ablations and vLLM summary is checked against its schema (data/results.py):
a value of the wrong type or range is read as null (not known) and listed in `problems`, which the page
shows and the verdict refuses to decide on ("cannot decide: <file> lacks <field>", reports/decision.py).
The sweeps and the vLLM bench are optional extras: a missing file is simply not shown, and one that cannot be
read (not JSON, not the documented shape) becomes a one-line note on the page, never an error;
a vLLM summary with "complete": false (the bench still running, or stopped) is shown as far as it got;
a non-finite or out-of-range number (NaN, Infinity, a share above 1) is read as "not known".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from data.errors import OilbirdError
from data.readfile import read_json as read_bounded_json
from data.results import Problem, read_result
from data.store.layout import (
    ABLATIONS_FILE,
    DECODE,
    NODES_DIR,
    SWEEPS,
    TRACES,
    census_pool,
    replay_name,
)
from data.store.storeset import current_fingerprint, read_store_meta  # a store, or a store set

# positions.parquet columns the pages use (docs/census.md); others are ignored.
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
    problems: list[Problem] = field(default_factory=list)  # summary.json against its schema (data/results.py)


@dataclass
class Arm:
    """One decoder arm: a live run (decode/<arm>/) or a replay (replay*/<arm>/[nodes-<N>/])."""

    name: str
    folder: Path
    summary: dict
    shares: dict[str, dict] = field(default_factory=dict)  # {"committed" | "draft": entry}: sole_source_shares
    kind: str = "live"  # "live" or "replay"
    pool: str = "past"  # the replay's pool ("past" or "warm"); live arms: "past"
    nodes: int | None = None  # node budget (summary.json `nodes`, else the nodes-<N> folder)
    problems: list[Problem] = field(default_factory=list)  # summary.json against its schema (data/results.py)

    @property
    def sole_source(self) -> dict | None:
        """The share the verdict reads: over committed tokens (the paper's definition), or None. Never the
        share over accepted draft tokens in its place: that one is always larger (it drops the bonus tokens
        from the denominator) and would move the verdict across its lines."""
        return self.shares.get("committed")


@dataclass
class Result:
    """Everything under runs/<bench>/<model>/ that a page shows."""

    bench: str  # folder name under runs/
    model: str  # folder name under runs/<bench>/
    folder: Path
    meta: dict | None  # traces/meta.json, None if absent
    censuses: list[Census] = field(default_factory=list)  # census/ first, then census-* by name
    arms: list[Arm] = field(default_factory=list)  # live decoder arms: ar first, then by name
    replay: list[Arm] = field(default_factory=list)  # replay, strictly-past pool: one arm each (the decision's)
    replay_nodes: dict[int, list[Arm]] = field(default_factory=dict)  # nodes -> arms, from replay/<arm>/nodes-<N>/
    replay_warm: list[Arm] = field(default_factory=list)  # replay-warm/, as replay
    replay_warm_nodes: dict[int, list[Arm]] = field(default_factory=dict)
    sweeps: dict[str, "Sweep"] = field(default_factory=dict)  # "index" / "budget", only those whose file exists
    ablations: "Ablations | None" = None  # ablations/ablations.json, None when the file does not exist
    vllm: dict | None = None  # vllm/summary.json (benchmarks/bench_vllm.py), None when absent or unreadable
    vllm_note: str | None = None  # set when vllm/summary.json exists but cannot be read: the page shows this line
    store_fingerprint: str | None = None  # the store's fingerprint now (None: no store); reports/freshness.py
    file_problems: list[Problem] = field(default_factory=list)  # ablations.json and vllm/summary.json's

    @property
    def problems(self) -> list[Problem]:
        """Every schema problem of every result file read for this result (data/results.py), in reading order."""
        holders = (*self.censuses, *self.arms, *self.replay, *(a for arms in self.replay_nodes.values() for a in arms),
                   *self.replay_warm, *(a for arms in self.replay_warm_nodes.values() for a in arms))
        unique = {id(h): h for h in holders}.values()  # an arm of several budgets is in replay and replay_nodes
        return [p for holder in unique for p in holder.problems] + self.file_problems

    @property
    def has_decoder(self) -> bool:
        return bool(self.arms or self.replay or self.replay_nodes or self.replay_warm or self.replay_warm_nodes)

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
                       *(a.summary for a in (self.arms + self.replay + self.replay_warm)[:1]),
                       *(s.meta for s in self.sweeps.values()), self.vllm):
            if source and isinstance(source.get("model"), str) and source["model"]:
                return source["model"]
        return self.model


def unreadable(path: Path, e: Exception) -> OilbirdError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return OilbirdError(f"cannot read {path}: {type(e).__name__}: {first}")


def read_json(path: Path) -> dict:
    """A small JSON object (traces/meta.json), read with data/readfile.py's bounds."""
    obj = read_bounded_json(path, "result file")
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


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _share_entry(raw, basis: str, source: str) -> dict | None:
    """{share, interval, sole, total, basis, definition, from} from a summary's share (a number or a dict)."""
    counts = raw if isinstance(raw, dict) else {}
    share = counts.get("value", counts.get("share")) if isinstance(raw, dict) else raw
    if not _finite(share):
        return None
    iv = counts.get("interval")
    total = counts.get("tokens") if "tokens" in counts else counts.get("accepted", counts.get("n"))
    return {"share": float(share),
            "interval": list(iv) if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(map(_finite, iv)) else None,
            "sole": counts.get("sole", counts.get("k")), "total": total, "basis": basis,
            "definition": counts.get("definition") if isinstance(counts.get("definition"), str) else None,
            "from": source}


def sole_source_shares(summary: dict, cycles_path: Path, replay: bool | None = None) -> dict[str, dict]:
    """The sole-source shares an arm reports, by denominator: {"committed": entry, "draft": entry} (either
    may be absent; {} for an arm without the semantic source).

    committed: accepted tokens only the semantic source proposed, over ALL committed tokens (bonus
    tokens included; the paper's definition). draft: the same tokens over accepted draft tokens.
    Read from summary.json when the decoder or the replay wrote them: `sole_source_share` is the
    committed one when it counts `tokens` or the summary is a replay's (`replay`; by default its `kind`
    says so); an older live summary's (a number, or {value | share, sole | k, accepted | n}) is the
    draft one, and `sole_source_share_of_draft` is the draft one. Otherwise both are counted from
    cycles.parquet (`sources`: one label per accepted node, the proposing sources joined by '|';
    `committed`: tokens per pass, if present), but only for an arm whose accepted tokens credit the
    semantic source at all (and a cycles.parquet without `sources` gives none).
    """
    out: dict[str, dict] = {}
    replay = summary.get("kind") == "replay" if replay is None else replay
    for key in ("sole_source_share", "semantic_sole_source_share"):
        raw = summary.get(key)
        committed = (isinstance(raw, dict) and "tokens" in raw) or (replay and key == "sole_source_share")
        entry = _share_entry(raw, "committed" if committed else "draft", "summary.json")
        if entry is not None:
            out[entry["basis"]] = entry
            break
    entry = _share_entry(summary.get("sole_source_share_of_draft"), "draft", "summary.json")
    if entry is not None:
        out["draft"] = entry
    if out or summary.get("kind") in ("replay", "live"):
        return out  # a summary from today's writers is the record: a share it lacks is not recounted elsewhere
    by_source = summary.get("accepted_by_source")
    if not isinstance(by_source, dict) or SEMANTIC_SOURCE not in by_source or not cycles_path.exists():
        return out
    try:
        names = pl.read_parquet_schema(cycles_path)
        if "sources" not in names:
            return out
        cycles = pl.read_parquet(cycles_path, columns=[c for c in ("sources", "committed") if c in names])
        labels = cycles["sources"].explode().drop_nulls()
        committed = int(cycles["committed"].sum()) if "committed" in cycles.columns else None
    except Exception as e:
        raise unreadable(cycles_path, e)
    accepted = int(labels.len())
    sole = int((labels == SEMANTIC_SOURCE).sum())
    for basis, total in (("draft", accepted), ("committed", committed)):
        if total:
            out[basis] = {"share": sole / total, "interval": None, "sole": sole, "total": total, "basis": basis,
                          "definition": None, "from": "cycles.parquet"}
    return out


def sole_source_share(summary: dict, cycles_path: Path) -> dict | None:
    """The share the verdict reads (over all committed tokens), or None: never the draft-token share instead."""
    return sole_source_shares(summary, cycles_path).get("committed")


def read_arm(folder: Path, kind: str, pool: str = "past", nodes: int | None = None) -> Arm:
    """The arm whose summary.json (and cycles.parquet) lie in `folder`, checked against its schema."""
    checked = read_result(folder / "summary.json", "replay" if kind == "replay" else "live")
    summary = checked.doc
    arm = summary.get("arm")
    name = str(arm) if isinstance(arm, (str, int)) and not isinstance(arm, bool) and str(arm) else None
    if name is None:
        name = folder.parent.name if nodes is not None else folder.name
    n = summary.get("nodes")
    nodes = int(n) if _finite(n) and float(n).is_integer() else nodes
    shares = sole_source_shares(summary, folder / "cycles.parquet", replay=kind == "replay" or None)
    return Arm(name, folder, summary, shares, kind, pool, nodes, checked.problems)


# ---------------------------------------------------------------- sweeps (python -m census sweep-*)

@dataclass
class Sweep:
    """One sweep file: its rows (validated, numbers finite or None) or, when unreadable, the note why."""

    kind: str  # "index" or "budget"
    path: Path
    meta: dict = field(default_factory=dict)  # the file's top-level scalars (bench, model, positions, ...)
    rows: list[dict] = field(default_factory=list)
    note: str | None = None  # set when the file could not be read: the page shows this one line instead
    bad_values: int = 0  # numbers read as unknown (NaN, Infinity, out of range, wrong type)
    dropped_rows: int = 0  # rows left out: not an object, or without their name (spec / budget)


SWEEP_FILES = {"index": "index.json", "budget": "budget.json"}
SWEEP_COMMANDS = {"index": "python -m census sweep-index", "budget": "python -m census sweep-budget"}
SHARE, POSITIVE, NONNEG = "share", "positive", "nonneg"
# per row: field -> the range a number must lie in (anything else reads as None)
SWEEP_FIELDS = {
    "index": {"bytes_per_state": POSITIVE, "gap_recall": SHARE, "gap_recall_ratio": NONNEG, "sem_hit_rate": SHARE,
              "knn_recall": SHARE, "warmup_share": SHARE, "seconds": NONNEG},
    "budget": {"budget_tokens": POSITIVE, "availability": SHARE, "producible": SHARE, "gap": SHARE,
               "gap_recall": SHARE, "sem_hit_rate": SHARE, "mean_pool_tokens": NONNEG},
}
SWEEP_LABEL = {"index": "spec", "budget": "budget"}  # the string naming a row
SWEEP_META = {"index": ("bench", "model", "positions", "gap_positions"), "budget": ("bench", "model")}


def _in_range(v, rule: str) -> bool:
    if not _finite(v):
        return False
    return {SHARE: 0 <= v <= 1, POSITIVE: v > 0, NONNEG: v >= 0}[rule]


def read_sweep(path: Path, kind: str) -> Sweep:
    """The sweep at `path` (which exists). Never raises for its content: an unreadable file gives a Sweep
    with `note` set (one line), a bad number gives None in its row (counted in `bad_values`), and a row
    that is not an object or lacks its name is dropped (counted in `dropped_rows`)."""
    sweep = Sweep(kind, path)
    try:  # bounded (data/readfile.py); NaN / Infinity (Python's json writes them) parse, then fail _in_range
        obj = read_bounded_json(path, "sweep file")
    except OilbirdError as e:
        why = str(e).replace(f"sweep file {path} ", "")
        sweep.note = f"{path.parent.name}/{path.name} could not be read ({why[3:] if why.startswith('is ') else why})"
        return sweep
    rows = obj.get("rows") if isinstance(obj, dict) else None
    if not isinstance(rows, list):
        what = "not a JSON object" if not isinstance(obj, dict) else "has no list of rows"
        sweep.note = f"{path.parent.name}/{path.name} could not be read ({what})"
        return sweep
    for key in SWEEP_META[kind]:
        v = obj.get(key)
        if isinstance(v, str) or (_finite(v) and v >= 0):
            sweep.meta[key] = v
        elif v is not None:
            sweep.bad_values += 1
    fields, label = SWEEP_FIELDS[kind], SWEEP_LABEL[kind]
    for raw in rows:
        name = raw.get(label) if isinstance(raw, dict) else None
        if not isinstance(name, str) or not name:
            sweep.dropped_rows += 1
            continue
        row = {label: name}
        for key, rule in fields.items():
            v = raw.get(key)
            ok = _in_range(v, rule)
            row[key] = float(v) if ok else None
            # a null budget_tokens is the unbounded pool; a null knn_recall is "not computed": neither is bad
            if not ok and not (v is None and key in ("budget_tokens", "knn_recall")):
                sweep.bad_values += 1
        if kind == "budget":
            row["unbounded"] = raw.get("budget_tokens") is None
        sweep.rows.append(row)
    if not sweep.rows:
        sweep.note = f"{path.parent.name}/{path.name} holds no usable rows"
    return sweep


def load_sweeps(folder: Path) -> dict[str, Sweep]:
    """The sweeps under runs/<bench>/<model>/sweeps/ whose file exists, by kind."""
    out = {}
    for kind, name in SWEEP_FILES.items():
        path = folder / SWEEPS / name
        if path.is_file():
            out[kind] = read_sweep(path, kind)
        elif path.exists():  # a folder, say
            out[kind] = Sweep(kind, path, note=f"sweeps/{name} is not a file")
    return out


ABLATIONS_COMMAND = "python -m decoder ablations"


@dataclass
class Ablations:
    """ablations/ablations.json (`python -m decoder ablations`): rows {label, arm, tau, tau_interval, vs_merged,
    vs_merged_interval, sole_source_share, exact, speedup}; a number that is not finite and in range reads as None,
    an interval that is not two finite numbers as None.

    Newer files add `headline` (the same rows for the baseline arms suffix, sam, lexical, recycling, pld, each with
    `oilbird_over_arm` and its paired `oilbird_over_arm_interval`), `best_lexical` ({arm, tau, oilbird_over_arm,
    oilbird_over_arm_interval}) and `target_met` (a bool); an older file without them reads as empty / None."""

    path: Path
    meta: dict = field(default_factory=dict)  # bench, model, pool, nodes, requests, seconds (those well formed)
    merged: dict | None = None
    ablations: list[dict] = field(default_factory=list)
    ladder: list[tuple[str, list[dict | None]]] = field(default_factory=list)  # (drafter, [base, +pool, +key, +key added])
    headline: list[dict] = field(default_factory=list)  # oilbird against each baseline arm (newer files)
    best_lexical: dict | None = None  # {arm, tau, oilbird_over_arm, oilbird_over_arm_interval} (newer files)
    target_met: bool | None = None  # the file's own verdict on the 1.25x target (newer files)
    missing: list[str] = field(default_factory=list)
    note: str | None = None  # set when the file could not be read: the page shows this one line instead
    bad_values: int = 0
    dropped_rows: int = 0
    problems: list[Problem] = field(default_factory=list)  # against its schema (data/results.py)


def _interval(v) -> list[float] | None:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_finite(x) for x in v) and v[0] <= v[1]:
        return [float(v[0]), float(v[1])]
    return None


RATIO_KEYS = ("vs_merged", "oilbird_over_arm")  # paired ratios a row may carry, each with `<key>_interval`


def _ablation_row(raw, abl: Ablations) -> dict | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("arm"), str) or not raw["arm"]:
        abl.dropped_rows += 1
        return None
    label = raw.get("label")
    row = {"arm": raw["arm"], "label": label if isinstance(label, str) and label else raw["arm"]}
    for key, rule in (("tau", POSITIVE), *((k, NONNEG) for k in RATIO_KEYS)):
        v = raw.get(key)
        row[key] = float(v) if _in_range(v, rule) else None
        if row[key] is None and v is not None:
            abl.bad_values += 1
        iv = raw.get(f"{key}_interval")
        row[f"{key}_interval"] = _interval(iv)
        if row[f"{key}_interval"] is None and iv is not None:
            abl.bad_values += 1
    v = raw.get("speedup")
    row["speedup"] = float(v) if _in_range(v, POSITIVE) else None
    if row["speedup"] is None and v is not None:
        abl.bad_values += 1
    row["exact"] = raw.get("exact") if isinstance(raw.get("exact"), bool) else None
    share = raw.get("sole_source_share")
    row["sole_source"] = _share_entry(share, "committed", "ablations.json") if share is not None else None
    if share is not None and row["sole_source"] is None:
        abl.bad_values += 1
    return row


def read_ablations(path: Path) -> Ablations:
    """The ablations at `path` (which exists). Never raises for its content: an unreadable or odd file gives
    `note` (one line)."""
    abl = Ablations(path)
    name = f"{path.parent.name}/{path.name}"
    try:  # bounded (data/readfile.py) and checked (data/results.py): a bad value is read as null, and said
        checked = read_result(path, "ablations")
    except OilbirdError as e:
        abl.note = f"{name} could not be read ({_why(e, path)})"
        return abl
    obj, abl.problems = checked.doc, checked.problems
    for key in ("bench", "model", "pool", "nodes", "requests", "seconds"):
        v = obj.get(key)
        if isinstance(v, str) or (_finite(v) and v >= 0):
            abl.meta[key] = v
    if obj.get("merged") is not None:
        abl.merged = _ablation_row(obj.get("merged"), abl)
    for key, into in (("ablations", abl.ablations), ("headline", abl.headline)):
        rows = obj.get(key)
        into += [row for row in (_ablation_row(raw, abl) for raw in (rows if isinstance(rows, list) else []))
                 if row is not None]
    ladder = obj.get("ladder")
    for raw in ladder if isinstance(ladder, list) else []:
        rungs = raw.get("rungs") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or not isinstance(raw.get("drafter"), str) or not isinstance(rungs, list):
            abl.dropped_rows += 1
            continue
        abl.ladder.append((raw["drafter"], [_ablation_row(r, abl) for r in rungs[:4]]))
    best = obj.get("best_lexical")
    if isinstance(best, dict) and isinstance(best.get("arm"), str) and best["arm"]:
        abl.best_lexical = _ablation_row(best, abl)
    elif best is not None:
        abl.bad_values += 1
    if isinstance(obj.get("target_met"), bool):
        abl.target_met = obj["target_met"]
    elif obj.get("target_met") is not None:
        abl.bad_values += 1
    missing = obj.get("missing")
    abl.missing = [m for m in missing if isinstance(m, str)] if isinstance(missing, list) else []
    if abl.merged is None and not abl.ablations and not abl.ladder and not abl.headline:
        abl.note = f"{name} holds no usable rows"
    return abl


def load_ablations(folder: Path) -> Ablations | None:
    path = folder / ABLATIONS_FILE
    if path.is_file():
        return read_ablations(path)
    if path.exists():
        return Ablations(path, note=f"{ABLATIONS_FILE} is not a file")
    return None


VLLM_FILE = "vllm/summary.json"


def _why(e: OilbirdError, path: Path) -> str:
    """An error about `path` without the path itself (the page names the file relative to the result)."""
    text = str(e)
    for prefix in (f"cannot read {path}: ", f"{path} "):
        text = text.replace(prefix, "")
    text = text.strip()
    return (text[3:] if text.startswith("is ") else text) or type(e).__name__


def load_vllm(folder: Path) -> tuple[dict | None, str | None, list[Problem]]:
    """(summary, None, problems) from vllm/summary.json, (None, note, []) when it exists but cannot be read (not
    JSON, not an object, no list of rows), (None, None, []) when there is none. Never raises for the file's
    content: a value against its schema (data/results.py) is read as null and listed in `problems`."""
    path = folder / VLLM_FILE
    if not path.exists():
        return None, None, []
    if not path.is_file():
        return None, f"{VLLM_FILE} is not a file", []
    try:
        checked = read_result(path, "vllm")
    except OilbirdError as e:
        return None, f"{VLLM_FILE} could not be read ({_why(e, path)})", []
    if not isinstance(checked.doc.get("rows"), list):
        return None, f"{VLLM_FILE} could not be read (has no list of rows)", []
    return checked.doc, None, checked.problems


DECISION_NODES = 60  # with several node budgets, the decision reads this one if replayed, else the largest


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def load_replay(folder: Path, pool: str) -> tuple[list[Arm], dict[int, list[Arm]]]:
    """(one arm per replayed arm, {nodes: arms}) of a replay folder (replay/ or replay-<pool>/).

    An arm folder holds summary.json (one node budget) or nodes-<N>/summary.json folders; for the
    first list an arm with several budgets is represented by nodes 60 if present, else its largest.
    """
    arms: list[Arm] = []
    by_nodes: dict[int, list[Arm]] = {}
    if not folder.is_dir():
        return arms, by_nodes
    for adir in _visible_dirs(folder):
        per_nodes: dict[int, Arm] = {}
        for ndir in _visible_dirs(adir):
            m = NODES_DIR.fullmatch(ndir.name)
            if m and (ndir / "summary.json").exists():
                arm = read_arm(ndir, "replay", pool, int(m.group(1)))
                per_nodes[int(m.group(1))] = arm
                by_nodes.setdefault(int(m.group(1)), []).append(arm)
        if (adir / "summary.json").exists():
            arms.append(read_arm(adir, "replay", pool))
        elif per_nodes:
            arms.append(per_nodes[DECISION_NODES if DECISION_NODES in per_nodes else max(per_nodes)])
    order = lambda a: (a.name != "ar", a.name)  # noqa: E731
    arms.sort(key=order)
    for n in by_nodes:
        by_nodes[n].sort(key=order)
    return arms, dict(sorted(by_nodes.items()))


def load_result(folder: Path) -> Result | None:
    """The census, decoder and replay results of runs/<bench>/<model>/, or None when it holds none."""
    meta_path = folder / TRACES / "meta.json"
    meta = None
    if meta_path.exists():
        try:
            meta = read_json(meta_path)
        except OilbirdError:
            meta = None  # only the tokenizer needs it; the page says token ids are shown instead
    elif (folder / TRACES).is_dir():  # a store set: a folder of stores (data/store/storeset.py), their common meta
        try:
            meta = read_store_meta(folder / TRACES)
        except OilbirdError:
            meta = None
    # a result whose recorded store_fingerprint differs from this one is stale (reports/freshness.py)
    now = current_fingerprint(folder / TRACES) if meta is not None else None
    result = Result(bench=folder.parent.name, model=folder.name, folder=folder, meta=meta, store_fingerprint=now)
    census_dirs = sorted((p for p in folder.iterdir()
                          if p.is_dir() and census_pool(p.name) is not None),
                         key=lambda p: (census_pool(p.name) != "past", p.name))  # census/ (strictly past) first
    for cdir in census_dirs:
        if not (cdir / "summary.json").exists():
            continue
        checked = read_result(cdir / "summary.json", "census")
        summary = checked.doc
        positions, missing = read_positions(cdir / "positions.parquet")
        pool = str(summary.get("pool") or census_pool(cdir.name))
        result.censuses.append(Census(cdir, pool, summary, positions, missing, checked.problems))
    decode = folder / DECODE
    if decode.is_dir():
        arm_dirs = sorted((p for p in decode.iterdir() if p.is_dir() and not p.name.startswith(".")
                           and (p / "summary.json").exists()), key=lambda p: (p.name != "ar", p.name))
        for adir in arm_dirs:
            result.arms.append(read_arm(adir, "live"))
    result.replay, result.replay_nodes = load_replay(folder / replay_name("past"), "past")
    result.replay_warm, result.replay_warm_nodes = load_replay(folder / replay_name("warm"), "warm")
    result.sweeps = load_sweeps(folder)
    result.ablations = load_ablations(folder)
    result.vllm, result.vllm_note, vllm_problems = load_vllm(folder)
    result.file_problems = (result.ablations.problems if result.ablations else []) + vllm_problems
    return (result if result.censuses or result.has_decoder or result.sweeps or result.ablations
            or result.vllm is not None or result.vllm_note else None)


def find_results(runs: Path) -> list[Result]:
    """Every runs/<bench>/<model>/ with a census, decoder, replay, sweep, ablations or vLLM bench result, sorted by
    (bench, model)."""
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
