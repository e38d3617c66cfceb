"""Rounds (rotated arm order, medians and ranges), the `ar-static` reference and speedup_vs_fastest_ar."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

import decoder.live.harness as harness
from data.capture.models import encode_prompt
from decoder.verify.engine import decode_greedy, stop_rule
from decoder.live.harness import DecodeConfig, run_decode
from decoder.live.results import format_table, speed_summary
from decoder.verify.reference import STATIC_ARM, StaticGreedy
from tests.conftest import STORY_PROMPTS, write_jsonl


def _prompts(lm, texts):
    return [encode_prompt(lm, [{"role": "user", "content": t}]) for t in texts]


def test_speed_summary_uses_the_faster_reference_per_round():
    # ar-static faster in round 1, ar faster in round 2, ar-static faster in round 3
    ar, static, arm = [10.0, 20.0, 10.0], [15.0, 16.0, 40.0], [30.0, 30.0, 20.0]
    s = speed_summary(arm, ar, static)
    assert s["tokens_per_s_rounds"] == arm and s["tokens_per_s"] == 30.0 and s["tokens_per_s_range"] == [20.0, 30.0]
    assert s["speedup_rounds"] == [3.0, 1.5, 2.0] and s["speedup"] == 2.0 and s["speedup_range"] == [1.5, 3.0]
    assert s["speedup_vs_fastest_ar_rounds"] == [2.0, 1.5, 0.5]
    assert s["speedup_vs_fastest_ar"] == 1.5 and s["speedup_vs_fastest_ar_range"] == [0.5, 2.0]
    assert s["fastest_ar_rounds"] == [STATIC_ARM, "ar", STATIC_ARM]
    assert s["ar_tokens_per_s"] == 10.0 and s["ar_static_tokens_per_s"] == 16.0
    alone = speed_summary(arm, ar)  # no ar-static: the fastest reference is ar
    assert alone["speedup_vs_fastest_ar_rounds"] == alone["speedup_rounds"] and alone["fastest_ar_rounds"] == ["ar"] * 3
    assert speed_summary([5.0, 7.0], [5.0, 7.0])["speedup"] == 1.0  # even count: mean of the middle two


def test_rounds_rotate_and_ar_static_is_lossless(stories, tmp_path, one_thread, monkeypatch):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    ran: list[tuple[str, str]] = []
    serve = harness.serve_arm

    def spy(name, *args, **kwargs):
        ran.append((name, args[6]))  # progress_desc
        return serve(name, *args, **kwargs)

    monkeypatch.setattr(harness, "serve_arm", spy)
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("ar", STATIC_ARM, "copy"), max_new_tokens=24,
                       out=str(tmp_path / "runs"), progress=False, rounds=2, static_compile=False)
    from tests.test_decoder_engine import CopyDrafter

    summaries = run_decode(cfg, lm=stories, extra_arms={"copy": lambda lm, c: CopyDrafter()})
    order = [["ar", STATIC_ARM, "copy"], [STATIC_ARM, "copy", "ar"]]  # round 2 starts at arm 1
    assert [name for name, _ in ran] == order[0] + order[1]
    assert ran[3][1] == f"{STATIC_ARM} (round 2/2, 1/3)" and ran[2][1] == "copy (round 1/2, 3/3)"
    ar, static = summaries["ar"]["tokens_per_s_rounds"], summaries[STATIC_ARM]["tokens_per_s_rounds"]
    for arm, s in summaries.items():
        assert s["round_order"] == order and s["rounds"] == 2 and s["rounds_identical"] and not s["round_mismatches"]
        tok = s["tokens_per_s_rounds"]
        assert len(tok) == 2 and s["tokens_per_s"] == pytest.approx(statistics.median(tok))
        assert s["tokens_per_s_range"] == [min(tok), max(tok)]
        assert s["speedup_rounds"] == pytest.approx([t / a for t, a in zip(tok, ar)])
        assert s["speedup"] == pytest.approx(statistics.median(s["speedup_rounds"]))
        assert s["speedup_range"] == [min(s["speedup_rounds"]), max(s["speedup_rounds"])]
        fastest = [max(a, st) for a, st in zip(ar, static)]
        assert s["speedup_vs_fastest_ar_rounds"] == pytest.approx([t / f for t, f in zip(tok, fastest)])
        assert s["speedup_vs_fastest_ar"] == pytest.approx(statistics.median(s["speedup_vs_fastest_ar_rounds"]))
        assert max(s["speedup_vs_fastest_ar_rounds"]) <= max(s["speedup_rounds"])
        audit = s["lossless"]
        assert audit["matched"] == audit["requests"] == 3, (arm, audit["mismatches"])
    assert summaries["ar"]["speedup"] == 1.0
    st = summaries[STATIC_ARM]
    assert st["compiled"] is False and st["generate"]["cache_implementation"] == "static" and st["tau"] == 1.0
    assert st["generated_tokens"] == summaries["ar"]["generated_tokens"]
    table = format_table(summaries)
    assert "vs fastest ar" in table.splitlines()[0] and "median over 2 rounds" in table


def test_ar_static_stops_where_ar_stops(stories, one_thread):
    """An extra EOS id, a stop string and the cap cut generate's output on the very token ar stops on."""
    prompts = _prompts(stories, STORY_PROMPTS[:2])
    free = decode_greedy(stories, prompts[0], stop_rule(stories, (), 60)).tokens
    text = stories.tokenizer.decode(free[15:40])
    word = next(w for w in text.split() if len(w) >= 3)
    cases = [(dataclasses.replace(stories, eos_ids=stories.eos_ids | {free[20]}), (), 60),
             (stories, (word,), 60), (stories, (), 17)]
    reasons = set()
    for lm, strings, cap in cases:
        stop = stop_rule(lm, strings, cap)
        static = StaticGreedy(lm, stop, max(map(len, prompts)), compile=False)
        static.warm_up(prompts[0])
        for p in prompts:
            ref, g = decode_greedy(lm, p, stop), static.decode(p)
            assert g.tokens == ref.tokens and g.stop_reason == ref.stop_reason, (strings, cap)
            assert len(g.cycles) == len(g.tokens) and g.chosen_ids.shape == (len(g.tokens), 8)
            assert (g.chosen_ids[:, 0] == g.tokens).all()
            reasons.add(g.stop_reason)
    assert reasons == {"eos", "stop_string", "length"}


def test_rounds_must_be_positive(tmp_path, capsys):
    from decoder.__main__ import main

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:1])
    assert main(["--bench", bench, "--model", "stories260k", "--arms", "ar", "--rounds", "0", "--quiet",
                 "--out", str(tmp_path / "runs")]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_ar_static_compiled_matches_ar(stories, tmp_path):
    """torch.compile on CPU (the first compile takes about 30 s on 2 cores): the same tokens as ar."""
    if not torch.cuda.is_available() and not hasattr(torch, "compile"):
        pytest.skip("no torch.compile")
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("ar", STATIC_ARM), max_new_tokens=32,
                       out=str(tmp_path / "runs"), progress=False)
    s = run_decode(cfg, lm=stories)[STATIC_ARM]
    assert s["compiled"] is True and s["lossless"]["lossless"], s["lossless"]["mismatches"]
