"""Issue 35, the profile's part: a verification-cost profile prices only what it measured.

Covers decoder/cost/pricing.py (a replay priced outside the profile's measured nodes, contexts, prompt lengths or
batch sizes refuses in one line naming the arm, the quantity, the measured range and the command measuring a
wider profile; shorter contexts are priced at the shortest measured one with a note in the summary), the
cost-sized drafts choosing among the measured node counts only (decoder/drafters/sizing.py), the profile engine's
fallback to the harness where vLLM cannot run the model (decoder/cost/engine_choice.py, `--engine auto`), the
profile's file named from the model's slug (`--print-path`, the Makefile's `make profile MODEL=../x/y`), and
`--if-missing` measuring again a profile the store has outgrown.

Run: python -m pytest -q tests/test_trust_profile.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.store.layout import replay_dir, store_dir
from decoder.__main__ import main as decoder_main
from decoder.cost.profile import CostModel, profile_main
from decoder.replay.run import ReplayConfig, run_replay
from decoder.drafters.sizing import StepCost
from tests.conftest import STORY_PROMPTS, capture_story_store

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260k"


@pytest.fixture(scope="module")
def store(tmp_path_factory, stories):
    """A stories260k store of four requests (its contexts run from the prompts' lengths to about 60)."""
    return capture_story_store(tmp_path_factory, stories, "trust_profile", STORY_PROMPTS[:4], 24)


def _profile(path: Path, fingerprint: str, nodes=(0, 8, 64), contexts=(1, 4096), prefill=(1, 4096),
             engine: str | None = None) -> str:
    """A profile whose step costs 10 ms + 1 ms a draft node, at any context, measured on the given grid."""
    d = {"format": 1, "model": "stories260k", "model_fingerprint": fingerprint, "device": "cpu",
         "device_name": "test", "threads": 1, "nodes": list(nodes), "contexts": list(contexts),
         "verify_s": [[0.01 + 0.001 * n for n in nodes] for _ in contexts],
         "prefill_lengths": list(prefill), "prefill_s": [0.001 * p for p in prefill]}
    if engine:
        d["engine"] = engine
    path.write_text(json.dumps(d))
    return str(path)


def _replay(argv, capsys) -> tuple[int, list[str]]:
    code = decoder_main(["replay", *argv, "--quiet", "--bootstrap", "0", "--jobs", "1"])
    return code, capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------ refusals outside the measured grid

def test_the_issue_case_nodes_1_contexts_64_refuses(store, stories, tmp_path, capsys):
    # the probe's case: a profile measured at `--nodes 1 --contexts 64` priced a 60-node replay with no note
    bench, out = store
    prof = _profile(tmp_path / "narrow.json", stories.fingerprint, nodes=(1,), contexts=(64,), prefill=(65,))
    code, err = _replay(["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "lexical",
                         "--profile", prof], capsys)
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith("error: arm lexical:") and "0 draft nodes" in line and "draft nodes 1..1" in line
    assert prof in line and "`python -m decoder profile --model stories260k --engine harness --nodes 0,1,60" in line
    assert not (replay_dir(out, bench, "stories260k") / "lexical").exists()  # nothing written


def test_a_fixed_budget_beyond_the_measured_nodes_refuses(store, stories, tmp_path, capsys):
    bench, out = store
    prof = _profile(tmp_path / "p8.json", stories.fingerprint, nodes=(0, 4, 8))
    for argv in (["--arms", "suffix"], ["--arms", "oilbird", "--sizing", "flat"]):  # flat: every candidate kept
        code, err = _replay(["--bench", bench, "--model", "stories260k", "--out", out, "--profile", prof, *argv],
                            capsys)
        assert code == 2 and len(err) == 1, err
        arm = argv[1]
        assert f"arm {arm}: its passes verify up to 60 draft nodes" in err[0] and "draft nodes 0..8" in err[0]
        assert "--nodes 0,4,8,60 --contexts 1,4096 --file" in err[0]


def test_cost_sized_arms_choose_among_the_measured_nodes(store, stories, tmp_path):
    # size auto is no extrapolation: its search stops at the most nodes measured, so the budget may exceed it
    bench, out = store
    prof = _profile(tmp_path / "p8.json", stories.fingerprint, nodes=(0, 4, 8), engine="vllm")
    got = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("oilbird", "oilbird-chain"), out=out,
                                  profile=prof, bootstrap=0, jobs=1, progress=False,
                                  results_dir=str(tmp_path / "r")))
    for arm in ("oilbird", "oilbird-chain"):
        nodes = pq.read_table(tmp_path / "r" / arm / "cycles.parquet")["nodes"].to_numpy()
        assert nodes.max() <= 8 and got[(arm, 60)]["estimate"]["speedup"] > 0
    cost = CostModel.load(prof)
    assert len(StepCost(cost).table(60, 100)) == 9  # n = 0..8, the measured counts' span
    assert len(StepCost(None).table(60, 100)) == 61  # a flat cost has no measured bound


