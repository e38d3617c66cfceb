"""The evidence page (<bench>__<model>__evidence.html, linked from the main page, the index and the grid).

oilbird against each baseline arm (suffix, sam, lexical, recycling, pld): tau with its interval and
oilbird ÷ arm with its paired interval, from ablations.json's `headline` (`python -m decoder ablations`),
else from the replay (reports/target.py); the target line; a tau chart with intervals; the replayed
oilbird's per-source acceptance and where, by depth, the key's gain lands; the ablations and the
transplant ladder (or the command that makes them); and every replayed arm.
"""

from __future__ import annotations

from data.store.layout import ABLATIONS_FILE
from decoder.verify.passes import DEPTH_ROWS
from decoder.policy import LEXICAL_ARMS, OFF_ARM, ON_ARM, TARGET_RULE
from reports import charts
from reports.arms import (
    as_dict,
    exact_notes,
    exact_text,
    form_pair,
    interval_ends,
    named,
    replay_table,
    share_text,
    tau_iv,
)
from reports.decision import shares_paragraph
from reports.freshness import freshness_callout, shown_results
from reports.htmlkit import (
    esc,
    finite,
    gain_text,
    href,
    humanize,
    not_available,
    number,
    page,
    section,
    table,
)
from reports.links import ablations_command, bench_name, page_name, replay_command
from reports.results import ABLATIONS_COMMAND, SEMANTIC_SOURCE, Ablations, Arm, Result
from reports.target import comparison, target, target_text

LADDER_RUNGS = ("base", "+pool", "+key", "+key added")  # +key: the pool's exact key replaced; added: beside it


def ablation_caveats(abl: Ablations) -> str:
    bits = []
    if abl.bad_values:
        bits.append(f"{abl.bad_values} value(s) in {ABLATIONS_FILE} were missing or not finite numbers in range "
                    "and show as n/a")
    if abl.dropped_rows:
        bits.append(f"{abl.dropped_rows} row(s) without an arm name were left out")
    return f'<p class="note">{esc("; ".join(bits))}.</p>' if bits else ""


def ablations_section(result: Result) -> str:
    """The ablations and transplant-ladder section: the table, chart and ladder of ablations/ablations.json, or
    one "not available" line (an unreadable file; no file: the command that makes it)."""
    abl: Ablations | None = result.ablations
    sid, title = "ablations", "Ablations and the transplant ladder (replay, pool past)"
    if abl is None:
        return section(sid, title, not_available(
            f"no {ABLATIONS_FILE} under {result.bench}/{result.model}/: `{ablations_command(result)}` "
            f"(`{ABLATIONS_COMMAND}`) replays the ablations, the transplant ladder and the paired headline"))
    if abl.note:
        return section(sid, title, not_available(f"{abl.note}; rerun `{ABLATIONS_COMMAND}` "
                                                 f"(`{ablations_command(result)}`)"))
    meta = abl.meta
    facts = ", ".join(f"{esc(k)} {esc(number(meta[k]) if not isinstance(meta[k], str) else meta[k])}"
                      for k in ("pool", "nodes", "requests") if k in meta)
    intro = (f'<p class="caption">Replayed arms against the merged decoder (<code>{esc(ABLATIONS_COMMAND)}</code>'
             + (f"; {facts}" if facts else "") + "). tau: tokens per verification pass, 95% interval in brackets; "
             "vs merged: the arm's tau over the merged arm's, paired; est. speedup: estimated from the "
             "verification-cost profile, when the replay had one; sole-source share: of all committed tokens.</p>")
    main_rows = ([abl.merged] if abl.merged else []) + abl.ablations
    rows = [[esc(r["label"]), f"<code>{esc(r['arm'])}</code>", tau_iv(r), tau_iv(r, "vs_merged", "ratio"),
             number(r.get("speedup"), "ratio"), share_text(r.get("sole_source")), exact_text(r.get("exact"))]
            for r in main_rows]
    tbl = table(["label", "arm", "tau [interval]", "vs merged [interval]", "est. speedup", "sole-source share",
                 "exact"], rows, {2, 3, 4, 5}) if rows else ""
    plotted = main_rows + [r for _, rungs in abl.ladder for r in rungs if r is not None]
    groups = (["merged"] if abl.merged else []) + ["ablation"] * len(abl.ablations) + [
        "ladder" for _, rungs in abl.ladder for r in rungs if r is not None]
    chart = ""
    if any(r["tau"] is not None for r in plotted):
        chart = charts.ablation_chart([r["arm"] for r in plotted], [r["tau"] for r in plotted],
                                      *interval_ends(plotted), groups)
    ladder = ""
    if abl.ladder:
        n = min(len(LADDER_RUNGS), max(len(rungs) for _, rungs in abl.ladder))  # an older file has 3 rungs
        lrows = [[esc(d)] + [tau_iv(rungs[i] if i < len(rungs) else None) for i in range(n)]
                 for d, rungs in abl.ladder]
        ladder = table(["drafter", *LADDER_RUNGS[:n]], lrows, set(range(1, 1 + n)),
                       caption="The transplant ladder: each drafter alone, with the pool under its own exact key, "
                               "with that key replaced by the semantic key (same pool, same node budget), and with "
                               "the semantic key added beside the exact one (asked only where the host matched); "
                               "tau [95% interval].")
    missing = ("<h3>Not measured</h3><ul>" + "".join(f"<li>{esc(m)}</li>" for m in abl.missing) + "</ul>"
               if abl.missing else "")
    return section(sid, title, intro, chart, ablation_caveats(abl), tbl, ladder, missing)


