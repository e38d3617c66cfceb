"""The decision block: whether to enable the semantic draft source, by the one rule in decoder/verdict.py.

Read from the replay's strictly-past pool (`oilbird`'s sole-source share, its paired tau gain over
`oilbird-no-semantic`, the two arms' estimated speedups; nodes 60 when several budgets were replayed,
else the largest); without a replay of `oilbird`, from the live decoder's share with the gain unknown
(so never "enable"). A missing or invalid field in a file the verdict reads (data/results.py's schema)
gives "cannot decide: <file> lacks <field>" instead of a decision; no other quantity is read in its place
(the share over accepted draft tokens is never the rule's share). Live decoder results are shown beside
the replay as the ground truth; the warm-pool replay and other node budgets are secondary tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from data.results import Problem
from decoder.policy import FORM_PAIRS, OFF_ARM, ON_ARM
from decoder.verdict import CANNOT_DECIDE, Sensitivity, Verdict, cannot_decide, sensitivity, verdict
from reports import charts
from reports.arms import (
    BASIS_TEXT,
    as_dict,
    est_speedup,
    estimate,
    exact_notes,
    fastest_arm,
    form_pair,
    live_speedup,
    named,
    nodes_table,
    replay_table,
    share_arms,
    share_text,
    speed_text,
    tau_of,
    warm_table,
)
from reports.freshness import is_stale, is_unverified, recompute_command
from reports.htmlkit import (
    esc,
    finite,
    gain_text,
    href,
    not_available,
    number,
    section,
    table,
    with_iv,
)
from reports.links import evidence_name, has_evidence, replay_command
from reports.results import Arm, Result
from reports.target import lexical_comparison

DECISION_CSS = {"enable": "enable", "neutral": "neutral", "leave off": "off", CANNOT_DECIDE: "cannot"}
DECISION_TEXT = {
    "enable": "enable the semantic source",
    "neutral": "neutral: the semantic source neither clearly pays nor clearly costs on these numbers",
    "leave off": "leave the semantic source off",
    CANNOT_DECIDE: "cannot decide: a result file the verdict reads lacks a field or holds an invalid value",
}


@dataclass
class Decision:
    """The verdict a page shows, and what it was read from."""

    source: str  # "replay" (replay/, strictly-past pool) or "live" (decode/)
    verdict: Verdict
    arm: Arm  # the arm whose sole-source share was read (oilbird, or oilbird-chain for a chain engine)
    off: Arm | None  # its key-off twin from the same source, if run
    gain: dict  # the replay's paired_gain block ({} when absent)
    engine: str = "harness"  # the engine the replay was priced on (its profile's)
    form: str = "tree"  # the form of draft that engine verifies, which the verdict compares in


def blockers(on: Arm, off: Arm | None) -> list[Problem]:
    """Why no verdict can be read from these arms' summaries: every schema problem of either file
    (data/results.py), else the rule's share when the key-on arm's file lacks it. Empty when it can decide."""
    out = [p for arm in (on, off) if arm is not None for p in arm.problems]
    if out or on.sole_source is not None:
        return out
    file, raw = str(on.folder / "summary.json"), on.summary.get("sole_source_share")
    if isinstance(raw, dict) and "value" in raw:
        return [Problem(file, "sole_source_share.value", "(no share computed)")]
    if "draft" in on.shares:
        return [Problem(file, "sole_source_share", "lacks", detail="over all committed tokens (it gives only the "
                        "share over accepted draft tokens, which is larger and not the rule's)")]
    return [Problem(file, "sole_source_share", "lacks")]


def decision_problems(result: Result) -> list[Problem]:
    """The problems that keep this result's verdict from deciding (none when it decides, or has no verdict)."""
    d = decide(result)
    return blockers(d.arm, d.off) if undecidable(d) else []


