"""The cross-benchmark grid pipeline: `python -m census grid --capture` (per-benchmark limits, resume),
`--if-missing` on the census and on replay (a result is reused only for the store as it is now), and
`python -m data capture --limit grid`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data.benchmarks.registry as benchmarks
import data.capture.models
from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.store.layout import store_dir
from data.store.reader import current_summary, read_meta, store_fingerprint
from decoder.__main__ import main as decoder_main
from tests.conftest import STORY_PROMPTS, write_jsonl

CAPTURE = ["--model", "stories260k", "--capture", "--max-new-tokens", "12", "--batch-size", "2", "--quiet"]


@pytest.fixture
def grid_bench(tmp_path, stories, monkeypatch):
    bench = write_jsonl(tmp_path / "traffic.jsonl", STORY_PROMPTS[:6])
    monkeypatch.setattr(data.capture.models, "load_model", lambda *a, **k: stories)  # the session's copy, loaded once
    monkeypatch.setitem(benchmarks.GRID_LIMITS, bench, 4)
    return bench, tmp_path / "runs"


def _mtime(p: Path) -> int:
    return p.stat().st_mtime_ns


def test_grid_captures_with_the_limit_then_reuses_and_extends(grid_bench, capsys):
    bench, out = grid_bench
    assert census_main(["grid", "--benches", bench, "--out", str(out), *CAPTURE]) == 0
    cap = capsys.readouterr()
    assert "the first 4 of 6 requests" in cap.err and "4/6" in cap.out
    store = store_dir(out, bench, "stories260k")
    meta = read_meta(store)
    assert meta["n_requests"] == 4 and meta["limit"] == 4 and meta["requests_total"] == 6 and meta["complete"]
    row = json.loads((out / "grid" / "stories260k" / "census_grid.json").read_text())["rows"][0]
    assert (row["requests"], row["requests_total"], row["limit"]) == (4, 6, 4)
    summary = store.parent / "census" / "summary.json"
    assert json.loads(summary.read_text())["store_fingerprint"] == store_fingerprint(meta)

    # a rerun reuses the current census (nothing recomputed)
    before = _mtime(summary)
    assert census_main(["grid", "--benches", bench, "--out", str(out), *CAPTURE]) == 0
    assert _mtime(summary) == before

    # a larger limit extends the store; the census of the shorter store is stale and recomputed
    benchmarks.GRID_LIMITS[bench] = 5
    assert census_main(["grid", "--benches", bench, "--out", str(out), *CAPTURE]) == 0
    assert read_meta(store)["n_requests"] == 5
    assert json.loads(summary.read_text())["requests"] == 5 and _mtime(summary) != before

    # --no-limits: the whole benchmark, so the limited store is extended to all 6
    assert census_main(["grid", "--benches", bench, "--out", str(out), *CAPTURE, "--no-limits"]) == 0
    assert read_meta(store)["n_requests"] == 6


def test_census_and_replay_if_missing(grid_bench, capsys):
    bench, out = grid_bench
    base = ["--bench", bench, "--model", "stories260k", "--out", str(out), "--quiet"]
    assert data_main(["capture", *base, "--limit", "grid", "--max-new-tokens", "12"]) == 0
    assert "the first 4 of 6" in capsys.readouterr().err
    store = store_dir(out, bench, "stories260k")

    census = ["--bootstrap", "20", "--no-embeddings"]
    assert census_main([*base, *census]) == 0
    summary = store.parent / "census" / "summary.json"
    before = _mtime(summary)
    assert census_main([*base, "--bootstrap", "20", "--if-missing"]) == 0
    assert "not recomputed" in capsys.readouterr().err and _mtime(summary) == before
    assert census_main([*base, "--bootstrap", "30", "--if-missing"]) == 0  # other settings: recomputed
    assert json.loads(summary.read_text())["config"]["bootstrap"] == 30

    replay = ["replay", *base, "--arms", "suffix,pld", "--bootstrap", "20", "--if-missing"]
    assert decoder_main(replay) == 0
    arm = store.parent / "replay" / "suffix" / "summary.json"
    before = _mtime(arm)
    capsys.readouterr()
    assert decoder_main(replay) == 0
    assert "not recomputed" in capsys.readouterr().err and _mtime(arm) == before
    assert decoder_main([*replay[:-1], "--arms", "suffix,lexical", "--if-missing"]) == 0  # an arm missing
    assert _mtime(arm) != before

    # the store grows: both results are stale
    assert data_main(["capture", *base, "--limit", "5", "--max-new-tokens", "12"]) == 0
    assert current_summary(arm, store) is None and current_summary(summary, store) is None
    assert decoder_main(replay) == 0
    assert json.loads(arm.read_text())["requests"] == 5


def test_bad_limit_is_one_line(tmp_path, capsys):
    bench = write_jsonl(tmp_path / "t.jsonl", STORY_PROMPTS[:2])
    for bad in ("abc", "0"):
        assert data_main(["capture", "--bench", bench, "--model", "stories260k", "--limit", bad,
                          "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--limit" in err[0]
    assert census_main(["grid", "--benches", "nope", "--capture", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "grid").exists()


def test_current_summary_rejects_incomplete_and_foreign(tmp_path):
    store = tmp_path / "s"
    store.mkdir()
    meta = {"complete": True, "checksums": {"a": "1"}, "n_requests": 3, "model_fingerprint": "m"}
    (store / "meta.json").write_text(json.dumps(meta))
    s = tmp_path / "summary.json"
    s.write_text(json.dumps({"store_fingerprint": store_fingerprint(meta), "nodes": 60}))
    assert current_summary(s, store, nodes=60) is not None
    assert current_summary(s, store, nodes=32) is None
    (store / "meta.json").write_text(json.dumps({**meta, "checksums": {"a": "2"}}))
    assert current_summary(s, store) is None
    (store / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    assert current_summary(s, store) is None
    s.write_text("{")
    (store / "meta.json").write_text(json.dumps(meta))
    assert current_summary(s, store) is None