def comparison_section(result: Result) -> str:
    """oilbird against each baseline arm (tau, oilbird ÷ arm paired), the target line and a tau chart."""
    sid, title = "comparison", f"{ON_ARM} against the baselines"
    h = comparison(result)
    abl = result.ablations
    if h is None:
        return section(sid, title, not_available(
            f"no replay of {ON_ARM} or of a baseline arm ({', '.join(LEXICAL_ARMS)}) and no headline in "
            f"{ABLATIONS_FILE}: run `{ablations_command(result)}`"))
    facts = ", ".join(bit for bit in (f"{number(h.nodes)} nodes" if h.nodes is not None else "",
                                      f"{number(h.requests)} requests" if h.requests is not None else "") if bit)
    if h.source == "ablations.json":
        intro = (f'<p class="caption">From <code>{ABLATIONS_FILE}</code> (pool past'
                 + (f", {facts}" if facts else "") + f"): {ON_ARM} and each baseline replayed over the same requests. "
                 f"tau: tokens per verification pass, request-bootstrap 95% interval; {ON_ARM} ÷ arm: the ratio of "
                 "the two taus with its paired interval (the same requests resampled jointly).</p>")
        older = ""
    else:
        why = ("has no headline (an older file)" if abl is not None and not abl.note else
               "could not be read" if abl is not None else "does not exist")
        intro = ('<p class="caption">From the replay (<code>replay/&lt;arm&gt;/summary.json</code>, pool past'
                 + (f", {facts}" if facts else "") + f"): {ABLATIONS_FILE} {esc(why)}. tau: tokens per "
                 f"verification pass, request-bootstrap 95% interval; {ON_ARM} ÷ arm: the ratio of the two taus, "
                 "paired only where the arm was replayed paired against oilbird.</p>")
        older = (f'<p class="note">The paired intervals, the ablations and the transplant ladder come from '
                 f"<code>{esc(ablations_command(result))}</code>.</p>")
    t = target(result, h)
    line = target_text(t) if t is not None else not_available(
        f"no lexical arm ({', '.join(LEXICAL_ARMS)}) beside {ON_ARM} to hold to the target ({TARGET_RULE})")
    rows = []
    if h.on is not None:
        rows.append([esc(h.on.get("label") or ON_ARM), f"<code>{esc(h.on['arm'])}</code>", tau_iv(h.on), "1",
                     number(h.on.get("speedup"), "ratio"), exact_text(h.on.get("exact"))])
    for r in h.rows:
        rows.append([esc(r["label"]), f"<code>{esc(r['arm'])}</code>", tau_iv(r),
                     gain_text(r.get("oilbird_over_arm"), r.get("oilbird_over_arm_interval")),
                     number(r.get("speedup"), "ratio"), exact_text(r.get("exact"))])
    tbl = table(["", "arm", "tau [95%]", f"{ON_ARM} ÷ arm [paired 95%]", "est. speedup", "exact"], rows,
                {2, 3, 4}, caption="est. speedup: estimated from a verification-cost profile (n/a without one); "
                                   "exact: the replay makes the same passes as live decoding.")
    plotted = ([h.on] if h.on is not None else []) + h.rows
    chart = ""
    if any(finite(r.get("tau")) for r in plotted):
        chart = charts.ablation_chart([r["arm"] for r in plotted], [r.get("tau") for r in plotted],
                                      *interval_ends(plotted),
                                      (["merged"] if h.on is not None else []) + ["baseline"] * len(h.rows),
                                      name="comparison", title=f"tau of {ON_ARM} and each baseline arm, replay "
                                                               "with 95% intervals")
    caveats = ablation_caveats(abl) if h.source == "ablations.json" and abl is not None else ""
    return section(sid, title, intro, line, tbl, chart, caveats, older)


