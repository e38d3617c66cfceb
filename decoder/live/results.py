"""What the live decoder writes and prints for each arm: its run (`ArmRun`), tokens per second and the speedups
over the rounds (`speed_summary`), summary.json (`summarize`), cycles.parquet and requests.parquet, the folder
swapped in whole (`write_folder`, which replay writes its folders with too), and the table a run prints
(`format_table`). Split from harness.py, which serves the arms and imports these back; the fields are
documented in harness.py's docstring."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data.index.stateindex import DEFAULT_INDEX
from data.stats import RequestBootstrap
from data.store.files import atomic_write_json, atomic_write_table
from data.store.schema import prompt_hash
from decoder.loop import Cycle, Generation
from decoder.pools import index_summary
from decoder.verify.audit import lossless_audit
from decoder.verify.passes import SEMANTIC_SOURCE, pass_statistics
from decoder.verify.reference import REFERENCE_ARM, STATIC_ARM

@dataclass
class ArmRun:
    name: str
    generations: list[Generation]
    pool_s: list[float]  # pool time per request: the window's evictions and add_trace
    warm_s: float = 0.0
    drafter_stats: dict | None = None  # the drafters' own counters (`Drafter.counters`), e.g. the semantic key's
    pools: dict | None = None  # TenantPools.summary (drafter arms): tenants, budget, the largest pool
    verifier: dict | None = None  # how the arm verified: {kind, overlap, ...} (graph: GraphVerifier.describe)


def tokens_per_s(run: ArmRun) -> float:
    """Generated tokens over the wall time of serving them: prefill, passes and pool insertion."""
    seconds = sum(g.seconds for g in run.generations) + sum(run.pool_s)
    return sum(len(g.tokens) for g in run.generations) / seconds if seconds > 0 else 0.0


def median_range(values: list[float]) -> tuple[float, list[float]]:
    """The median of one value per round and its [min, max]."""
    return float(statistics.median(values)), [float(min(values)), float(max(values))]


def speed_summary(arm_rounds: list[float], ar_rounds: list[float] | None,
                  static_rounds: list[float] | None = None) -> dict:
    """tokens/s and the speedups of an arm over its rounds (one value per round, in round order).

    A round's speedup is the arm's tokens/s over `ar`'s of the same round; its speedup_vs_fastest_ar, over the
    faster of `ar` and `ar-static` in that round (`ar` alone when ar-static did not run). Each figure is the
    median over the rounds, with `_rounds` (every round) and `_range` ([min, max]) beside it."""
    tok, tok_range = median_range(arm_rounds)
    out = {"tokens_per_s": tok, "tokens_per_s_rounds": [float(x) for x in arm_rounds], "tokens_per_s_range": tok_range}
    if not ar_rounds or not all(ar_rounds):
        return {**out, "speedup": None, "speedup_rounds": None, "speedup_range": None, "ar_tokens_per_s": None,
                "ar_tokens_per_s_rounds": None, "speedup_vs_fastest_ar": None, "speedup_vs_fastest_ar_rounds": None,
                "speedup_vs_fastest_ar_range": None, "fastest_ar_rounds": None, "ar_static_tokens_per_s": None}
    static = list(static_rounds) if static_rounds else [0.0] * len(ar_rounds)
    fastest = [max(a, st) for a, st in zip(ar_rounds, static)]
    speedups = [x / a for x, a in zip(arm_rounds, ar_rounds)]
    vs_fastest = [x / f for x, f in zip(arm_rounds, fastest)]
    out["speedup"], out["speedup_range"] = median_range(speedups)
    out["speedup_rounds"] = speedups
    out["ar_tokens_per_s"], _ = median_range(ar_rounds)
    out["ar_tokens_per_s_rounds"] = [float(x) for x in ar_rounds]
    out["speedup_vs_fastest_ar"], out["speedup_vs_fastest_ar_range"] = median_range(vs_fastest)
    out["speedup_vs_fastest_ar_rounds"] = vs_fastest
    out["fastest_ar_rounds"] = [STATIC_ARM if st > a else REFERENCE_ARM for a, st in zip(ar_rounds, static)]
    out["ar_static_tokens_per_s"] = median_range(static_rounds)[0] if static_rounds else None
    return out


def summarize(run: ArmRun, reference: ArmRun | None, request_ids: list[str], base: dict,
              bootstrap: int = 2000, seed: int = 0, speed: dict | None = None) -> dict:
    """One arm's summary.json from one round's run (`run`, audited against `reference`); `speed` carries the
    tokens/s and speedups over every round (speed_summary), by default those of `run` alone."""
    gens = run.generations
    cycles = [c for g in gens for c in g.cycles]
    draft_s = sum(c.draft_s for c in cycles)
    verify_s = sum(c.verify_s for c in cycles)
    update_s = sum(c.update_s for c in cycles)
    beside_s = sum(c.beside_s for c in cycles)
    overlapped = bool((run.verifier or {}).get("overlap"))
    # the drafter's work on the critical path: drafting and the observation the next propose reads, and the
    # deferred bookkeeping too where it did not run beside the verify (decoder/loop.py)
    critical_s = draft_s + update_s + (0.0 if overlapped else beside_s)
    cycle_s = draft_s + verify_s + update_s + (0.0 if overlapped else beside_s)
    stats = run.drafter_stats or {}
    has_key = any(SEMANTIC_SOURCE in c.node_sources for c in cycles) or bool(stats.get("semantic_key"))
    boot = RequestBootstrap(len(gens), bootstrap, seed) if bootstrap > 0 else None
    passes = pass_statistics([g.cycles for g in gens], has_key, boot)
    retrieval_s = stats.get("semantic_time_s", 0.0) + stats.get("rollout_time_s", 0.0)
    if speed is None:
        speed = speed_summary([tokens_per_s(run)], [tokens_per_s(reference)] if reference is not None else None)
    stops: dict[str, int] = {}
    for g in gens:
        stops[g.stop_reason] = stops.get(g.stop_reason, 0) + 1
    return {
        **base,
        "kind": "live",
        "arm": run.name,
        "requests": len(gens),
        **passes,
        "tau": passes["tau"] or 0.0,
        "seconds": sum(g.seconds for g in gens) + sum(run.pool_s),
        **speed,
        "time": {"prefill_s": sum(g.prefill_s for g in gens), "draft_s": draft_s, "verify_s": verify_s,
                 "update_s": update_s, "beside_s": beside_s, "pool_s": sum(run.pool_s), "warm_pool_s": run.warm_s},
        "drafting": {"overlapped": overlapped, "critical_path_s": critical_s,
                     "beside_verify_s": beside_s if overlapped else 0.0,
                     "definition": "critical_path_s: propose + the observation the next propose reads (+ the "
                                   "previous pass's deferred bookkeeping, where the verifier does not overlap); "
                                   "beside_verify_s: that bookkeeping, run while the verify ran"},
        "draft_fraction": draft_s / cycle_s if cycle_s else 0.0,
        "update_fraction": update_s / cycle_s if cycle_s else 0.0,
        "overhead_fraction": critical_s / cycle_s if cycle_s else 0.0,
        "semantic_time_s": stats.get("semantic_time_s") if stats else None,
        "retrieval_fraction": retrieval_s / cycle_s if stats and cycle_s else None,
        "store_bytes_per_token": stats.get("store_bytes_per_token") if stats else None,
        "drafter_stats": stats or None,
        **index_summary(stats, base.get("index", DEFAULT_INDEX)),
        **(run.pools or {"tenants": None, "store_budget_tokens": base.get("store_budget_tokens"),
                         "max_pool_tokens": None, "pool_evictions": None, "evicted_traces": None}),
        "stop_reasons": stops,
        "lossless": (lossless_audit(run.generations, reference.generations, request_ids, base["dtype"], REFERENCE_ARM)
                     if reference is not None else None),
    }


def cycles_table(per_request: list[list[Cycle]]) -> pa.Table:
    """One row per verification pass (live and replay alike)."""
    rows = [(r, p, c) for r, cycles in enumerate(per_request) for p, c in enumerate(cycles)]
    return pa.table({
        "request": pa.array([r for r, _, _ in rows], pa.int32()),
        "pass": pa.array([p for _, p, _ in rows], pa.int32()),
        "nodes": pa.array([c.nodes for _, _, c in rows], pa.int32()),
        "accepted": pa.array([c.accepted for _, _, c in rows], pa.int32()),
        "committed": pa.array([c.committed for _, _, c in rows], pa.int32()),
        "sources": pa.array([c.sources for _, _, c in rows], pa.list_(pa.string())),
        "draft_s": pa.array([c.draft_s for _, _, c in rows], pa.float64()),
        "verify_s": pa.array([c.verify_s for _, _, c in rows], pa.float64()),
        "update_s": pa.array([c.update_s for _, _, c in rows], pa.float64()),
        "beside_s": pa.array([c.beside_s for _, _, c in rows], pa.float64()),
    })


def requests_table(run: ArmRun, requests, prompts: list[list[int]]) -> pa.Table:
    gens = run.generations
    return pa.table({
        "request": pa.array(range(len(gens)), pa.int32()),
        "id": pa.array([r.id for r in requests], pa.string()),
        "group": pa.array([r.group for r in requests], pa.string()),
        "prompt_hash": pa.array([prompt_hash(p) for p in prompts], pa.string()),
        "output_tokens": pa.array([g.tokens for g in gens], pa.list_(pa.int32())),
        "stop_reason": pa.array([g.stop_reason for g in gens], pa.string()),
        "seconds": pa.array([g.seconds for g in gens], pa.float64()),
        "prefill_s": pa.array([g.prefill_s for g in gens], pa.float64()),
        "pool_s": pa.array(run.pool_s, pa.float64()),
        "passes": pa.array([len(g.cycles) for g in gens], pa.int32()),
    })


def write_folder(folder: Path, files: dict[str, dict | pa.Table]) -> None:
    """Write `files` ({relative path: JSON object or table}) into a fresh folder beside `folder`, then
    swap it in: a reader sees the old folder or the new one, never half of each."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        for rel, obj in files.items():
            if isinstance(obj, pa.Table):
                atomic_write_table(tmp / rel, obj)
            else:
                atomic_write_json(tmp / rel, obj)
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def with_range(s: dict, key: str, digits: int = 2, suffix: str = "") -> str:
    """`s[key]` (a median over rounds) and, with more than one round, its [min-max]: "1.84x [1.71-1.90]"."""
    value, rng = s.get(key), s.get(f"{key}_range")
    if value is None:
        return "-"
    text = f"{value:.{digits}f}{suffix}"
    if rng and len(s.get(f"{key}_rounds") or ()) > 1:
        text += f" [{rng[0]:.{digits}f}-{rng[1]:.{digits}f}]"
    return text


