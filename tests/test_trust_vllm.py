"""vLLM settings checked once, when the engine starts (issue 35, item 5), without starting an engine.

Covers data/capture/vllm_settings.py through its callers: `speculative_config` (the parent, before any worker
forks), the Oilbird proposer's and the recorder's constructors (the worker, which reads the environment
itself), `make_llm` for the recorder, `python -m decoder vllm-run` (in-process, its engine replaced by one
that fails the test if it starts); and the serving-time side: a stats, log or store write that fails while
serving is logged once and counted, never raised into vLLM. The engine-level case (a stats folder replaced
by a file mid-run, every request still vLLM's greedy) is tests/test_vllm.py's
test_an_unwritable_stats_file_mid_run_keeps_serving (it reuses that file's engines).

    /work/main/.venv/bin/python -m pytest -q tests/test_trust_vllm.py
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from data.errors import OilbirdError

ROOT = Path(__file__).resolve().parents[1]
VARS = ("ARM", "NODES", "INDEX", "STATS", "LOG", "PROFILE", "STORE", "STORE_FLUSH", "BENCH", "TRACES", "LAYER")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No OILBIRD_VLLM_* from the caller's shell or from an earlier speculative_config in this process."""
    for v in VARS:
        monkeypatch.delenv("OILBIRD_VLLM_" + v, raising=False)


def fake_vllm_config(k: int = 4):
    """What the proposer and the recorder read of vLLM's config."""
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
                                 model_config=types.SimpleNamespace(max_model_len=1024, get_vocab_size=lambda: 512))


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------ before the engine: arguments

def test_an_explicit_argument_wins_and_unused_variables_are_not_read(monkeypatch, tmp_path):
    """OILBIRD_VLLM_NODES=abc was a raw ValueError even with nodes passed; a variable that is not used (the
    store's commit size without a store, stats passed explicitly) is never parsed into a failure."""
    from decoder.vllm.proposer import speculative_config

    monkeypatch.setenv("OILBIRD_VLLM_NODES", "abc")
    monkeypatch.setenv("OILBIRD_VLLM_STATS", "/")  # a folder: unused, stats is passed
    monkeypatch.setenv("OILBIRD_VLLM_STORE_FLUSH", "eight")  # unused: no OILBIRD_VLLM_STORE
    monkeypatch.setenv("OILBIRD_VLLM_BENCH", "a/b")
    spec = speculative_config("oilbird", k=4, nodes=30, stats=str(tmp_path / "s.json"))
    assert spec == {"method": "custom_class", "model": "decoder.vllm.proposer.OilbirdProposer",
                    "num_speculative_tokens": 4}
    import os

    assert os.environ["OILBIRD_VLLM_NODES"] == "30"  # what the worker reads back
    assert os.environ["OILBIRD_VLLM_STATS"] == str(tmp_path / "s.json")


@pytest.mark.parametrize("kw, line", [
    ({"nodes": -5}, "nodes=-5: -5 is outside 1..256; allowed: the tree's node budget"),
    ({"nodes": 100000}, "nodes=100000: 100000 is outside 1..256"),
    ({"nodes": True}, "nodes=True: a bool, not a whole number"),
    ({"k": "8"}, "k='8': text, not a whole number; allowed: draft tokens per row and step, a whole number 1..256"),
    ({"k": 0}, "k=0: 0 is outside 1..256"),
    ({"k": 2.5}, "k=2.5: a float, not a whole number"),
    ({"index": "nosuch"}, "index='nosuch': unknown index spec 'nosuch'"),
    ({"arm": "lexical"}, "arm='lexical': arm 'lexical' cannot interleave requests"),
    ({"arm": "no-such-arm"}, "arm='no-such-arm': unknown drafter 'no-such-arm'"),
    ({"arm": ""}, "arm='': empty, or holds spaces"),
    ({"stats": "/"}, "stats='/': / is a folder; allowed: a JSON file to write"),
    ({"stats": "/proc/self/x"}, "stats='/proc/self/x': /proc/self/x is under /proc, a kernel file system"),
    ({"stats": "/no/such/folder/s.json"}, "stats='/no/such/folder/s.json': its folder /no/such/folder does not exist"),
    ({"log": "/dev/null"}, "log='/dev/null': /dev/null is under /dev"),
    ({"profile": "/no/such/profile.json"}, "profile='/no/such/profile.json': file /no/such/profile.json not found"),
])
def test_a_bad_argument_is_one_line_before_the_engine(kw, line):
    """speculative_config(..., nodes=-5), index="nosuch" and k="8" were accepted (or a TypeError) and failed
    inside the engine; a stats path naming a folder started an engine that died at its first finished request."""
    from decoder.vllm.proposer import speculative_config

    with pytest.raises(OilbirdError) as e:
        speculative_config(**{"arm": "oilbird", "k": 4, **kw})
    assert one_line(e).startswith(line), str(e.value)


