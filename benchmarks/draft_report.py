"""`make bench-draft`'s figures: time distributions in ms, and the printed tables (the rows, the whole-store
rounds, the targets)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from draft_rounds import BEFORE_ARM, INLINE_ARM

from decoder.policy import OFF_ARM, ON_ARM


def ms_distribution(seconds: Sequence[float]) -> dict:
    """median, p99, mean (and count) in milliseconds."""
    v = 1e3 * np.asarray(seconds, np.float64)
    if not len(v):
        return {"median": None, "p99": None, "mean": None, "count": 0}
    return {"median": round(float(np.median(v)), 5), "p99": round(float(np.percentile(v, 99)), 5),
            "mean": round(float(v.mean()), 5), "count": int(len(v))}


def verdict(holds) -> str:
    return "n/a" if holds is None else ("PASS" if holds else "FAIL")


def ms_text(d: dict | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:.3f}"


def format_table(rows: Sequence[dict]) -> str:
    head = ("arm", "pool states", "index", "tau", "draft ms med", "p99", "mean", "query ms med", "p99", "recall",
            "warm s", "serve s")
    lines = []
    for r in rows:
        if r.get("absent"):
            lines.append((r["arm"], "-", "-", "absent", "", "", "", "", "", "", "", ""))
            continue
        rec = r.get("recall_vs_exact")
        lines.append((r["arm"], f"{r['pool_states']:,}", r.get("index") or "-",
                      "-" if r.get("tau") is None else f"{r['tau']:.2f}",
                      ms_text(r["draft_ms_per_pass"], "median"), ms_text(r["draft_ms_per_pass"], "p99"),
                      ms_text(r["draft_ms_per_pass"], "mean"), ms_text(r.get("query_ms"), "median"),
                      ms_text(r.get("query_ms"), "p99"), "-" if rec is None else f"{rec:.3f}",
                      f"{r['warm_s']:.1f}", f"{r['serve_s']:.1f}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i < 3 else str(c).rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def format_whole(block: dict) -> str:
    """The whole-store rounds, one line per arm: tau, drafting per pass (median over rounds [range])."""
    lines = [f"whole store ({block['requests']} requests, {block['rounds']} rounds, arms interleaved):"]
    for arm, a in block["arms"].items():
        m, d = a["draft_ms_per_pass"]["mean"], a["draft_ms_per_pass"]["median"]
        lines.append(f"  {arm:36} tau {a['tau']:.4f}  draft ms/pass mean {m['median']:.3f} [{m['min']:.3f}-"
                     f"{m['max']:.3f}]  median {d['median']:.3f}  key queries {a['key_queries']}")
    if "draft_ratio" in block:
        r = block["draft_ratio"]
        lines.append(f"  drafting {ON_ARM} / {OFF_ARM}: x{r['mean']['median']:.2f} by mean, x{r['median']['median']:.2f}"
                     " by median")
    if "draft_ratio_inline" in block:
        r = block["draft_ratio_inline"]
        lines.append(f"  drafting {INLINE_ARM} / {OFF_ARM}: x{r['mean']['median']:.2f} by mean, "
                     f"x{r['median']['median']:.2f} by median (the query inline, one core)")
    if block.get("torch_threads") is not None:
        worker = block.get("worker_ms_per_query")
        overlap = "on" if block.get("key_overlap") else "off"
        lines.append(f"  torch threads {block['torch_threads']}; key overlap {overlap}"
                     + (f"; the worker answered in {worker:.3f} ms a query" if worker else ""))
    if "draft_speedup_vs_before" in block:
        lines.append(f"  drafting {BEFORE_ARM} / {ON_ARM}: x{block['draft_speedup_vs_before']['median']:.2f} "
                     f"by mean; tau {ON_ARM} / before: x{block['tau_vs_before']:.4f}")
    return "\n".join(lines)


def format_targets(targets: Sequence[dict]) -> str:
    lines = []
    for t in targets:
        m = t["measured"]
        if m is None:
            got = "not run"
        elif "query_ms_median" in m:
            rec = "-" if m["recall"] is None else f"{m['recall']:.3f}"
            got = f"median {m['query_ms_median']:.3f} ms, recall {rec}"
        elif "tau_ratio" in m:
            got = f"x{m['tau_ratio']:.4f}"
        else:
            got = f"x{m['mean']:.2f} by mean, x{m['median']:.2f} by median"
        lines.append(f"{verdict(t['holds']):4}  {t['name']}: {got} (target: {t['rule']})")
    return "\n".join(lines)
