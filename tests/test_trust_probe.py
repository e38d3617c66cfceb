"""Issue 45, item 3: what the independent probe of db96edb found, each case answered as issue 35's were (one
`error: ...` line and exit 2 for bad input, never a traceback, never a wrong result with exit 0).

Silently wrong before:
  - a profile's times unchecked (every verify_s negated or 0, a negative prefill_s, more draft nodes far
    cheaper than fewer): decoder/cost/profile.py refuses it on read, in one line;
  - a bare number where a replay summary holds a block (`sole_source_share: 0.5`, `estimate: "x"`):
    data/results.py's replay schema says the block is not an object, and the page cannot decide;
  - a one-store capture into a store set's folder whose members were placed by hand (`shard-a/`,
    `shard-b/`): refused, as for Ray's shard names (data/capture/run.py, data/store/storeset.py's definition);
  - an unsealed store (an edited layer cannot be caught): the census's and replay's summaries note it.
Tracebacks and hangs before:
  - `--ray 'local:²'` (a non-ASCII digit) and a stale RAY_ADDRESS under `--ray auto` (data/raycluster.py);
  - meta.json `runs` not a list, in an unsealed store (data/store/reader.py read_meta);
  - OILBIRD_VLLM_STATS naming a folder with the proposer's dict built by hand: make_llm checks the
    proposer's settings before vLLM starts (data/capture/vllm_engine.py), the constructor's line says how to
    check them before serving.

Run: python -m pytest -q tests/test_trust_probe.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.layout import census_dir, replay_dir, store_dir
from data.store.meta import META_SEAL
from decoder.cost.profile import CostModel
from decoder.replay.run import replay_main
from tests.conftest import STORY_PROMPTS, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 8


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "b.jsonl", STORY_PROMPTS[:4])


@pytest.fixture(scope="module")
def captured(stories, bench, tmp_path_factory) -> Path:
    """A complete 3-request store of stories260k (copied by each test that changes it)."""
    return Path(capture(CaptureConfig(bench=bench, model="stories260k", out=str(tmp_path_factory.mktemp("runs")),
                                      max_new_tokens=MAX_NEW, limit=3, progress=False), lm=stories))


@pytest.fixture
def out(captured, bench, tmp_path) -> Path:
    """A results root holding a copy of the captured store at runs/<bench>/stories260k/traces."""
    root = tmp_path / "runs"
    shutil.copytree(captured, store_dir(root, bench, "stories260k"))
    return root


def _one_line(main, argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    return err


def _edit_meta(store: Path, drop: tuple[str, ...] = (), **changes) -> None:
    meta = {k: v for k, v in json.loads((store / "meta.json").read_text()).items() if k not in drop}
    (store / "meta.json").write_text(json.dumps({**meta, **changes}, indent=2))


def _census(bench: str, out: Path) -> list[str]:
    return ["--bench", bench, "--model", "stories260k", "--out", str(out), "--no-embeddings", "--bootstrap", "0",
            "--quiet"]


def _replay(bench: str, out: Path, *more: str) -> list[str]:
    return ["--bench", bench, "--model", "stories260k", "--out", str(out), "--arms", "suffix", "--bootstrap", "0",
            "--jobs", "1", "--quiet", *more]


# ------------------------------------------------------------------ a profile's times

def _profile(fingerprint: str = "fp", **changes) -> dict:
    """A plausible profile: 10 ms + 1 ms a node, 1 ms more per 1000 tokens of context; prefill 1 ms per 10 tokens."""
    nodes, contexts, lengths = [0, 8, 64], [64, 512, 1024], [16, 65, 1025]
    d = {"format": 1, "model": "stories260k", "model_fingerprint": fingerprint, "device": "cpu",
         "device_name": "test", "threads": 1, "nodes": nodes, "contexts": contexts,
         "verify_s": [[0.01 + 0.001 * n + 1e-6 * c for n in nodes] for c in contexts],
         "prefill_lengths": lengths, "prefill_s": [1e-4 * p for p in lengths]}
    d.update(changes)
    return d


def _negated(d: dict) -> list:
    return [[-v for v in row] for row in d["verify_s"]]


BAD_PROFILES = [  # (name, the change, words of the refusal)
    ("verify_s negated", lambda d: {"verify_s": _negated(d)}, "verify_s[0][0] = -0.010064 is not a positive time"),
    ("verify_s zero", lambda d: {"verify_s": [[0.0] * 3] * 3}, "verify_s[0][0] = 0.0 is not a positive time"),
    ("prefill_s negative", lambda d: {"prefill_s": [-0.001, 0.0065, 0.1025]},
     "prefill_s[0] = -0.001 is not a positive time"),
    ("verify_s NaN", lambda d: {"verify_s": [[0.01, float("nan"), 0.08], [0.01, 0.02, 0.08], [0.01, 0.02, 0.08]]},
     "verify_s[0][1] = nan is not a positive time"),
    ("more nodes far cheaper", lambda d: {"verify_s": [[0.01, 0.018, 0.002], [0.011, 0.019, 0.075],
                                                       [0.012, 0.02, 0.076]]},
     "verify_s at context 64: 64 nodes cost 0.002 s, less than 1/3 of the 0.01 s of 0 nodes"),
    ("longer context far cheaper", lambda d: {"verify_s": [[0.01, 0.018, 0.074], [0.011, 0.019, 0.075],
                                                           [0.001, 0.02, 0.076]]},
     "verify_s at 0 nodes: context 1024 costs 0.001 s, less than 1/3 of the 0.01 s of context 64"),
    ("the grid reversed", lambda d: {"verify_s": [row[::-1] for row in d["verify_s"][::-1]]},
     "verify_s: at every context, 64 nodes cost less than 1/3 of 0 nodes (0.01102 s against 0.07502 s at context 64)"),
    ("longer prompt far cheaper", lambda d: {"prefill_s": [0.0016, 0.0065, 0.0004]},
     "prefill_s: 1025 tokens cost 0.0004 s, less than 1/3 of the 0.0016 s of 16 tokens"),
    ("a batch grid negated", lambda d: {"verify_s_by_batch": {"4": _negated(d)}},
     "verify_s_by_batch[4][0][0] = -0.010064 is not a positive time"),
]


@pytest.mark.parametrize("change, words", [b[1:] for b in BAD_PROFILES], ids=[b[0] for b in BAD_PROFILES])
def test_a_profile_with_times_that_are_not_times_is_one_line(change, words, tmp_path):
    """Every verify_s negated priced "est. speedup 0.08x", every verify_s 0 0.88x, a negative prefill_s was
    clamped to 0: all exit 0. A profile is read like the other result files: times positive and finite, and
    ordered by what they measure within a stated tolerance (decoder/cost/profile.py ORDER_FACTOR)."""
    good = _profile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(good))
    assert CostModel.load(path).verify_s(8, 64) == pytest.approx(good["verify_s"][0][1])
    path.write_text(json.dumps({**good, **change(good)}))
    with pytest.raises(OilbirdError) as e:
        CostModel.load(path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path} is not a decoder profile (") and words in line, line
    assert "python -m decoder profile" in line


def test_timing_noise_within_the_tolerance_is_accepted(tmp_path):
    """A measured profile is noisy: a point below the one before it (a slow run there) is not refused, nor a
    flat row, nor one slow point many times the next (7.4 ms at 0 nodes, 1.3 ms at 2: measured on this machine
    under load); only a cost under 1/3 of every one of two or more costs below it is."""
    d = _profile(verify_s=[[0.0074, 0.0013, 0.0015], [0.0119, 0.0121, 0.011], [0.0119, 0.0121, 0.011]],
                 prefill_s=[0.003, 0.0009, 0.1])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert CostModel.load(path).verify_s(64, 1024) == pytest.approx(0.011)
    assert CostModel.load(path).verify_s(8, 64) == pytest.approx(0.0013)


def test_replay_refuses_a_negated_profile(out, bench, stories, tmp_path, capsys):
    """The probe's case end to end: exit 2 and one line, no replay written."""
    d = _profile(stories.fingerprint)
    path = tmp_path / "neg.json"
    path.write_text(json.dumps({**d, "verify_s": _negated(d)}))
    err = _one_line(replay_main, _replay(bench, out, "--profile", str(path)), capsys)
    assert "is not a positive time" in err, err
    assert not (replay_dir(out, bench, "stories260k") / "suffix").exists()