def decide(result: Result) -> Decision | None:
    """The verdict from the replay (strictly-past pool), in the form the replay's engine verifies (chains for
    vLLM: oilbird-chain against oilbird-no-semantic-chain; trees: oilbird against oilbird-no-semantic) when it
    ran that form's key-on arm (else the tree's), else from the live decoder's sole-source share (no paired
    gain: never "enable"), else None."""
    engine, form, on_name, off_name = form_pair(result)
    on = named(result.replay, on_name)
    if on is not None:
        peers = result.replay_nodes.get(on.nodes, []) if on.nodes is not None else []
        off = named(peers, off_name) or named(result.replay, off_name)
        if off is not None and None not in (off.nodes, on.nodes) and off.nodes != on.nodes:
            off = None  # another node budget: not a paired comparison
        share = on.sole_source or {}
        gain = as_dict(on.summary.get("paired_gain"))
        if gain.get("versus", off_name) != off_name:
            gain = {}
        why = blockers(on, off)
        if why:
            return Decision("replay", cannot_decide([str(p) for p in why], on_name, off_name), on, off, gain, engine,
                            form)
        v = verdict(share.get("share"), share.get("interval"), gain.get("interval"), est_speedup(on),
                    est_speedup(off) if off is not None else None, on_name, off_name)
        return Decision("replay", v, on, off, gain, engine, form)
    arms = share_arms(result)
    main = named(result.arms, ON_ARM) or (arms[0] if arms else None)
    if main is None:
        return None
    off = named(result.arms, OFF_ARM) if main.name == ON_ARM else None
    why = blockers(main, off)
    if why:
        return Decision("live", cannot_decide([str(p) for p in why]), main, off, {})
    both = off is not None and live_speedup(main) is not None and live_speedup(off) is not None
    v = verdict(main.sole_source["share"], main.sole_source.get("interval"), None,
                live_speedup(main) if both else None, live_speedup(off) if both else None)
    return Decision("live", v, main, off, {})


def undecidable(d: Decision | None) -> bool:
    """Whether the verdict could not be read (a result file lacks a field or holds an invalid value)."""
    return d is not None and d.verdict.decision == CANNOT_DECIDE


def verdict_callout(d: Decision, lead: str, extra: str = "") -> str:
    v = d.verdict
    reasons = "".join(f"<li>{esc(r)}</li>" for r in v.reasons)
    return (f'<div class="callout {DECISION_CSS[v.decision]}"><p>{lead}Verdict: '
            f"<strong>{esc(DECISION_TEXT[v.decision])}</strong>.</p>"
            f"<ul>{reasons}</ul>{extra}"
            f'<p class="note">Rule (decoder/verdict.py): {esc(v.rule)}</p></div>')


def profile_sensitivity(d: Decision | None) -> Sensitivity | None:
    """Whether a replay's verdict holds at both ends of its profile's measured spread (decoder/verdict.py
    `sensitivity`, over the key-on arm's `profile_spread`); None for the live decoder, a verdict that cannot
    decide, or a replay without the block."""
    if d is None or d.source != "replay" or undecidable(d):
        return None
    return sensitivity(d.verdict, d.arm.summary.get("profile_spread"), *FORM_PAIRS[d.form])


def spread_paragraph(result: Result, d: Decision) -> str:
    """The verdict's sensitivity to the profile, in one line inside the verdict's callout: it holds at both ends
    of the profile's measured spread, or what an end decides instead, or the spread is unknown."""
    s = profile_sensitivity(d)
    if s is None:
        if est_speedup(d.arm) is None:
            return ""  # no profile priced this replay: nothing for the verdict to be sensitive to
        return (f'<p class="spread note">Profile spread: not checked (a replay from before the spread was kept; '
                f"<code>{esc(recompute_command(result))}</code> recomputes it).</p>")
    if s.holds is False:
        return f'<p class="spread sensitive"><strong>Sensitive to the profile:</strong> {esc(s.line)}</p>'
    return f'<p class="spread">{esc(s.line)}</p>'


def shares_paragraph(arm: Arm, where: str) -> str:
    parts = []
    for basis in ("committed", "draft"):
        e = arm.shares.get(basis)
        if e and finite(e.get("share")):
            parts.append(f"<strong>{share_text(e)}</strong> {esc(BASIS_TEXT[basis])}")
    if not parts:
        return f'<p>Sole-source share of <strong>{esc(arm.name)}</strong> ({esc(where)}): not available.</p>'
    older = ("" if "committed" in arm.shares else
             " This summary gives only the draft-token share (an older decoder run); the paper's 3% / 9% lines "
             "are drawn for the share of all committed tokens, which is lower.")
    return (f"<p>Sole-source share of <strong>{esc(arm.name)}</strong> ({esc(where)}), the accepted tokens that only "
            f"the semantic source proposed: {'; '.join(parts)}.{esc(older)}</p>")


