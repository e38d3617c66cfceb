"""Reading decoder arms (live decode/ and replay/ summaries) and the tables of arms the pages share.

A live summary gives tau as a number (with `tau_interval`), a replay summary as {value, interval}; the
estimated speedup of a replay is its `estimate` block (a verification-cost profile), the measured one of
a live run its `speedup`. Every reader here returns None (shown as n/a) for a value that is missing or
not a finite number.
"""

from __future__ import annotations

from decoder.policy import FORM_PAIRS, ON_ARM, engine_form
from decoder.verify.reference import REFERENCE_ARM, STATIC_ARM
from reports.htmlkit import esc, finite, gain_text, interval, number, table, with_iv
from reports.results import DECISION_NODES, Arm, Result

BASIS_TEXT = {
    "committed": "of all committed tokens (bonus tokens included; the paper's definition)",
    "draft": "of accepted draft tokens (bonus tokens left out)",
}


def as_dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def named(arms: list[Arm], name: str) -> Arm | None:
    return next((a for a in arms if a.name == name), None)


def form_pair(result: Result) -> tuple[str, str, str, str]:
    """(engine, form, key-on arm, key-off arm) the replay decides in: the engine its estimates were priced on
    (harness when none says), the form that engine verifies (decoder/policy.py), and that form's pair when its
    key-on arm was replayed, else the tree's (oilbird, oilbird-no-semantic)."""
    engine = next((e for e in (estimate(a).get("engine") for a in result.replay) if isinstance(e, str) and e),
                  "harness")
    form = engine_form(engine)
    if named(result.replay, FORM_PAIRS[form][0]) is None:
        form = "tree"
    return (engine, form, *FORM_PAIRS[form])


def tau_of(summary: dict):
    """(tau, interval) of a replay ({value, interval}) or live (a number, tau_interval) summary."""
    t = summary.get("tau")
    if isinstance(t, dict):
        return t.get("value"), t.get("interval")
    return t, summary.get("tau_interval")


def estimate(arm: Arm | None) -> dict:
    return as_dict(arm.summary.get("estimate")) if arm is not None else {}


def est_speedup(arm: Arm | None):
    v = estimate(arm).get("speedup")
    return v if finite(v) else None


def live_speedup(arm: Arm | None):
    v = arm.summary.get("speedup") if arm is not None else None
    return v if finite(v) else None


def speed_text(arm) -> str:
    return f"{arm.summary['speedup']:.2f}×" if arm is not None and finite(arm.summary.get("speedup")) else "n/a"


def speed_cell(arm: Arm) -> str:
    est = arm.summary.get("estimate")
    if isinstance(est, dict):
        return with_iv(est.get("speedup"), est.get("speedup_interval"), "ratio")
    note = arm.summary.get("estimate_note")
    tip = f' title="{esc(note)}"' if isinstance(note, str) and note else ""
    return f'<span class="na"{tip}>no profile</span>'


def exact_cell(summary: dict, notes: list[str]) -> str:
    exact = summary.get("exact")
    if exact is True:
        return "yes"
    if exact is False:
        reason = summary.get("exact_reason")
        if isinstance(reason, str) and reason:
            if reason not in notes:
                notes.append(reason)
            k = notes.index(reason) + 1
            return f'<span title="{esc(reason)}">no [{k}]</span>'
        return "no"
    return "n/a"


def exact_text(v) -> str:
    return "yes" if v is True else "no" if v is False else "n/a"


def tau_iv(row: dict | None, key: str = "tau", kind: str = "2f") -> str:
    if row is None:
        return "n/a"
    v = row.get(key)
    iv = row.get(f"{key}_interval")
    return number(v, kind) + (f" [{interval(iv, kind)}]" if iv is not None else "")


def interval_ends(rows: list[dict], key: str = "tau") -> tuple[list, list]:
    ivs = [r.get(f"{key}_interval") or [None, None] for r in rows]
    return [i[0] for i in ivs], [i[1] for i in ivs]


def share_text(entry: dict | None) -> str:
    """A sole-source share with its interval and counts, e.g. 3.10% [2.00–4.00%] (2,100 of 67,324)."""
    if not entry or not finite(entry.get("share")):
        return "–"
    counts = _sole_counts(entry)
    return with_iv(entry["share"], entry.get("interval"), "pct") + (f" ({counts})" if counts else "")


def _sole_counts(ss: dict) -> str:
    sole, total = ss.get("sole"), ss.get("total")
    return f"{int(sole):,} of {int(total):,}" if finite(sole) and finite(total) else ""


def share_arms(result: Result) -> list:
    """Live arms with a sole-source share of either definition (`oilbird` first, whose the live verdict reads)."""
    arms = [a for a in result.arms if any(finite(e.get("share")) for e in a.shares.values())]
    return sorted(arms, key=lambda a: a.name != ON_ARM)


def fastest_arm(result: Result, exclude=None):
    """The drafting arm (not a greedy reference, not `exclude`) with the highest speedup, or None."""
    arms = [a for a in result.arms if a is not exclude and a.name not in (REFERENCE_ARM, STATIC_ARM)
            and finite(a.summary.get("speedup"))]
    return max(arms, key=lambda a: a.summary["speedup"], default=None)


