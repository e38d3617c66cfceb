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


def test_constants_and_rule_text():
    assert (ENABLE_SHARE, OFF_SHARE, SPEED_MARGIN) == (0.09, 0.03, 1.02)
    assert DECISIONS == ("enable", "neutral", "leave off")
    for words in ("at least 9%", "below 3%", "entirely above 1", "entirely below 1", "divided by 1.02",
                  "over all committed tokens", "oilbird-no-semantic", "otherwise neutral"):
        assert words in RULE, words
    assert verdict(0.1, None, GAIN_UP).rule == RULE


def test_enable_all_conditions_hold():
    v = verdict(0.12, [0.10, 0.14], GAIN_UP, 2.1, 2.0)
    assert isinstance(v, Verdict) and v.decision == "enable"
    text = " | ".join(v.reasons)
    assert "12.0%" in text and "10.0–14.0%" in text  # the share and its interval
    assert "1.010–1.070" in text and "2.10× with the semantic source against 2.00× without" in text


def test_enable_without_speedups_says_the_speed_condition_was_skipped():
    v = verdict(0.12, None, GAIN_UP)
    assert v.decision == "enable"
    assert any("speed condition skipped (neither speedup given)" in r for r in v.reasons)
    v = verdict(0.12, None, GAIN_UP, 2.0, None)  # one speedup is not a comparison
    assert v.decision == "enable" and any("no speedup for oilbird-no-semantic" in r for r in v.reasons)


@pytest.mark.parametrize("share,decision", [
    (0.09, "enable"),  # the enable line is inclusive
    (0.0899999, "neutral"),
    (0.03, "neutral"),  # the off line is exclusive
    (0.0299999, "leave off"),
    (0.0, "leave off"),
    (1.0, "enable"),
])
def test_share_boundaries(share, decision):
    assert verdict(share, None, GAIN_UP, 2.1, 2.0).decision == decision


@pytest.mark.parametrize("gain,decision", [
    ([1.0001, 1.2], "enable"),
    ([1.0, 1.2], "neutral"),  # lower end must be > 1
    (GAIN_FLAT, "neutral"),
    ([0.8, 1.0], "neutral"),  # upper end must be < 1 for leave off
    ([0.8, 0.9999], "leave off"),
    (GAIN_DOWN, "leave off"),
])
def test_gain_boundaries(gain, decision):
    assert verdict(0.12, None, gain).decision == decision


@pytest.mark.parametrize("on,off,decision", [
    (2.01, 2.0, "enable"),
    (2.0, 2.0, "neutral"),  # equal: not faster
    (1.0, 1.02, "neutral"),  # exactly off / 1.02: not below it
    (0.999, 1.02, "leave off"),
    (1.5, 2.0, "leave off"),
])
def test_speed_boundaries(on, off, decision):
    assert verdict(0.12, None, GAIN_UP, on, off).decision == decision


def test_neutral_says_which_condition_kept_it_from_enable():
    v = verdict(0.05, [0.04, 0.06], GAIN_UP, 2.1, 2.0)
    assert v.decision == "neutral"
    assert v.reasons[0].startswith("kept from enable: sole-source share 5.00%") and "9% enable line" in v.reasons[0]
    v = verdict(0.12, None, GAIN_FLAT)
    assert v.decision == "neutral" and "0.980–1.030, includes 1" in v.reasons[0]
    v = verdict(0.12, None, GAIN_UP, 2.0, 2.0)
    assert v.decision == "neutral" and v.reasons[0] == ("kept from enable: speedup 2.00× with the semantic source "
                                                        "against 2.00× without: not faster")


def test_leave_off_wins_over_other_conditions():
    # share below the off line, even with a clear gain and a faster arm
    v = verdict(0.02, None, GAIN_UP, 2.1, 2.0)
    assert v.decision == "leave off" and v.reasons[0] == "sole-source share 2.00% is below the 3% line"
    # a high share, but the gain is clearly below 1
    v = verdict(0.2, None, GAIN_DOWN)
    assert v.decision == "leave off" and "entirely below 1" in v.reasons[0]
    # a high share and a gain, but the key costs more time than it saves
    v = verdict(0.2, None, GAIN_UP, 1.5, 2.0)
    assert v.decision == "leave off" and "costs more time than it saves" in v.reasons[0]


def test_missing_inputs_never_crash_and_never_enable():
    v = verdict(None, None, None)
    assert v.decision == "neutral"
    assert any("no sole-source share" in r for r in v.reasons)
    assert any("no paired tau gain interval" in r for r in v.reasons)
    v = verdict(0.5, [0.4, 0.6], None, 3.0, 1.0)  # everything but the gain: not enable
    assert v.decision == "neutral" and v.reasons[0].startswith("kept from enable: no paired tau gain interval")
    assert verdict(0.01, None, None).decision == "leave off"  # the share alone can still say leave off
    assert verdict(None, None, GAIN_DOWN).decision == "leave off"
    assert verdict(None, None, GAIN_UP, 2.1, 2.0).decision == "neutral"


@pytest.mark.parametrize("bad", [[1.2, 1.1], [1.1], [1.1, 1.2, 1.3], ["1.1", "1.2"], [math.nan, 1.2],
                                 [1.1, math.inf], "1.1-1.2", {"lo": 1.1}, [True, 2]])
def test_malformed_gain_interval_counts_as_missing(bad):
    v = verdict(0.12, None, bad, 2.1, 2.0)
    assert v.decision == "neutral"
    assert any("the paired tau gain interval is not valid" in r for r in v.reasons)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "0.12", True, [0.12]])
def test_malformed_numbers_count_as_missing(bad):
    assert verdict(bad, None, GAIN_UP).decision == "neutral"
    v = verdict(0.12, bad, GAIN_UP, bad, 2.0)  # a bad share interval is left out; a bad speedup skips the check
    assert v.decision == "enable" and "interval" not in v.reasons[0]


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
