"""Arm variants (`arm@field=value`) and the ablation command's table."""

from __future__ import annotations

import pytest

from data.errors import OilbirdError
from decoder.drafters import make_drafter, parse_variant
from decoder.replay import replay_arm, resolve_arms
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

    from data.capture import CaptureConfig, capture
    from decoder.__main__ import main as decoder_main
    from decoder.ablations import ABLATIONS, LADDER
    from decoder.replay import ReplayConfig, run_replay
    from tests.conftest import STORY_PROMPTS, write_jsonl

    bench = write_jsonl(tmp_path / "bench.jsonl", STORY_PROMPTS)
    out = str(tmp_path / "runs")
    capture(CaptureConfig(bench=bench, model="stories260k", max_new_tokens=24, out=out, progress=False), lm=stories)
    assert decoder_main(["ablations", "--bench", bench, "--model", "stories260k", "--out", out, "--bootstrap", "0",
                         "--jobs", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "transplant ladder" in text and "oilbird@k=4" in text
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
