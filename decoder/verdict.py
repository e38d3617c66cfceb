"""Should the semantic draft source be enabled on this traffic? One rule, written once.

The reports (reports/decision.py) and the replay command read it from here; it imports nothing but the
standard library and the policy's thresholds and arm names (decoder/policy.py), so any page or command
can use it without loading a model.

The rule (the paper's lines, section "Generality": above about 9% sole-source share the semantic
source pays for itself, below about 3% it does not; the thresholds and arm names are decoder/policy.py's).
It decides on intervals, never on a point estimate beside a line its interval crosses:

  share  = sole-source share of `oilbird`: accepted tokens that only the semantic source proposed,
           over all committed tokens (bonus tokens included; the paper's definition), given with its
           95% interval [s_lo, s_hi] (request bootstrap)
  gain   = the paired tau gain of `oilbird` over `oilbird-no-semantic` (requests resampled jointly),
           given as its 95% interval [g_lo, g_hi]
  speedups (optional) = the estimated (or measured) speedups over plain greedy of the two arms

  enable     s_lo >= ENABLE_SHARE (9%): the share's interval lies wholly at or above the enable line,
             and g_lo > 1, and, when both speedups are given, speedup_on > speedup_off
  leave off  s_hi < OFF_SHARE (3%): the share's interval lies wholly below the off line,
             or g_hi < 1, or, when both speedups are given, speedup_on < speedup_off / SPEED_MARGIN
             (1.02): the key costs more time than it saves
  neutral    otherwise; the reasons say which condition kept it from "enable", and name the line an
             interval straddles ("the share's interval straddles the 3% line": s_lo < 3% <= s_hi, and
             likewise for the 9% line; a share interval between the lines, 3% <= s_lo and s_hi < 9%,
             is neutral without straddling either)

The two outcomes exclude each other (a valid interval has lo <= hi, and 3% < 9%), so the order of the
checks does not matter. The share's point estimate is reported, never compared with a line. A missing
input (None, NaN, an interval that is not two finite numbers with lo <= hi) never raises: without a
share, or without its interval (a replay without bootstrap draws), the share's side of the lines is not
established, so the share can make the verdict neither "enable" nor "leave off" (the reasons say so);
without a gain interval the verdict cannot be "enable"; without both speedups the speed conditions are
skipped (and said so).

A number that cannot be what it claims (a share or an end of its interval outside [0, 1], a speedup or a gain
interval end at or below 0) gives "cannot decide" (CANNOT_DECIDE), not a decision: the rule is never
applied to a value that is wrong. The reports also give it, through `cannot_decide`, when a result file the
verdict reads lacks a field or holds an invalid one (data/results.py); no other quantity is ever read in a
missing one's place.

The profile prices the arms and sizes the cost-sized drafts, so the share, the gain and the speedups move with
it. `sensitivity` applies the same rule to the replay's `profile_spread` block (the verdict's pair sized and
priced with every verify step at the fastest, then at the slowest, of its repetitions: decoder/cost/spread.py)
and says in one line whether the verdict holds at both ends, or what each end decides and why, or that the
spread is unknown (a profile that kept only medians). It states; it does not change the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from decoder.policy import ENABLE_SHARE, OFF_ARM, OFF_SHARE, ON_ARM, SPEED_MARGIN

DECISIONS = ("enable", "neutral", "leave off")
CANNOT_DECIDE = "cannot decide"  # not an outcome of the rule: its inputs are missing or invalid

def rule_text(on: str = ON_ARM, off: str = OFF_ARM) -> str:
    """The rule in one sentence, for the pair `on` / `off` (the form the engine verifies: decoder/policy.py)."""
    return (f"Enable the semantic source when the 95% interval of the sole-source share of {on} (accepted tokens "
            f"only the semantic source proposed, over all committed tokens) lies entirely at or above "
            f"{100 * ENABLE_SHARE:g}%, the paired tau gain of {on} over {off} has its 95% interval entirely above 1 "
            f"and, when both estimated speedups are known, {on}'s is the higher; leave it off when the share's "
            f"interval lies entirely below {100 * OFF_SHARE:g}%, or the gain's interval lies entirely below 1, or "
            f"{on}'s estimated speedup is below {off}'s divided by {SPEED_MARGIN:g}; otherwise neutral (an "
            f"interval that straddles a line decides nothing).")


RULE = rule_text()


@dataclass(frozen=True)
class Verdict:
    decision: str  # one of DECISIONS
    rule: str  # the rule in one sentence, with its thresholds (RULE)
    reasons: list[str] = field(default_factory=list)  # the numbers that decided it, formatted


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _interval(iv) -> tuple[float, float] | None:
    if not isinstance(iv, (list, tuple)) or len(iv) != 2:
        return None
    lo, hi = _num(iv[0]), _num(iv[1])
    if lo is None or hi is None or lo > hi:
        return None
    return lo, hi


def cannot_decide(reasons: list[str], on_arm: str = ON_ARM, off_arm: str = OFF_ARM) -> Verdict:
    """The verdict when an input is missing or invalid: each reason says which (e.g. "<file> lacks <field>")."""
    return Verdict(CANNOT_DECIDE, rule_text(on_arm, off_arm), [f"cannot decide: {r}" for r in reasons])


def _out_of_range(share, share_interval, gain_interval, speedup_on, speedup_off, on_arm: str, off_arm: str) -> list[str]:
    """The inputs that are numbers but cannot be what they claim to be."""
    bad = []
    share = _num(share)
    if share is not None and not 0 <= share <= 1:
        bad.append(f"the sole-source share of {on_arm} is {share:g}, outside [0, 1]")
    siv = _interval(share_interval)
    if siv is not None and not (0 <= siv[0] and siv[1] <= 1):
        bad.append(f"the sole-source share interval {siv[0]:g}–{siv[1]:g} of {on_arm} is not within [0, 1]")
    giv = _interval(gain_interval)
    if giv is not None and giv[0] <= 0:
        bad.append(f"the paired tau gain interval {giv[0]:g}–{giv[1]:g} is not above 0")
    for arm, v in ((on_arm, _num(speedup_on)), (off_arm, _num(speedup_off))):
        if v is not None and v <= 0:
            bad.append(f"the speedup of {arm} is {v:g}, not above 0")
    return bad


def _pct(v: float) -> str:
    x = 100 * v
    return f"{x:.2f}%" if abs(x) < 10 else f"{x:.1f}%"


def _line(v: float) -> str:
    return f"{100 * v:g}%"


def verdict(share, share_interval, gain_interval, speedup_on=None, speedup_off=None, on_arm: str = ON_ARM,
            off_arm: str = OFF_ARM) -> Verdict:
    """The decision for the semantic source (see the module docstring for the rule, stated exactly).

    share: sole-source share of oilbird (a fraction, over all committed tokens; reported, never compared with a
    line); share_interval: its 95% interval, which the rule compares with the lines; gain_interval: the 95%
    interval of the paired tau ratio oilbird / oilbird-no-semantic; speedup_on / speedup_off: the speedups over plain greedy of
    oilbird and oilbird-no-semantic (both, or the speed conditions are skipped); `on_arm` / `off_arm`: the
    pair's names (oilbird-chain / oilbird-no-semantic-chain where the engine verifies chains).
    """
    bad = _out_of_range(share, share_interval, gain_interval, speedup_on, speedup_off, on_arm, off_arm)
    if bad:
        return cannot_decide(bad, on_arm, off_arm)
    share, siv, giv = _num(share), _interval(share_interval), _interval(gain_interval)
    on, off = _num(speedup_on), _num(speedup_off)
    off_why: list[str] = []  # conditions for "leave off" that hold
    not_enable: list[str] = []  # conditions for "enable" that fail (without making it "leave off")
    enable_why: list[str] = []  # conditions for "enable" that hold

    if share is None:
        not_enable.append(f"no sole-source share for {on_arm}: cannot enable")
    elif siv is None:
        not_enable.append(f"sole-source share {_pct(share)} has no 95% interval (a run without bootstrap draws): "
                          f"which side of the {_line(OFF_SHARE)} and {_line(ENABLE_SHARE)} lines it lies on is not "
                          "established")
    else:
        lo, hi = siv
        txt = f"sole-source share {_pct(share)} (95% interval {_pct(lo).rstrip('%')}–{_pct(hi)})"
        if hi < OFF_SHARE:
            off_why.append(f"{txt}: its interval lies entirely below the {_line(OFF_SHARE)} line")
        elif lo >= ENABLE_SHARE:
            enable_why.append(f"{txt}: its interval lies entirely at or above the {_line(ENABLE_SHARE)} line")
        else:
            crossed = [_line(x) for x in (OFF_SHARE, ENABLE_SHARE) if lo < x <= hi]
            if crossed:
                lines = " and the ".join(crossed) + (" lines" if len(crossed) > 1 else " line")
                not_enable.append(f"the share's interval straddles the {lines}: {txt}")
            else:
                not_enable.append(f"{txt}: its interval lies between the {_line(OFF_SHARE)} off line and the "
                                  f"{_line(ENABLE_SHARE)} enable line")

    if giv is None:
        what = "no paired tau gain interval" if gain_interval is None else "the paired tau gain interval is not valid"
        not_enable.append(f"{what} ({on_arm} / {off_arm}): cannot enable")
    else:
        txt = f"paired tau gain over {off_arm}, 95% interval {giv[0]:.3f}–{giv[1]:.3f}"
        if giv[1] < 1:
            off_why.append(f"{txt}, entirely below 1")
        elif giv[0] <= 1:
            not_enable.append(f"{txt}, includes 1 (not a clear gain)")
        else:
            enable_why.append(f"{txt}, entirely above 1")

    notes: list[str] = []  # inputs that were not given
    if on is not None and off is not None:
        txt = f"speedup {on:.2f}× with the semantic source against {off:.2f}× without"
        if on < off / SPEED_MARGIN:
            off_why.append(f"{txt}: more than {100 * (SPEED_MARGIN - 1):g}% slower, the key costs more time "
                           "than it saves")
        elif on <= off:
            not_enable.append(f"{txt}: not faster")
        else:
            enable_why.append(f"{txt}: faster")
    else:
        missing = "neither speedup" if on is None and off is None else (
            f"no speedup for {on_arm}" if on is None else f"no speedup for {off_arm}")
        notes.append(f"speed condition skipped ({missing} given)")

    if off_why:  # the decisive numbers first, then the rest for context
        return Verdict("leave off", rule_text(on_arm, off_arm), off_why + not_enable + enable_why + notes)
    if not_enable:
        return Verdict("neutral", rule_text(on_arm, off_arm),
                       [f"kept from enable: {r}" for r in not_enable] + enable_why + notes)
    return Verdict("enable", rule_text(on_arm, off_arm), enable_why + notes)


# ---------------------------------------------------------------- the verdict at the ends of the profile's spread

END_WORDS = {"fast": "the fast end (every step at the fastest of its repetitions)",
             "slow": "the slow end (every step at the slowest of its repetitions)"}


@dataclass(frozen=True)
class Sensitivity:
    """Whether the verdict holds at both ends of the profile's measured spread (decoder/cost/spread.py)."""

    holds: bool | None  # True: the same decision at both ends; False: an end decides otherwise; None: unknown
    line: str  # one line for the page and the replay command
    ends: dict = field(default_factory=dict)  # end -> the Verdict there (empty when unknown)


