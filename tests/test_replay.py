"""Replay: the store as the verifier. Exact small-array tests of the kernel (truth_argmax, the store rows),
pass-by-pass equality with the live decoder for the exact arms (stories260k, tiny random Llama and Qwen2),
the outputs, the paired gain, and the one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.capture.models import load_model
from data.capture.run import CaptureConfig, capture
from data.store.layout import replay_dir
from decoder.__main__ import main as decoder_main
from decoder.draft import ROOT
from decoder.drafters import make_drafter
from decoder.live.harness import DecodeConfig, run_decode
from decoder.replay.run import ReplayConfig, run_replay
from decoder.replay.traces import StoreRows, Trace, exactness, store_topk, truth_argmax
from decoder.verify.tree import greedy_accept
from tests.conftest import STORY_PROMPTS, capture_story_store, write_jsonl

# arms whose proposals depend only on committed tokens and their states: replay must equal live
EXACT_ARMS = ("pld", "suffix", "sam", "pld+key")
INEXACT_ARMS = ("recycling", "lexical", "oilbird", "oilbird-no-semantic")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ------------------------------------------------------------------ the kernel

def test_truth_argmax_marks_the_true_path_only():
    # anchor -> 5 -> 6 -> 7 ; anchor -> 5' (duplicate of 5) -> 9 ; anchor -> 8
    tokens = [5, 6, 7, 5, 9, 8]
    parents = [ROOT, 0, 1, ROOT, 3, ROOT]
    argmax, on_path = truth_argmax(tokens, parents, [5, 6, 7, 4])
    assert on_path == {0: 1, 1: 2, 2: 3, 3: 1}
    assert argmax.tolist() == [5, 6, 7, 4, 6, -1, -1]
    accepted, bonus = greedy_accept(tokens, parents, argmax)
    assert accepted == [0, 1, 2] and bonus == 4


def test_truth_argmax_at_the_trace_end_and_without_truth():
    argmax, on_path = truth_argmax([5, 6, 7], [ROOT, 0, 1], [5, 6])
    assert on_path == {0: 1, 1: 2} and argmax.tolist() == [5, 6, -1, -1]  # after the last token: unknown
    accepted, bonus = greedy_accept([5, 6, 7], [ROOT, 0, 1], argmax)
    assert accepted == [0, 1] and bonus == -1
    argmax, on_path = truth_argmax([], [], [3])
    assert argmax.tolist() == [3] and on_path == {}


def _trace(n=5, d=4):
    hidden = np.arange(n * d, dtype=np.float16).reshape(n, d)
    topk = np.arange(n * 8, dtype=np.int32).reshape(n, 8)
    topk[-1] = -1
    return Trace(prompt=[1, 2], tokens=list(range(10, 10 + n)), hidden=hidden, topk=topk,
                 first_hidden=np.full(d, -1, np.float16), first_topk=np.full(8, 99, np.int32))


def test_store_rows_and_topk():
    tr = _trace()
    rows = StoreRows(tr, 0, {0: 1, 2: 2})
    assert rows[0].tolist() == [-1] * 4  # the first pass's anchor: the prompt's last state
    assert rows[1].tolist() == tr.hidden[0].tolist() and rows[3].tolist() == tr.hidden[1].tolist()
    with pytest.raises(LookupError):
        rows[2]  # node 1 is off the true path: its state is not in the store
    rows = StoreRows(tr, 2, {0: 1})
    assert rows[0].tolist() == tr.hidden[1].tolist() and rows[1].tolist() == tr.hidden[2].tolist()
    topk = store_topk(tr, 2, 3, {0: 1, 2: 2})
    assert topk[0].tolist() == tr.topk[1].tolist() and topk[1].tolist() == tr.topk[2].tolist()
    assert topk[2].tolist() == [-1] * 8 and topk[3].tolist() == tr.topk[3].tolist()
    assert store_topk(tr, 0, 0, {})[0].tolist() == [99] * 8


def test_exactness_by_what_the_drafter_reads():
    for arm in EXACT_ARMS:
        assert exactness(make_drafter(arm, vocab_size=64, nodes=60))[0], arm
    for arm in INEXACT_ARMS:
        exact, why = exactness(make_drafter(arm, vocab_size=64, nodes=60))
        assert not exact and why, arm
    assert "ring buffer" in exactness(make_drafter("semantic-only", vocab_size=64, nodes=60))[1]


# ------------------------------------------------------------------ replay equals live, pass by pass

TRAFFIC = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1], STORY_PROMPTS[3], STORY_PROMPTS[4] + " Tom"]


def _live_and_replay(lm, tmp_path: Path, arms, max_new: int, pool_cap: int | None = None):
    bench = write_jsonl(tmp_path / "bench.jsonl", TRAFFIC)
    out = str(tmp_path / "runs")
    capture(CaptureConfig(bench=bench, model=lm.name, max_new_tokens=pool_cap or max_new, out=out, progress=False),
            lm=lm)
    live = run_decode(DecodeConfig(bench=bench, model=lm.name, arms=("ar", *arms), max_new_tokens=max_new, out=out,
                                   progress=False), lm=lm)
    replay = run_replay(ReplayConfig(bench=bench, model=lm.name, arms=tuple(arms), max_new_tokens=max_new, out=out,
                                     bootstrap=50, jobs=1, progress=False))
    return bench, out, live, replay


def _passes(folder: Path) -> list[tuple]:
    t = pq.read_table(folder / "cycles.parquet").to_pydict()
    return list(zip(t["request"], t["pass"], t["nodes"], t["accepted"], t["committed"], map(tuple, t["sources"])))


def _check_exact(live, replay, arms):
    for arm in arms:
        live_dir = Path(live[arm]["decode_dir"]) / arm
        s = replay[(arm, 60)]
        assert s["exact"], arm
        replay_dir_ = Path(s["store"]).parent / "replay" / arm
        assert _passes(replay_dir_) == _passes(live_dir), arm
        assert s["tau"]["value"] == pytest.approx(live[arm]["tau"]), arm
        assert s["generated_tokens"] == live[arm]["generated_tokens"] == live["ar"]["generated_tokens"]


def test_replay_equals_live_stories(stories, tmp_path):
    # the cap of the replay (40) is below the store's (48): traces are cut there, as greedy with cap 40
    _, _, live, replay = _live_and_replay(stories, tmp_path, EXACT_ARMS + INEXACT_ARMS, 40, pool_cap=48)
    _check_exact(live, replay, EXACT_ARMS)
    assert replay[("pld+key", 60)]["accepted_by_source"].get("semantic", 0) > 0  # the key itself drafted
    for arm in INEXACT_ARMS:  # replay may differ here, within reason, and says why
        s = replay[(arm, 60)]
        assert not s["exact"] and s["exact_reason"]
        assert s["generated_tokens"] == live[arm]["generated_tokens"]
        assert s["tau"]["value"] == pytest.approx(live[arm]["tau"], rel=0.35), arm


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_replay_equals_live_tiny_random(kind, tiny_dirs, tmp_path):
    lm = load_model(tiny_dirs[kind])
    _, _, live, replay = _live_and_replay(lm, tmp_path, EXACT_ARMS, 32)
    _check_exact(live, replay, EXACT_ARMS)


# ------------------------------------------------------------------ outputs, pools, nodes, the paired gain

@pytest.fixture(scope="module")
def small_store(tmp_path_factory, stories):
    return capture_story_store(tmp_path_factory, stories, "replay_store", TRAFFIC, 32)


def test_summary_paired_gain_and_several_nodes(small_store, tmp_path):
    bench, out = small_store
    out2 = str(tmp_path / "runs")
    import shutil

    shutil.copytree(out, out2)
    cfg = ReplayConfig(bench=bench, model="stories260k", arms=("oilbird", "oilbird-no-semantic", "suffix"),
                       nodes=(16, 60), out=out2, bootstrap=200, jobs=2, progress=False)
    summaries = run_replay(cfg)
    root = replay_dir(out2, bench, "stories260k")
    for arm in cfg.arms:
        for nodes in cfg.nodes:
            s = json.loads((root / arm / f"nodes-{nodes}" / "summary.json").read_text())
            assert s["kind"] == "replay" and s["nodes"] == nodes and s["pool"] == "past"
            lo, hi = s["tau"]["interval"]
            assert lo <= s["tau"]["value"] <= hi
            assert s["nodes_per_pass"]["max"] <= nodes
            assert s["draft_s_per_pass"]["mean"] > 0
            cycles = pq.read_table(root / arm / f"nodes-{nodes}" / "cycles.parquet").to_pydict()
            assert sum(cycles["committed"]) == s["generated_tokens"] and len(cycles["pass"]) == s["passes"]
    s = summaries[("oilbird", 60)]
    share, draft_share = s["sole_source_share"], s["sole_source_share_of_draft"]
    assert share["tokens"] == s["generated_tokens"] and draft_share["accepted"] == s["accepted_draft_tokens"]
    assert share["sole"] == draft_share["sole"] <= s["accepted_by_source"].get("semantic", 0)
    assert share["value"] == pytest.approx(share["sole"] / share["tokens"])
    gain = s["paired_gain"]
    off = summaries[("oilbird-no-semantic", 60)]
    assert gain["versus"] == "oilbird-no-semantic"
    assert gain["tau_ratio"] == pytest.approx(s["tau"]["value"] / off["tau"]["value"])
    assert gain["interval"][0] <= gain["tau_ratio"] <= gain["interval"][1]
    assert summaries[("suffix", 60)]["sole_source_share"] is None and summaries[("suffix", 60)]["paired_gain"] is None
    # one process and two give the same passes
    again = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("suffix",), nodes=(16, 60), out=out2,
                                    bootstrap=200, jobs=1, progress=False))
    assert again[("suffix", 60)]["passes"] == summaries[("suffix", 60)]["passes"]


def test_warm_pool_skips_own_prompt(small_store, tmp_path):
    bench, out = small_store
    past = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("suffix",), out=out, bootstrap=0,
                                   jobs=1, progress=False))[("suffix", 60)]
    warm = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("suffix",), pool="warm", out=out,
                                   bootstrap=0, jobs=1, progress=False))[("suffix", 60)]
    assert (replay_dir(out, bench, "stories260k", "warm") / "suffix" / "summary.json").exists()
    assert warm["pool"] == "warm" and warm["tau"]["value"] >= past["tau"]["value"]
    # a store of one prompt repeated: warm must not draft request r from its own (identical) trace
    solo = write_jsonl(tmp_path / "solo.jsonl", [STORY_PROMPTS[0]] * 3)
    out2 = str(tmp_path / "runs")
    capture(CaptureConfig(bench=solo, model="stories260k", max_new_tokens=24, out=out2, progress=False),
            lm=load_model("stories260k"))
    s = run_replay(ReplayConfig(bench=solo, model="stories260k", arms=("suffix", "sam"), pool="warm", out=out2,
                                bootstrap=0, jobs=1, progress=False))
    past_solo = run_replay(ReplayConfig(bench=solo, model="stories260k", arms=("suffix", "sam"), out=out2,
                                        bootstrap=0, jobs=1, progress=False))
    for arm in ("suffix", "sam"):  # one prompt: every trace shares its hash, so both pools hold nothing usable
        assert s[(arm, 60)]["passes"] == past_solo[(arm, 60)]["passes"], arm


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing written

def _cli(argv, capsys):
    code = decoder_main(["replay", *argv, "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_bad_input_one_line(small_store, tmp_path, capsys):
    bench, out = small_store
    base = ["--bench", bench, "--model", "stories260k", "--out", out]
    code, err = _cli(["--bench", "apibank", "--model", "stories260k", "--out", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "python -m data capture" in err[0]
    for bad in (["--nodes", "0"], ["--nodes", "16,-4"], ["--nodes", "x"], ["--arms", "nope"], ["--max-new-tokens", "999"],
                ["--profile", str(tmp_path / "missing.json")]):
        code, err = _cli(base + bad, capsys)
        assert code == 2 and len(err) == 1 and err[0].startswith("error:"), (bad, err)
    assert not (Path(out) / Path(replay_dir(out, bench, "stories260k")).relative_to(out) / "nope").exists()


def test_semantic_arm_needs_states(small_store, tmp_path, capsys):
    bench, out = small_store
    import shutil

    from data.store.reader import open_store

    out2 = tmp_path / "runs"
    shutil.copytree(out, out2)
    store = open_store(Path(replay_dir(str(out2), bench, "stories260k")).parent / "traces")
    # a store whose states are all null (e.g. captured without states)
    import pyarrow as pa

    from data.store.reader import position_parts

    for part in position_parts(store.path):
        t = pq.read_table(part)
        d = store.d_model
        null_hidden = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(t.num_rows * d, np.float16)), d,
                                                        mask=pa.array(np.ones(t.num_rows, bool)))
        t = t.set_column(t.schema.get_field_index("hidden"), "hidden", null_hidden)
        pq.write_table(t, part)
    from data.store.writer import record_checksums

    record_checksums(store.path)  # a deliberate edit: re-record the checksums, or the store reads as damaged
    code, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(out2), "--arms", "oilbird"], capsys)
    assert code == 2 and len(err) == 1 and "needs hidden states" in err[0]
    assert not (replay_dir(str(out2), bench, "stories260k") / "oilbird").exists()
    code, _ = _cli(["--bench", bench, "--model", "stories260k", "--out", str(out2), "--arms", "suffix",
                    "--bootstrap", "0"], capsys)
    assert code == 0  # the lexical arms need no states
    code, _ = _cli(["--bench", bench, "--model", "stories260k", "--out", str(out2), "--arms", "pld+pool,semantic-null",
                    "--bootstrap", "0"], capsys)
    assert code == 0  # nor do Oilbird presets that never query the key


def _profile(path: Path, fingerprint: str, verify_s: float = 0.01, prefill_s: float = 0.5) -> str:
    path.write_text(json.dumps({
        "format": 1, "model": "stories260k", "model_fingerprint": fingerprint, "device": "cpu",
        "device_name": "test", "threads": 1, "nodes": [0, 64], "contexts": [1, 4096],
        "verify_s": [[verify_s, verify_s], [verify_s, verify_s]], "prefill_lengths": [1, 4096],
        "prefill_s": [prefill_s, prefill_s]}))
    return str(path)


def test_estimate_with_a_constant_cost_profile(small_store, tmp_path, stories):
    bench, out = small_store
    prof = _profile(tmp_path / "flat.json", stories.fingerprint)
    s = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=("sam",), out=out, profile=prof,
                                bootstrap=100, jobs=1, progress=False))[("sam", 60)]
    est = s["estimate"]
    R, T, P = s["requests"], s["generated_tokens"], s["passes"]
    assert est["ar_seconds"] == pytest.approx(R * 0.5 + T * 0.01)  # prefill + one forward per token
    assert est["verify_seconds"] == pytest.approx(P * 0.01)  # one forward per pass, whatever its nodes
    assert est["draft_seconds"] == pytest.approx(s["draft_s_per_pass"]["mean"] * P)
    assert est["arm_seconds"] == pytest.approx(R * 0.5 + P * 0.01 + est["draft_seconds"] + est["update_seconds"]
                                               + est["pool_seconds"])
    assert est["speedup"] == pytest.approx(est["ar_seconds"] / est["arm_seconds"])
    assert est["speedup_interval"][0] <= est["speedup"] <= est["speedup_interval"][1]
    assert 0 < est["draft_fraction"] < 1


def test_profile_of_another_model_is_refused(small_store, tmp_path, capsys):
    bench, out = small_store
    prof = _profile(tmp_path / "other.json", "0000other")
    code, err = _cli(["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "sam",
                      "--profile", prof], capsys)
    assert code == 2 and len(err) == 1 and "measured for model" in err[0]


def test_depth_profile_exact():
    from types import SimpleNamespace as C

    from decoder.verify.passes import depth_profile

    cycles = [C(accepted=3, sources=["spine", "semantic|spine", "semantic"]),
              C(accepted=1, sources=["adjacency"]),
              C(accepted=0, sources=[]),
              C(accepted=2, sources=["semantic", "spine"])]
    p = depth_profile(cycles, depths=4)
    assert p["passes"] == 4 and p["reach"] == [0.75, 0.5, 0.25, 0.0]
    assert p["by_source"] == {"adjacency": [1, 0, 0, 0], "semantic": [1, 1, 1, 0], "spine": [1, 2, 0, 0]}
    assert p["sole_semantic"] == [1, 0, 1, 0]
    assert depth_profile([C(accepted=5, sources=["spine"] * 5)], depths=2)["reach"] == [1.0, 1.0]


# ------------------------------------------------------------------ tokens per second: the sizing rule in replay

def _steep_profile(path: Path, fingerprint: str, engine: str = "vllm", batches=(8,)) -> str:
    """A profile whose step grows with every draft token (10 ms + 2 ms a node; batch B: B times that)."""
    nodes = [0, 8, 64]
    grid = lambda scale: [[scale * (0.01 + 0.002 * n) for n in nodes] for _ in range(2)]  # noqa: E731
    path.write_text(json.dumps({
        "format": 1, "model": "stories260k", "model_fingerprint": fingerprint, "device": "cpu", "engine": engine,
        "device_name": "test", "threads": 1, "nodes": nodes, "contexts": [1, 4096], "verify_s": grid(1.0),
        "prefill_lengths": [1, 4096], "prefill_s": [0.05, 0.05],
        "verify_s_by_batch": {str(b): grid(float(b)) for b in batches}}))
    return str(path)


def test_flat_sizing_is_the_fixed_tree_and_a_steep_profile_prunes(small_store, tmp_path, stories):
    bench, out = small_store
    steep = _steep_profile(tmp_path / "steep.json", stories.fingerprint)
    arms = ("oilbird", "oilbird-fixed", "oilbird-chain", "oilbird@size=fixed:chain=32")
    run_replay(ReplayConfig(bench=bench, model="stories260k", arms=arms, out=out, bootstrap=0, jobs=1,
                                   progress=False, results_dir=str(tmp_path / "flat")))
    # no profile: a flat cost, under which the sized tree keeps every candidate: the fixed tree, pass for pass
    assert _passes(tmp_path / "flat" / "oilbird") == _passes(tmp_path / "flat" / "oilbird-fixed")
    sized = run_replay(ReplayConfig(bench=bench, model="stories260k", arms=arms, out=out, bootstrap=0, jobs=1,
                                    progress=False, profile=steep, results_dir=str(tmp_path / "steep")))
    auto, fixed = sized[("oilbird", 60)], sized[("oilbird-fixed", 60)]
    assert auto["mean_nodes"] < fixed["mean_nodes"]  # priced, the low-probability nodes are left out
    assert auto["accepted_per_node"] > fixed["accepted_per_node"]
    assert auto["estimate"]["speedup"] > fixed["estimate"]["speedup"]
    chain = sized[("oilbird-chain", 60)]
    lengths = pq.read_table(tmp_path / "steep" / "oilbird-chain" / "cycles.parquet")["nodes"].to_numpy()
    assert lengths.max() <= 32 and len(set(lengths.tolist())) > 2  # the chain's length varies by step
    stats = auto["drafter_stats"]
    assert stats["size"] == "auto" and stats["step_cost"] == "vllm profile, batch 1"
    cal = stats["calibration"]
    assert cal["node"]["labels"] > 0 and 0 <= cal["node"]["ece"] <= 1 and "spine" in cal
    assert fixed["drafter_stats"]["calibration"] is None
    assert chain["estimate_by_batch"].keys() == {"1", "8"}
    assert chain["paired_gain"] is None  # its key-off twin was not replayed: no pair


def test_decision_arms_follow_the_profile_engine(small_store, tmp_path, stories):
    from decoder.policy import decision_arms, paired_arm

    assert decision_arms("vllm", [1, 8]) == ("suffix-arctic", "pld", "oilbird-chain", "oilbird-no-semantic-chain",
                                             "oilbird-chain@batch=8", "oilbird-no-semantic-chain@batch=8")
    assert decision_arms("harness")[3:5] == ("oilbird", "oilbird-no-semantic")
    assert paired_arm("oilbird-chain@batch=8") == "oilbird-no-semantic-chain@batch=8"
    assert paired_arm("suffix") is None
    from decoder.drafters import PRESETS, installed
    from decoder.replay.run import expand_decision

    bench, out = small_store
    steep = _steep_profile(tmp_path / "steep.json", stories.fingerprint)
    cfg = ReplayConfig(bench=bench, model="stories260k", arms=("decision",), out=out, bootstrap=50, jobs=1,
                       progress=False, profile=steep, results_dir=str(tmp_path / "d"))
    assert expand_decision(cfg, "stories260k").arms == decision_arms("vllm", [1, 8])  # the profile's engine and batches
    # the floor environment (make test-floor) has no ArcticInference: its arm is left out there, replayed in make test
    arms = tuple(a for a in decision_arms("vllm", [1, 8])
                 if installed(PRESETS.get(a.partition("@")[0], (a.partition("@")[0],))[0]))
    got = run_replay(ReplayConfig(**{**cfg.__dict__, "arms": arms if len(arms) < 6 else ("decision",)}))
    assert {a for a, _ in got} == set(arms)
    on = got[("oilbird-chain@batch=8", 60)]
    assert on["estimate"]["batch"] == 8 and on["paired_gain"]["versus"] == "oilbird-no-semantic-chain@batch=8"
    assert on["drafter_stats"]["step_cost"] == "vllm profile, batch 8"
    # at batch 8 a step costs 8x: the chains sized for it are no longer than batch 1's
    assert on["mean_nodes"] <= got[("oilbird-chain", 60)]["mean_nodes"]


def test_an_unmeasured_batch_is_one_line(small_store, tmp_path, stories, capsys):
    bench, out = small_store
    steep = _steep_profile(tmp_path / "steep.json", stories.fingerprint, batches=())
    code, err = _cli(["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "oilbird-chain@batch=4",
                      "--profile", steep, "--bootstrap", "0"], capsys)
    assert code == 2 and len(err) == 1 and "not 4" in err[0]