# ------------------------------------------------------------------ a bare number where a block is due

def test_a_bare_share_or_estimate_cannot_decide(tmp_path):
    """`sole_source_share: 0.5` (no value, no interval) was read as the rule's share ("50.0% is at or above the
    9% line"); with `estimate` a string too, the page said "Verdict: enable the semantic source"."""
    from reports.render import render_site
    from reports.results import find_results
    from tests.test_trust_schema import decision, edit, make_replay

    runs = tmp_path / "runs"
    on = make_replay(runs)
    assert decision(render_site(find_results(runs))["toy__toy-model.html"])[0] == "neutral"
    edit(on, lambda d: d.update(sole_source_share=0.5))
    cls, text = decision(render_site(find_results(runs))["toy__toy-model.html"])
    assert cls == "cannot" and f"cannot decide: {on} has sole_source_share = 0.5 not an object" in text, text
    edit(on, lambda d: d.update(estimate="fast"))
    cls, text = decision(render_site(find_results(runs))["toy__toy-model.html"])
    assert cls == "cannot" and "Verdict: enable" not in text and 'estimate = "fast" not an object' in text, text
    edit(on, lambda d: d.update(sole_source_share={"value": 0.5}, estimate={"speedup": 2.0}, paired_gain=1.2))
    cls, text = decision(render_site(find_results(runs))["toy__toy-model.html"])
    assert cls == "cannot" and "paired_gain = 1.2 not an object" in text, text


