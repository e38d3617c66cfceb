"""What `python -m decoder replay` prints: one row per (arm, nodes) with tau, the estimated speedup and the
sole-source share (each with its 95% interval), drafting time per pass and exactness; the paired gains;
for oilbird against its paired arm, the verdict on the semantic source (decoder/verdict.py) and where
along the accepted path the key's gain lands."""

from __future__ import annotations

from decoder.verify.passes import DEPTH_ROWS
from decoder.policy import FORM_PAIRS, ON_ARM, engine_form


def _fmt_iv(v, iv, digits=2, pct=False) -> str:
    if v is None:
        return "n/a"
    scale = 100 if pct else 1
    txt = f"{scale * v:.{digits}f}" + ("%" if pct else "")
    if iv:
        txt += f" [{scale * iv[0]:.{digits}f}-{scale * iv[1]:.{digits}f}]"
    return txt


def format_depth_table(on: dict, off: dict, depths: tuple[int, ...] = DEPTH_ROWS) -> str:
    """Where the key's gain lands: per depth of the accepted path, the share of passes reaching it with
    the key and without, and the tokens there that only the semantic source proposed (per pass)."""
    a, b = on["by_depth"], off["by_depth"]
    lines = [f"per depth of the accepted path: {on['arm']} ({a['passes']} passes) vs {off['arm']} ({b['passes']} passes)",
             f"{'depth':>5} {'reach on':>9} {'reach off':>9} {'semantic alone':>15} {'spine':>7} {'semantic':>9}"]
    src = a["by_source"]
    for d in depths:
        if d > min(a["depths"], b["depths"]):
            break
        lines.append(f"{d:>5} {100 * a['reach'][d - 1]:>8.1f}% {100 * b['reach'][d - 1]:>8.1f}% "
                     f"{100 * a['sole_semantic'][d - 1] / max(a['passes'], 1):>14.2f}% "
                     f"{100 * (src.get('spine') or [0] * d)[d - 1] / max(a['passes'], 1):>6.1f}% "
                     f"{100 * (src.get('semantic') or [0] * d)[d - 1] / max(a['passes'], 1):>8.1f}%")
    lines.append("(reach: passes accepting at least d draft tokens; the other columns: accepted tokens at depth d "
                 "per pass of the arm with the key, by the source that proposed them)")
    return "\n".join(lines)


def format_table(summaries: dict[tuple[str, int], dict]) -> str:
    """The table `python -m decoder replay` prints."""
    width = max([10, *(len(a) + 1 for a, _ in summaries)])
    head = (f"{'arm':<{width}} {'nodes':>5} {'tau [95%]':>20} {'est. speedup':>20} {'sole share':>22} "
            f"{'draft ms/pass':>13} {'draft %':>7} {'exact':>5} {'seconds':>7}")
    lines = [head]
    for (arm, nodes), s in summaries.items():
        est = s.get("estimate") or {}
        share = s.get("sole_source_share") or {}
        draft = s["draft_s_per_pass"]["mean"]
        frac = est.get("draft_fraction")
        lines.append(
            f"{arm:<{width}} {nodes:>5} {_fmt_iv(s['tau']['value'], s['tau']['interval']):>20} "
            f"{_fmt_iv(est.get('speedup'), est.get('speedup_interval')):>20} "
            f"{_fmt_iv(share.get('value'), share.get('interval'), 1, pct=True) if share else '-':>22} "
            f"{(1000 * draft if draft is not None else float('nan')):>13.3f} "
            f"{(f'{100 * frac:.1f}' if frac is not None else 'n/a'):>7} {('yes' if s['exact'] else 'no'):>5} "
            f"{s['seconds']:>7.1f}")
    for (arm, nodes), s in summaries.items():
        g = s.get("paired_gain")
        if g:
            lines.append(f"paired gain {arm} / {g['versus']} (nodes {nodes}): tau x{_fmt_iv(g['tau_ratio'], g['interval'], 3)}"
                         + (f", est. speedup x{_fmt_iv(g['speedup_ratio'], g['speedup_interval'], 3)}"
                            if g.get("speedup_ratio") is not None else ""))
    # the verdict in the form the profile's engine verifies (decoder/policy.py): oilbird-chain for vLLM, else oilbird
    engine = next((s["estimate"].get("engine") for s in summaries.values() if s.get("estimate")), None)
    names = [FORM_PAIRS[engine_form(engine)][0], ON_ARM]
    on = next((s for name in names for (arm, _), s in summaries.items() if arm == name and s.get("paired_gain")), None)
    if on is not None:
        from decoder.verdict import CANNOT_DECIDE, sensitivity, verdict

        off = summaries.get((on["paired_gain"]["versus"], on["nodes"])) or {}
        share = on.get("sole_source_share") or {}
        v = verdict(share.get("value"), share.get("interval"), on["paired_gain"]["interval"],
                    (on.get("estimate") or {}).get("speedup"), (off.get("estimate") or {}).get("speedup"),
                    on["arm"], on["paired_gain"]["versus"])
        if v.decision == CANNOT_DECIDE:  # an input out of its range (decoder/verdict.py): no decision to state
            lines.append(f"verdict: CANNOT DECIDE ({'; '.join(v.reasons)})")
        else:
            lines.append(f"verdict: {v.decision.upper()} the semantic source ({'; '.join(v.reasons)})")
        spread = sensitivity(v, on.get("profile_spread"), on["arm"], on["paired_gain"]["versus"])
        if spread is not None:  # the same rule at both ends of the profile's measured spread
            lines.append(f"profile: {spread.line}")
        lines.append(f"rule: {v.rule}")
        if on.get("by_depth") and off.get("by_depth"):
            lines.append(format_depth_table(on, off))
    notes = {n for s in summaries.values() for n in (s.get("estimate_note"), s.get("store_note")) if n}
    lines += [f"note: {n}" for n in sorted(notes)]
    return "\n".join(lines)
