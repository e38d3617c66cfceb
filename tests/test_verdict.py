"""decoder/verdict.py: the one rule that decides whether to enable the semantic source, branch by branch; and
decoder/policy.py: its thresholds, the arms the decision names, and the target rule."""

from __future__ import annotations

import math

import pytest

from decoder.policy import (
    DECISION_ARMS,
    ENABLE_SHARE,
    LEXICAL_ARMS,
    OFF_ARM,
    OFF_SHARE,
    ON_ARM,
    SPEED_MARGIN,
    TARGET_RULE,
    TARGET_STATUSES,
    target_status,
)
from decoder.verdict import DECISIONS, RULE, Verdict, verdict

GAIN_UP = [1.01, 1.07]  # clearly above 1
GAIN_FLAT = [0.98, 1.03]  # includes 1
GAIN_DOWN = [0.90, 0.97]  # clearly below 1
HIGH = [0.10, 0.14]  # a share interval wholly above the 9% line
LOW = [0.01, 0.025]  # ... wholly below the 3% line


def test_constants_and_rule_text():
    assert (ENABLE_SHARE, OFF_SHARE, SPEED_MARGIN) == (0.09, 0.03, 1.02)
    assert DECISIONS == ("enable", "neutral", "leave off")
    for words in ("95% interval of the sole-source share", "entirely at or above 9%", "entirely below 3%",
                  "entirely above 1", "entirely below 1", "divided by 1.02", "over all committed tokens",
                  "oilbird-no-semantic", "otherwise neutral", "straddles a line decides nothing"):
        assert words in RULE, words
    assert verdict(0.12, HIGH, GAIN_UP).rule == RULE


# ---------------------------------------------------------------- the brute-force reference

def reference(share_iv, gain_iv, on, off) -> str:
    """The rule of docs/replay.md "The verdict", written from its words, one input at a time: each input says
    "for", "against" or "open", then enable needs every "for" and no "against", leave off any "against"."""
    if share_iv is None:
        share = "open"  # no interval: which side of the lines is not established
    elif share_iv[1] < 0.03:
        share = "against"  # wholly below the off line
    elif share_iv[0] >= 0.09:
        share = "for"  # wholly at or above the enable line
    else:
        share = "open"  # straddles a line, or lies between them
    if gain_iv is None:
        gain = "open"
    elif gain_iv[1] < 1:
        gain = "against"
    elif gain_iv[0] > 1:
        gain = "for"
    else:
        gain = "open"
    if on is None or off is None:
        speed = "for"  # skipped: it neither helps nor blocks
    elif on * 1.02 < off:
        speed = "against"
    elif on > off:
        speed = "for"
    else:
        speed = "open"
    states = (share, gain, speed)
    if "against" in states:
        return "leave off"
    if states == ("for", "for", "for"):
        return "enable"
    return "neutral"


SHARE_ENDS = [0.0, 0.01, 0.0299999, 0.03, 0.0300001, 0.05, 0.0899999, 0.09, 0.0900001, 0.2, 1.0]
SHARE_IVS = [None] + [[lo, hi] for lo in SHARE_ENDS for hi in SHARE_ENDS if lo <= hi]
GAIN_IVS = [None, [0.8, 0.9], [0.8, 0.9999], [0.8, 1.0], [0.9, 1.1], [1.0, 1.2], [1.0001, 1.2], [1.1, 1.3]]
SPEEDS = [(None, None), (2.0, None), (2.1, 2.0), (2.0, 2.0), (1.0, 1.02), (0.999, 1.02), (1.5, 2.0)]


def test_verdict_matches_the_brute_force_table():
    """Every combination of a grid of share intervals (each end just below, at and just above both lines),
    gain intervals and speedup pairs: the rule in decoder/verdict.py against the reference above."""
    seen = {d: 0 for d in DECISIONS}
    for siv in SHARE_IVS:
        share = None if siv is None else (siv[0] + siv[1]) / 2
        for giv in GAIN_IVS:
            for on, off in SPEEDS:
                v = verdict(share, siv, giv, on, off)
                want = reference(siv, giv, on, off)
                assert v.decision == want, (siv, giv, on, off, v.reasons)
                seen[want] += 1
    assert all(seen.values()) and sum(seen.values()) == len(SHARE_IVS) * len(GAIN_IVS) * len(SPEEDS)


