"""The page of one (benchmark, model): the headline, the decision, the census sections, the sweeps, the
case viewer, the live decoder and the vLLM bench; a census of another pool mode gets its own page with that
census only.
"""

from __future__ import annotations

from data.store.sampling import sampled_note
from decoder.policy import ON_ARM
from reports import charts
from reports.arms import as_dict, share_arms, share_text, speed_text, tau_of
from reports.case_viewer import TokenText
from reports.census_sections import (
    cases_section,
    cliff_section,
    coverage_section,
    headline,
    mechanism_section,
    notes_section,
    novel_section,
    proportions_table,
    threshold_section,
)
from reports.decision import decide, decision_section
from reports.freshness import freshness_callout, shown_results
from reports.htmlkit import (
    esc,
    finite,
    href,
    not_available,
    number,
    page,
    pct,
    section,
    table,
)
from reports.links import bench_name, evidence_name, has_evidence
from reports.results import Census, Result
from reports.sweep_sections import sweep_sections
from reports.vllm_section import vllm_section


def audit_cell(audit: dict | None) -> str:
    """matched/requests, with the mismatches' kinds (decoder/verify/audit.py) when there are any."""
    if not audit:
        return "n/a"
    cell = f"{number(audit.get('matched'))}/{number(audit.get('requests'))}"
    if audit.get("mismatches") and "numeric" in audit:
        cell += (f" ({number(audit.get('numeric'))} numeric, {number(audit.get('algorithmic'))} algorithmic, "
                 f"{esc(str(audit.get('dtype')))})")
    return cell


def decoder_section(result: Result) -> str:
    title = "Decoder: what the draft sources deliver"
    if not result.arms:
        return section("decoder", title, not_available(
            f"no decoder results under {result.bench}/{result.model}/decode/ (run `python -m decoder`)"
            + ("; the decision above reads the replay" if result.replay else "")))
    arms = result.arms
    rows = []
    for a in arms:
        s = a.summary
        audit = s.get("lossless") if isinstance(s.get("lossless"), dict) else None
        lossless = audit_cell(audit)
        rows.append([esc(a.name), number(tau_of(s)[0]), number(s.get("tokens_per_s")), speed_text(a),
                     number(s.get("overhead_fraction"), "pct"), number(s.get("mean_nodes")), lossless,
                     number(s.get("requests"))])
    parts = [table(["arm", "tau", "tokens/s", "speedup", "draft+update share", "mean nodes", "lossless",
                    "requests"], rows, {1, 2, 3, 4, 5, 6, 7},
                   caption="tau = committed tokens per verification pass; speedup = tokens/s over the same "
                           "invocation's ar; lossless = requests whose output equals ar's token for token. A "
                           "mismatch is numeric when the arm committed its own forward's argmax and both logit "
                           "gaps at the first difference are within the dtype's rounding (bfloat16: tree and "
                           "one-token scoring round differently), algorithmic otherwise (a decoder bug); "
                           "float32 must match exactly (docs/lossless.md).")]
    value = lambda v: v if finite(v) else None  # noqa: E731
    parts.append(charts.arm_chart([a.name for a in arms], [value(tau_of(a.summary)[0]) for a in arms],
                                  [value(a.summary.get("speedup")) for a in arms]))
    by_source = [as_dict(a.summary.get("accepted_by_source")) for a in arms]
    sources = sorted({src for d in by_source for src in d})
    if sources:
        acc = [[int(d[src]) if finite(d.get(src)) else 0 for src in sources] for d in by_source]
        rate = [as_dict(a.summary.get("acceptance_rate_by_source")) for a in arms]
        src_rows = [[esc(a.name)] + [f"{acc[i][j]:,}" + (f" ({pct(rate[i][src])})" if finite(rate[i].get(src))
                                                         else "") for j, src in enumerate(sources)]
                    for i, a in enumerate(arms) if any(acc[i])]
        parts.append("<h3>Accepted tokens per source</h3>" + table(
            ["arm"] + [esc(s) for s in sources], src_rows, set(range(1, len(sources) + 1)),
            caption="A token proposed by several sources is credited to each; in brackets the share of that "
                    "source's drafted nodes that were accepted."))
        shown = [i for i, a in enumerate(arms) if any(acc[i])]
        if shown:
            parts.append(charts.source_chart([arms[i].name for i in shown], sources, [acc[i] for i in shown]))
    else:
        parts.append(not_available("no per-source accepted tokens in the decoder summaries"))
    parts.append("<h3>Sole-source share</h3>" + sole_source_block(result))
    return section("decoder", title, *parts)


