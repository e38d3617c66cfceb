"""The census's outputs: read the trace store, run the census, write positions.parquet and summary.json.

`run_census` is what `python -m census` runs: the store of runs/<bench>/<model> (or `--store`: a store or
a store set, data/store/storeset.py) in, the census folder (data/store/layout.py `census_dir`) out, both
files written as one unit (`write_census`).
`format_summary` is the command's printed summary.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

from census.definitions import CensusConfig, CensusInput
from census.positions import census_run
from census.summary import summarize
from data.capture.models import pick_device
from data.capture.store_model import check_store_model  # the same check as replay's
from data.errors import OilbirdError
from data.results import check_written
from data.store.files import (
    atomic_write_json,
    atomic_write_table,
    clean_leftovers,
    fault_point,
    is_stale,
    make_tmp_dir,
)
from data.store.layout import census_dir, model_slug, store_dir
from data.store.meta import unsealed_note
from data.store.reader import TraceStore
from data.store.sampling import sampled_note, sampled_requests
from data.store.storeset import open_store_or_set, set_provenance


def load_embeddings(meta: dict) -> tuple[np.ndarray | None, str | None]:
    """The model's input embedding matrix, or (None, why not) when the model cannot be loaded here.
    A model that loads but is not the one the store was captured with is refused (one line)."""
    try:
        from data.capture.models import load_model

        lm = load_model(meta["model"], dtype="float32", device="cpu")
    except Exception as e:  # any failure to load only costs the static-embedding key
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"static-embedding key not computed: cannot load model '{meta.get('model')}' ({first})"
    if meta.get("model_fingerprint") and lm.fingerprint != meta["model_fingerprint"]:
        raise OilbirdError(f"model '{meta['model']}' loads with fingerprint {lm.fingerprint}, but the trace store was "
                           f"captured with {meta['model_fingerprint']}: the store's meta.json names the wrong model, "
                           "or the model changed since the capture; recapture with --force")
    if int(meta.get("d_model") or lm.d_model) != lm.d_model:
        raise OilbirdError(f"model '{meta['model']}' has d_model {lm.d_model}, the trace store {meta['d_model']}: "
                           "wrong model for this store")
    return lm.model.get_input_embeddings().weight.detach().float().cpu().numpy(), None


def write_census(target: Path, df: pl.DataFrame, summary: dict) -> None:
    """positions.parquet and summary.json as one unit: both are written into a fresh folder beside
    `target`, which then replaces it, so census/ holds the old pair or the new pair, never one of
    each. A kill leaves at most a dot-named leftover, removed by the next census."""
    check_written(summary, "census", str(target / "summary.json"))  # data/results.py: what the reports accept
    _restore_or_clean(target)
    tmp = make_tmp_dir(target)
    old = None
    try:
        atomic_write_table(tmp / "positions.parquet", df.to_arrow())
        fault_point("census_after_positions")
        atomic_write_json(tmp / "summary.json", summary)
        if target.exists():
            old = target.with_name(f".{target.name}.{os.getpid()}.x.old")
            target.rename(old)
        fault_point("census_mid_swap")
        tmp.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)  # put the previous census back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _restore_or_clean(target: Path) -> None:
    """Leftovers of a census killed while writing: a temporary folder (dropped), and the previous
    census moved aside for the swap (put back when nothing replaced it, else dropped)."""
    for aside in sorted(target.parent.glob(f".{target.name}.*.old")):
        if not target.exists() and aside.is_dir() and is_stale(aside):
            aside.rename(target)
    clean_leftovers(target.parent, f".{target.name}.*.tmp")
    clean_leftovers(target.parent, f".{target.name}.*.old")


UNVERIFIED_NOTE = ("computed on an unverified trace store (no checksums in its meta.json, as in a store written "
                   "before checksums existed), so its files could not be checked against what capture wrote")


def store_provenance(store: TraceStore) -> dict:
    """What a result records about the store it was computed on: `store_fingerprint` (what makes it
    stale when the store changes: data/store/reader.py `current_fingerprint`) and `store_verified` (false:
    a store without checksums; the result's notes and the reports say so), `store_sealed` (false: an unsealed
    meta.json, whose hand edits cannot be caught; the notes say so); for a store set, its fingerprint and
    `store_set` (members, order: data/store/storeset.py)."""
    return {"store_fingerprint": store.fingerprint, "store_verified": bool(store.verified),
            "store_sealed": bool(store.meta_sealed), **set_provenance(store)}


def open_input(bench: str, model: str, out: str | Path, store: str | Path | None = None,
               defer_hidden: bool = False) -> tuple[Path, TraceStore]:
    """The opened trace store of runs/<bench>/<model>, or `store` (a store or a store set: one stream,
    data/store/storeset.py); refused with one line when missing or damaged. defer_hidden: its states left
    in its files for the census's Ray shards to read (data/store/statefiles.py)."""
    slug = model_slug(model)
    path = Path(store) if store is not None else store_dir(out, bench, slug)
    if store is None and not (path / "meta.json").exists() and not path.is_dir():  # a folder may hold a set
        raise OilbirdError(f"no trace store for {bench} / {slug} at {path}: run `python -m data capture "
                           f"--bench {bench} --model {model} --out {out}` first (or `make census BENCH={bench}`)")
    opened = open_store_or_set(path, defer_hidden=defer_hidden)
    check_store_model(opened.meta, model, path)
    return path, opened


