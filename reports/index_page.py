"""index.html: one row per (benchmark, model) with the census's shares, the decoder's best speedup, the
sole-source share, oilbird's replayed tau and the verdict, and links to every page of the result."""

from __future__ import annotations

from decoder.policy import ON_ARM
from reports.arms import BASIS_TEXT, fastest_arm, named, tau_of
from reports.census_sections import entry_value
from reports.decision import Decision, decide, verdict_cell
from reports.freshness import row_flags, shown_results
from reports.htmlkit import (
    esc,
    finite,
    href,
    interval,
    number,
    page,
    pct,
    table,
    with_iv,
)
from reports.links import bench_name, evidence_link, has_evidence, page_name
from reports.results import Result


def _cell(e) -> str:
    """A percentage with its intervals in the tooltip."""
    if entry_value(e) is None:
        return '<span class="na">n/a</span>'
    tip = f"Wilson 95% {interval(e.get('wilson'))}; bootstrap {interval(e.get('bootstrap'))}"
    return f'<span title="{esc(tip)}">{pct(e["value"])}</span>'


def replay_tau_cell(result: Result) -> str:
    """tau of oilbird in the replay (strictly-past pool) with its interval, or –."""
    on = named(result.replay, ON_ARM)
    return with_iv(*tau_of(on.summary)) if on is not None else "–"


def share_cell(d: Decision | None) -> str:
    e = d.arm.sole_source if d is not None else None
    if not e or not finite(e.get("share")):
        return "–"
    tip = f"{d.arm.name} ({d.source}): {BASIS_TEXT[e['basis']]}; 95% interval {interval(e.get('interval'))}"
    return f'<span title="{esc(tip)}">{pct(e["share"])}</span>' + ("" if e["basis"] == "committed" else " (draft)")


def index_page(results: list[Result]) -> str:
    rows = []
    for r in results:
        c = r.census
        s = c.summary if c else {}
        best = fastest_arm(r)
        d = decide(r)
        links = [f'<a href="{href(page_name(r))}">report</a>'] + [
            f'<a href="{href(page_name(r, o))}">pool {esc(o.pool)}</a>' for o in r.censuses[1:]] + (
            [evidence_link(r)] if has_evidence(r) else [])
        flags = row_flags(r, shown_results(r, c, replay=True, warm=False, vllm=False))  # what the row shows
        rows.append([esc(bench_name(r, c)) + flags, esc(r.model_name), number(s.get("positions")) if c else "–",
                     _cell(s.get("available")) if c else "–", _cell(s.get("gap")) if c else "–",
                     _cell(s.get("recall")) if c else "–",
                     esc(", ".join(a.name for a in r.arms)) or "–",
                     f"{best.summary['speedup']:.2f}× ({esc(best.name)})" if best else "–",
                     share_cell(d), replay_tau_cell(r), verdict_cell(d), " · ".join(links)])
    body = ("<h1>Oilbird gap reports</h1>"
            f'<p class="sub">{len(results)} result(s). <a href="grid.html">Cross-benchmark grid</a>. Percentages of '
            "generated positions (Recall: of gap positions); hover for intervals. Verdict: should the semantic draft "
            "source be enabled (decoder/verdict.py), read from the replay when it ran oilbird, else from the live "
            "decoder; hover for its numbers. A result marked <em>stale</em> was computed on its trace store before the store "
            "changed; <em>unverified</em>, on a store without checksums (hover for which).</p>"
            + table(["benchmark", "model", "positions", "Avail", "Gap", "Recall", "decoder arms", "best speedup",
                     "sole-source share", "tau oilbird (replay)", "verdict", "pages"], rows, {2, 3, 4, 5, 7, 8, 9}))
    return page("Oilbird gap reports", body)