def _share_iv(entry: dict) -> str:
    v, iv = _num(entry.get("value")), _interval(entry.get("interval"))
    if v is None:
        return "not known"
    return _pct(v) + (f" [{_pct(iv[0]).rstrip('%')}–{_pct(iv[1])}]" if iv else " (no interval)")


def sensitivity(main: Verdict, block, on_arm: str = ON_ARM, off_arm: str = OFF_ARM) -> Sensitivity | None:
    """The verdict `main` against the same rule applied to the replay's `profile_spread` block (the key-on arm's
    summary.json: decoder/replay/run.py add_profile_spread), end by end; None when there is no block (a replay
    without a profile, or from before the spread was kept) or `main` could not decide."""
    if not isinstance(block, dict) or main.decision == CANNOT_DECIDE:
        return None
    ends = block.get("ends")
    if not isinstance(ends, dict) or not ends:
        note = block.get("note")
        return Sensitivity(None, "Profile spread unknown: " + (note.removeprefix("spread unknown: ")
                                                                if isinstance(note, str) and note else
                                                                "the replay recorded no end of it"))
    got: dict[str, Verdict] = {}
    shares: dict[str, str] = {}
    for end in ("fast", "slow"):
        e = ends.get(end) if isinstance(ends.get(end), dict) else {}
        share = e.get("sole_source_share") if isinstance(e.get("sole_source_share"), dict) else {}
        gain = e.get("paired_gain") if isinstance(e.get("paired_gain"), dict) else {}
        got[end] = verdict(share.get("value"), share.get("interval"), gain.get("interval"), e.get("speedup"),
                           e.get("speedup_versus"), on_arm, off_arm)
        shares[end] = _share_iv(share)
    reps, width = block.get("reps"), _num(block.get("width"))
    what = ", ".join(x for x in (
        f"{reps} repetitions a point" if isinstance(reps, int) and not isinstance(reps, bool) else "",
        f"the slowest up to {100 * width:.0f}% above the fastest" if width is not None else "") if x)
    what = f" ({what})" if what else ""
    if all(v.decision == main.decision for v in got.values()):
        return Sensitivity(True, f"The verdict holds at both ends of the profile's measured spread{what}: "
                                 f"sole-source share {shares['fast']} at the fast end, {shares['slow']} at the slow "
                                 "end.", got)
    parts = []
    for end, v in got.items():
        said = v.reasons[0].removeprefix("kept from enable: ").split(": sole-source share ")[0] if v.reasons else ""
        parts.append(f"at {END_WORDS[end]}: share {shares[end]} → {v.decision.upper()}"
                     + (" (as at the median)" if v.decision == main.decision else f" ({said})"))
    return Sensitivity(False, f"The verdict does not hold across the profile's measured spread{what}: "
                              + "; ".join(parts) + ".", got)