def test_contexts_beyond_the_longest_measured_refuse(store, stories, tmp_path, capsys):
    bench, out = store
    prof = _profile(tmp_path / "short.json", stories.fingerprint, contexts=(1, 16))
    code, err = _replay(["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "suffix",
                         "--nodes", "8", "--profile", prof], capsys)
    assert code == 2 and len(err) == 1, err
    assert "arm suffix: its requests reach contexts of" in err[0] and "contexts 1..16" in err[0]
    assert "--contexts 1,16,64 " in err[0]  # the widened grid covers the longest (rounded up to 16)


def test_prompts_beyond_the_longest_measured_prefill_refuse(store, stories, tmp_path, capsys):
    bench, out = store
    prof = _profile(tmp_path / "prefill.json", stories.fingerprint, prefill=(1, 2))
    code, err = _replay(["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "suffix",
                         "--profile", prof], capsys)
    assert code == 2 and len(err) == 1 and "its prompts run to" in err[0] and "prefills of up to 2 tokens" in err[0]


def test_an_unmeasured_batch_names_the_arm(store, stories, tmp_path, capsys):
    bench, out = store
    prof = _profile(tmp_path / "b1.json", stories.fingerprint, engine="vllm")
    code, err = _replay(["--bench", bench, "--model", "stories260k", "--out", out, "--arms",
                         "oilbird-chain@batch=4", "--profile", prof], capsys)
    assert code == 2 and len(err) == 1
    assert "arm oilbird-chain@batch=4 is sized for batch 4" in err[0] and "--batch-sizes 1,4" in err[0]


def test_shorter_contexts_are_priced_at_the_shortest_with_a_note(store, stories, tmp_path, capsys):
    bench, out = store
    from data.store.reader import open_store

    s = open_store(store_dir(out, bench, "stories260k"), load_hidden=False)
    prompts = s.requests["prompt_tokens"].list.len().to_list()
    outputs = s.requests["output_tokens"].list.len().to_list()
    shortest = 40
    want = sum(max(0, min(p + t - 1, shortest) - (p - 1)) for p, t in zip(prompts, outputs))
    assert 0 < want < sum(outputs)  # some of greedy's steps are below 40, some not
    prof = _profile(tmp_path / "from40.json", stories.fingerprint, contexts=(shortest, 4096))
    got = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("suffix",), out=out, profile=prof,
                                  bootstrap=0, jobs=1, progress=False, results_dir=str(tmp_path / "r")))
    note = got[("suffix", 60)]["estimate"]["context_note"]
    assert note.startswith(f"{want} of greedy's {sum(outputs)} steps") and "priced at 40" in note
    assert f"note: {note}" in capsys.readouterr().err
    # a profile covering every context: no note
    full = _profile(tmp_path / "full.json", stories.fingerprint)
    got = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("suffix",), out=out, profile=full,
                                  bootstrap=0, jobs=1, progress=False, results_dir=str(tmp_path / "r2")))
    assert got[("suffix", 60)]["estimate"]["context_note"] is None


def test_priced_span_by_hand():
    from decoder.cost.pricing import PricedSpan, priced_span

    # prompts 5 and 10 tokens, 3 and 0 tokens generated: contexts 4, 5, 6 (the second request prices a prefill only)
    assert priced_span([5, 10], [3, 0], 6) == PricedSpan(4, 6, 10, 3, 2)
    assert priced_span([5, 10], [3, 2], 1) == PricedSpan(4, 10, 10, 5, 0)


def test_cost_model_never_extrapolates():
    nodes, contexts = (0, 8), (100, 200)
    cost = CostModel.from_dict({"format": 1, "model": "m", "model_fingerprint": "f", "nodes": list(nodes),
                                "contexts": list(contexts), "prefill_lengths": [100, 200], "prefill_s": [0.1, 0.2],
                                "verify_s": [[0.01 + 0.001 * n for n in nodes] for _ in contexts]})
    assert cost.verify_s(64, 100) == cost.verify_s(8, 100) == pytest.approx(0.018)  # the most nodes measured
    assert cost.verify_s(0, 10_000) == cost.verify_s(0, 200)  # the longest context measured
    assert cost.prefill_s(50) == pytest.approx(0.05) and cost.prefill_s(10_000) == pytest.approx(0.2)