def verdict_cell(d: Decision | None) -> str:
    """The verdict in one cell, its reasons in the tooltip."""
    if d is None:
        return "–"
    tip = f"read from the {d.source} results: " + "; ".join(d.verdict.reasons)
    s = profile_sensitivity(d)
    if s is not None:
        tip += f". {s.line}"
    mark = " · <em>sensitive to the profile</em>" if s is not None and s.holds is False else ""
    return f'<span title="{esc(tip)}"><strong>{esc(d.verdict.decision)}</strong> ({esc(d.source)}){mark}</span>'


def replay_verdict(result: Result, d: Decision) -> list[str]:
    """The verdict read from the replay, then its numbers: both shares, the paired gain over oilbird-no-semantic,
    the target line against the best lexical arm and the estimated speedups (or why each is missing)."""
    on, off = d.arm, d.off
    on_name, off_name = FORM_PAIRS[d.form]
    command = replay_command(result)
    engine = "vLLM" if d.engine == "vllm" else "the Oilbird harness"
    form = ("one chain per request, its length chosen per step by the cost rule" if d.form == "chain"
            else "a token tree")
    lead = (f"From the replay of the captured traces (strictly-past pool, {number(on.nodes)} candidate nodes, "
            f"{number(on.summary.get('requests'))} requests), in the form {engine} verifies: {form}. ")
    if undecidable(d):
        return [verdict_callout(d, lead), not_available(
            f"no verdict and none of its numbers until the file is rewritten: `{command} --arms "
            f"{on_name},{off_name}` recomputes both arms; the arms table below shows the values that are valid")]
    parts = [verdict_callout(d, lead, spread_paragraph(result, d)), fastest_paragraph(result, d),
             shares_paragraph(on, "replay")]
    g = d.gain
    if g:
        speed = (f"; estimated speedup {gain_text(g.get('speedup_ratio'), g.get('speedup_interval'))}"
                 if finite(g.get("speedup_ratio")) else "")
        parts.append(f"<p>Paired gain of <strong>{on_name}</strong> over <strong>{off_name}</strong> (the same "
                     f"requests, resampled jointly): tau <strong>{gain_text(g.get('tau_ratio'), g.get('interval'))}"
                     f"</strong>{speed}.</p>")
    else:
        note = on.summary.get("paired_gain_note")
        parts.append(not_available(f"no paired gain of {on_name} over {off_name} in the replay"
                                   + (f" ({note})" if isinstance(note, str) and note else
                                      f" (replay both arms in one command: `{command} --arms {on_name},{off_name}`)")))
    parts.append(lexical_comparison(result))
    est = estimate(on)
    if est:
        device = " · ".join(esc(x) for x in (est.get("device_name"), est.get("device")) if isinstance(x, str) and x)
        off_est = estimate(off)
        speeds = (f" {on_name} {with_iv(est.get('speedup'), est.get('speedup_interval'), 'ratio')}"
                  + (f", {off_name} {with_iv(off_est.get('speedup'), off_est.get('speedup_interval'), 'ratio')}"
                     if off_est else "") + " over plain greedy.")
        mode = est.get("vllm_mode")
        mode = f" ({esc(mode)} mode, {'the mode that serves' if mode == 'compiled' else 'not the mode vLLM serves in by default'})" \
            if isinstance(mode, str) and d.engine == "vllm" else ""
        parts.append(f"<p>Estimated speedups (not measured), priced on {engine}{mode}: verification cost from the profile "
                     f"<code>{esc(est.get('profile', 'n/a'))}</code>" + (f" ({device})" if device else "")
                     + f", plus the drafting and update time measured in the replay:{speeds}</p>")
    else:
        note = on.summary.get("estimate_note")
        parts.append(not_available(
            f"{on_name}: {note}" if isinstance(note, str) and note else
            f"no estimated speedup for {on_name}: the replay had no verification-cost profile "
            "(`python -m decoder profile`)"))
    parts.append(calibration_table(on))
    return parts