@pytest.mark.parametrize("point", [0.0, 0.02, 0.05, 0.12, 1.0])
def test_the_point_estimate_never_decides(point):
    """The share's point estimate is reported; only its interval meets the lines (a point outside its own
    interval, which a damaged file could hold, changes nothing)."""
    assert verdict(point, HIGH, GAIN_UP, 2.1, 2.0).decision == "enable"
    assert verdict(point, LOW, GAIN_UP, 2.1, 2.0).decision == "leave off"
    assert verdict(point, [0.02, 0.04], GAIN_UP, 2.1, 2.0).decision == "neutral"


# ---------------------------------------------------------------- the reasons

def test_enable_all_conditions_hold():
    v = verdict(0.12, [0.10, 0.14], GAIN_UP, 2.1, 2.0)
    assert isinstance(v, Verdict) and v.decision == "enable"
    text = " | ".join(v.reasons)
    assert ("sole-source share 12.0% (95% interval 10.0–14.0%): its interval lies entirely at or above the 9% line"
            in text)
    assert "1.010–1.070" in text and "2.10× with the semantic source against 2.00× without" in text


def test_enable_without_speedups_says_the_speed_condition_was_skipped():
    v = verdict(0.12, HIGH, GAIN_UP)
    assert v.decision == "enable"
    assert any("speed condition skipped (neither speedup given)" in r for r in v.reasons)
    v = verdict(0.12, HIGH, GAIN_UP, 2.0, None)  # one speedup is not a comparison
    assert v.decision == "enable" and any("no speedup for oilbird-no-semantic" in r for r in v.reasons)


@pytest.mark.parametrize("interval,line", [
    ([0.0231, 0.0469], "the 3% line"),  # API-Bank on one machine: 3.45% [2.31-4.69%]
    ([0.0204, 0.0388], "the 3% line"),  # ... and on the other: 2.91% [2.04-3.88%], point below the line
    ([0.07, 0.11], "the 9% line"),
    ([0.02, 0.10], "the 3% and the 9% lines"),
    ([0.0299, 0.03], "the 3% line"),  # the upper end on the line: not wholly below it
    ([0.0899, 0.09], "the 9% line"),
])
def test_neutral_names_the_line_the_share_straddles(interval, line):
    share = (interval[0] + interval[1]) / 2
    v = verdict(share, interval, GAIN_UP, 2.1, 2.0)
    assert v.decision == "neutral"
    assert v.reasons[0].startswith(f"kept from enable: the share's interval straddles {line}: sole-source share ")


def test_neutral_between_the_lines_and_without_an_interval():
    v = verdict(0.05, [0.04, 0.06], GAIN_UP, 2.1, 2.0)
    assert v.decision == "neutral" and v.reasons[0] == (
        "kept from enable: sole-source share 5.00% (95% interval 4.00–6.00%): its interval lies between the 3% off "
        "line and the 9% enable line")
    assert "straddles" not in " ".join(v.reasons)
    for share in (0.01, 0.5):  # no interval (a run without bootstrap draws): neither side is established
        v = verdict(share, None, GAIN_UP, 2.1, 2.0)
        assert v.decision == "neutral" and "has no 95% interval" in v.reasons[0] and "not established" in v.reasons[0]
    v = verdict(0.12, HIGH, GAIN_FLAT)
    assert v.decision == "neutral" and "0.980–1.030, includes 1" in v.reasons[0]
    v = verdict(0.12, HIGH, GAIN_UP, 2.0, 2.0)
    assert v.decision == "neutral" and v.reasons[0] == ("kept from enable: speedup 2.00× with the semantic source "
                                                        "against 2.00× without: not faster")


def test_leave_off_wins_over_other_conditions():
    # the share's interval below the off line, even with a clear gain and a faster arm
    v = verdict(0.02, [0.015, 0.025], GAIN_UP, 2.1, 2.0)
    assert v.decision == "leave off" and v.reasons[0] == (
        "sole-source share 2.00% (95% interval 1.50–2.50%): its interval lies entirely below the 3% line")
    # a high share, but the gain is clearly below 1
    v = verdict(0.2, HIGH, GAIN_DOWN)
    assert v.decision == "leave off" and "entirely below 1" in v.reasons[0]
    # a share that straddles the line, but the key costs more time than it saves: off, the straddle still said
    v = verdict(0.035, [0.02, 0.05], GAIN_UP, 1.5, 2.0)
    assert v.decision == "leave off" and "costs more time than it saves" in v.reasons[0]
    assert any("straddles the 3% line" in r for r in v.reasons)


