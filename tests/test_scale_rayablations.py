"""Replay and the ablations on Ray (issue 36, decoder/replay/arms.py): one Ray task per (arm, nodes) writes the
files the worker processes write, file for file, timing aside; `--ray` with `--jobs`, a bad `--ray`, an address
that does not answer and a missing ray package are each one line with exit code 2, before any work.

Every comparison is against the same command without --ray, run in the same test on the same store (a
stories260k store of 6 requests, 24 tokens each). One local Ray cluster (2 CPUs, tests/conftest.py
ray_cluster) serves the module. Run: python -m pytest -q tests/test_scale_rayablations.py (about 30 s)
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from decoder.__main__ import main as decoder_main
from tests.conftest import STORY_PROMPTS, capture_story_store

pytestmark = pytest.mark.usefixtures("one_thread")

TIMED_COLUMNS = ("draft_s", "verify_s", "update_s", "beside_s")  # cycles.parquet: measured per pass


@pytest.fixture(scope="module")
def story_store(tmp_path_factory, stories):
    return capture_story_store(tmp_path_factory, stories, "rayablations_store", STORY_PROMPTS, 24)


def _timed(key: str) -> bool:
    """A field a run measures (seconds, per-pass times, the invocation's clock) rather than computes; and
    key_overlap, which says how the key's query ran (on a thread of its own where a core is spare: off on
    Ray, whose tasks fill every CPU), not what it answered."""
    return (key in ("seconds", "invocation", "key_overlap") or key.endswith(("_s", "seconds"))
            or key.endswith("_s_per_pass"))


def _untimed(value):
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not _timed(k)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _files(folder: Path) -> dict[str, object]:
    """Every file under folder by its relative path: JSON less its timed fields, Parquet less its timed
    columns (every other file: its bytes)."""
    out: dict[str, object] = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        if f.suffix == ".json":
            out[str(f.relative_to(folder))] = _untimed(json.loads(f.read_text()))
        elif f.suffix == ".parquet":
            t = pq.read_table(f)
            out[str(f.relative_to(folder))] = t.drop_columns([c for c in TIMED_COLUMNS if c in t.column_names])
        else:
            out[str(f.relative_to(folder))] = f.read_bytes()
    return out


def _same_files(one: Path, ray: Path) -> None:
    a, b = _files(one), _files(ray)
    assert sorted(a) == sorted(b)
    for name in a:
        if isinstance(a[name], dict):
            assert a[name] == b[name], name
        else:
            assert a[name].equals(b[name]) if hasattr(a[name], "equals") else a[name] == b[name], name


def _one_line(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# ---------------------------------------------------------------- the same files

def test_replay_on_ray_is_the_replay(ray_cluster, story_store, capsys):
    """`replay --ray local:2`: three arms at two node budgets (six tasks) write the worker processes' folders."""
    bench, out = story_store
    args = ["replay", "--bench", bench, "--model", "stories260k", "--out", out, "--arms", "oilbird,suffix,lexical",
            "--nodes", "16,60", "--bootstrap", "200", "--quiet"]
    folder = next(Path(out).glob("*/stories260k")) / "replay"
    assert decoder_main(args) == 0, capsys.readouterr().err
    assert "on Ray" not in capsys.readouterr().err
    one = shutil.copytree(folder, Path(out).parent / "replay-processes")
    assert decoder_main(args + ["--ray", "local:2"]) == 0, capsys.readouterr().err
    assert "replay on Ray (local:2): 6 arm run(s) as tasks on 2 CPU(s)" in capsys.readouterr().err
    assert len(list(folder.rglob("cycles.parquet"))) == 6
    _same_files(one, folder)
    s = json.loads((folder / "oilbird" / "nodes-60" / "summary.json").read_text())
    assert s["passes"] < s["generated_tokens"]  # it drafted: the equality is not of empty runs


def test_ablations_on_ray_are_the_ablations(ray_cluster, story_store, capsys):
    """`ablations --ray local:2` (every ablation, ladder and headline arm a task) writes ablations.json and the
    arms' folders as `--jobs 2` does."""
    bench, out = story_store
    args = ["ablations", "--bench", bench, "--model", "stories260k", "--out", out, "--bootstrap", "200", "--quiet"]
    folder = next(Path(out).glob("*/stories260k")) / "ablations"
    assert decoder_main(args + ["--jobs", "2"]) == 0, capsys.readouterr().err
    assert "on Ray" not in capsys.readouterr().err
    one = shutil.copytree(folder, Path(out).parent / "ablations-processes")
    assert decoder_main(args + ["--ray", "local:2"]) == 0, capsys.readouterr().err
    assert "replay on Ray (local:2)" in capsys.readouterr().err
    _same_files(one, folder)
    r = json.loads((folder / "ablations.json").read_text())
    assert len(list(folder.glob("*/cycles.parquet"))) > 30 and r["merged"]["tau"] > 1


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written

def _dead_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["replay", "ablations"])
@pytest.mark.parametrize("flags, words", [
    (["--ray", "local:0"], ["--ray local:0", "local:N"]),
    (["--ray", "nowhere"], ["--ray 'nowhere'", "HOST:PORT"]),
    (["--ray", "local:2", "--jobs", "2"], ["--ray local:2 and --jobs 2", "drop --jobs"]),
    (["--ray", "DEAD"], ["no Ray cluster answers"]),
])
def test_ray_refusals(story_store, tmp_path, capsys, command, flags, words):
    bench, out = story_store
    port = _dead_port()
    flags = [f"127.0.0.1:{port}" if f == "DEAD" else f for f in flags]
    results = tmp_path / "runs"
    shutil.copytree(out, results)
    before = sorted(p for p in results.rglob("*"))
    assert decoder_main([command, "--bench", bench, "--model", "stories260k", "--out", str(results), "--quiet",
                         *flags]) == 2
    _one_line(capsys, *words)
    assert sorted(p for p in results.rglob("*")) == before  # refused before any work


def test_ray_missing(story_store, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` then fails
    bench, out = story_store
    assert decoder_main(["replay", "--bench", bench, "--model", "stories260k", "--out", out, "--ray", "auto"]) == 2
    _one_line(capsys, "ray", "make install")