def fastest_paragraph(result: Result, d: Decision) -> str:
    """The fastest configuration the engine can run among every replayed arm of its form (ours or a peer's), at
    batch 1 and at every other batch size the profile measured (an Oilbird arm sized for that batch,
    `@batch=B`, where replayed)."""
    lines = []
    for batch, arm, speed, iv in fastest_by_batch(result, d.form):
        lines.append(f"batch {batch}: <strong>{esc(arm)}</strong> {with_iv(speed, iv, 'ratio')}")
    if not lines:
        return not_available("no estimated speedup in the replay: no fastest configuration to name "
                             "(`python -m decoder profile`, then the replay)")
    engine = "vLLM" if d.engine == "vllm" else "the Oilbird harness"
    return (f"<p>Fastest configuration {engine} can run (estimated speedup over plain greedy at the same batch "
            f"size, 95% interval): {'; '.join(lines)}.</p>")


def fastest_by_batch(result: Result, form: str) -> list[tuple[int, str, float, list | None]]:
    """Per batch size: (batch, the arm with the highest estimated speedup, its speedup, interval). An arm sized
    for batch B (`@batch=B`) competes at B only; an arm sized for no batch competes at each through its
    `estimate_by_batch`. Trees compete only for a tree engine."""
    from decoder.cost.pricing import arm_batch

    rows: dict[int, tuple] = {}
    for arm in result.replay:
        chain = arm.name.startswith("oilbird") and ("chain" in arm.name) or arm.name in ("suffix-arctic", "pld")
        if form == "chain" and not chain:
            continue
        sized = arm_batch(arm.name) if "@batch=" in arm.name else None
        by = as_dict(arm.summary.get("estimate_by_batch"))
        for b, block in by.items():
            if not str(b).isdigit() or (sized is not None and int(b) != sized):
                continue
            if sized is None and "@batch=" not in arm.name and _has_sized(result, arm.name, int(b)):
                continue  # an Oilbird arm sized for this batch replays it: the unsized one is not what runs
            s = as_dict(block).get("speedup")
            if finite(s) and (int(b) not in rows or s > rows[int(b)][2]):
                rows[int(b)] = (int(b), arm.name, s, as_dict(block).get("speedup_interval"))
    return [rows[b] for b in sorted(rows)]


def _has_sized(result: Result, name: str, batch: int) -> bool:
    return batch > 1 and named(result.replay, f"{name}@batch={batch}") is not None


def calibration_table(arm: Arm) -> str:
    """The calibration of the arm's node probabilities: per source, predicted against observed acceptance."""
    from decoder.calibration import COMBINED

    cal = as_dict(as_dict(arm.summary.get("drafter_stats")).get("calibration"))
    if not cal:
        return ""
    rows = []
    for name, entry in sorted(cal.items(), key=lambda kv: (kv[0] == COMBINED, kv[0])):
        e = as_dict(entry)
        bins = e.get("bins") or []
        n = sum(b[0] for b in bins) or 0
        pred = sum(b[1] for b in bins) / n if n else None
        obs = sum(b[2] for b in bins) / n if n else None
        label = "the node (sources combined)" if name == COMBINED else name
        rows.append([esc(label), number(e.get("labels")), number(pred, "3f"), number(obs, "3f"),
                     number(e.get("ece"), "3f")])
    return table(["source", "labelled nodes", "mean predicted", "mean observed", "ECE"], rows, {1, 2, 3, 4},
                 caption=f"Calibration of {esc(arm.name)}'s node probabilities (decoder/calibration.py): every "
                         "candidate whose parent's next token the verification computed, scored against the estimate "
                         "made before it was seen; ECE = expected calibration error over 10 bins of predicted "
                         "probability.")


