"""The verdict's sensitivity to the profile (issue 45, item 2): the profile keeps the fastest and the slowest of
its repetitions (decoder/cost/profile.py, decoder/cost/vllm_profile.py; decoder/cost/spread.py), replay sizes and prices
the verdict's pair at both ends of that spread (decoder/replay/run.py add_profile_spread), and the decision block says
whether the verdict holds at both (decoder/verdict.py sensitivity, reports/decision.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from data.errors import OilbirdError
from data.store.layout import replay_dir
from decoder.__main__ import main as decoder_main
from decoder.cost.profile import CostModel, measure_profile
from decoder.cost.spread import spread_ends
from decoder.replay.run import ReplayConfig, replay_is_current, run_replay
from decoder.verdict import DECISIONS, sensitivity, verdict
from tests.conftest import STORY_PROMPTS, capture_story_store

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NODES = [0, 8, 64]
PAIR = ("oilbird-chain", "oilbird-no-semantic-chain")


def grid(base: float, slope: float) -> list[list[float]]:
    return [[base + slope * n for n in NODES] for _ in range(2)]


def profile(path: Path, fingerprint: str, lo=None, hi=None, reps=3, engine="vllm") -> str:
    """A two-context vLLM profile: 10 ms + 2 ms a node at the median; `lo` / `hi`: its spread grids (None: an
    older profile, medians only)."""
    d = {"format": 1, "model": "stories260k", "model_fingerprint": fingerprint, "device": "cpu", "engine": engine,
         "device_name": "test", "threads": 1, "nodes": NODES, "contexts": [1, 4096], "verify_s": grid(0.01, 0.002),
         "prefill_lengths": [1, 4096], "prefill_s": [0.05, 0.05], "reps": reps}
    if lo is not None:
        d["verify_s_min"] = lo
    if hi is not None:
        d["verify_s_max"] = hi
    path.write_text(json.dumps(d))
    return str(path)


# ---------------------------------------------------------------- the profile keeps its spread

def test_the_harness_profile_keeps_the_fastest_and_slowest_rep(stories):
    d = measure_profile(stories, [32, 96], nodes=(0, 4), reps=3, progress=False)
    med, lo, hi = (np.array(d[k]) for k in ("verify_s", "verify_s_min", "verify_s_max"))
    assert med.shape == lo.shape == hi.shape == (2, 2)
    assert np.all(lo <= med) and np.all(med <= hi) and np.all(lo > 0)
    ends, note = spread_ends(CostModel.from_dict(json.loads(json.dumps(d))))
    assert note is None and set(ends) == {"fast", "slow"}
    assert ends["fast"].verify_s(4, 96) == pytest.approx(lo[1][1]) and ends["slow"].verify_s(0, 32) == pytest.approx(hi[0][0])
    assert ends["fast"].prefill_s(33) == pytest.approx(CostModel.from_dict(d).prefill_s(33))  # prefill: its median


def test_an_old_profile_or_one_rep_has_no_spread_and_a_damaged_one_is_refused(tmp_path):
    old = CostModel.load(profile(tmp_path / "old.json", "f"))  # written before the spread was kept: still read
    ends, note = spread_ends(old)
    assert ends is None and note.startswith("spread unknown: ") and "keeps only the median" in note
    one = CostModel.load(profile(tmp_path / "one.json", "f", grid(0.01, 0.002), grid(0.01, 0.002), reps=1))
    assert spread_ends(one)[0] is None and "timed each point once (--reps 1)" in spread_ends(one)[1]
    for lo, hi, why in ((grid(0.02, 0.002), grid(0.03, 0.002), "fastest repetition above its median"),
                        (grid(0.005, 0.002), grid(0.009, 0.002), "slowest below it"),
                        ([[0.01]], grid(0.03, 0.002), "verify_s_min is not a grid of 2 contexts x 3 nodes"),
                        (grid(-0.01, 0.0), grid(0.03, 0.002), "not a positive finite number"),
                        (grid(0.005, 0.002), None, "verify_s_min without verify_s_max")):
        bad = CostModel.load(profile(tmp_path / "bad.json", "f", lo, hi))
        with pytest.raises(OilbirdError, match=re.escape(why)):
            spread_ends(bad)


# ---------------------------------------------------------------- replay at both ends

TRAFFIC = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1], STORY_PROMPTS[3], STORY_PROMPTS[4] + " Tom"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, stories):
    return capture_story_store(tmp_path_factory, stories, "spread_store", TRAFFIC, 32)


def _replay(store, tmp_path, prof, arms=PAIR, **kw):
    bench, out = store
    cfg = ReplayConfig(bench=bench, model="stories260k", arms=arms, out=out, profile=prof, bootstrap=100, jobs=1,
                       progress=False, results_dir=str(tmp_path / "replay"), **kw)
    return run_replay(cfg)


def test_replay_sizes_and_prices_the_pair_at_both_ends(store, tmp_path, stories):
    # the fast end is cheaper at 0 nodes (each node relatively dearer: shorter chains), the slow end dearer
    prof = profile(tmp_path / "p.json", stories.fingerprint, grid(0.004, 0.002), grid(0.03, 0.002))
    got = _replay(store, tmp_path, prof, arms=(*PAIR, "suffix"))
    on = got[("oilbird-chain", 60)]
    block = on["profile_spread"]
    assert block["reps"] == 3 and block["note"] is None and block["width"] == pytest.approx(0.03 / 0.004 - 1)
    fast, slow = block["ends"]["fast"], block["ends"]["slow"]
    for e in (fast, slow):
        assert e["resized"] is True and e["paired_gain"]["versus"] == "oilbird-no-semantic-chain"
        share = e["sole_source_share"]
        assert 0 <= share["value"] <= 1 and share["interval"][0] <= share["value"] <= share["interval"][1]
        assert e["speedup"] > 0 and e["speedup_versus"] > 0
    assert fast["mean_nodes"] < on["mean_nodes"] < slow["mean_nodes"]  # the ends size the chains differently
    assert "profile_spread" not in got[("oilbird-no-semantic-chain", 60)] and "profile_spread" not in got[("suffix", 60)]
    written = json.loads((tmp_path / "replay" / "oilbird-chain" / "summary.json").read_text())
    assert written["profile_spread"] == json.loads(json.dumps(block))
    from data.results import validate

    assert validate(written, "replay", "s") == []


def test_a_spread_of_nothing_reproduces_the_median_verdict_exactly(store, tmp_path, stories):
    same = grid(0.01, 0.002)
    on = _replay(store, tmp_path, profile(tmp_path / "p.json", stories.fingerprint, same, same))[("oilbird-chain", 60)]
    for e in on["profile_spread"]["ends"].values():
        assert e["sole_source_share"] == {k: on["sole_source_share"][k] for k in ("value", "interval")}
        assert e["paired_gain"]["interval"] == on["paired_gain"]["interval"]
        assert e["mean_nodes"] == pytest.approx(on["mean_nodes"])


def test_an_old_profile_says_spread_unknown_and_flat_sizing_only_reprices(store, tmp_path, stories):
    on = _replay(store, tmp_path, profile(tmp_path / "old.json", stories.fingerprint))[("oilbird-chain", 60)]
    assert on["profile_spread"]["ends"] is None and "spread unknown" in on["profile_spread"]["note"]
    prof = profile(tmp_path / "p.json", stories.fingerprint, grid(0.004, 0.002), grid(0.03, 0.002))
    flat = _replay(store, tmp_path, prof, sizing="flat")[("oilbird-chain", 60)]
    ends = flat["profile_spread"]["ends"]
    assert not ends["fast"]["resized"] and ends["fast"]["mean_nodes"] == pytest.approx(flat["mean_nodes"])
    assert ends["fast"]["sole_source_share"] == ends["slow"]["sole_source_share"]  # same passes, priced otherwise
    assert ends["fast"]["speedup"] != ends["slow"]["speedup"]


def test_a_damaged_spread_is_one_line_before_any_work(store, tmp_path, stories, capsys):
    bench, out = store
    prof = profile(tmp_path / "bad.json", stories.fingerprint, grid(0.02, 0.002), grid(0.03, 0.002))
    code = decoder_main(["replay", "--bench", bench, "--model", "stories260k", "--out", out, "--arms", ",".join(PAIR),
                         "--profile", prof, "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "fastest repetition above" in err[0]


def test_the_replay_command_prints_the_sensitivity_and_if_missing_recomputes_an_older_result(store, tmp_path,
                                                                                            stories, capsys):
    bench, out = store
    out2 = tmp_path / "runs"
    shutil.copytree(out, out2)
    prof = profile(tmp_path / "p.json", stories.fingerprint, grid(0.009, 0.002), grid(0.011, 0.002))
    argv = ["replay", "--bench", bench, "--model", "stories260k", "--out", str(out2), "--arms", ",".join(PAIR),
            "--profile", prof, "--quiet", "--bootstrap", "100"]
    assert decoder_main(argv) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^profile: (The verdict holds at both ends|The verdict does not hold across)", printed, re.M)
    cfg = ReplayConfig(bench=bench, model="stories260k", arms=PAIR, out=str(out2), profile=prof, bootstrap=100)
    assert replay_is_current(cfg)
    summary = replay_dir(str(out2), bench, "stories260k") / "oilbird-chain" / "summary.json"
    doc = json.loads(summary.read_text())
    doc.pop("profile_spread")  # a replay from before the spread was kept
    summary.write_text(json.dumps(doc))
    assert not replay_is_current(cfg)


# ---------------------------------------------------------------- the rule at the ends

CASES = {  # share interval, gain interval, speedups: one input set of each decision, and one on the 3% line
    "enable": ([0.10, 0.14], [1.01, 1.07], 2.1, 2.0),
    "neutral": ([0.04, 0.06], [1.01, 1.07], 2.1, 2.0),
    "straddle": ([0.025, 0.035], [1.01, 1.07], 2.1, 2.0),
    "leave off": ([0.01, 0.025], [1.01, 1.07], 2.1, 2.0),
    "slower": ([0.04, 0.06], [1.01, 1.07], 1.5, 2.0),
}


def end(case: str) -> dict:
    siv, giv, on, off = CASES[case]
    return {"sole_source_share": {"value": sum(siv) / 2, "interval": siv}, "paired_gain": {"interval": giv},
            "speedup": on, "speedup_versus": off}


def test_sensitivity_says_so_whenever_an_end_decides_otherwise():
    """Every combination of median, fast and slow inputs: the verdict "holds" exactly when both ends decide as
    the median does; otherwise the line names each end that does not, with its decision and its share."""
    for m in CASES:
        main = verdict(*[sum(CASES[m][0]) / 2, *CASES[m]])
        for f in CASES:
            for s in CASES:
                got = sensitivity(main, {"reps": 3, "width": 0.2, "ends": {"fast": end(f), "slow": end(s)}})
                want = {e: verdict(*[sum(CASES[c][0]) / 2, *CASES[c]]).decision for e, c in (("fast", f), ("slow", s))}
                assert got.holds is all(d == main.decision for d in want.values()), (m, f, s)
                assert {e: v.decision for e, v in got.ends.items()} == want
                if got.holds:
                    assert got.line.startswith("The verdict holds at both ends of the profile's measured spread "
                                               "(3 repetitions a point, the slowest up to 20% above the fastest)")
                    continue
                assert got.line.startswith("The verdict does not hold across the profile's measured spread")
                for e, d in want.items():
                    share = CASES[(f, s)[e == "slow"]][0]
                    assert f"at the {e} end (every step at the " in got.line
                    piece = got.line.split(f"at the {e} end")[1]
                    pct = lambda x: f"{100 * x:.2f}" if x < 0.1 else f"{100 * x:.1f}"  # noqa: E731
                    assert f"{pct(share[0])}–{pct(share[1])}%] → {d.upper()}" in piece
    assert set(DECISIONS) <= {verdict(*[sum(c[0]) / 2, *c]).decision for c in CASES.values()}


def test_sensitivity_unknown_and_absent():
    main = verdict(0.05, [0.04, 0.06], [1.01, 1.07])
    got = sensitivity(main, {"reps": 3, "ends": None, "note": "spread unknown: p.json keeps only the median"})
    assert got.holds is None and got.line == "Profile spread unknown: p.json keeps only the median"
    assert sensitivity(main, None) is None
    assert sensitivity(verdict(5.0, None, None), {"ends": {}}) is None  # cannot decide: nothing to hold


# ---------------------------------------------------------------- the page says it

def _page(tmp_path, spread, share=0.025, interval=(0.02, 0.029)):
    """A replay whose median verdict is LEAVE OFF (the share's interval wholly below 3%), its key-on arm's
    `profile_spread` block as given."""
    from reports.render import render_site
    from reports.results import find_results
    from tests.test_reports import decision_of, make_runs, render_one, replay_arms, write_replay

    runs = make_runs(tmp_path, decode=False)
    arms = replay_arms(share, [1.01, 1.06])
    arms[-1]["sole_source_share"]["interval"] = list(interval)
    if spread is not None:
        arms[-1]["profile_spread"] = spread
    write_replay(runs / "toy" / "toy-model", arms)
    index = "".join(__import__("tests.test_reports", fromlist=["parse"]).parse(
        render_site(find_results(runs))["index.html"]).text)
    return (*decision_of(render_one(runs)), index)


def _ends(fast, slow):
    e = lambda siv: {"sole_source_share": {"value": sum(siv) / 2, "interval": list(siv)},  # noqa: E731
                     "paired_gain": {"versus": "oilbird-no-semantic", "tau_ratio": 1.03, "interval": [1.01, 1.06]},
                     "speedup": 2.1, "speedup_versus": 2.0, "mean_nodes": 5.0, "resized": True}
    return {"reps": 3, "width": 0.35, "note": None, "ends": {"fast": e(fast), "slow": e(slow)}}


def test_a_verdict_the_spread_moves_past_neutral_is_said_on_the_page(tmp_path):
    """The pin of issue 45: a profile change within the measured spread that moves the verdict (here LEAVE OFF at
    the median, NEUTRAL at the fast end, where the chains are sized otherwise) is named on the page, in the
    verdict's callout and in the index's verdict cell; where both ends agree, the page says the verdict holds."""
    cls, text, index = _page(tmp_path / "a", _ends((0.025, 0.034), (0.018, 0.027)))
    assert cls == "off"  # the verdict stays the median profile's; the page says it is sensitive
    callout = text.split("Rule (decoder/verdict.py)")[0]
    assert ("Sensitive to the profile: The verdict does not hold across the profile's measured spread (3 repetitions "
            "a point, the slowest up to 35% above the fastest): at the fast end (every step at the fastest of its "
            "repetitions): share 2.95% [2.50–3.40%] → NEUTRAL (the share's interval straddles the 3% line); at the "
            "slow end (every step at the slowest of its repetitions): share 2.25% [1.80–2.70%] → LEAVE OFF (as at "
            "the median).") in callout
    assert "leave off (replay) · sensitive to the profile" in index
    cls, text, index = _page(tmp_path / "b", _ends((0.021, 0.028), (0.019, 0.026)))
    assert cls == "off" and "Sensitive to the profile" not in text and "sensitive to the profile" not in index
    assert ("The verdict holds at both ends of the profile's measured spread (3 repetitions a point, the slowest up "
            "to 35% above the fastest): sole-source share 2.45% [2.10–2.80%] at the fast end, 2.25% [1.90–2.60%] at "
            "the slow end.") in text.split("Rule (decoder/verdict.py)")[0]


def test_the_page_says_when_the_spread_is_unknown_or_was_not_checked(tmp_path):
    note = "spread unknown: runs/profiles/p.json keeps only the median of its repetitions (measured before ...)"
    _, text, _ = _page(tmp_path / "a", {"reps": 3, "width": None, "note": note, "ends": None})
    assert "Profile spread unknown: runs/profiles/p.json keeps only the median of its repetitions" in text
    _, text, _ = _page(tmp_path / "b", None)  # a replay from before the spread was kept
    assert "Profile spread: not checked (a replay from before the spread was kept; make census BENCH=toy" in text


def test_a_damaged_spread_block_cannot_decide(tmp_path):
    spread = _ends((0.025, 0.034), (0.018, 0.027))
    spread["ends"]["fast"]["sole_source_share"]["value"] = 5.0
    cls, text, _ = _page(tmp_path, spread)
    assert cls == "cannot" and "profile_spread.ends.fast.sole_source_share.value = 5.0 outside [0, 1]" in text