# ------------------------------------------------------------------ a store set's folder

def test_a_one_store_capture_into_a_hand_placed_set_is_refused(out, bench, captured, capsys):
    """Members `shard-a/`, `shard-b/` placed by hand, as docs/store.md describes sets: the capture wrote a store
    beside them (exit 0), and from then on the folder read as that one store."""
    folder = store_dir(out, bench, "stories260k")
    shutil.rmtree(folder)
    for name in ("shard-a", "shard-b"):
        shutil.copytree(captured, folder / name)
    before = sorted(p.name for p in folder.iterdir())
    err = _one_line(data_main, ["capture", "--bench", bench, "--model", "stories260k", "--out", str(out),
                                "--max-new-tokens", str(MAX_NEW), "--quiet"], capsys)
    assert f"{folder} holds a store set (2 stores: shard-a, shard-b)" in err, err
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing written beside the members
    # nor Ray's shards beside them (two splits in one set)
    from data.capture.run import check_store_folder

    with pytest.raises(OilbirdError, match=r"holds a store set of stores not captured with --ray \(shard-a, shard-b\)"):
        check_store_folder(folder, sharded=True)


# ------------------------------------------------------------------ an unsealed store

def test_an_unsealed_store_is_noted_by_the_census_and_replay(out, bench, capsys):
    """An unsealed meta.json with its layer edited: the census reported "layer 2" with no note (`data verify`
    says the meta is unsealed). Now both summaries note it, and both commands print the note."""
    store = store_dir(out, bench, "stories260k")
    layer = json.loads((store / "meta.json").read_text())["layer"]
    _edit_meta(store, drop=(META_SEAL,), layer=layer - 1)
    assert census_main(_census(bench, out)) == 0
    printed = capsys.readouterr().out
    summary = json.loads((census_dir(out, bench, "stories260k") / "summary.json").read_text())
    notes = [n for n in summary["notes"] if "unsealed" in n]
    assert len(notes) == 1 and f"note: {notes[0]}" in printed and summary["store_sealed"] is False
    assert "python -m data migrate" in notes[0]
    assert replay_main(_replay(bench, out)) == 0
    printed = capsys.readouterr().out
    s = json.loads((replay_dir(out, bench, "stories260k") / "suffix" / "summary.json").read_text())
    assert s["store_sealed"] is False and "unsealed" in s["store_note"] and f"note: {s['store_note']}" in printed


def test_a_sealed_store_has_no_such_note(out, bench, capsys):
    assert census_main(_census(bench, out)) == 0
    summary = json.loads((census_dir(out, bench, "stories260k") / "summary.json").read_text())
    assert summary["store_sealed"] is True and not any("unsealed" in n for n in summary["notes"])


# ------------------------------------------------------------------ --ray

@pytest.mark.parametrize("spec", ["local:²", "local:٣", "127.0.0.1:²", "ray://host:６３７９"])
def test_a_ray_spec_with_a_digit_that_is_not_ascii_is_one_line(spec):
    """`str.isdigit()` accepts a superscript two; `int()` then raised a ValueError traceback."""
    from data.raycluster import parse_ray

    with pytest.raises(OilbirdError, match=r"^--ray "):
        parse_ray(spec)


def test_census_and_replay_refuse_local_superscript_in_one_line(out, bench, capsys):
    _one_line(census_main, _census(bench, out) + ["--ray", "local:²"], capsys)
    _one_line(replay_main, _replay(bench, out, "--ray", "local:²"), capsys)