def live_verdict(result: Result, d: Decision) -> list[str]:
    """The verdict read from the live decoder (no replay of oilbird): its share, the measured speedups, and the
    replay an "enable" would need."""
    best = fastest_arm(result, exclude=d.arm)
    if undecidable(d):
        return [verdict_callout(d, f"From the live decoder (no replay with {ON_ARM}). "),
                not_available(f"no verdict until the file is rewritten: run `{replay_command(result)}`, or decode "
                              f"{ON_ARM} again")]
    return [verdict_callout(d, f"From the live decoder (no replay with {ON_ARM}). "),
            shares_paragraph(d.arm, "live decoder"),
            f"<p>Measured: <strong>{esc(d.arm.name)}</strong> {speed_text(d.arm)} over ar, against "
            f"{speed_text(best)} for the best other arm (<strong>{esc(best.name)}</strong>).</p>" if best else
            f"<p>Measured speedup of {esc(d.arm.name)}: {speed_text(d.arm)}.</p>",
            not_available(f"no replay with {ON_ARM}: run `{replay_command(result)}` for the paired gain over "
                          f"{OFF_ARM} with its interval, which an \"enable\" needs")]


def arms_block(result: Result, d: Decision | None) -> list[str]:
    """Below the verdict: the replayed arms beside the live ones with a tau chart, the node budgets, the warm
    pool, and the link to the evidence page."""
    parts = []
    notes: list[str] = []
    if result.replay:
        parts.append("<h3>Arms</h3>" + replay_table(result, notes))
        tau = [tau_of(a.summary) for a in result.replay]
        ivs = [iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(finite(x) for x in iv) else (None, None)
               for _, iv in tau]
        live = [tau_of(named(result.arms, a.name).summary)[0] if named(result.arms, a.name) else None
                for a in result.replay]
        value = lambda v: v if finite(v) else None  # noqa: E731
        if any(value(t) is not None for t, _ in tau):
            parts.append(charts.tau_chart([a.name for a in result.replay], [value(t) for t, _ in tau],
                                          [value(i[0]) for i in ivs], [value(i[1]) for i in ivs],
                                          [value(v) for v in live] if result.arms else None))
        if notes:
            parts.append(exact_notes(notes))
    if result.arms and result.replay:
        parts.append('<p class="note">Live decoder results (decode/, the section below) are the ground truth: '
                     "measured on the model, where the replay simulates the drafters over the traces and estimates "
                     "time. Where they disagree, trust the live run.</p>")
    if result.replay_nodes:
        chosen = d.arm.nodes if d is not None and d.source == "replay" else None
        parts.append("<h3>Node budgets</h3>" + nodes_table(result.replay_nodes, chosen))
    if result.replay_warm:
        parts.append("<h3>Warm pool</h3>" + warm_table(result.replay_warm))
    if has_evidence(result):
        parts.append(f'<p class="note">{ON_ARM} against every baseline with paired intervals, where its tokens come '
                     f'from, the ablations and the transplant ladder: <a href="{href(evidence_name(result))}">the '
                     "evidence page</a>.</p>")
    return parts


def decision_flags(result: Result, d: Decision) -> list[str]:
    """A line above the verdict when the replay it reads was computed on the store before it changed, or on
    a store without checksums (reports/freshness.py; the page's callout lists every such result)."""
    read = [a for a in (d.arm, d.off) if a is not None]
    out = []
    if any(is_stale(a.summary, result) for a in read):
        out.append('<p class="callout stale"><strong>Stale verdict:</strong> '
                   + esc(f"the replay it reads was computed on the trace store before the store changed; "
                         f"`{recompute_command(result)}` recomputes it.") + "</p>")
    if any(is_unverified(a.summary) for a in read):
        out.append('<p class="callout stale"><strong>Unverified store:</strong> '
                   + esc("the replay this verdict reads ran on a trace store without checksums.") + "</p>")
    return out


def decision_section(result: Result) -> str:
    """The decision block: the verdict with its rule and numbers, read from the replay (else the live decoder)."""
    sid, title = "decision", "Decision: enable the semantic source?"
    command = replay_command(result)
    if not result.has_decoder:
        return section(sid, title, not_available(
            f"no replay or decoder results under {result.bench}/{result.model}/ (run `{command}`; it needs only "
            "the trace store)"))
    d = decide(result)
    if d is not None and d.source == "replay":
        parts = [*decision_flags(result, d), *replay_verdict(result, d)]
    elif d is not None:
        parts = live_verdict(result, d)
    else:
        parts = [not_available(f"no arm reports a sole-source share: replay or decode the semantic arm `{ON_ARM}` "
                               f"with `{OFF_ARM}` (`{command}`)")]
    return section(sid, title, *parts, *arms_block(result, d))
