"""The sweep sections of a benchmark page, each drawn only when its file exists under sweeps/.

index.json (`python -m census sweep-index`): semantic gap recall against bytes per state, one point
per index spec, with the 128 B/state target and 95% of exact's recall marked; budget.json
(`python -m census sweep-budget`): availability, gap and semantic gap recall against the pool's
budget, the unbounded pool at the right end as "all". An unreadable sweep file is one "not
available" line.
"""

from __future__ import annotations

from reports import charts
from reports.htmlkit import esc, not_available, number, pct, section, table
from reports.results import SWEEP_COMMANDS, Result, Sweep

INDEX_TARGET_BYTES = 128  # bytes per state the compressed semantic key aims for
INDEX_KEEP = 0.95  # ... keeping this share of exact's gap recall
KEEP_TEXT = f"{100 * INDEX_KEEP:g}%"


def _sweep_note(sweep: Sweep) -> str:
    """The one line shown in place of an unreadable sweep."""
    return not_available(f"{sweep.note}; rerun `{SWEEP_COMMANDS[sweep.kind]}`")


def _sweep_caveats(sweep: Sweep, off_chart: int) -> str:
    """A note on values read as unknown, rows dropped, and rows the chart could not place; "" when none."""
    name = f"sweeps/{sweep.path.name}"
    bits = []
    if sweep.bad_values:
        bits.append(f"{sweep.bad_values} value(s) in {name} were missing or not finite numbers in range (NaN, "
                    "Infinity, a share outside 0–1, a negative count) and show as n/a")
    if sweep.dropped_rows:
        bits.append(f"{sweep.dropped_rows} row(s) without a {'spec' if sweep.kind == 'index' else 'budget'} "
                    "name were left out")
    if off_chart:
        bits.append(f"{off_chart} row(s) lack a number the chart needs and are in the table only")
    return f'<p class="note">{esc("; ".join(bits))}.</p>' if bits else ""


def exact_recall(rows: list[dict]) -> float | None:
    """Exact's gap recall: the `exact` row's, else one implied by any row's gap_recall / gap_recall_ratio."""
    for r in rows:
        if r["spec"] == "exact" and r["gap_recall"] is not None:
            return r["gap_recall"]
    for r in rows:
        if r["gap_recall"] is not None and r["gap_recall_ratio"]:
            return r["gap_recall"] / r["gap_recall_ratio"]
    return None


def _ratio_to_exact(row: dict, exact: float | None) -> float | None:
    if row["gap_recall_ratio"] is not None:
        return row["gap_recall_ratio"]
    if row["gap_recall"] is not None and exact:
        return row["gap_recall"] / exact
    return None


def index_section(sweep: Sweep) -> str:
    sid, title = "sweep-index", "Index compression: semantic gap recall against bytes per state"
    if sweep.note:
        return section(sid, title, _sweep_note(sweep))
    rows = sweep.rows
    exact = exact_recall(rows)
    meets = lambda r: (r["bytes_per_state"] is not None and r["bytes_per_state"] <= INDEX_TARGET_BYTES  # noqa: E731
                       and (_ratio_to_exact(r, exact) or 0) >= INDEX_KEEP)
    fits = sorted((r for r in rows if r["spec"] != "exact" and meets(r)),
                  key=lambda r: (r["bytes_per_state"], -(r["gap_recall"] or 0)))
    if not any(r["spec"] != "exact" for r in rows):
        verdict_line = f"Only exact was swept (gap recall {pct(exact)}): no compressed spec to hold to it."
    elif exact is None:
        verdict_line = "Exact's gap recall is not known (no <code>exact</code> row), so no spec can be held to it."
    elif fits:
        best = fits[0]
        verdict_line = (f"The smallest spec within {INDEX_TARGET_BYTES} B/state that keeps {KEEP_TEXT} of "
                        f"exact's gap recall: <strong>{esc(best['spec'])}</strong>, {number(best['bytes_per_state'])} "
                        f"B/state, gap recall <strong>{pct(best['gap_recall'])}</strong> "
                        f"({_ratio_to_exact(best, exact):.3f}× exact's {pct(exact)}).")
    else:
        verdict_line = (f"No spec within {INDEX_TARGET_BYTES} B/state keeps {KEEP_TEXT} of exact's gap recall "
                        f"({pct(exact)}).")
    counts = []
    if "positions" in sweep.meta:
        counts.append(f"{number(sweep.meta['positions'])} positions")
    if "gap_positions" in sweep.meta:
        counts.append(f"{number(sweep.meta['gap_positions'])} gap positions")
    intro = (f'<p class="caption">The semantic key with its index compressed (<code>{esc(SWEEP_COMMANDS["index"])}'
             f"</code>{', ' + ', '.join(counts) if counts else ''}): the share of gap positions it still recovers, "
             "against the bytes each stored state costs. Dashed: the "
             f"{INDEX_TARGET_BYTES} B/state target and {KEEP_TEXT} of exact's recall; a point inside both is "
             f"green.</p><p>{verdict_line}</p>")
    plotted = [r for r in rows if r["bytes_per_state"] is not None and r["gap_recall"] is not None]
    chart = charts.index_chart([r["spec"] for r in plotted], [r["bytes_per_state"] for r in plotted],
                               [100 * r["gap_recall"] for r in plotted],
                               100 * exact if exact is not None else None, INDEX_TARGET_BYTES) if plotted else ""
    order = sorted(rows, key=lambda r: (r["spec"] != "exact", -(r["bytes_per_state"] or 0)))
    table_rows = []
    for r in order:
        ratio = _ratio_to_exact(r, exact)
        table_rows.append([
            f"<code>{esc(r['spec'])}</code>", number(r["bytes_per_state"]), pct(r["gap_recall"]),
            f"{ratio:.3f}×" if ratio is not None else "n/a", pct(r["sem_hit_rate"]),
            pct(r["knn_recall"]) if r["knn_recall"] is not None else '<span class="na">n/a</span>',
            pct(r["warmup_share"]), number(r["seconds"]),
            "–" if r["spec"] == "exact" else ("yes" if meets(r) else "no")])
    tbl = table(["spec", "bytes/state", "gap recall", "vs exact", "semantic hit rate", "kNN recall@8",
                 "warm-up share", "seconds", "meets target"],
                table_rows, {1, 2, 3, 4, 5, 6, 7},
                caption="gap recall: share of gap positions the semantic key recovers; vs exact: that over exact's; "
                        "kNN recall@8: the ids found against exact's; warm-up share: queries answered exactly "
                        f"before the index was trained; meets target: at most {INDEX_TARGET_BYTES} B/state and at "
                        f"least {KEEP_TEXT} of exact's gap recall.")
    return section(sid, title, intro, chart, _sweep_caveats(sweep, len(rows) - len(plotted)), tbl)


