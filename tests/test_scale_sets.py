"""Store sets (issue 36, item 1): several trace stores read as one serving stream.

Covers: the `finished_at` column (written at commit, null in older stores); a set of 4 stores captured one
after the other over 4 consecutive request ranges censuses (positions Parquet and summary.json, timing
aside) and replays (a lexical arm) to the same figures as one store holding the same requests, with the
same-prompt and tenant rules across stores; the set's fingerprint in results and stale detection; `data
verify` of a set; the reports reading a set at runs/<bench>/<model>/traces; the order of a set whose members
lack finished_at (stores ordered whole, with its note); the refusals (another model, layer, d_model, vocab
size, tokenizer, store format; an empty folder, a member that is not a store, a store given twice).

Run: /work/main/.venv/bin/python -m pytest -q tests/test_scale_sets.py
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.meta import write_meta
from data.store.reader import open_store, read_meta
from data.store.storeset import (
    current_fingerprint,
    current_summary,
    open_store_or_set,
    set_fingerprint,
)
from data.store.writer import record_checksums
from decoder.replay.run import ReplayConfig, run_replay
from tests.conftest import STORY_PROMPTS

# 8 requests: request 2 repeats request 0's prompt (and 6 repeats 3's), so the same-prompt rule crosses
# stores when the 8 are split in 4 ranges of 2; two tenants alternate, so the tenant rule does too
PROMPTS = STORY_PROMPTS + [STORY_PROMPTS[3], "Once upon a time, there was a little girl named Lily."]
TENANTS = ["acme", "globex", "acme", "acme", "globex", "acme", "globex", "acme"]
RANGES = [(0, 2), (2, 4), (4, 6), (6, 8)]
# what differs by design: timing, the store named and its fingerprint, the set's block, and the benchmark
# (each part store was captured from its own JSONL: the set's bench joins theirs)
TIMING = ("timing", "store", "store_fingerprint", "store_set", "notes", "bench")


def _jsonl(path: Path, lo: int, hi: int) -> str:
    with open(path, "w") as f:
        for i in range(lo, hi):
            f.write(json.dumps({"id": f"r{i}", "prompt": PROMPTS[i], "tenant": TENANTS[i]}) + "\n")
    return f"jsonl:{path}"


def _capture(bench: str, out: Path, lm) -> Path:
    # prefix_reuse off: every request's states from one full forward, whichever store it lands in
    cfg = CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=24, progress=False,
                        flush_every=2, prefix_reuse=False)
    return Path(capture(cfg, lm=lm))


@pytest.fixture(scope="module")
def stores(stories, tmp_path_factory):
    """One store of the 8 requests, and 4 stores of the same requests in 4 consecutive ranges, captured one
    after the other (so finished_at orders them as the one store does)."""
    import torch

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sets")
    one = _capture(_jsonl(root / "all.jsonl", 0, 8), root / "one", stories)
    parts = [_capture(_jsonl(root / f"part{i}.jsonl", lo, hi), root / f"part{i}", stories)
             for i, (lo, hi) in enumerate(RANGES)]
    folder = root / "set"
    folder.mkdir()
    for i, p in enumerate(parts):
        shutil.copytree(p, folder / f"s{i}")
    return {"root": root, "one": one, "parts": parts, "folder": folder}


def _census(out: Path, store: Path | str, capsys) -> tuple[pl.DataFrame, dict]:
    code = census_main(["--bench", "sets", "--model", "stories260k", "--out", str(out), "--store", str(store),
                        "--no-embeddings", "--quiet", "--bootstrap", "50"])
    assert code == 0, capsys.readouterr().err
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    return pl.read_parquet(folder / "positions.parquet"), json.loads((folder / "summary.json").read_text())


def test_finished_at_recorded_at_commit(stores):
    st = open_store(stores["one"])
    t = st.requests["finished_at"].to_numpy()
    assert not np.isnan(t).any() and np.all(np.diff(t) >= 0)
    # every part store finished after the one before it: the set's order is the ranges' order
    firsts = [open_store(p).requests["finished_at"].to_numpy() for p in stores["parts"]]
    assert all(a.max() <= b.min() for a, b in zip(firsts, firsts[1:]))


def test_set_opens_as_the_one_store(stores):
    one = open_store(stores["one"])
    # a folder, a list, and a list in reverse: finished_at orders the stream, not the member order
    for spec in (stores["folder"], ",".join(str(p) for p in stores["parts"]),
                 ",".join(str(p) for p in stores["parts"][::-1])):
        s = open_store_or_set(spec)
        assert s.n_requests == one.n_requests and s.requests["request"].to_list() == list(range(8))
        for col in ("id", "prompt_hash", "tenant", "output_tokens"):
            assert s.requests[col].to_list() == one.requests[col].to_list()
        assert s.positions.equals(one.positions)
        np.testing.assert_array_equal(s.hidden, one.hidden)
        np.testing.assert_array_equal(s.topk, one.topk)
        np.testing.assert_array_equal(s.prompt_last_hidden, one.prompt_last_hidden)
        np.testing.assert_array_equal(s.offsets, one.offsets)
        assert s.fingerprint == set_fingerprint([open_store(m).fingerprint for m in s.members])
        assert s.fingerprint == current_fingerprint(spec) != one.fingerprint
        assert s.meta["layer"] == one.meta["layer"] and s.meta["n_requests"] == 8


def test_census_of_the_set_equals_the_one_store(stores, tmp_path, capsys):
    pos_one, sum_one = _census(tmp_path / "a", stores["one"], capsys)
    pos_set, sum_set = _census(tmp_path / "b", stores["folder"], capsys)
    assert pos_set.equals(pos_one)
    assert {k: v for k, v in sum_set.items() if k not in TIMING} == {k: v for k, v in sum_one.items() if k not in TIMING}
    assert sum_one["available"]["k"] > 0  # the same-prompt rule and pools did something to compare
    assert sum_set["store_set"]["members"] == 4 and sum_set["store_set"]["order"] == "finished_at"
    assert sum_set["store_fingerprint"] == current_fingerprint(stores["folder"])
    assert sum_set["notes"] == sum_one["notes"]
    # stale detection: the summary is current for the set, and stops being so when a member changes
    summary = tmp_path / "b" / "sets" / "stories260k" / "census" / "summary.json"
    assert current_summary(summary, stores["folder"]) is not None
    copy = tmp_path / "copy"
    shutil.copytree(stores["folder"], copy)
    assert current_summary(summary, copy) is not None  # the same members' files: the same fingerprint
    shutil.rmtree(copy / "s3")
    assert current_summary(summary, copy) is None


def test_census_of_a_set_crosses_the_same_prompt_and_tenant_rules(stores, tmp_path, capsys):
    """Without the merged stream each store would see only its own past: the census of store s1 alone differs
    from the set's rows for those requests (request 2 repeats request 0's prompt, in another store)."""
    pos_set, _ = _census(tmp_path / "a", stores["folder"], capsys)
    pos_s1, _ = _census(tmp_path / "b", stores["parts"][1], capsys)
    rows_set = pos_set.filter(pl.col("request").is_in([2, 3])).drop("request")
    assert not rows_set.equals(pos_s1.drop("request"))


def test_replay_of_the_set_equals_the_one_store(stores, tmp_path):
    def replay(out, store):
        cfg = ReplayConfig(bench="sets", model="stories260k", arms=("lexical",), out=str(out), store=str(store),
                           bootstrap=0, jobs=1, progress=False)
        s = run_replay(cfg)[("lexical", 60)]
        cycles = pl.read_parquet(Path(out) / "sets" / "stories260k" / "replay" / "lexical" / "cycles.parquet")
        return s, cycles.select([c for c in cycles.columns if not c.endswith("_s")])

    s_one, c_one = replay(tmp_path / "a", stores["one"])
    s_set, c_set = replay(tmp_path / "b", ",".join(str(p) for p in stores["parts"]))
    assert c_set.equals(c_one)
    for key in ("tau", "passes", "generated_tokens", "accepted_draft_tokens", "accepted_by_source", "requests"):
        assert s_set[key] == s_one[key], key
    assert s_one["accepted_draft_tokens"] > 0
    assert s_set["store_fingerprint"] == current_fingerprint(",".join(str(p) for p in stores["parts"]))
    assert s_set["store_set"]["members"] == 4 and "store_set" not in s_one


def test_verify_a_set(stores, capsys):
    assert data_main(["verify", str(stores["folder"])]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 5 and all(line.startswith("OK: ") for line in out)
    assert f"4 stores, 8 requests, fingerprint {current_fingerprint(stores['folder'])}" in out[-1]
    assert data_main(["show", str(stores["folder"])]) == 0
    shown = capsys.readouterr().out
    assert f"store set of 4 stores, fingerprint {current_fingerprint(stores['folder'])}" in shown
    assert "requests 8," in shown and "tenants 2" in shown


def _one_line(capsys, argv) -> str:
    assert data_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("key,value,words", [
    ("model_fingerprint", "0123456789abcdef", "model (weight fingerprint)"), ("layer", 1, "layer"),
    ("d_model", 8, "d_model"), ("vocab_size", 7, "vocab size"), ("tokenizer_hash", "feedfeedfeedfeed", "tokenizer"),
    ("store_format", 1, "store format"),
])
def test_members_that_cannot_combine_are_refused(stores, tmp_path, capsys, key, value, words):
    folder = tmp_path / "set"
    shutil.copytree(stores["folder"], folder)
    meta = read_meta(folder / "s2")
    meta[key] = value
    write_meta(folder / "s2", meta)  # resealed: only the set can object
    line = _one_line(capsys, ["verify", str(folder)])
    assert f"s2 has {words}" in line and line.count("s2") == 1
    with pytest.raises(OilbirdError, match=words.split(" (")[0]):
        open_store_or_set(folder)


def test_sets_that_are_not_sets_are_refused(stores, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no store folders in it" in _one_line(capsys, ["verify", str(empty)])
    mixed = tmp_path / "mixed"
    shutil.copytree(stores["folder"], mixed)
    (mixed / "notes").mkdir()
    assert "notes/ is not a trace store" in _one_line(capsys, ["verify", str(mixed)])
    p0 = str(stores["parts"][0])
    assert "is not a trace store" in _one_line(capsys, ["verify", f"{p0},{tmp_path}"])
    assert "twice" in _one_line(capsys, ["verify", f"{p0},{p0}/"])
    copied = tmp_path / "copied"
    shutil.copytree(stores["folder"], copied)
    shutil.copytree(stores["parts"][0], copied / "s9")
    assert "are the same store" in _one_line(capsys, ["verify", str(copied)])
    rc = census_main(["--bench", "sets", "--model", "stories260k", "--out", str(tmp_path / "o"), "--store",
                      str(copied), "--no-embeddings", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "are the same store" in err[0]
    assert not (tmp_path / "o" / "sets").exists()


def test_members_without_finished_at_are_ordered_store_by_store(stores, tmp_path, capsys):
    """Stores written before finished_at: whole stores by meta.json `created`, each in its own order, said in
    one note (here `created` runs against the member order, so the order is visibly the rule's)."""
    folder = tmp_path / "set"
    shutil.copytree(stores["folder"], folder)
    for i, created in enumerate(["2026-01-04T00:00:00+00:00", "2026-01-02T00:00:00+00:00",
                                 "2026-01-03T00:00:00+00:00", "2026-01-01T00:00:00+00:00"]):
        path = folder / f"s{i}"
        req = pq.read_table(path / "requests.parquet")
        pq.write_table(req.drop_columns(["finished_at"]), path / "requests.parquet")
        record_checksums(path)
        meta = read_meta(path)
        meta["created"] = created
        write_meta(path, meta)
    assert open_store(folder / "s0").requests["finished_at"].null_count() == 2  # an older store: nulls
    s = open_store_or_set(folder)
    assert s.requests["id"].to_list() == ["r6", "r7", "r2", "r3", "r4", "r5", "r0", "r1"]
    assert s.order == "stores" and "lack finished_at" in s.order_note
    _, summary = _census(tmp_path / "c", folder, capsys)
    assert s.order_note in summary["notes"] and summary["store_set"]["order"] == "stores"
    assert "lack finished_at" in _verify_last(capsys, folder)


def _verify_last(capsys, folder) -> str:
    assert data_main(["verify", str(folder)]) == 0
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_reports_read_a_set_in_the_runs_layout(stores, tmp_path, capsys):
    """A set at runs/<bench>/<model>/traces (a folder of stores): the census finds it there, the reports show
    its fingerprint and member count, and compare it with the set's fingerprint now."""
    from reports.census_sections import notes_section
    from reports.freshness import is_stale
    from reports.results import load_result

    model = tmp_path / "runs" / "sets" / "stories260k"
    model.mkdir(parents=True)
    shutil.copytree(stores["folder"], model / "traces")
    assert census_main(["--bench", "sets", "--model", "stories260k", "--out", str(tmp_path / "runs"),
                        "--no-embeddings", "--quiet", "--bootstrap", "0"]) == 0
    capsys.readouterr()
    result = load_result(model)
    census = result.censuses[0]
    assert result.store_fingerprint == census.summary["store_fingerprint"] == current_fingerprint(model / "traces")
    assert not is_stale(census.summary, result)
    html = notes_section(census)
    assert "a store set of 4 stores" in html and census.summary["store_fingerprint"] in html
    shutil.rmtree(model / "traces" / "s3")
    assert is_stale(census.summary, load_result(model))


def test_grid_profile_contexts_and_warm_pool_read_a_set(stores, stories, tmp_path, capsys):
    """The other readers of runs/<bench>/<model>/traces take a set there as they take the one store: the census
    grid (its row), the profile's context lengths (`profile --bench`), the live decoder's `--warm-from` pool."""
    from census.definitions import CensusConfig
    from census.grid import grid_table
    from decoder.live.harness import load_warm_pool
    from decoder.cost.profile import contexts_from_store

    cfg = CensusConfig(bootstrap=0)
    rows = {}
    for name, src in (("one", stores["one"]), ("set", stores["folder"])):
        model = tmp_path / name / "sets" / "stories260k"
        model.mkdir(parents=True)
        shutil.copytree(src, model / "traces")
        rows[name] = grid_table(["sets"], "stories260k", cfg, tmp_path / name, progress=False)["rows"][0]
    # requests_total is a benchmark's request count: a set's members each came from their own JSONL, so it has none
    assert rows["one"].pop("requests_total") == 8 and rows["set"].pop("requests_total") is None
    assert rows["set"] == rows["one"] and rows["one"]["requests"] == 8
    assert contexts_from_store(stores["folder"]) == contexts_from_store(stores["one"])
    one, merged = load_warm_pool(str(stores["one"]), stories), load_warm_pool(str(stores["folder"]), stories)
    assert [(p, t, n) for p, t, _, n in merged] == [(p, t, n) for p, t, _, n in one]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(merged, one))


