"""decoder/cost/profile.py: measuring verify/prefill cost on stories260k, the CostModel, the command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from data.errors import OilbirdError
from data.store.layout import default_profile_path
from decoder.cost.profile import (
    DEFAULT_CONTEXTS,
    CostModel,
    clip_contexts,
    contexts_from_store,
    measure_profile,
    profile_main,
)
from tests.conftest import STORY_PROMPTS, write_jsonl


def _profile_dict(**kw) -> dict:
    """A hand-made profile: verify = 1 + contexts/1000 + nodes/100 ms-ish numbers, all dyadic-friendly."""
    d = {"format": 1, "model": "toy", "model_fingerprint": "abc", "device": "cpu", "device_name": "x",
         "dtype": "float32", "threads": 1, "torch": "0", "reps": 1, "created": "now",
         "contexts": [100, 200, 400], "nodes": [0, 4, 8],
         "verify_s": [[1.0, 2.0, 4.0],
                      [2.0, 3.0, 5.0],
                      [3.0, 5.0, 9.0]],
         "prefill_lengths": [10, 20, 40], "prefill_s": [1.0, 2.0, 6.0]}
    d.update(kw)
    return d


def test_measure_profile_shape(stories, one_thread):
    d = measure_profile(stories, [32, 96], nodes=(0, 4, 16), reps=1, progress=False)
    assert d["contexts"] == [32, 96] and d["nodes"] == [0, 4, 16]
    v = np.array(d["verify_s"])
    assert v.shape == (2, 3) and np.all(np.isfinite(v)) and np.all(v > 0)
    assert d["prefill_lengths"] == sorted(d["prefill_lengths"]) and {33, 97} <= set(d["prefill_lengths"])
    assert all(math.isfinite(s) and s > 0 for s in d["prefill_s"])
    assert d["model_fingerprint"] == stories.fingerprint and d["device"] == "cpu" and d["reps"] == 1
    json.dumps(d)  # JSON-ready
    cm = CostModel.from_dict(d)
    assert cm.verify_s(4, 96) == pytest.approx(d["verify_s"][1][1])


def test_contexts_clipped_to_model_positions(stories):
    # stories260k has 512 positions: room for the anchor and 64 nodes leaves 447
    assert clip_contexts(stories.model, DEFAULT_CONTEXTS, (0, 64)) == [256, 447]
    assert clip_contexts(stories.model, [100, 100, 50], (0, 8)) == [50, 100]


def test_cost_model_exact_at_grid_and_linear_between():
    cm = CostModel.from_dict(_profile_dict())
    d = _profile_dict()
    for i, c in enumerate(d["contexts"]):
        for j, n in enumerate(d["nodes"]):
            assert cm.verify_s(n, c) == d["verify_s"][i][j]
    assert cm.verify_s(2, 100) == 1.5  # between nodes
    assert cm.verify_s(0, 150) == 1.5  # between contexts
    assert cm.verify_s(2, 150) == 2.0  # bilinear: mean of 1, 2, 2, 3
    assert cm.verify_s(6, 300) == pytest.approx((3.0 + 5.0 + 5.0 + 9.0) / 4)
    # outside the grid nothing is extrapolated: the nearest measured context or node count (issue 35)
    assert cm.verify_s(0, 600) == 3.0 and cm.verify_s(8, 600) == 9.0
    assert cm.verify_s(0, 0) == 1.0 and cm.verify_s(8, 0) == 4.0
    assert cm.verify_s(16, 100) == 4.0
    assert cm.verify_s(-3, 100) == 1.0
    # vectorised, broadcast
    out = cm.verify_s(np.array([0, 4, 8, 2]), np.array([100, 200, 400, 150]))
    assert isinstance(out, np.ndarray) and out.tolist() == [1.0, 3.0, 9.0, 2.0]
    grid = cm.verify_s(np.array([0, 8])[None, :], np.array([100, 400])[:, None])
    assert grid.tolist() == [[1.0, 4.0], [3.0, 9.0]]
    assert isinstance(cm.verify_s(4, 200), float)
    # prefill: piecewise linear from (0 tokens, 0 s) through the measured points; the last value beyond
    assert cm.prefill_s(20) == 2.0 and cm.prefill_s(30) == 4.0
    assert cm.prefill_s(80) == 6.0
    assert cm.prefill_s(5) == pytest.approx(0.5) and cm.prefill_s(0) == 0.0
    assert cm.prefill_s(np.array([10, 40])).tolist() == [1.0, 6.0]


def test_cost_model_one_point_axes():
    cm = CostModel.from_dict(_profile_dict(contexts=[100], nodes=[0, 4], verify_s=[[1.0, 3.0]],
                                           prefill_lengths=[100], prefill_s=[2.0]))
    assert cm.verify_s(2, 5000) == 2.0  # constant along the single context
    assert cm.verify_s(8, 100) == 3.0  # the last measured count: not extrapolated
    assert cm.prefill_s(50) == 1.0  # one point: proportional up to it


def test_cost_model_load_errors(tmp_path):
    path = tmp_path / "p.json"
    with pytest.raises(OilbirdError, match="python -m decoder profile --model stories260k"):
        CostModel.load(path, model="stories260k")
    path.write_text("{not json")
    with pytest.raises(OilbirdError, match="not a decoder profile"):
        CostModel.load(path)
    path.write_text(json.dumps({"format": 1, "model": "x"}))
    with pytest.raises(OilbirdError, match="not a decoder profile"):
        CostModel.load(path)
    path.write_text(json.dumps(_profile_dict(verify_s=[[1.0, 2.0]])))  # wrong shape
    with pytest.raises(OilbirdError, match="not a decoder profile"):
        CostModel.load(path)
    path.write_text(json.dumps(_profile_dict()))
    with pytest.raises(OilbirdError, match=r"measured for model toy .*not smollm2-135m.*--model smollm2-135m"):
        CostModel.load(path, model_fingerprint="other", model="smollm2-135m")
    assert CostModel.load(path, model_fingerprint="abc").verify_s(0, 100) == 1.0
    try:
        CostModel.load(tmp_path / "none.json")
    except OilbirdError as e:
        assert "\n" not in str(e)


def test_default_profile_path():
    assert str(default_profile_path("runs", "stories260k", "cuda")) == "runs/profiles/stories260k-cuda.json"


def test_profile_main_end_to_end(stories, one_thread, tmp_path, capsys):
    path = tmp_path / "prof.json"
    assert profile_main(["--model", "stories260k", "--contexts", "64,128", "--nodes", "0,8", "--reps", "1",
                         "--file", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "context" in out
    cm = CostModel.load(path, model_fingerprint=stories.fingerprint)
    assert cm.contexts.tolist() == [64, 128] and cm.nodes.tolist() == [0, 8]
    assert cm.verify_s(4, 100) > 0 and cm.prefill_s(100) > 0


def test_profile_main_bad_input(tmp_path, capsys):
    base = ["--model", "stories260k", "--file", str(tmp_path / "p.json"), "--quiet"]
    for argv, msg in [(["--nodes", "-1"], "--nodes"), (["--nodes", "0,300"], "--nodes"),
                      (["--nodes", "a"], "--nodes"), (["--reps", "0"], "--reps"),
                      (["--contexts", "0,64"], "--contexts"),
                      (["--bench", "nosuch", "--out", str(tmp_path)], "python -m data capture --bench nosuch")]:
        assert profile_main(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err
    assert not (tmp_path / "p.json").exists()


def test_contexts_from_store_and_bench(stories, one_thread, tmp_path, capsys):
    from data.capture.run import CaptureConfig, capture

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    out = tmp_path / "runs"
    store = capture(CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=12,
                                  progress=False), lm=stories)
    from data.store.reader import open_store

    s = open_store(store, load_hidden=False)
    lengths = [len(p) + t for p, o in zip(s.requests["prompt_tokens"].to_list(), s.requests["output_tokens"].to_list())
               for t in range(len(o))]
    got = contexts_from_store(store)
    assert got == sorted(set(got)) and all(c % 16 == 0 for c in got[1:])
    assert got[-1] >= max(lengths) and got[-1] - max(lengths) < 16  # covers the longest context
    shortest = min(len(p) for p in s.requests["prompt_tokens"].to_list()) - 1  # replay's first cache
    assert got[0] <= max(1, shortest) and (got[0] == 1 or got[0] % 16 == 0)  # ... and the shortest (issue 35)
    assert contexts_from_store(store, points=1) == [got[-1]]
    path = tmp_path / "p.json"
    assert profile_main(["--model", "stories260k", "--bench", bench, "--out", str(out), "--nodes", "0,4",
                         "--reps", "1", "--file", str(path), "--quiet"]) == 0
    assert json.loads(path.read_text())["contexts"] == got