def read_input(bench: str, model: str, out: str | Path, store: str | Path | None = None) -> tuple[Path, dict, CensusInput]:
    """The trace store of runs/<bench>/<model> (or `store`, a store or set) as a census input: (store path, meta, input)."""
    path, store = open_input(bench, model, out, store)
    meta = dict(store.meta, n_requests=store.n_requests)  # counted from the rows, not taken from meta.json
    return path, meta, CensusInput.from_store(store).check()


def run_census(bench: str, model: str, cfg: CensusConfig, out: str | Path = "runs", *,
               embeddings: np.ndarray | None | str = "load", progress: bool = True,
               store: str | Path | None = None, ray: str | None = None,
               ray_shards: int | None = None) -> tuple[Path, dict]:
    """Read runs/<bench>/<model>/traces (or `store`: a store or a store set), write census/positions.parquet
    and summary.json as one unit. ray: census the per-position work on Ray (census/ray_census.py: auto,
    local:N or an address; ray_shards: how many shards, default 4 per CPU); the outputs are the same,
    only timing differs."""
    cfg.validate()
    runner = ray_target = None
    if ray is not None:  # refused before any work: a bad --ray, ray missing, an index a shard cannot rebuild
        from census.ray_census import RayParts, check_ray_config, import_ray, parse_ray

        ray_target = parse_ray(ray)
        import_ray()
        check_ray_config(cfg)
        if ray_shards is not None and ray_shards < 1:
            raise OilbirdError(f"--ray-shards must be >= 1 (got {ray_shards})")
        runner = RayParts(shards=ray_shards, progress=progress)
    slug = model_slug(model)
    target = census_dir(out, bench, slug, cfg.pool)
    if (store_dir(out, bench, slug) / "meta.json").exists():
        _restore_or_clean(target)  # leftovers of a census killed while writing
    t0 = time.perf_counter()
    path, opened = open_input(bench, model, out, store, defer_hidden=runner is not None)
    meta = dict(opened.meta, n_requests=opened.n_requests)  # counted from the rows, not taken from meta.json
    data = CensusInput.from_store(opened).check()
    provenance = store_provenance(opened)
    sampled = sampled_requests(opened.requests)  # the store's sampled requests, said in one line (docs/replay.md)
    del opened
    if sampled_note(sampled):
        print(f"note: {sampled_note(sampled)}", file=sys.stderr)
    t_read = time.perf_counter() - t0
    notes = [] if provenance["store_verified"] else [UNVERIFIED_NOTE]
    if not provenance["store_sealed"]:
        notes.append(unsealed_note(path, "computed"))
    if (provenance.get("store_set") or {}).get("note"):
        notes.append(provenance["store_set"]["note"])  # a set ordered store by store (data/store/storeset.py)
    if isinstance(embeddings, str):
        embeddings, why = load_embeddings(meta)
        if why:
            notes.append(why)
    t1 = time.perf_counter()
    parts: dict[str, float] = {}
    if runner is None:
        result = census_run(data, cfg, embeddings=embeddings, progress=progress, timings=parts)
    else:
        from census.ray_census import ray_session

        with ray_session(ray_target):
            result = census_run(data, cfg, embeddings=embeddings, progress=progress, timings=parts, runner=runner)
    df = result.positions
    t_census = time.perf_counter() - t1
    if result.index.get("note"):
        notes.append(result.index["note"])
    t2 = time.perf_counter()
    summary = summarize(df, cfg, meta=meta, notes=notes, emb_available=embeddings is not None)
    t_summary = time.perf_counter() - t2
    summary["store"] = str(path)
    summary.update(provenance)
    summary["sampled_requests"] = sampled
    summary["index"] = result.index
    summary["pool_bounds"] = result.pool
    summary["timing"] = {"read_s": round(t_read, 3), "census_s": round(t_census, 3), "summary_s": round(t_summary, 3),
                         "positions_per_s": round(len(df) / max(t_census, 1e-9), 1),
                         "parts_s": {k: round(v, 3) for k, v in parts.items()},
                         "device": str(pick_device(cfg.device)),
                         # this process's peak resident memory (KiB on Linux): the bench reads it per arm
                         "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)}
    if runner is not None:  # where the work ran; parts_s is then the workers' seconds summed
        summary["timing"]["ray"] = dict(runner.report, target=ray_target.text)
    write_census(target, df, summary)
    return target, summary


def format_summary(s: dict) -> str:
    def pct(p):
        if p is None or p.get("value") is None:
            return "n/a"
        w = p.get("wilson") or [None, None]
        b = p.get("bootstrap") or [None, None]
        txt = f"{100 * p['value']:.2f}% (n={p['n']})"
        if w[0] is not None:
            txt += f"  wilson {100 * w[0]:.2f}-{100 * w[1]:.2f}"
        if b and b[0] is not None:
            txt += f"  bootstrap {100 * b[0]:.2f}-{100 * b[1]:.2f}"
        return txt

    m = s["mechanism"]
    lines = [
        f"census {s['bench']} / {s['model']} (layer {s['layer']}, pool {s['pool']}): "
        f"{s['positions']} positions, {s['requests']} requests",
        f"  available   {pct(s['available'])}",
        f"  producible  {pct(s['producible'])}",
        f"  gap         {pct(s['gap'])}",
        f"  recall      {pct(s['recall'])}  (semantic key over gap positions)",
        f"  recall emb  {pct(m['recall_static_embedding'])}",
        f"  recall adj  {pct(m['recall_adjacency'])}",
        f"  blind lexical {pct(m['blind_lexical'])}; with semantic {pct(m['blind_with_semantic'])}",
    ]
    ix, pb = s.get("index") or {}, s.get("pool_bounds") or {}
    if ix and ix.get("spec") != "exact":
        def share(v):
            return "n/a" if v is None else f"{100 * v:.1f}%"
        lines.append(f"  index {ix['spec']}: {ix.get('bytes_per_state')} bytes/state, knn recall@C "
                     f"{share(ix.get('knn_recall'))}, gap recall {share(ix.get('gap_recall_index'))} vs exact "
                     f"{share(ix.get('gap_recall_exact'))} (n={ix.get('gap_sample')})")
    if pb.get("budget_tokens") is not None:
        lines.append(f"  store budget {pb['store_budget']} = {pb['budget_tokens']} tokens; "
                     f"mean pool {pb['mean_pool_tokens']:.0f} tokens")
    if (pb.get("tenants") or 1) > 1:
        lines.append(f"  tenants {pb['tenants']} (each censused against its own traces only)")
    if isinstance(s.get("store_set"), dict):
        lines.append(f"  store set of {s['store_set'].get('members')} stores, fingerprint {s.get('store_fingerprint')}")
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    return "\n".join(lines)
