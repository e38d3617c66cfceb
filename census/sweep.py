"""Sweeps over one trace store, written to runs/<bench>/<model>/sweeps/ (beside census/, never in it:
run_census swaps census/ whole).

sweep-index   the semantic key under several --index specs. The lexical part (which positions are
              gaps) does not depend on the index: it is computed once; then only the semantic key
              runs per spec, the exact key first (the reference of every ratio and recall).
              Per spec: bytes per state, gap recall (share of gap positions whose target the key
              has among its candidates), its ratio to the exact key's, the sem hit rate over all
              positions, recall@candidates of the key's neighbours against the exact ones on a
              seeded sample of positions, the share of queries answered during the warm-up, and
              the seconds its pass took. A missing query state counts as a miss.
sweep-budget  the whole census under several --store-budget values (`all`: unbounded):
              availability, producible, gap, gap recall, sem hit rate and the mean pool size.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from census.definitions import CensusConfig, build_entries, entry_valid
from census.keys import IndexedKey, SemanticKey, combined_describe
from census.knn import set_exact_matmul
from census.output import read_input
from census.pool import LexicalPool, Part, prepare
from census.positions import census_run
from census.recall import knn_recall
from data.capture.models import pick_device
from data.errors import OilbirdError
from data.index.budget import bytes_per_token, check_budget, parse_budget
from data.index.stateindex import check_trainable, parse_index_spec
from data.index.stateindex import (
    split_specs as stateindex_split,  # one definition of a spec list
)
from data.store.files import atomic_write_json, clean_leftovers
from data.store.layout import model_slug, sweeps_dir


def split_specs(texts: list[str] | str) -> list[str]:
    """The specs of one or more --index values (data/index/stateindex.py's split_specs: ';' separates,
    commas join what can follow, so opq64,pq64 is one spec and sq8,pq64 two)."""
    specs = [sp for text in ([texts] if isinstance(texts, str) else texts) for sp in stateindex_split(text)]
    if not specs:
        raise OilbirdError("--index names no spec; e.g. --index exact,sq8,pq64")
    return specs


def lexical_gaps(part: Part, cfg: CensusConfig, progress: bool) -> np.ndarray:
    """gap at every row of the part (the census's lexical pass alone)."""
    data = part.data
    off = data.offsets
    outputs = [data.tokens[off[r]:off[r + 1]] for r in range(data.n_requests)]
    lex = LexicalPool(cfg.pool, cfg.count_len, list(data.prompt_hash), outputs)
    gap = np.zeros(data.n_positions, bool)
    for r in tqdm(range(data.n_requests), desc="lexical", unit="req", disable=not progress, leave=False):
        if len(outputs[r]):
            lx = lex.view(r, part.plan.at(r)).lexical_pass(
                data.prompts[r], outputs[r], horizon=cfg.horizon, min_suffix=cfg.min_suffix,
                max_suffix=cfg.max_suffix, candidates=cfg.candidates)
            gap[off[r]:off[r + 1]] = lx.available & ~lx.producible
        lex.finish_request(r)
    return gap


def semantic_pass(part: Part, ent, key, k: int, sample: np.ndarray, progress: bool, desc: str):
    """The semantic key alone over one part: (hit per row, -1 where the query state is missing;
    the key's top-k ids at the sample rows)."""
    data = part.data
    off = data.offsets
    hit = np.full(data.n_positions, -1, np.int8)
    ids = np.full((len(sample), k), -1, np.int64)
    for r in tqdm(range(data.n_requests), desc=desc, unit="req", disable=not progress, leave=False):
        a, n = int(off[r]), int(off[r + 1] - off[r])
        if n:
            pool = part.plan.at(r)
            idx, _, ok = key.topk(a, n, pool.hi, pool.excluded, k, pool.lo)
            nxt = np.where(idx >= 0, ent.next[np.maximum(idx, 0)], -1)
            hit[a:a + n] = np.where(ok, (nxt == data.tokens[a:a + n, None]).any(axis=1), -1)
            i, j = np.searchsorted(sample, [a, a + n])
            ids[i:j] = idx[sample[i:j] - a]
        key.finish(a, n)
    return hit, ids


def parse_sweep_specs(specs: list[str], data, bounded: bool) -> list:
    """The parsed specs, each checked against the store (trainable; evictable under a budget)."""
    parsed = [parse_index_spec(s, data.d_model) for s in specs]
    n_valid = int(entry_valid(data).sum())
    for sp in parsed:
        if not sp.exact:
            check_trainable(sp, n_valid)
            if bounded and not sp.evictable:
                raise OilbirdError(f"index {sp.text} cannot evict (faiss HNSW has no removal): no --store-budget")
    return parsed


def spec_row(sp, parts: list[Part], keys: list, hit: np.ndarray, ids: np.ndarray, secs: float, gap: np.ndarray,
             exact_hit: np.ndarray, exact_ids: np.ndarray) -> dict:
    """One spec's row of sweeps/index.json, against the exact key's hits and ids."""
    N = len(hit)
    exact_gap = float((exact_hit[gap] == 1).mean()) if gap.any() else None
    desc = combined_describe(keys)
    g = float((hit[gap] == 1).mean()) if gap.any() else None
    # the same ratio over the gap positions the trained index answered (the warm-up's exact answers left out)
    after = np.ones(N, bool)
    if not sp.exact:
        after[:] = False
        for part, key in zip([p for p in parts if p.data.n_positions], keys):
            if key.trained_at is not None:
                after[part.rows[key.trained_at:]] = True
    ga = gap & after
    g_after = float((hit[ga] == 1).mean()) if ga.any() else None
    e_after = float((exact_hit[ga] == 1).mean()) if ga.any() else None
    return {
        "spec": sp.text,
        "bytes_per_state": desc["bytes_per_state"],
        "gap_recall": g,
        "gap_recall_ratio": g / exact_gap if g is not None and exact_gap else None,
        "sem_hit_rate": float((hit == 1).mean()),
        "knn_recall": 1.0 if sp.exact else knn_recall(ids, exact_ids)[0],
        "warmup_share": desc["warmup_queries"] / desc["queries"] if desc["queries"] else 0.0,
        "trained_gap_positions": int(ga.sum()),
        "gap_recall_trained": g_after,
        "gap_recall_ratio_trained": g_after / e_after if g_after is not None and e_after else None,
        "seconds": round(secs, 3),
    }


def sweep_index(bench: str, model: str, specs: list[str], cfg: CensusConfig, out: str | Path = "runs",
                progress: bool = True) -> dict:
    """The index sweep (module docstring); writes sweeps/index.json and returns its content."""
    cfg = replace(cfg, index="exact").validate()
    budget = parse_budget(cfg.store_budget)
    if budget is not None and budget.tokens is None:
        raise OilbirdError(f"sweep-index takes --store-budget in tokens (a budget of {budget.text} would hold "
                           "a different number of tokens under every index)")
    _, meta, data = read_input(bench, model, out)
    parsed = parse_sweep_specs(specs, data, budget is not None)  # every bad spec fails before any work
    setup = prepare(data, cfg)
    dev = pick_device(cfg.device)
    set_exact_matmul()
    N, C = data.n_positions, cfg.candidates

    t0 = time.perf_counter()
    gap = np.zeros(N, bool)
    for part in setup.parts:
        gap[part.rows] = lexical_gaps(part, cfg, progress)
    lexical_s = time.perf_counter() - t0
    rng = np.random.default_rng(cfg.seed)
    valid = np.nonzero(entry_valid(data))[0]
    sample = np.sort(rng.choice(valid, min(len(valid), cfg.recall_sample), replace=False))
    ents = [build_entries(part.data) for part in setup.parts]

    def run(make, desc):
        t = time.perf_counter()
        hit = np.full(N, -1, np.int8)
        ids = np.full((len(sample), C), -1, np.int64)
        keys = []
        for part, ent in zip(setup.parts, ents):
            if not part.data.n_positions:  # a tenant with no generated token
                continue
            key = make(ent)
            local = np.nonzero(np.isin(part.rows, sample))[0]
            h, i = semantic_pass(part, ent, key, C, local, progress, desc)
            hit[part.rows] = h
            ids[np.searchsorted(sample, part.rows[local])] = i
            keys.append(key)
        return hit, ids, keys, time.perf_counter() - t

    exact_hit, exact_ids, exact_keys, exact_s = run(lambda ent: SemanticKey(ent, dev), "exact")
    rows = []
    for sp in tqdm(parsed, desc="specs", unit="spec", disable=not progress or len(parsed) < 2, leave=False):
        if sp.exact:
            hit, ids, keys, secs = exact_hit, exact_ids, exact_keys, exact_s
        else:
            hit, ids, keys, secs = run(lambda ent: IndexedKey(ent, sp, cfg.index_train, cfg.pool == "warm"), sp.text)
        rows.append(spec_row(sp, setup.parts, keys, hit, ids, secs, gap, exact_hit, exact_ids))
    result = {"bench": bench, "model": meta.get("model", model), "positions": N, "gap_positions": int(gap.sum()),
              "pool": cfg.pool, "store_budget": cfg.store_budget, "candidates": C,
              "recall_sample": int(len(sample)), "lexical_s": round(lexical_s, 3), "rows": rows}
    target = sweeps_dir(out, bench, model_slug(model))
    clean_leftovers(target)  # temporary files of a killed earlier sweep
    atomic_write_json(target / "index.json", result)
    return result


def sweep_budget(bench: str, model: str, budgets: list[str], cfg: CensusConfig, out: str | Path = "runs",
                 progress: bool = True) -> dict:
    """The budget sweep (module docstring); writes sweeps/budget.json and returns its content."""
    cfg = replace(cfg, store_budget=None, bootstrap=0).validate()
    if cfg.pool != "past":
        raise OilbirdError("sweep-budget bounds the past pool: use --pool past")
    _, meta, data = read_input(bench, model, out)
    spec = parse_index_spec(cfg.index, data.d_model)
    lengths = np.diff(data.offsets)
    for b in budgets:  # every bad budget fails before any work
        parsed = parse_budget(b)
        if parsed is not None:
            check_budget(parsed.in_tokens(bytes_per_token(spec, data.d_model)), lengths)
    rows = []
    for b in budgets:
        t = time.perf_counter()
        res = census_run(data, replace(cfg, store_budget=None if parse_budget(b) is None else b), progress=progress)
        df = res.positions
        flag = lambda c: df[c].fill_null(False).to_numpy().astype(bool)  # noqa: E731
        gap, sem = flag("gap"), flag("sem_hit")
        rows.append({
            "budget": b, "budget_tokens": res.pool["budget_tokens"],
            "availability": float(flag("available").mean()), "producible": float(flag("producible").mean()),
            "gap": float(gap.mean()), "gap_recall": float(sem[gap].mean()) if gap.any() else None,
            "sem_hit_rate": float(sem.mean()), "mean_pool_tokens": res.pool["mean_pool_tokens"],
            "seconds": round(time.perf_counter() - t, 3),
        })
    result = {"bench": bench, "model": meta.get("model", model), "positions": data.n_positions,
              "index": spec.text, "rows": rows}
    target = sweeps_dir(out, bench, model_slug(model))
    clean_leftovers(target)
    atomic_write_json(target / "budget.json", result)
    return result


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def format_index_sweep(s: dict) -> str:
    head = (f"{'spec':<24} {'bytes/state':>11} {'gap recall':>10} {'vs exact':>8} {'sem hit':>8} "
            f"{'knn@' + str(s['candidates']):>7} {'warm-up':>8} {'seconds':>8}")
    lines = [f"index sweep {s['bench']} / {s['model']}: {s['positions']} positions, {s['gap_positions']} gap "
             f"positions (pool {s['pool']}, lexical part {s['lexical_s']:.1f} s once)", head, "-" * len(head)]
    for r in s["rows"]:
        bps = "n/a" if r["bytes_per_state"] is None else f"{r['bytes_per_state']:.1f}"
        ratio = "n/a" if r["gap_recall_ratio"] is None else f"{r['gap_recall_ratio']:.3f}"
        knn = "n/a" if r["knn_recall"] is None else f"{r['knn_recall']:.3f}"
        lines.append(f"{r['spec']:<24} {bps:>11} {_pct(r['gap_recall']):>10} {ratio:>8} {_pct(r['sem_hit_rate']):>8} "
                     f"{knn:>7} {_pct(r['warmup_share']):>8} {r['seconds']:>8.1f}")
    return "\n".join(lines)


def format_budget_sweep(s: dict) -> str:
    head = (f"{'budget':<10} {'tokens':>10} {'avail.':>7} {'produc.':>7} {'gap':>6} {'gap recall':>10} "
            f"{'sem hit':>8} {'pool tokens':>11}")
    lines = [f"budget sweep {s['bench']} / {s['model']}: {s['positions']} positions, index {s['index']}",
             head, "-" * len(head)]
    for r in s["rows"]:
        tok = "all" if r["budget_tokens"] is None else str(r["budget_tokens"])
        lines.append(f"{r['budget']:<10} {tok:>10} {_pct(r['availability']):>7} {_pct(r['producible']):>7} "
                     f"{_pct(r['gap']):>6} {_pct(r['gap_recall']):>10} {_pct(r['sem_hit_rate']):>8} "
                     f"{r['mean_pool_tokens']:>11.0f}")
    return "\n".join(lines)