# ------------------------------------------------------------------ which engine, which file

def test_choose_engine_falls_back_where_vllm_cannot_run(tmp_path, monkeypatch):
    import data.capture.vllm_engine as ve
    from decoder.cost.engine_choice import choose_engine

    monkeypatch.setattr(ve.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ve, "require_vllm", lambda: None)  # as if installed
    # stories260k: head dim 8, which vLLM's CPU attention refuses
    engine, note = choose_engine("auto", str(STORIES_DIR), (1, 8))
    assert engine == "harness" and "head dim 8" in note and "batch sizes 8 left out" in note and "\n" not in note
    ok = tmp_path / "m64"
    ok.mkdir()
    (ok / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))  # SmolLM2: 64
    assert choose_engine("auto", str(ok)) == ("vllm", None)
    assert choose_engine("vllm", str(STORIES_DIR)) == ("vllm", None)  # asked for: vLLM refuses it itself
    assert choose_engine("harness", str(ok)) == ("harness", None)

    def missing():
        raise ve.OilbirdError(ve.MISSING)

    monkeypatch.setattr(ve, "require_vllm", missing)
    engine, note = choose_engine("auto", str(ok))
    assert engine == "harness" and "vLLM is not installed" in note


def test_auto_profile_of_the_tiny_model_is_the_harness_one(stories, tmp_path, capsys):
    path = tmp_path / "p.json"
    assert profile_main(["--model", "stories260k", "--engine", "auto", "--batch-sizes", "1,8", "--contexts", "16",
                         "--nodes", "0,2", "--reps", "1", "--file", str(path), "--quiet"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: profile engine")]
    assert len(err) == 1 and "the harness, not vLLM" in err[0]
    cost = CostModel.load(path)
    assert cost.meta.get("engine", "harness") == "harness" and cost.batch_sizes() == [1]
    from decoder.policy import decision_arms

    assert "oilbird" in decision_arms(cost.meta.get("engine"), cost.batch_sizes())  # the verdict's form: trees


def test_print_path_names_the_file_from_the_slug(tmp_path, monkeypatch, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "y").symlink_to(STORIES_DIR)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    out = tmp_path / "o"
    assert profile_main(["--model", "../x/y", "--out", str(out), "--engine", "auto", "--print-path"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == out / "profiles" / "y-cpu.json"  # inside OUT; the harness's name (vLLM cannot run it)
    assert profile_main(["--model", "../x/y", "--file", str(tmp_path / "f.json"), "--print-path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "f.json")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_profile_lets_python_name_the_file(tmp_path):
    venv = tmp_path / "venv"
    for target in ("profile", "replay", "census"):
        run = subprocess.run(["make", "-n", "-C", str(REPO), target, "MODEL=../x/y", f"OUT={tmp_path}/o",
                              f"VENV={venv}", "-o", f"{venv}/.installed"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "profiles/../" not in run.stdout and "/profiles/" not in run.stdout  # no name built from MODEL
        assert f"--model '../x/y' --out '{tmp_path}/o' --engine auto --print-path" in run.stdout


def test_if_missing_measures_again_a_profile_the_store_outgrew(store, stories, tmp_path, capsys):
    bench, out = store
    runs = tmp_path / "runs"
    shutil.copytree(out, runs)
    path = tmp_path / "p.json"
    argv = ["--model", "stories260k", "--bench", bench, "--out", str(runs), "--nodes", "0,2", "--reps", "1",
            "--file", str(path), "--quiet", "--if-missing"]
    _profile(path, stories.fingerprint, nodes=(0, 2), contexts=(1, 16))  # shorter than the store's contexts
    assert profile_main(argv) == 0
    err = capsys.readouterr().err
    assert "measured contexts up to 16, the store reaches" in err and "measuring it again" in err
    again = CostModel.load(path)
    assert again.contexts_range()[1] > 16
    assert profile_main(argv) == 0  # it covers the store now: kept
    assert "exists; kept" in capsys.readouterr().err
    assert np.array_equal(CostModel.load(path).contexts, again.contexts)