def budget_positions(rows: list[dict]) -> list[float | None]:
    """Where each row sits on the chart's token axis: its budget, or for the unbounded pool the right end (4x the
    largest budget, 1 without one); None for a row whose budget is not known."""
    finite = [r["budget_tokens"] for r in rows if r["budget_tokens"] is not None]
    right = 4 * max(finite) if finite else 1.0
    return [r["budget_tokens"] if r["budget_tokens"] is not None else (right if r["unbounded"] else None)
            for r in rows]


def budget_section(sweep: Sweep) -> str:
    sid, title = "sweep-budget", "What the pool's size buys"
    if sweep.note:
        return section(sid, title, _sweep_note(sweep))
    rows = sorted(sweep.rows, key=lambda r: (r["unbounded"], r["budget_tokens"] is None, r["budget_tokens"] or 0))
    xs = budget_positions(rows)
    plotted = [(r, x) for r, x in zip(rows, xs) if x is not None]
    series = {label: [100 * r[key] if r[key] is not None else None for r, _ in plotted]
              for label, key in (("availability", "availability"), ("gap", "gap"),
                                 ("semantic gap recall", "gap_recall"))}
    drawable = any(v is not None for vals in series.values() for v in vals)
    chart = charts.budget_chart(["all" if r["unbounded"] else r["budget"] for r, _ in plotted],
                                [x for _, x in plotted], series) if plotted and drawable else ""
    unbounded = next((r for r in rows if r["unbounded"]), None)
    lead = ""
    if unbounded is not None and unbounded["gap_recall"]:
        enough = [r for r in rows if not r["unbounded"] and r["gap_recall"] is not None
                  and r["gap_recall"] >= INDEX_KEEP * unbounded["gap_recall"]]
        lead = (f"<p>Unbounded pool: availability <strong>{pct(unbounded['availability'])}</strong>, gap "
                f"<strong>{pct(unbounded['gap'])}</strong>, semantic gap recall "
                f"<strong>{pct(unbounded['gap_recall'])}</strong>. "
                + (f"The smallest budget keeping {KEEP_TEXT} of that recall: <strong>{esc(enough[0]['budget'])}"
                   "</strong>." if enough else f"No bounded budget keeps {KEEP_TEXT} of that recall.") + "</p>")
    intro = (f'<p class="caption">The census rerun with the pool bounded to a number of generated tokens '
             f"(<code>{esc(SWEEP_COMMANDS['budget'])}</code>; the oldest traces leave first). <em>all</em> is the "
             "unbounded pool, drawn at the right end (not to scale).</p>")
    table_rows = [[esc(r["budget"]), "unbounded" if r["unbounded"] else number(r["budget_tokens"]),
                   number(r["mean_pool_tokens"]), pct(r["availability"]), pct(r["producible"]), pct(r["gap"]),
                   pct(r["gap_recall"]), pct(r["sem_hit_rate"])] for r in rows]
    tbl = table(["budget", "budget tokens", "mean pool tokens", "availability", "producible", "gap",
                 "semantic gap recall", "semantic hit rate"], table_rows, {1, 2, 3, 4, 5, 6, 7},
                caption="Shares of generated positions, except semantic gap recall (of gap positions); mean pool "
                        "tokens: the pool's mean size over the requests.")
    return section(sid, title, intro, lead, chart, _sweep_caveats(sweep, len(rows) - len(plotted)), tbl)


def sweep_sections(result: Result) -> list[str]:
    """The sweep sections whose files exist (index, then budget); none without them."""
    out = []
    if "index" in result.sweeps:
        out.append(index_section(result.sweeps["index"]))
    if "budget" in result.sweeps:
        out.append(budget_section(result.sweeps["budget"]))
    return out