def _env_cases(tmp_path: Path) -> list[tuple[dict, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    store = str(tmp_path / "store")
    return [
        ({"NODES": "abc"}, "OILBIRD_VLLM_NODES='abc': text, not a whole number; allowed: the tree's node budget, "
                           "a whole number 1..256"),
        ({"NODES": "-3"}, "OILBIRD_VLLM_NODES='-3': -3 is outside 1..256"),
        ({"INDEX": "nosuch"}, "OILBIRD_VLLM_INDEX='nosuch': unknown index spec"),
        ({"ARM": "sam"}, "OILBIRD_VLLM_ARM='sam': arm 'sam' cannot interleave requests"),
        ({"STATS": str(tmp_path)}, f"OILBIRD_VLLM_STATS='{tmp_path}': {tmp_path} is a folder"),
        ({"STATS": "/proc/self/x"}, "OILBIRD_VLLM_STATS='/proc/self/x': /proc/self/x is under /proc"),
        ({"LOG": str(tmp_path / "no" / "x.log")}, f"OILBIRD_VLLM_LOG='{tmp_path / 'no' / 'x.log'}': its folder"),
        ({"PROFILE": str(tmp_path)}, f"OILBIRD_VLLM_PROFILE='{tmp_path}': file {tmp_path} is a folder"),
        ({"STORE": "/proc/self/x"}, "OILBIRD_VLLM_STORE='/proc/self/x': /proc/self/x is under /proc"),
        ({"STORE": str(a_file)}, f"OILBIRD_VLLM_STORE='{a_file}': {a_file} is a file, not a folder"),
        ({"STORE": str(a_file / "s")}, f"OILBIRD_VLLM_STORE='{a_file / 's'}': cannot make {a_file / 's'}"),
        ({"STORE": store, "STORE_FLUSH": "abc"}, "OILBIRD_VLLM_STORE_FLUSH='abc': text, not a whole number; "
                                                 "allowed: finished requests per store commit"),
        ({"STORE": store, "STORE_FLUSH": "0"}, "OILBIRD_VLLM_STORE_FLUSH='0': 0 is outside 1..100000"),
        ({"STORE": store, "BENCH": "../x"}, "OILBIRD_VLLM_BENCH='../x': not a plain name"),
        ({"TRACES": str(a_file)}, f"OILBIRD_VLLM_TRACES='{a_file}': {a_file} is a file, not a folder"),
        ({"LAYER": "top"}, "OILBIRD_VLLM_LAYER='top': text, not a whole number"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_a_bad_variable_is_one_line_before_the_engine(case, monkeypatch, tmp_path):
    """Every OILBIRD_VLLM_* value is checked by speculative_config, before any worker forks (the store's
    variables printed 130-150 lines of worker traceback; the stats one killed the engine mid-service)."""
    from decoder.vllm.proposer import speculative_config

    env, line = _env_cases(tmp_path)[case]
    for k, v in env.items():
        monkeypatch.setenv("OILBIRD_VLLM_" + k, v)
    with pytest.raises(OilbirdError) as e:
        speculative_config(k=4)  # every setting from the environment
    assert one_line(e).startswith(line), str(e.value)
    assert not (tmp_path / "store").exists()  # nothing made by a refused start


# ------------------------------------------------------------------ in the worker: the constructors

def test_the_proposer_constructor_checks_the_environment(monkeypatch, tmp_path):
    """`vllm serve` runs none of our parent code: the worker's constructor applies the same checks."""
    from decoder.vllm.proposer import OilbirdProposer

    monkeypatch.setenv("OILBIRD_VLLM_NODES", "abc")
    with pytest.raises(OilbirdError, match=r"^OILBIRD_VLLM_NODES='abc': text, not a whole number"):
        OilbirdProposer(fake_vllm_config())
    monkeypatch.setenv("OILBIRD_VLLM_NODES", "30")
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path))
    with pytest.raises(OilbirdError, match=r"^OILBIRD_VLLM_STATS='.*': .* is a folder"):
        OilbirdProposer(fake_vllm_config())
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(tmp_path / "s.json"))
    with pytest.raises(OilbirdError, match=r"^k=0: 0 is outside 1..256"):  # vLLM's num_speculative_tokens
        OilbirdProposer(fake_vllm_config(k=0))
    p = OilbirdProposer(fake_vllm_config())
    assert (p.settings.nodes, p.settings.stats, p.k) == (30, str(tmp_path / "s.json"), 4)


def test_the_recorder_checks_its_variables_before_the_engine(monkeypatch, tmp_path):
    """Capture by serving's recorder (no Oilbird arm): its store variables are checked by its constructor and
    by make_llm before vLLM is asked for an engine."""
    from data.capture import vllm_engine
    from data.capture.vllm_capture import RECORDER_CLASS, RequestRecorder

    monkeypatch.setenv("OILBIRD_VLLM_NODES", "abc")  # the recorder does not read it
    monkeypatch.setenv("OILBIRD_VLLM_STORE", "/proc/self/x")
    with pytest.raises(OilbirdError, match=r"^OILBIRD_VLLM_STORE='/proc/self/x': .* under /proc"):
        RequestRecorder(fake_vllm_config())
    monkeypatch.setenv("OILBIRD_VLLM_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("OILBIRD_VLLM_STORE_FLUSH", "abc")

    def engine(**kw):
        raise AssertionError("the engine started")

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=engine))
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    with pytest.raises(OilbirdError, match=r"^OILBIRD_VLLM_STORE_FLUSH='abc'"):
        vllm_engine.make_llm(vllm_engine.EngineConfig(str(tmp_path)),
                             {"method": "custom_class", "model": RECORDER_CLASS, "num_speculative_tokens": 1})
    monkeypatch.setenv("OILBIRD_VLLM_STORE_FLUSH", "3")
    assert RequestRecorder(fake_vllm_config()).settings.store_flush == 3


