"""oilbird against each lexical baseline, and the target line (decoder/policy.py's target rule).

The comparison reads ablations.json's `headline` (`python -m decoder ablations`: every baseline replayed
paired against oilbird), else the replay (paired only where an arm was replayed against oilbird). The
target line holds oilbird over the best lexical arm to the rule: met, not met, or not established
without a paired interval; where ablations.json's own `target_met` disagrees with its numbers, the line
says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from data.store.layout import ABLATIONS_FILE
from decoder.policy import (
    LEXICAL_ARMS,
    ON_ARM,
    TARGET_LOWER,
    TARGET_RATIO,
    TARGET_RULE,
    target_interval,
    target_status,
)
from reports.arms import as_dict, est_speedup, form_pair, named, tau_of
from reports.htmlkit import esc, finite, not_available, number
from reports.results import ABLATIONS_COMMAND, Arm, Result

BASELINE_LABELS = {"suffix": "SuffixDecoding (ours)", "suffix-arctic-tree": "SuffixDecoding (ArcticInference, tree)",
                   "suffix-arctic": "SuffixDecoding (ArcticInference, vLLM's defaults)", "sam": "SAM-Decoding",
                   "lexical": "lexical sources merged", "recycling": "Token Recycling", "pld": "prompt lookup (PLD)"}


def _paired_over(arm: Arm) -> tuple[float | None, list | None]:
    """oilbird's tau over `arm`'s, paired, from the arm's paired_gain when it was paired against oilbird (its
    tau_ratio is arm / oilbird: inverted, the percentile interval's ends swap)."""
    g = as_dict(arm.summary.get("paired_gain"))
    r, iv = g.get("tau_ratio"), g.get("interval")
    if g.get("versus") != ON_ARM or not finite(r) or r <= 0:
        return None, None
    ok = isinstance(iv, (list, tuple)) and len(iv) == 2 and all(finite(x) and x > 0 for x in iv)
    return 1 / r, ([1 / iv[1], 1 / iv[0]] if ok else None)


def _replay_row(arm: Arm, label: str) -> dict:
    tau, iv = tau_of(arm.summary)
    return {"arm": arm.name, "label": label, "tau": tau if finite(tau) else None,
            "tau_interval": list(iv) if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(map(finite, iv))
            else None, "speedup": est_speedup(arm), "exact": arm.summary.get("exact")
            if isinstance(arm.summary.get("exact"), bool) else None, "sole_source": arm.sole_source}


@dataclass
class Comparison:
    """oilbird against each baseline arm: from ablations.json's `headline` when it has one, else from the replay."""

    source: str  # "ablations.json" or "replay"
    on: dict | None  # oilbird's row (tau, tau_interval, ...)
    rows: list[dict]  # one per baseline arm: ... plus oilbird_over_arm, oilbird_over_arm_interval
    nodes: int | None
    requests: int | None


def comparison(result: Result) -> Comparison | None:
    abl = result.ablations
    if abl is not None and not abl.note and abl.headline:
        nodes, requests = abl.meta.get("nodes"), abl.meta.get("requests")
        return Comparison("ablations.json", abl.merged, abl.headline, nodes if finite(nodes) else None,
                        requests if finite(requests) else None)
    on_name = form_pair(result)[2]  # the form the engine verifies: oilbird's tree, or its chain for vLLM
    on = named(result.replay, on_name)
    arms = [a for a in result.replay if a.name in LEXICAL_ARMS and (on is None or a.nodes == on.nodes)]
    if on is None and not arms:
        return None
    on_row = _replay_row(on, f"merged ({on_name})") if on is not None else None
    rows = []
    for a in sorted(arms, key=lambda a: LEXICAL_ARMS.index(a.name)):
        row = _replay_row(a, BASELINE_LABELS.get(a.name, a.name))
        ratio, iv = _paired_over(a)
        if ratio is None and on_row is not None and on_row["tau"] is not None and row["tau"]:
            ratio = on_row["tau"] / row["tau"]
        row.update(oilbird_over_arm=ratio, oilbird_over_arm_interval=iv)
        rows.append(row)
    ref = on or arms[0]
    req = ref.summary.get("requests")
    return Comparison("replay", on_row, rows, ref.nodes, req if finite(req) else None)


@dataclass
class Target:
    """The target line: oilbird over the best lexical arm, held to the target rule (decoder/policy.py)."""

    arm: str  # the best lexical arm
    arm_tau: float | None
    on_tau: float | None
    ratio: float
    interval: list | None  # paired 95% interval of the ratio, when known
    status: str  # "met", "not met" or "not established" (at or above the line, but no paired interval)
    considered: list[str]  # the lexical arms compared
    source: str  # as Comparison.source
    file_says: bool | None  # ablations.json's own target_met, when the numbers came from it
    on_arm: str = ON_ARM  # the merged arm held to the line (oilbird-chain where the engine verifies chains)