def test_a_stale_ray_address_in_the_environment_is_bounded(tmp_path):
    """RAY_ADDRESS=127.0.0.1:1 with `--ray auto`: Ray's client retried past 120 s; the 10 s bound applied to
    `--ray HOST:PORT` only. Run in a process of its own (the hang is the point)."""
    pytest.importorskip("ray")
    code = ("import sys\nfrom data.errors import OilbirdError\nfrom data.raycluster import parse_ray, start_ray\n"
            "try:\n    start_ray(parse_ray('auto'))\nexcept OilbirdError as e:\n"
            "    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=90)
    assert time.monotonic() - t0 < 60
    err = r.stderr.strip()
    assert r.returncode == 2 and err.count("\n") == 0 and err.startswith("error: --ray auto: RAY_ADDRESS=127.0.0.1:1"), err
    assert "no Ray cluster answers there" in err and "unset RAY_ADDRESS" in err


# ------------------------------------------------------------------ meta.json fields of the commits

@pytest.mark.parametrize("field, value", [("runs", "abc"), ("runs", [1, 2]), ("truncated", [3]),
                                          ("prompt_tokens_reused", "x")])
def test_a_commit_field_of_the_wrong_shape_is_one_line(field, value, out, bench, stories, capsys):
    """meta.json `runs` set to a string in an unsealed store: extending the store was a TypeError traceback."""
    store = store_dir(out, bench, "stories260k")
    _edit_meta(store, drop=(META_SEAL,), **{field: value})
    with pytest.raises(OilbirdError, match=f"`{field}` is .*meta.json was edited or damaged"):
        capture(CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=MAX_NEW, limit=4,
                              progress=False), lm=stories)
    err = _one_line(data_main, ["show", str(store)], capsys)
    assert f"`{field}` is" in err, err


# ------------------------------------------------------------------ vLLM settings, the proposer's dict by hand

def test_make_llm_checks_the_proposers_settings_before_the_engine(monkeypatch, tmp_path):
    """OILBIRD_VLLM_STATS naming a folder, the proposer's dict built by hand: vLLM's "Engine core initialization
    failed" after ~130 lines of worker tracebacks. Where our code builds the engine, one line before it starts."""
    from data.capture import vllm_engine
    from decoder.vllm.proposer import CLASS_PATH

    for v in ("ARM", "NODES", "INDEX", "STATS", "LOG", "PROFILE", "STORE", "TRACES", "LAYER"):
        monkeypatch.delenv("OILBIRD_VLLM_" + v, raising=False)
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path))

    def engine(**kw):
        raise AssertionError("the engine started")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=engine))
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    spec = {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": 4}
    with pytest.raises(OilbirdError, match=r"^OILBIRD_VLLM_STATS='.*': .* is a folder") as e:
        vllm_engine.make_llm(vllm_engine.EngineConfig(str(tmp_path)), spec)
    assert "\n" not in str(e.value)


def test_the_proposers_constructor_says_how_to_check_before_serving(monkeypatch, tmp_path):
    """`vllm serve` runs none of our code before its workers: the constructor's one line names the variable and
    the command that checks the settings before serving."""
    from decoder.vllm.proposer import OilbirdProposer
    from tests.test_trust_vllm import fake_vllm_config

    for v in ("ARM", "NODES", "INDEX", "STATS", "LOG", "PROFILE", "STORE", "TRACES", "LAYER"):
        monkeypatch.delenv("OILBIRD_VLLM_" + v, raising=False)
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path))
    with pytest.raises(OilbirdError) as e:
        OilbirdProposer(fake_vllm_config())
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"OILBIRD_VLLM_STATS='{tmp_path}'"), line
    assert "Oilbird proposer" in line and "python -m decoder vllm-check" in line, line


def test_vllm_check_reads_the_settings_as_the_proposer_does(monkeypatch, tmp_path, capsys):
    """The check the constructor's line names, run as a user would before `vllm serve`: the same line, exit 2;
    settings that hold: one OK line."""
    from decoder.__main__ import main as decoder_main

    for v in ("ARM", "NODES", "INDEX", "STATS", "LOG", "PROFILE", "STORE", "TRACES", "LAYER"):
        monkeypatch.delenv("OILBIRD_VLLM_" + v, raising=False)
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path))
    err = _one_line(decoder_main, ["vllm-check"], capsys)
    assert err.startswith(f"error: OILBIRD_VLLM_STATS='{tmp_path}': ") and "is a folder" in err, err
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path / "stats.json"))
    monkeypatch.setenv("OILBIRD_VLLM_NODES", "30")
    assert decoder_main(["vllm-check", "--k", "4"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("OK: ") and "arm oilbird" in said and "nodes 30" in said and "k 4" in said, said
    assert not (tmp_path / "stats.json").exists()  # checked writable, nothing written
