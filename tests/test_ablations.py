"""Arm variants (`arm@field=value`, in replay and in the live decoder), the one-source arm in replay, and the
ablation command's table with its headline rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.errors import OilbirdError
from decoder.drafters import make_drafter, parse_variant
from decoder.replay.run import replay_arm, resolve_arms
from tests.test_decoder_scale import VOCAB, _passes, phrase_traffic

pytestmark = pytest.mark.usefixtures("one_thread")


def test_variant_sets_the_fields():
    d = make_drafter("oilbird@theta=0.7:k=4:calib_window=0:semantic=off:depth_schedule=0.9x16_0.82x4",
                     vocab_size=100, nodes=8)
    c = d.config
    assert (c.theta, c.k, c.calib_window, c.semantic) == (0.7, 4, 0, False)
    assert c.depth_schedule == ((0.9, 16), (0.82, 4))
    assert d.name == "oilbird@theta=0.7:k=4:calib_window=0:semantic=off:depth_schedule=0.9x16_0.82x4"
    # a preset's own options stay, the variant's are added
    r = make_drafter("pld+key@k=3", vocab_size=100, nodes=8).config
    assert (r.host, r.k) == ("pld", 3)
    assert parse_variant("oilbird") == ("oilbird", {})


@pytest.mark.parametrize("name, words", [
    ("oilbird@nosuch=1", "has no field nosuch"),
    ("oilbird@theta=high", "cannot read theta"),
    ("oilbird@semantic=maybe", "cannot read semantic"),
    ("oilbird@depth_schedule=0.9", "0.9x48_0.82x8"),
    ("oilbird@theta", "write arm@field=value"),
    ("oilbird@", "sets no field"),
])
def test_bad_variants_are_one_line(name, words):
    with pytest.raises(OilbirdError, match=words):
        make_drafter(name, vocab_size=100, nodes=8)


def test_replay_resolves_variants_before_work():
    assert resolve_arms(["oilbird@k=4", "suffix"]) == ["oilbird@k=4", "suffix"]
    with pytest.raises(OilbirdError, match="unknown arm 'nosuch@k=4'"):
        resolve_arms(["nosuch@k=4"])
    with pytest.raises(OilbirdError, match="cannot read k"):
        resolve_arms(["oilbird@k=many"])


def test_variant_replays_exactly_like_the_preset_it_spells():
    """oilbird@semantic=off is oilbird-no-semantic, pass for pass; a real change (a 4-token spine) differs."""
    traces = phrase_traffic()
    a = replay_arm("oilbird@semantic=off", traces, 60, "past", VOCAB)
    b = replay_arm("oilbird-no-semantic", traces, 60, "past", VOCAB)
    assert [_passes(c) for c in a.cycles] == [_passes(c) for c in b.cycles]
    short = replay_arm("oilbird-no-semantic@spine_max=4", traces, 60, "past", VOCAB)
    assert [_passes(c) for c in short.cycles] != [_passes(c) for c in b.cycles]
    assert max(c.accepted for cs in short.cycles for c in cs) < max(c.accepted for cs in b.cycles for c in cs)


def test_ablations_command_writes_the_table(tmp_path, stories, capsys):
    """`python -m decoder ablations` on a tiny store: every row present, paired with the merged tree
    (the merged arm against itself would be 1; lexical only is its own replay), the json written."""
    import json

    from data.capture.run import CaptureConfig, capture
    from decoder.__main__ import main as decoder_main
    from decoder.replay.ablations import ABLATIONS, HEADLINE, LADDER
    from decoder.policy import LEXICAL_ARMS
    from decoder.replay.run import ReplayConfig, run_replay
    from tests.conftest import STORY_PROMPTS, write_jsonl

    bench = write_jsonl(tmp_path / "bench.jsonl", STORY_PROMPTS)
    out = str(tmp_path / "runs")
    capture(CaptureConfig(bench=bench, model="stories260k", max_new_tokens=24, out=out, progress=False), lm=stories)
    assert decoder_main(["ablations", "--bench", bench, "--model", "stories260k", "--out", out, "--bootstrap", "200",
                         "--jobs", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "transplant ladder" in text and "oilbird@k=4" in text and "headline" in text and "best lexical" in text
    files = list((tmp_path / "runs").rglob("ablations.json"))
    assert len(files) == 1
    r = json.loads(files[0].read_text())
    assert [a["arm"] for a in r["ablations"]] == [a for _, a in ABLATIONS]
    assert [[x["arm"] for x in lad["rungs"]] for lad in r["ladder"]] == [list(rungs) for _, rungs in LADDER]
    own = run_replay(ReplayConfig(bench=bench, model="stories260k", out=str(tmp_path / "other"), arms=("oilbird",
                                  "oilbird-no-semantic"), store=str(files[0].parent.parent / "traces"),
                                  bootstrap=0, jobs=1, progress=False))
    row = next(a for a in r["ablations"] if a["arm"] == "oilbird-no-semantic")
    assert row["tau"] == pytest.approx(own[("oilbird-no-semantic", 60)]["tau"]["value"])
    assert row["vs_merged"] == pytest.approx(row["tau"] / r["merged"]["tau"])
    assert "oilbird-one-source" in [a["arm"] for a in r["ablations"]]
    # the null control drafts, and its per-node counters say what placed its tokens: root branching only in
    # replay (the rejected-branch pool records nothing there); without root branching it drafts nothing
    null = next(a for a in r["ablations"] if a["arm"] == "semantic-null")
    assert null["tau"] > 1 and set(null["accepted_by_source"]) == {"root"} and "accepted by source, semantic-null" in text
    bare = next(a for a in r["ablations"] if a["arm"] == "semantic-null@root_branching=0")
    assert bare["tau"] == 1 and not bare["accepted_by_source"]
    assert not [m for m in r["missing"] if "no arm yet" in m]
    # the headline: every baseline against oilbird both ways, from one replay (pld / recycling shared with the ladder)
    assert [h["arm"] for h in r["headline"]] == [a for _, a in HEADLINE]
    assert sorted(a for _, a in HEADLINE) == sorted(LEXICAL_ARMS)  # every best-lexical candidate is replayed
    rungs = {x["arm"]: x for lad in r["ladder"] for x in lad["rungs"]}
    for h in r["headline"]:
        assert h["vs_merged"] == pytest.approx(h["tau"] / r["merged"]["tau"])
        assert h["oilbird_over_arm"] == pytest.approx(1 / h["vs_merged"])
        lo, hi = h["oilbird_over_arm_interval"]
        vlo, vhi = h["vs_merged_interval"]
        # the replay's own bootstrap draws, so the percentile interval of 1/x sits at 1/hi .. 1/lo
        assert lo == pytest.approx(1 / vhi, rel=0.05) and hi == pytest.approx(1 / vlo, rel=0.05)
        if h["arm"] in rungs:
            assert h["tau"] == rungs[h["arm"]]["tau"]
    best = max((h for h in r["headline"] if h["arm"] in LEXICAL_ARMS), key=lambda h: h["tau"])
    assert r["best_lexical"]["arm"] == best["arm"]
    assert r["best_lexical"]["oilbird_over_arm"] == best["oilbird_over_arm"]
    ratio, (lo, _) = best["oilbird_over_arm"], best["oilbird_over_arm_interval"]
    assert r["target_met"] == (ratio >= 1.25 and lo > 1.0)


def test_one_source_replays_one_source_per_pass():
    """oilbird-one-source in replay: every pass drafts the lexical sources or the semantic one, never both;
    both occur on this traffic; every pass chose one; attribution counts each source."""
    from decoder.verify.passes import pass_statistics

    traces = phrase_traffic()  # no top-8 in these traces: no adjacency, so the gate would stay shut; lift it
    # the floor off: on this traffic a far answer (cosine 0.3-0.45) and an exact repeat alternate pass to pass, and
    # the floor (tuned on API-Bank, docs/decoder.md) skipping 3 passes after a far one missed every repeat
    run = replay_arm("oilbird-one-source@gate=off:key_floor=0", traces, 60, "past", VOCAB)
    lexical, semantic = {"spine", "branch", "adjacency"}, {"semantic", "rollout"}
    kinds = set()
    for c in (c for cs in run.cycles for c in cs):
        drafted = set(c.node_sources)
        assert drafted <= lexical or drafted <= semantic, drafted
        if drafted:
            kinds.add("lexical" if drafted <= lexical else "semantic")
    assert kinds == {"lexical", "semantic"}
    st = run.stats
    assert st["chose_lexical"] > 0 and st["chose_semantic"] > 0
    assert st["chose_lexical"] + st["chose_semantic"] + st["gated"] == st["passes"]
    stats = pass_statistics(run.cycles, run.has_key, None)
    assert stats["accepted_by_source"].get("semantic", 0) > 0 and stats["accepted_by_source"].get("spine", 0) > 0


def test_live_decoder_takes_arm_variants(stories, tmp_path):
    """`python -m decoder --arms` accepts arm@field=value like replay: the variant's config is the one served, and
    it decodes lossless against plain greedy, token for token."""
    from decoder.live.harness import DecodeConfig, library_drafters, run_decode
    from decoder.live.harness import resolve_arms as live_arms
    from tests.conftest import STORY_PROMPTS, write_jsonl

    factories = library_drafters()
    assert live_arms(("oilbird-one-source@one_source_min_match=3", "sam@spine_max=4"), factories) == (
        ["ar", "oilbird-one-source@one_source_min_match=3", "sam@spine_max=4"], True)
    made = factories["sam@spine_max=4"](stories, DecodeConfig(bench="x"))
    assert made.config.spine_max == 4 and made.name == "sam@spine_max=4"
    for arms, words in [(("oilbird@theta=high",), "cannot read theta"), (("nosuch@k=4",), "unknown arm 'nosuch@k=4'"),
                        (("ar@k=4",), "unknown arm 'ar@k=4'"), (("oilbird@nosuch=1",), "has no field nosuch")]:
        with pytest.raises(OilbirdError, match=words):
            live_arms(arms, library_drafters())
    bench = write_jsonl(tmp_path / "bench.jsonl", STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1]])
    arms = ("ar", "oilbird-one-source@one_source_min_match=3", "oilbird-one-source", "sam@spine_max=4")
    summaries = run_decode(DecodeConfig(bench=bench, model="stories260k", arms=arms, max_new_tokens=40,
                                        out=str(tmp_path / "runs"), progress=False), lm=stories)
    assert list(summaries) == list(arms)
    for arm in arms[1:]:
        s = summaries[arm]
        assert s["lossless"]["lossless"], (arm, s["lossless"]["mismatches"])
        assert s["generated_tokens"] == summaries["ar"]["generated_tokens"]
        assert (Path(s["decode_dir"]) / arm / "summary.json").exists()
    for arm in arms[1:3]:
        st = summaries[arm]["drafter_stats"]
        assert st["chose_lexical"] + st["chose_semantic"] + st["gated"] == st["passes"] > 0
