"""The live decoder sized by this machine's profile (decoder/cost/live.py, `--profile PATH|auto|flat`) and served
through the graph verifier (`--verifier graph`), end to end on stories260k: every arm lossless against ar."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import STORY_PROMPTS, write_jsonl
from decoder.cost.live import live_contexts, live_nodes
from decoder.live.harness import DecodeConfig, run_decode


def test_live_grid():
    # quantiles 0, 1/3, 2/3, 1 of [10, 10, 20, 30, 94] (the shortest prompt, the prompts, the longest + the cap):
    # 10, 13.3, 26.7, 94, rounded up to 16
    assert live_contexts([10, 20, 30], 64) == [16, 32, 96]
    assert live_contexts([300], 0) == [304]
    assert live_nodes(60) == [0, 1, 2, 4, 8, 16, 24, 32, 48, 60]
    assert live_nodes(0) == [0]


def _cfg(tmp_path, **kw):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    return DecodeConfig(bench=bench, model="stories260k", arms=("ar", "oilbird", "lexical"), max_new_tokens=40,
                        out=str(tmp_path / "runs"), progress=False, **kw)


def test_profile_auto_measures_once_then_reads_it(stories, tmp_path, capsys):
    first = run_decode(_cfg(tmp_path, profile="auto"), lm=stories)
    err = capsys.readouterr().err
    path = tmp_path / "runs" / "profiles" / "stories260k-cpu.json"
    assert "measuring this machine's verification cost with the eager verifier once" in err and path.is_file()
    assert first["oilbird"]["sizing"] == f"harness profile {path} (measured now)"
    assert first["oilbird"]["drafter_stats"]["step_cost"] == "harness profile, batch 1"
    created = json.loads(path.read_text())["created"]
    again = run_decode(_cfg(tmp_path, profile="auto"), lm=stories)
    assert "measuring" not in capsys.readouterr().err and json.loads(path.read_text())["created"] == created
    assert again["oilbird"]["sizing"] == f"harness profile {path}"
    for s in (*first.values(), *again.values()):
        assert s["lossless"]["lossless"] and s["lossless"]["matched"] == s["requests"], s["arm"]
    flat = run_decode(_cfg(tmp_path, profile="flat"), lm=stories)
    assert flat["oilbird"]["sizing"] == "flat" and flat["oilbird"]["drafter_stats"]["step_cost"] == "flat"
    # a profile sized by cost verifies no more nodes a pass than the flat cost's whole candidate tree
    assert first["oilbird"]["mean_nodes"] <= flat["oilbird"]["mean_nodes"] + 1e-9


def test_a_profile_short_of_a_run_s_contexts_grows_to_cover_it(stories, tmp_path, capsys):
    """A cached profile measured for short prompts, then a run with longer ones: only the missing contexts are
    measured, merged in; the first benchmark is then covered (at both ends) and measures nothing."""
    short = write_jsonl(tmp_path / "short.jsonl", STORY_PROMPTS[:2])
    long = write_jsonl(tmp_path / "long.jsonl", [" ".join(STORY_PROMPTS) * 2])
    out = str(tmp_path / "runs")
    kw = dict(model="stories260k", arms=("ar", "oilbird"), max_new_tokens=8, out=out, progress=False, profile="auto")
    run_decode(DecodeConfig(bench=short, **kw), lm=stories)
    path = tmp_path / "runs" / "profiles" / "stories260k-cpu.json"
    first = json.loads(path.read_text())
    capsys.readouterr()
    run_decode(DecodeConfig(bench=long, **kw), lm=stories)
    err = capsys.readouterr().err
    assert f"was measured at contexts {first['contexts'][0]}..{first['contexts'][-1]}" in err and "added to it" in err
    grown = json.loads(path.read_text())
    assert set(first["contexts"]) < set(grown["contexts"]) and grown["contexts"] == sorted(grown["contexts"])
    assert grown["merged"][0]["contexts"] == first["contexts"]
    for c, row in zip(first["contexts"], first["verify_s"]):  # the old rows kept as measured
        assert grown["verify_s"][grown["contexts"].index(c)] == row
    again = run_decode(DecodeConfig(bench=short, **kw), lm=stories)
    assert "measuring" not in capsys.readouterr().err and again["oilbird"]["sizing"] == f"harness profile {path}"


def test_a_profile_of_another_model_is_refused(stories, tmp_path, capsys):
    from decoder.__main__ import main

    run_decode(_cfg(tmp_path, profile="auto"), lm=stories)
    path = tmp_path / "runs" / "profiles" / "stories260k-cpu.json"
    d = json.loads(path.read_text())
    d["model_fingerprint"], d["model"] = "0" * 16, "another-model"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(d))
    bench = write_jsonl(tmp_path / "c.jsonl", STORY_PROMPTS[:1])
    argv = ["--bench", bench, "--model", "stories260k", "--arms", "ar,oilbird", "--out", str(tmp_path / "r2"),
            "--quiet", "--max-new-tokens", "8"]
    capsys.readouterr()
    assert main(argv + ["--profile", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --profile") and "another-model's, not stories260k's" in err and "\n" not in err
    assert main(argv + ["--profile", str(tmp_path / "none.json")]) == 2
    assert "--profile must be auto, flat or a profile file" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()


def _passes(summary) -> list[tuple]:
    import pyarrow.parquet as pq

    t = pq.read_table(f"{summary['decode_dir']}/{summary['arm']}/cycles.parquet").to_pylist()
    return [(c["request"], c["pass"], c["nodes"], c["accepted"], c["committed"], tuple(c["sources"])) for c in t]


def test_every_arm_through_the_graph_verifier_is_lossless(stories, tmp_path):
    cfg = _cfg(tmp_path, profile="flat", verifier="graph", nodes=12, overlap="on")
    cfg.arms = ("ar", "oilbird", "oilbird+serial", "lexical", "pld")
    out = run_decode(cfg, lm=stories)
    for arm, s in out.items():
        assert s["lossless"]["lossless"] and s["lossless"]["matched"] == s["requests"] == 3, arm
    assert out["ar"]["verifier"] == {"kind": "eager-greedy"}
    for arm in ("oilbird", "oilbird+serial", "lexical", "pld"):
        v = out[arm]["verifier"]
        assert v["kind"] == "graph" and v["buckets"] == [1, 16] and v["passes"] == out[arm]["passes"]
        assert v["recompiles_after_warmup"] == 0 and v["compiles"] >= 1  # verified on the worker thread too
        assert v["overlap"] is (arm != "oilbird+serial")
    # the bookkeeping beside the verify or before it: the same passes (decoder/loop.py)
    assert _passes(out["oilbird"]) == _passes(out["oilbird+serial"])
    eager = run_decode(_cfg(tmp_path, profile="flat", verifier="eager", nodes=12), lm=stories)
    assert eager["oilbird"]["verifier"] == {"kind": "eager", "overlap": False}  # --overlap auto: off on a CPU
    # the same passes as the eager verifier (the same drafter, the same model: only the verify differs)
    assert _passes(eager["oilbird"]) == _passes(out["oilbird"])
    assert np.isclose(eager["oilbird"]["tau"], out["oilbird"]["tau"])
    # oilbird defers its calibration labels, adjacency update and ring buffer: that work ran beside the verify
    d = out["oilbird"]["drafting"]
    assert d["overlapped"] and d["beside_verify_s"] == out["oilbird"]["time"]["beside_s"] > 0
    assert d["critical_path_s"] == pytest.approx(out["oilbird"]["time"]["draft_s"] + out["oilbird"]["time"]["update_s"])
    serial = out["oilbird+serial"]["drafting"]
    assert not serial["overlapped"] and serial["beside_verify_s"] == 0.0
    assert serial["critical_path_s"] > out["oilbird+serial"]["time"]["draft_s"] + out["oilbird+serial"]["time"]["update_s"]


def test_each_verifier_is_sized_by_its_own_profile(stories, tmp_path, capsys):
    """oilbird+graph and oilbird+eager in one run: each arm's trees are sized by the profile of the verifier that
    verifies it (<model>-<device>-graph.json timed through the graph verifier itself), both lossless."""
    cfg = _cfg(tmp_path, profile="auto", nodes=12)
    cfg.arms = ("ar", "oilbird+graph", "oilbird+eager")
    out = run_decode(cfg, lm=stories)
    profiles = tmp_path / "runs" / "profiles"
    graph_file, eager_file = profiles / "stories260k-cpu-graph.json", profiles / "stories260k-cpu.json"
    assert json.loads(graph_file.read_text())["verifier"] == "graph"
    assert json.loads(eager_file.read_text())["verifier"] == "eager"
    assert out["oilbird+graph"]["sizing"] == f"harness profile {graph_file} (measured now)"
    assert out["oilbird+eager"]["sizing"] == f"harness profile {eager_file} (measured now)"
    assert out["oilbird+graph"]["verifier"]["kind"] == "graph"
    assert out["oilbird+eager"]["verifier"] == {"kind": "eager", "overlap": False}
    assert out["oilbird+graph"]["verifier"]["recompiles_after_warmup"] == 0  # the profile timed the run's own graph
    for s in out.values():
        assert s["lossless"]["lossless"] and s["lossless"]["matched"] == 3, s["arm"]


def test_profile_cli_verifier_graph_needs_the_harness(capsys):
    from decoder.cost.profile import profile_main

    assert profile_main(["--model", "stories260k", "--engine", "vllm", "--verifier", "graph"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --verifier graph times the harness's graph verifier: it needs --engine harness"
