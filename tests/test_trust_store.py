"""Issue 35, the store's part: meta.json sealed, the model checked the same way by census and replay,
model folders recorded resolved, devices and FIFOs refused before reading, foreign files one line.

Run: `python -m pytest -q tests/test_trust_store.py`

Covered (each on a tiny store captured in process with stories260k):
  - an edited layer, vocab_size or model in meta.json: refused in one line (exit 2) by `data verify`,
    the census, replay and a capture extending the store; an extension with other settings
    (vocab_size) is refused by the writer;
  - a store written before the seal (no `meta_sha256`) opens, `verify` says it is unsealed,
    `data migrate` seals it, and an edit after that is refused;
  - replay checks --model against the store as the census does (an alias of another model, other
    weights under the same folder name), and accepts the same weights under another path;
  - `--model <relative folder>` is recorded resolved; an older store recording a relative path
    still matches the same model given by its absolute path (weight fingerprint);
  - meta.json or a store part that is a FIFO or a device: one line, exit 2, no hang (subprocesses
    with a timeout: the hang or the unbounded read is the point);
  - a foreign requests.parquet, a schema mismatch: one line from verify, census and replay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.capture.run import CaptureConfig, capture
from data.capture.store_model import check_store_model
from data.errors import OilbirdError
from data.store.layout import store_dir
from data.store.meta import META_SEAL
from data.store.reader import open_store
from data.store.writer import StoreWriter
from decoder.replay.run import replay_main
from tests.conftest import STORIES, STORY_PROMPTS, write_jsonl

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 8


def _cfg(bench: str, out: Path, **kw) -> CaptureConfig:
    return CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=MAX_NEW, flush_every=2,
                         progress=False, **kw)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "b.jsonl", STORY_PROMPTS[:4])


@pytest.fixture(scope="module")
def captured(stories, bench, tmp_path_factory) -> Path:
    """A complete 3-request store of stories260k (copied by each test that changes it)."""
    return Path(capture(_cfg(bench, tmp_path_factory.mktemp("runs"), limit=3), lm=stories))


@pytest.fixture
def out(captured, bench, tmp_path) -> Path:
    """A results root holding a copy of the captured store at runs/<bench>/stories260k/traces."""
    root = tmp_path / "runs"
    shutil.copytree(captured, store_dir(root, bench, "stories260k"))
    return root


def _meta(store: Path) -> dict:
    return json.loads((store / "meta.json").read_text())


def _edit(store: Path, drop: tuple[str, ...] = (), **changes) -> None:
    meta = {k: v for k, v in _meta(store).items() if k not in drop}
    (store / "meta.json").write_text(json.dumps({**meta, **changes}, indent=2))


def _one_line(main, argv, capsys) -> str:
    """Run a CLI main in process; it must refuse with exit 2 and exactly one `error:` line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (code, err)
    return err


def _census(bench: str, out: Path, model: str = "stories260k") -> list[str]:
    return ["--bench", bench, "--model", model, "--out", str(out), "--no-embeddings", "--bootstrap", "0", "--quiet"]


def _replay(bench: str, out: Path, model: str = "stories260k", *more: str) -> list[str]:
    return ["--bench", bench, "--model", model, "--out", str(out), "--arms", "suffix", "--bootstrap", "0",
            "--jobs", "1", "--quiet", *more]


# ------------------------------------------------------------------ the seal

@pytest.mark.parametrize("field,value", [("layer", 3), ("vocab_size", 100), ("model", "smollm2-135m")])
def test_edited_meta_is_refused_by_every_reader(field, value, bench, out, stories, capsys):
    store = store_dir(out, bench, "stories260k")
    assert _meta(store)[field] != value
    _edit(store, **{field: value})
    for main, argv in ((data_main, ["verify", str(store)]), (census_main, _census(bench, out)),
                       (replay_main, _replay(bench, out))):
        err = _one_line(main, argv, capsys)
        assert "meta.json was edited after capture" in err and "meta_sha256" in err, err
    # extending the store (a larger --limit) is refused before it writes anything
    before = {f.name: f.read_bytes() for f in store.iterdir()}
    with pytest.raises(OilbirdError, match="edited after capture"):
        capture(_cfg(bench, out, limit=4), lm=stories)
    assert before == {f.name: f.read_bytes() for f in store.iterdir()}


def test_extension_with_other_settings_is_refused(out, bench):
    """An extension never mixes settings: every setting the states depend on is compared, vocab_size too."""
    store = store_dir(out, bench, "stories260k")
    meta = {k: v for k, v in _meta(store).items() if k in (*StoreWriter.SETTINGS, "vocab_size", "n_layers")}
    for key, value in (("vocab_size", meta["vocab_size"] + 1), ("n_layers", meta["n_layers"] + 1),
                       ("layer", meta["layer"] - 1)):
        with pytest.raises(OilbirdError, match=f"other settings \\({key} differ"):
            StoreWriter(store, {**meta, key: value})
    with StoreWriter(store, meta) as w:  # the same settings: accepted
        assert w.done == 3


def test_store_written_before_the_seal_opens_and_migrate_seals_it(out, bench, capsys):
    store = store_dir(out, bench, "stories260k")
    _edit(store, drop=(META_SEAL,))
    st = open_store(store)
    assert st.n_requests == 3 and META_SEAL not in st.meta
    assert data_main(["verify", str(store)]) == 0
    assert "meta.json unsealed" in capsys.readouterr().out
    assert data_main(["migrate", str(store)]) == 0
    assert "sealed" in capsys.readouterr().out
    assert META_SEAL in _meta(store)
    assert data_main(["verify", str(store)]) == 0
    assert "meta.json sealed" in capsys.readouterr().out
    _edit(store, layer=3)
    _one_line(data_main, ["verify", str(store)], capsys)