def replay_table(result: Result, notes: list[str]) -> str:
    """Replay arms (strictly-past pool) beside the live decoder's, one row per arm."""
    live = {a.name: a for a in result.arms}
    names = [a.name for a in result.replay] + [a.name for a in result.arms if named(result.replay, a.name) is None]
    head = ["arm", "nodes: budget / verified per pass", "accepted / node", "tau [95%]",
            "est. speedup [95%]", "drafting ms / pass (median)", "exact", "sole-source share, committed tokens",
            "… of accepted draft tokens"]
    if live:
        head += ["live tau", "live speedup (measured)"]
    rows = []
    for name in names:
        r, lv = named(result.replay, name), live.get(name)
        if r is not None:
            tau, iv = tau_of(r.summary)
            row = [esc(name), f'{number(r.nodes)} / {number(r.summary.get("mean_nodes"), "2f")}',
                   number(r.summary.get("accepted_per_node"), "3f"), with_iv(tau, iv), speed_cell(r),
                   drafting_cell(r.summary), exact_cell(r.summary, notes), share_text(r.shares.get("committed")),
                   share_text(r.shares.get("draft"))]
        else:
            row = [esc(name) + " (live only)", "–", "–", "–", "–", "–", "–", "–", "–"]
        if live:
            if lv is not None:
                ltau, liv = tau_of(lv.summary)
                row += [with_iv(ltau, liv), speed_text(lv)]
            else:
                row += ["–", "–"]
        rows.append(row)
    caption = ("Replay over the captured traces, strictly-past pool. nodes: the candidate budget, and what the engine "
               "verified per pass on average (an arm sized by the cost rule verifies fewer); accepted / node = "
               "accepted draft tokens over verified nodes. tau = committed tokens per verification pass "
               "(request-bootstrap 95% interval); est. speedup = estimated from a verification-cost profile "
               "(none: no profile); drafting = the drafter's time per pass on this machine, mean (median), which "
               "the estimate prices; exact = the replay makes the same passes as live decoding (see the notes).")
    caption += key_index_text([named(result.replay, n) for n in names])
    if live:
        caption += (" Live columns: the decoder run on the model (decode/); live results are the ground truth, "
                    "measured where the replay estimates.")
    return table(head, rows, {1, 2, 3, 4, 5} | ({9, 10} if live else set()), caption=caption)


def drafting_cell(summary: dict) -> str:
    """Drafting time per pass in ms: mean (median)."""
    d = summary.get("draft_s_per_pass") or {}
    mean, p50 = d.get("mean"), d.get("p50")
    if not finite(mean):
        return "–"
    return f"{1e3 * mean:.3f}" + (f" ({1e3 * p50:.3f})" if finite(p50) else "")


def key_index_text(runs) -> str:
    """One sentence per arm whose key answered from an index: what answered at the end and its measured
    recall (summary.json's index block)."""
    out = []
    for r in runs:
        if r is None or not r.summary.get("active_index"):
            continue
        rec = r.summary.get("knn_recall") or {}
        recall = (f", tie-aware recall@{rec.get('k')} against exact {rec['value']:.3f} on {rec.get('queries'):,} "
                  "sampled queries" if finite(rec.get("value")) else "")
        out.append(f"{r.name}'s key: {r.summary['active_index']}{recall}")
    return (" The semantic key's index: " + "; ".join(esc(t) for t in out) + ".") if out else ""


def exact_notes(notes: list[str]) -> str:
    """The numbered reasons behind replay_table's "no [k]" exact cells."""
    return "".join(f'<p class="note">[{k}] not exact: {esc(n)}</p>' for k, n in enumerate(notes, 1))


def nodes_table(by_nodes: dict[int, list[Arm]], chosen: int | None) -> str:
    budgets = sorted(by_nodes)
    names = list(dict.fromkeys(a.name for n in budgets for a in by_nodes[n]))
    rows = []
    for name in names:
        row = [esc(name)]
        for n in budgets:
            a = named(by_nodes[n], name)
            row.append(with_iv(*tau_of(a.summary)) if a is not None else "–")
        rows.append(row)
    head = ["arm"] + [f"tau at {n} nodes" + (" (decision)" if n == chosen else "") for n in budgets]
    return table(head, rows, set(range(1, len(budgets) + 1)),
                 caption="tau [95%] per node budget (replay/&lt;arm&gt;/nodes-&lt;N&gt;/). The decision reads "
                         f"{DECISION_NODES} nodes when replayed, else the largest budget.")


def warm_table(arms: list[Arm]) -> str:
    rows = []
    for a in arms:
        gain = as_dict(a.summary.get("paired_gain"))
        rows.append([esc(a.name), number(a.nodes), with_iv(*tau_of(a.summary)), speed_cell(a),
                     share_text(a.shares.get("committed")),
                     gain_text(gain.get("tau_ratio"), gain.get("interval")) if gain else "–"])
    return table(["arm", "nodes", "tau [95%]", "est. speedup [95%]", "sole-source share, committed tokens",
                  "paired tau gain"], rows, {1, 2, 3},
                 caption="Warm pool: every other request's trace is in the pool from the start (what a long-running "
                         "deployment approaches). For comparison only: the decision reads the strictly-past pool.")