# ------------------------------------------------------------------ vllm-run: one line, exit 2, no engine

@pytest.mark.parametrize("args, env, line", [
    (["--index", "nosuch"], {}, "error: index='nosuch': unknown index spec 'nosuch'"),
    ([], {"STORE": "/proc/self/x"}, "error: OILBIRD_VLLM_STORE='/proc/self/x': /proc/self/x is under /proc"),
    ([], {"STORE": "STORE", "STORE_FLUSH": "abc"}, "error: OILBIRD_VLLM_STORE_FLUSH='abc': text, not a whole number"),
])
def test_vllm_run_refuses_bad_settings_in_one_line(args, env, line, monkeypatch, capsys, tmp_path):
    """`vllm-run --index nosuch`, OILBIRD_VLLM_STORE=/proc/self/x and OILBIRD_VLLM_STORE_FLUSH=abc printed 130-150
    lines of worker tracebacks; now one line and exit 2, before any engine starts."""
    from decoder.vllm import run

    def engine(*a, **kw):
        raise AssertionError("the engine started")

    monkeypatch.setattr(run, "make_llm", engine)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    (tmp_path / "p.json").write_text(json.dumps([[1, 2, 3]]))
    for k, v in env.items():
        monkeypatch.setenv("OILBIRD_VLLM_" + k, str(tmp_path / "store") if v == "STORE" else v)
    rc = run.vllm_run_main(["--model", str(model), "--prompts", str(tmp_path / "p.json"), "--arm", "oilbird",
                            "--out", str(tmp_path / "r.json"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(line), err
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------ while serving: logged once, counted, never raised

def test_a_stats_write_that_fails_while_serving_is_counted_and_logged_once(monkeypatch, tmp_path, caplog):
    from decoder.vllm.proposer import OilbirdProposer

    folder = tmp_path / "stats"
    folder.mkdir()
    stats = folder / "proposer.json"
    monkeypatch.setenv("OILBIRD_VLLM_STATS", str(stats))
    monkeypatch.setenv("OILBIRD_VLLM_LOG", str(tmp_path / "proposer.log"))
    p = OilbirdProposer(fake_vllm_config())
    p._write_stats()
    assert stats.exists()
    shutil.rmtree(folder)
    folder.write_text("a file where the stats folder was")  # replaced after start-up
    with caplog.at_level(logging.WARNING, logger="oilbird.vllm"):
        p._write_stats()
        p._write_stats()
    warnings = [r.getMessage() for r in caplog.records if r.name == "oilbird.vllm"]
    assert len(warnings) == 1 and f"cannot write the stats {stats}" in warnings[0] and "serving goes on" in warnings[0]
    assert warnings[0] in (tmp_path / "proposer.log").read_text()
    folder.unlink()
    folder.mkdir()
    p._write_stats()  # writable again: the failures are in the stats
    assert json.loads(stats.read_text())["stats_write_failures"] == 2


def _trace(n: int = 3, d: int = 4, seed: int = 0):
    from data.capture.vllm_capture import Trace

    rng = np.random.default_rng(seed)
    return Trace(prompt=np.arange(1, 5, dtype=np.int32) + seed, output=rng.integers(3, 16, n).astype(np.int32),
                 hidden=rng.standard_normal((n, d)).astype(np.float32), hidden_valid=np.ones(n, bool),
                 topk=np.tile(np.arange(8), (n, 1)), prompt_last_hidden=np.zeros(d, np.float32),
                 prompt_last_topk=np.arange(8))


def _served_store(path: Path, flush: int):
    from data.capture.served_store import ENGINE, ServedStore

    meta = {"model": "tiny", "model_path": "tiny", "model_fingerprint": "f", "layer": 1, "n_layers": 1, "d_model": 4,
            "vocab_size": 16, "dtype": "float32", "device": "cpu", "tokenizer_hash": "t", "chat_template_hash": "c",
            "bench": "served", "data_fingerprint": "served", "requests_total": None, "mode": "generate",
            "max_new_tokens": 64, "stop_strings": [], "truncate": None, "prompt_hash_scheme": 2, "engine": ENGINE,
            "versions": {}, "created": "2026-11-28T00:00:00+00:00"}
    return ServedStore(path, meta, frozenset({2}), flush)


def test_a_store_commit_that_fails_while_serving_is_kept_for_the_next(monkeypatch, tmp_path):
    """A full disk before a commit's point: the requests stay pending and go with the next commit. After it
    (requests.parquet written, the meta.json that follows not): they are committed and not sent again (they
    were, forever: "records must continue the store in order"). Either way the store reads whole, in order."""
    from data.store import writer
    from data.store.reader import open_store

    store = _served_store(tmp_path / "store", flush=2)
    for i in range(2):
        store.add(_trace(seed=i))
    real_table, real_meta = writer.atomic_write_table, writer.write_meta

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(writer, "atomic_write_table", full)  # the part: before the commit point
    store.add(_trace(seed=2))
    with pytest.raises(OSError, match="No space left"):
        store.add(_trace(seed=3))
    assert (store.written, len(store.pending)) == (2, 2)
    monkeypatch.setattr(writer, "atomic_write_table", real_table)
    calls = []

    def full_after_the_commit(path, obj):  # the pending meta lands; the meta after requests.parquet does not
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_meta(path, obj)

    monkeypatch.setattr(writer, "write_meta", full_after_the_commit)
    with pytest.raises(OSError, match="No space left"):
        store.add(_trace(seed=4))
    assert (store.written, len(store.pending)) == (5, 0)  # committed: requests.parquet names them
    monkeypatch.setattr(writer, "write_meta", real_meta)
    store.add(_trace(seed=5))
    store.close()  # commits the last
    s = open_store(tmp_path / "store")
    assert len(s.requests) == 6 and s.requests["request"].to_list() == list(range(6))


def test_a_store_folder_removed_while_serving_is_not_half_remade(tmp_path):
    """The writer would make a fresh folder holding a meta.json that names parts no longer there; instead the
    commit fails (counted by the recorder) and what cannot be kept is bounded and counted."""
    from data.capture import served_store

    store = _served_store(tmp_path / "store", flush=1)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(FileNotFoundError, match="removed while serving"):
        store.add(_trace())
    assert not (tmp_path / "store").exists()
    keep = served_store.MAX_PENDING_COMMITS
    for i in range(keep + 3):
        with pytest.raises(FileNotFoundError):
            store.add(_trace(seed=i))
    assert len(store.pending) == keep and store.dropped == 4
    store.close()  # at exit: a warning, never a traceback
    assert not (tmp_path / "store").exists()


def test_the_recorder_never_lets_a_write_failure_reach_vllm(monkeypatch, tmp_path, caplog):
    """vLLM turns an exception in a proposer into EngineDeadError: a store or traces write that fails is counted
    and logged once instead."""
    from data.capture import vllm_capture
    from data.capture.vllm_capture import RequestRecorder

    class FullStore:
        path, written, dropped = tmp_path / "store", 0, 0

        def add(self, trace):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "positions-00001.parquet"))

    monkeypatch.setenv("OILBIRD_VLLM_TRACES", str(tmp_path / "traces"))
    rec = RequestRecorder(fake_vllm_config())
    rec.store = FullStore()
    monkeypatch.setattr(vllm_capture, "request_trace", lambda req: _trace())
    (tmp_path / "traces").write_text("a file where the traces folder should be")
    with caplog.at_level(logging.WARNING, logger="oilbird.vllm"):
        for serial in range(3):
            rec._finish(types.SimpleNamespace(serial=serial))
    assert rec.counts["store_write_failures"] == rec.counts["trace_write_failures"] == 3
    assert rec.counts["finished"] == 3 and rec.counts["written"] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "oilbird.vllm"]
    assert len(lines) == 2 and "No space left on device" in lines[0] + lines[1]


# ------------------------------------------------------------------ the docs

def test_every_variable_is_in_the_docs_table():
    from data.capture.vllm_settings import settings_table

    doc = (ROOT / "docs" / "vllm.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(OILBIRD_VLLM_[A-Z_]+)` \|.*$", doc, re.M)}
    for name, default, _ in settings_table():
        assert name in rows, f"docs/vllm.md's table lacks {name}"
    assert set(rows) == {name for name, _, _ in settings_table()}