def sources_section(result: Result) -> str:
    """Per-source acceptance of the replayed oilbird: drafted nodes, accepted tokens, acceptance rate; its
    sole-source shares; the drafter's counters."""
    on_name = form_pair(result)[2]  # oilbird, or oilbird-chain where the engine verifies chains
    sid, title = "sources", f"Where {on_name}'s accepted tokens come from (replay)"
    on = named(result.replay, on_name)
    if on is None:
        return section(sid, title, not_available(f"no replay of {on_name} (run `{replay_command(result)}`)"))
    s = on.summary
    acc, drafted, rate = (as_dict(s.get(k)) for k in ("accepted_by_source", "drafted_by_source",
                                                     "acceptance_rate_by_source"))
    sources = list(dict.fromkeys([*acc, *drafted, *rate]))
    parts = [shares_paragraph(on, "replay")]
    total = s.get("accepted_draft_tokens")
    if sources:
        rows = []
        for src in sources:
            a, d, r = acc.get(src), drafted.get(src), rate.get(src)
            if not finite(r) and finite(a) and finite(d) and d > 0:
                r = a / d
            rows.append([esc(src), number(d), number(a), number(r, "pct"),
                         number(a / total, "pct") if finite(a) and finite(total) and total > 0 else "n/a"])
        parts.append(table(["source", "drafted nodes", "accepted tokens", "acceptance rate",
                            "of accepted draft tokens"], rows, {1, 2, 3, 4},
                           caption="A token proposed by several sources is credited to each, so the last column "
                                   f"can sum above 100% (accepted draft tokens: {number(total)}). Acceptance "
                                   "rate: accepted over drafted nodes of that source."))
    else:
        parts.append(not_available(f"the replay summary of {ON_ARM} has no per-source attribution "
                                   "(accepted_by_source)"))
    stats = {k: v for k, v in as_dict(s.get("drafter_stats")).items() if finite(v) or isinstance(v, bool)}
    if stats:
        parts.append(f"<details><summary>Drafter counters ({len(stats)})</summary>" + table(
            ["counter", "value"], [[esc(humanize(k)), number(v)] for k, v in stats.items()], {1},
            caption=f"As the replay of {ON_ARM} reports them (summary.json `drafter_stats`).") + "</details>")
    return section(sid, title, *parts)


def _depth(arm: Arm | None) -> dict | None:
    d = as_dict(arm.summary.get("by_depth")) if arm is not None else {}
    ok = d and isinstance(d.get("reach"), list) and isinstance(d.get("by_source"), dict) and finite(d.get("passes"))
    return d if ok else None


def depth_section(result: Result) -> str:
    """Per depth of the accepted path (summary.json `by_depth`): how many passes reach it with the key and
    without, and which source proposed the tokens accepted there: where the key's tau gain lands."""
    sid, title = "depth", f"Where the key's gain lands: acceptance per depth ({ON_ARM} against {OFF_ARM}, replay)"
    on, off = _depth(named(result.replay, ON_ARM)), _depth(named(result.replay, OFF_ARM))
    if on is None or off is None:
        return section(sid, title, not_available(
            f"no per-depth acceptance (summary.json `by_depth`) in the replays of {ON_ARM} and {OFF_ARM}; a replay "
            f"made before it was recorded: rerun `{replay_command(result)}`"))
    n = max(on["passes"], 1)
    src = on["by_source"]
    names = [k for k in ("spine", "branch", "adjacency", SEMANTIC_SOURCE, "rollout") if k in src]
    names += sorted(k for k in src if k not in names)
    rows = []
    for d in DEPTH_ROWS:
        if d > min(len(on["reach"]), len(off["reach"])):
            break
        sole = on.get("sole_semantic") or []
        rows.append([str(d), number(on["reach"][d - 1], "pct"), number(off["reach"][d - 1], "pct"),
                     number(sole[d - 1] / n, "pct") if len(sole) >= d else "n/a",
                     *[number(src[k][d - 1] / n, "pct") if len(src[k]) >= d else "n/a" for k in names]])
    head = ["depth d", f"passes reaching d ({ON_ARM})", f"passes reaching d ({OFF_ARM})",
            "semantic alone", *[f"{esc(k)}" for k in names]]
    caption = (f"Passes reaching d: share of verification passes accepting at least d draft tokens ({number(on['passes'])} "
               f"passes with the key, {number(off['passes'])} without: the same tokens in fewer passes is the tau gain). "
               "The other columns: accepted tokens at depth d per pass of the arm with the key, by the source that "
               "proposed them (a token several sources proposed counts for each); semantic alone: proposed by no "
               "other source, the sole-source share by depth.")
    return section(sid, title, table(head, rows, set(range(1, len(head))), caption=caption))


def evidence_page(result: Result) -> str:
    """The evidence of one (benchmark, model): oilbird against the baselines with the target line, where its
    tokens come from, the ablations and transplant ladder, and every replayed arm."""
    bench = bench_name(result)
    title = f"Evidence: {bench} · {result.model_name}"
    parts = [f"<h1>{esc(title)}</h1>",
             f'<p class="sub">Replay and ablation results from <code>{esc(result.bench)}/{esc(result.model)}/</code>'
             f' (strictly-past pool). <a href="{href(page_name(result))}">Main report</a> (census, decision, live '
             "decoder).</p>",
             freshness_callout(result, shown_results(result, replay=True, warm=False, vllm=False)),
             comparison_section(result), sources_section(result), depth_section(result), ablations_section(result)]
    if result.replay:
        notes: list[str] = []
        tbl = replay_table(result, notes)
        parts.append(section("replay", "Every replayed arm (pool past)", tbl, exact_notes(notes)))
    else:
        parts.append(section("replay", "Every replayed arm (pool past)", not_available(
            f"no replay under {result.bench}/{result.model}/replay/ (run `{replay_command(result)}`)")))
    return page(title, "\n".join(parts))