def test_unsealed_meta_with_an_edited_vocab_size_is_one_line_from_replay(out, bench, capsys):
    """An older store (no seal) edited by hand: replay says the ids lie outside the vocabulary, and a
    count that is no count is refused by every reader."""
    store = store_dir(out, bench, "stories260k")
    _edit(store, drop=(META_SEAL,), vocab_size=100)
    err = _one_line(replay_main, _replay(bench, out), capsys)
    assert "outside its meta.json vocab_size 100" in err, err
    _edit(store, vocab_size="many")
    err = _one_line(data_main, ["verify", str(store)], capsys)
    assert "`vocab_size` is 'many'" in err, err


# ------------------------------------------------------------------ which model

def test_replay_checks_the_model_as_the_census_does(out, bench, tiny_dirs, tmp_path, capsys):
    store = store_dir(out, bench, "stories260k")
    # another model's alias, the store given by --store
    err = _one_line(replay_main, _replay(bench, out, "smollm2-135m", "--store", str(store)), capsys)
    assert "captured with model 'stories260k', not 'smollm2-135m'" in err, err
    assert not (store.parents[1] / "smollm2-135m").exists()  # no stories260k results under smollm2-135m's name
    # other weights under the same folder name: the store's folder, another model
    other = tmp_path / "elsewhere" / "stories260k"
    shutil.copytree(tiny_dirs["llama"], other)
    for main, argv in ((replay_main, _replay(bench, out, str(other))), (census_main, _census(bench, out, str(other)))):
        err = _one_line(main, argv, capsys)
        assert "holds other weights" in err, err
    assert not (store.parent / "replay").exists() and not (store.parent / "census").exists()
    # the same weights under another path: the same model
    same = tmp_path / "copy" / "stories260k"
    shutil.copytree(STORIES, same)
    assert replay_main(_replay(bench, out, str(same))) == 0
    capsys.readouterr()


def test_model_folders_are_recorded_resolved(stories, bench, tmp_path, monkeypatch):
    """`--model ../x/stories260k` is recorded by its resolved path; an older store that recorded the
    relative path still matches the same model given absolutely, from another working directory."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(STORIES, tmp_path / "models" / "stories260k")
    monkeypatch.chdir(work)
    rel = "../models/stories260k"
    lm = type(stories)(**{**stories.__dict__, "name": rel, "path": rel})
    store = Path(capture(_cfg(bench, tmp_path / "runs", limit=2), lm=lm))
    absolute = str((tmp_path / "models" / "stories260k").resolve())
    meta = _meta(store)
    assert meta["model"] == absolute and meta["model_path"] == absolute
    # an older store: the relative path as typed, checked from another working directory
    _edit(store, drop=(META_SEAL,), model=rel, model_path=rel)
    monkeypatch.chdir(tmp_path)
    check_store_model(_meta(store), absolute, store)  # the same weights: accepted
    with pytest.raises(OilbirdError, match="captured with model '../models/stories260k', not 'smollm2-135m'"):
        check_store_model(_meta(store), "smollm2-135m", store)


# ------------------------------------------------------------------ files that are no files

def _run(module: str, args: list[str], memory_mb: int = 3000) -> subprocess.CompletedProcess:
    """A CLI in a subprocess, its memory bounded (an unbounded read fails fast) and its time too (a hang)."""
    import resource

    def bound():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))

    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, preexec_fn=bound)


def test_fifos_and_devices_are_refused_without_reading(out, bench):
    store = store_dir(out, bench, "stories260k")
    fifo_store = out.parent / "fifo"
    shutil.copytree(store, fifo_store)
    (fifo_store / "meta.json").unlink()
    os.mkfifo(fifo_store / "meta.json")
    proc = _run("data", ["verify", str(fifo_store)])  # blocked forever before
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "is a FIFO (named pipe), not a regular file" in proc.stderr
    part = sorted(store.glob("positions-*.parquet"))[0]
    part.unlink()
    part.symlink_to("/dev/zero")
    proc = _run("census", _census(bench, out))  # read without bound before (MemoryError)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert f"{part.name} is a device, not a regular file" in proc.stderr
    req = store / "requests.parquet"
    req.unlink()
    os.mkfifo(req)
    proc = _run("decoder", ["replay", *_replay(bench, out)])  # blocked forever before
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "requests.parquet is a FIFO (named pipe), not a regular file" in proc.stderr


# ------------------------------------------------------------------ foreign files

def test_foreign_requests_parquet_and_schema_mismatch_are_one_line(out, bench, stories, tmp_path, capsys):
    """A guard: these were one line before issue 35 too (its abort at exit, rc 134, is another test's:
    the process's exit, not the message)."""
    store = store_dir(out, bench, "stories260k")
    other = write_jsonl(tmp_path / "o.jsonl", STORY_PROMPTS[3:6])
    foreign = Path(capture(_cfg(other, tmp_path / "other", limit=3), lm=stories))
    shutil.copy(foreign / "requests.parquet", store / "requests.parquet")
    argvs = ((data_main, ["verify", str(store)]), (census_main, _census(bench, out)),
             (replay_main, _replay(bench, out)))
    for main, argv in argvs:
        assert "requests.parquet does not match its checksum" in _one_line(main, argv, capsys)
    table = pq.read_table(foreign / "requests.parquet").drop_columns(["seconds"])
    pq.write_table(table, store / "requests.parquet")
    for main, argv in argvs:
        err = _one_line(main, argv, capsys)
        assert "does not match the trace schema (seconds: missing" in err, err