def test_one_member_without_finished_at_orders_by_first_finish_else_created(stores, tmp_path):
    """Mixed: members with finished_at rank by their first request's; the one without by its `created`."""
    folder = tmp_path / "set"
    shutil.copytree(stores["folder"], folder)
    path = folder / "s1"
    pq.write_table(pq.read_table(path / "requests.parquet").drop_columns(["finished_at"]), path / "requests.parquet")
    record_checksums(path)
    meta = read_meta(path)
    meta["created"] = "2020-01-01T00:00:00+00:00"  # before any member's first finish
    write_meta(path, meta)
    s = open_store_or_set(folder)
    assert s.requests["id"].to_list() == ["r2", "r3", "r0", "r1", "r4", "r5", "r6", "r7"]
    assert s.order == "stores" and str(path) in s.order_note


def test_a_served_store_stamps_when_serving_finished_each_request(tmp_path, monkeypatch):
    """finished_at in a served store is the time `add` saw the request finish, not its commit (FLUSH later)."""
    from data.capture import served_store
    from tests.test_trust_vllm import _served_store, _trace

    clock = itertools.count(100.0, 100.0)  # time.time everywhere: the run id 100, the adds 200 and 300, the commit 400
    monkeypatch.setattr(served_store.time, "time", lambda: next(clock))
    store = _served_store(tmp_path / "store", flush=2)
    store.add(_trace(seed=0))
    store.add(_trace(seed=1))  # the commit, at 400
    store.close()
    assert open_store(tmp_path / "store").requests["finished_at"].to_list() == [200.0, 300.0]