def target(result: Result, h: Comparison | None = None) -> Target | None:
    """oilbird over the best lexical arm (ablations.json's `best_lexical`, else the highest tau among the
    comparison's lexical rows) held to the target rule; None when there is no ratio to hold to it."""
    h = h if h is not None else comparison(result)
    if h is None:
        return None
    lex = [r for r in h.rows if r["arm"] in LEXICAL_ARMS and finite(r.get("tau"))]
    on_tau = h.on.get("tau") if h.on else None
    on_tau = on_tau if finite(on_tau) else None
    abl = result.ablations
    best = abl.best_lexical if h.source == "ablations.json" and abl is not None else None
    if best is None:
        if not lex:
            return None
        best = max(lex, key=lambda r: r["tau"])
    ratio, iv = best.get("oilbird_over_arm"), best.get("oilbird_over_arm_interval")
    if not finite(ratio):
        row = next((r for r in h.rows if r["arm"] == best["arm"]), {})
        ratio, iv = row.get("oilbird_over_arm"), iv or row.get("oilbird_over_arm_interval")
    arm_tau = best.get("tau") if finite(best.get("tau")) else None
    if not finite(ratio) and on_tau is not None and arm_tau:
        ratio = on_tau / arm_tau
    if not finite(ratio):
        return None
    return Target(best["arm"], arm_tau, on_tau, float(ratio), target_interval(iv), target_status(ratio, iv),
                  sorted(r["arm"] for r in lex),
                  h.source, abl.target_met if h.source == "ablations.json" and abl is not None else None,
                  (h.on or {}).get("arm") or ON_ARM)


TARGET_CSS = {"met": "enable", "not met": "off", "not established": "neutral"}


def target_text(t: Target) -> str:
    """One paragraph: oilbird against the best lexical arm, the ratio with its paired interval, and the verdict
    on the target with the reason."""
    iv = f" [paired 95% {t.interval[0]:.3f}–{t.interval[1]:.3f}]" if t.interval else ""
    short = ("" if t.ratio >= TARGET_RATIO else
             f", short of the {TARGET_RATIO:g}× line by "
             f"{100 * (TARGET_RATIO - t.ratio) / TARGET_RATIO:.1f}%")
    if t.status == "met":
        why = f"at or above {TARGET_RATIO:g}× and the paired lower end {t.interval[0]:.3f} is above {TARGET_LOWER:g}"
    elif t.ratio < TARGET_RATIO:
        why = f"below {TARGET_RATIO:g}×"
    elif t.interval is not None:
        why = f"the paired lower end {t.interval[0]:.3f} is not above {TARGET_LOWER:g}"
    else:
        why = (f"no paired interval for the ratio (replay the arms paired against {ON_ARM}: "
               f"`{ABLATIONS_COMMAND}`)")
    among = ", ".join(t.considered) if t.considered else t.arm
    where = ABLATIONS_FILE if t.source == "ablations.json" else "the replay"
    disagree = ""
    if t.file_says is not None and t.status != "not established" and t.file_says != (t.status == "met"):
        disagree = (f" ({ABLATIONS_FILE} itself says target_met = {str(t.file_says).lower()}; the numbers "
                    "shown give the verdict above.)")
    elif t.file_says is not None and t.status == "not established":
        disagree = f" ({ABLATIONS_FILE} says target_met = {str(t.file_says).lower()}.)"
    return (f'<div class="callout {TARGET_CSS[t.status]} target"><p>Against the best lexical arm (of '
            f"{esc(among)}; from {esc(where)}): <strong>{esc(t.on_arm)}</strong> tau {number(t.on_tau, '2f')} vs "
            f"<strong>{esc(t.arm)}</strong> {number(t.arm_tau, '2f')}, <strong>{t.ratio:.3f}×</strong>{iv}{short}."
            f"</p>\n<p>Target, {esc(TARGET_RULE)}: <strong>{esc(t.status)}</strong> ({esc(why)}).{esc(disagree)}</p>"
            "</div>")


def lexical_comparison(result: Result) -> str:
    """oilbird's tau against the best lexical arm (ablations.json's headline, else the replay at the same node
    budget), and the target line."""
    t = target(result)
    if t is None:
        return not_available(f"no lexical arm ({', '.join(LEXICAL_ARMS)}) replayed beside {ON_ARM} to compare with")
    return target_text(t)