def test_missing_inputs_never_crash_and_never_enable():
    v = verdict(None, None, None)
    assert v.decision == "neutral"
    assert any("no sole-source share" in r for r in v.reasons)
    assert any("no paired tau gain interval" in r for r in v.reasons)
    v = verdict(0.5, [0.4, 0.6], None, 3.0, 1.0)  # everything but the gain: not enable
    assert v.decision == "neutral" and v.reasons[0].startswith("kept from enable: no paired tau gain interval")
    assert verdict(0.01, LOW, None).decision == "leave off"  # the share alone can still say leave off
    assert verdict(None, None, GAIN_DOWN).decision == "leave off"
    assert verdict(None, None, GAIN_UP, 2.1, 2.0).decision == "neutral"
    assert verdict(None, HIGH, GAIN_UP, 2.1, 2.0).decision == "neutral"  # an interval without its share


@pytest.mark.parametrize("bad", [[1.2, 1.1], [1.1], [1.1, 1.2, 1.3], ["1.1", "1.2"], [math.nan, 1.2],
                                 [1.1, math.inf], "1.1-1.2", {"lo": 1.1}, [True, 2]])
def test_malformed_gain_interval_counts_as_missing(bad):
    v = verdict(0.12, HIGH, bad, 2.1, 2.0)
    assert v.decision == "neutral"
    assert any("the paired tau gain interval is not valid" in r for r in v.reasons)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "0.12", True, [0.12]])
def test_malformed_numbers_count_as_missing(bad):
    assert verdict(bad, HIGH, GAIN_UP).decision == "neutral"
    v = verdict(0.12, bad, GAIN_UP, 2.1, 2.0)  # a bad share interval is no interval: not established
    assert v.decision == "neutral" and "has no 95% interval" in v.reasons[0]
    v = verdict(0.12, HIGH, GAIN_UP, bad, 2.0)  # a bad speedup skips the check
    assert v.decision == "enable" and any("speed condition skipped" in r for r in v.reasons)


@pytest.mark.parametrize("interval", [[-0.01, 0.05], [0.5, 1.5]])
def test_a_share_interval_outside_0_1_cannot_decide(interval):
    from decoder.verdict import CANNOT_DECIDE

    v = verdict(0.04, interval, GAIN_UP)
    assert v.decision == CANNOT_DECIDE and "share interval" in v.reasons[0] and "not within [0, 1]" in v.reasons[0]


# ---------------------------------------------------------------- decoder/policy.py: arms and the target rule

def test_policy_arms():
    assert (ON_ARM, OFF_ARM) == ("oilbird", "oilbird-no-semantic")
    assert DECISION_ARMS == ("suffix", "suffix-arctic-tree", "lexical", "oilbird", "oilbird-no-semantic",
                             "oilbird-fixed", "oilbird-no-semantic-fixed")
    assert LEXICAL_ARMS == ("suffix", "suffix-arctic-tree", "suffix-arctic", "sam", "lexical", "recycling", "pld")
    assert TARGET_RULE == ("tau(oilbird) ≥ 1.25× the best lexical arm's, with the paired 95% interval's lower end "
                           "above 1")


@pytest.mark.parametrize("ratio,interval,status", [
    (1.3, [1.1, 1.5], "met"),
    (1.25, [1.0001, 1.5], "met"),  # the ratio line is inclusive
    (1.2499, [1.1, 1.5], "not met"),  # short of the line, even with a clear gain
    (1.3, [1.0, 1.6], "not met"),  # the lower end must be above 1
    (1.3, [0.95, 1.6], "not met"),
    (1.3, None, "not established"),  # above the line, but no paired interval (--bootstrap 0)
    (1.1, None, "not met"),  # below the line needs no interval
    (1.3, [1.1], "not established"),  # a malformed interval is no interval
    (1.3, [math.nan, 1.5], "not established"),
    (None, [1.1, 1.5], "not established"),
    (math.nan, None, "not established"),
])
def test_target_status(ratio, interval, status):
    assert status in TARGET_STATUSES
    assert target_status(ratio, interval) == status


def test_every_lexical_arm_has_a_report_label():
    """The decision block names every best-lexical candidate (a KeyError once broke `make census`)."""
    from reports.target import BASELINE_LABELS

    assert set(LEXICAL_ARMS) <= set(BASELINE_LABELS)