def sole_source_block(result: Result) -> str:
    """The live arms' sole-source shares (both definitions); the verdict itself is in the decision block."""
    with_share = share_arms(result)
    if not with_share:
        return not_available("no arm reports a sole-source share (run the decoder's semantic arm, `oilbird`)")
    rows = [[esc(a.name), share_text(a.shares.get("committed")), share_text(a.shares.get("draft")),
             esc(", ".join(dict.fromkeys(e.get("from", "") for e in a.shares.values())))]
            for a in with_share]
    d = decide(result)
    where = "the replay" if d is not None and d.source == "replay" else "these live figures"
    pointer = (f'<p class="note">The verdict ({esc(d.verdict.decision)}, read from {where}) is at the top of '
               'the page: <a href="#decision">Decision</a>.</p>' if d is not None else "")
    return pointer + table(["arm", "share of committed tokens (paper)", "share of accepted draft tokens",
                            "read from"], rows, {1, 2},
                           caption="Sole-source share: accepted tokens that only the semantic source proposed.")


def sampled_line(result: Result, census: Census | None, main_page: bool = True) -> str:
    """One line beside the decision when the store holds sampled requests (data/store/sampling.py): read from the
    replay the decision reads (main page), else the census; what it means for the figures is docs/replay.md,
    "Sampled traces"."""
    sources = [("replay", a.summary) for a in (result.replay if main_page else [])]
    sources += [("census", census.summary)] if census else []
    for name, summary in sources:
        line = sampled_note(summary.get("sampled_requests"))
        if line:
            return (f'<p class="callout neutral" id="sampled"><strong>Sampled requests.</strong> {esc(line)} '
                    f'(the {name}\'s <code>sampled_requests</code>)</p>')
    return ""


def schema_callout(result: Result, census: Census | None, main_page: bool) -> str:
    """Above every number: the result files of this page that lack a required field or hold an invalid value
    (data/results.py). Those values are shown as n/a, and a verdict that reads such a file cannot decide."""
    problems = [p for p in (result.problems if main_page else census.problems if census else [])]
    if not problems:
        return ""
    items = "".join(f"<li>{esc(str(p))}</li>" for p in problems)
    return (f'<div class="callout cannot"><p><strong>Invalid result files:</strong> {len(problems)} field(s) '
            "missing or outside their range (docs/reports.md, \"Result files\"). They are shown as n/a, and a "
            "verdict that reads one of these files says \"cannot decide\".</p>"
            f"<ul>{items}</ul></div>")


def result_page(result: Result, census: Census | None = None, token_text: TokenText | None = None,
                others: list[tuple[str, str]] = ()) -> str:
    """The page of one (benchmark, model): the headline, the decision (replay / decoder), its census (the given
    one, default the first) and the live decoder. Pages of another census pool show that census only."""
    census = census or result.census
    bench = bench_name(result, census)
    title = f"Gap report: {bench} · {result.model_name}" + (f" · pool {census.pool}" if census and
                                                             census.pool != "past" else "")
    main_page = census is None or census is result.census
    links = [f'<a href="{href(name)}">{esc(label)}</a>' for name, label in others]
    if main_page and has_evidence(result):
        links.append(f'<a href="{href(evidence_name(result))}">evidence: {ON_ARM} against the baselines, '
                     "ablations</a>")
    parts = [f"<h1>{esc(title)}</h1>",
             f'<p class="sub">Results from <code>{esc(result.bench)}/{esc(result.model)}/</code>. '
             + " ".join(links) + "</p>",
             # before any number: which of the results below no longer describe the store (or were never checked)
             freshness_callout(result, shown_results(result, census, replay=main_page, warm=main_page,
                                                     vllm=main_page)),
             schema_callout(result, census, main_page)]
    if census is None:
        parts += [sampled_line(result, None), decision_section(result)]
        parts.append(section("census", "Census", not_available(
            f"no census under {result.bench}/{result.model}/ (run `python -m census --bench ...`)")))
        parts += sweep_sections(result)
    else:
        parts += [headline(result, census), sampled_line(result, census, main_page),
                  decision_section(result) if main_page else "",
                  proportions_table(census), mechanism_section(census),
                  coverage_section(census), cliff_section(census), novel_section(census), threshold_section(census),
                  *(sweep_sections(result) if main_page else []),
                  cases_section(result, census, token_text)]
    if main_page:
        parts.append(decoder_section(result))
        parts.append(vllm_section(result))
    if census is not None:
        parts.append(notes_section(census))
    return page(title, "\n".join(parts))