def format_table(summaries: dict[str, dict]) -> str:
    """tau, tokens/s, speedup over ar and over the faster of ar and ar-static, overhead and the audit per arm,
    as printed at the end of a run; with --rounds R the speed figures are medians over the rounds [min-max]."""
    width = max([12, *(len(n) + 1 for n in summaries)])
    cols = [(with_range(s, "tokens_per_s", 1), with_range(s, "speedup", 2, "x"),
             with_range(s, "speedup_vs_fastest_ar", 2, "x")) for s in summaries.values()]
    w = [max([len(h), *(len(c[i]) for c in cols)]) for i, h in enumerate(("tok/s", "speedup", "vs fastest ar"))]
    lines = [f"{'arm':<{width}} {'tau':>6} {'tok/s':>{w[0]}} {'speedup':>{w[1]}} {'vs fastest ar':>{w[2]}} "
             f"{'overhead':>9} {'sole':>6} {'lossless':>10}"]
    for (name, s), (tok, speedup, fastest) in zip(summaries.items(), cols):
        audit = s["lossless"]
        share = s.get("sole_source_share")
        sole = f"{100 * share['value']:>5.1f}%" if share and share["value"] is not None else f"{'-':>6}"
        lines.append(f"{name:<{width}} {s['tau']:>6.2f} {tok:>{w[0]}} {speedup:>{w[1]}} {fastest:>{w[2]}} "
                     f"{100 * s['overhead_fraction']:>8.1f}% {sole} "
                     f"{audit['matched']:>4}/{audit['requests']:<5}")
    first = next(iter(summaries.values()), {})
    if (first.get("rounds") or 1) > 1:
        lines.append(f"tok/s and speedups: median over {first['rounds']} rounds [min-max], each round's arm over "
                     "that round's ar (vs fastest ar: over the faster of ar and ar-static)")
    lines += [f"warning: {name} decoded differently in round(s) "
              f"{', '.join(str(m['round']) for m in s['round_mismatches'])} than in round 1"
              for name, s in summaries.items() if s.get("round_mismatches")]
    return "\n".join(lines)

