"""Input and environment faults of issue 23 (part B), one `error: ...` line and exit code 2 each, never a
traceback, and no store damaged: `python -m pytest -q tests/test_input_faults.py`.

  - a --model or --bench that would leave its folder (`--model /path/sub/..` gives the slug '..'):
    refused before any work, by every stage;
  - a JSONL line nested 100,000 deep (RecursionError in json);
  - an --out that is a file, lies under /proc or cannot be written (immutable; read-only for a user
    other than root): capture, census, replay, the live decoder and reports each refuse it before any
    work, and an OSError met later while writing is one line too (data/errors.py cli_entry);
  - stdout closed by its reader (`python -m data list | head -1`): a quiet exit, no BrokenPipeError;
  - a JSONL line longer than --max-line-bytes (default 1 MiB): refused with only the bound in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest

from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.benchmarks.jsonl import DEFAULT_MAX_LINE_BYTES, line_bound
from data.benchmarks.registry import load_requests
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError, cli_entry
from data.store.layout import model_dir, store_dir
from data.store.verify import verify_store
from decoder.__main__ import main as decoder_main
from decoder.replay.run import replay_main
from reports.__main__ import main as reports_main
from tests.conftest import STORY_PROMPTS, write_jsonl

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 6
PROC = Path("/proc")


def _cli(main, argv, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err.strip()


def _one_error(code: int, err: str) -> str:
    assert code == 2, (code, err)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@contextmanager
def _unwritable(folder: Path):
    """`folder` refuses new entries: `chattr +i` as root (root ignores permission bits), chmod 555 otherwise."""
    if os.geteuid() == 0:
        if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(folder)],
                                                        capture_output=True).returncode != 0:
            pytest.skip("root, and chattr +i does not work here: no folder root cannot write")
        try:
            yield folder
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(mode)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "b.jsonl", STORY_PROMPTS[:2])


@pytest.fixture(scope="module")
def runs(stories, bench, tmp_path_factory) -> Path:
    """A captured store (2 requests) with its census: what census, replay and reports read."""
    out = tmp_path_factory.mktemp("runs")
    capture(CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=MAX_NEW, progress=False),
            lm=stories)
    assert census_main(["--bench", bench, "--model", "stories260k", "--out", str(out), "--no-embeddings",
                        "--bootstrap", "10", "--quiet"]) == 0
    return out


def _store(runs: Path, bench: str) -> Path:
    return store_dir(runs, bench, "stories260k")


def _copy_runs(runs: Path, dest: Path) -> Path:
    shutil.copytree(runs, dest)
    return dest


def _bad_outs(tmp_path: Path) -> list[tuple[str, Path]]:
    """--out values no stage can write to, beside a label: a file, one below a file, one under /proc."""
    afile = tmp_path / "a-file"
    afile.write_text("not a folder\n")
    outs = [("file", afile), ("below a file", afile / "runs")]
    if PROC.is_dir():
        outs.append(("/proc", PROC / "self" / "oilbird-runs"))
    return outs


# ------------------------------------------------------------------ 2: path components from user input

@pytest.mark.parametrize("stage", ["capture", "census", "replay", "decode", "profile"])
def test_model_path_ending_in_dotdot_is_refused_before_any_work(stage, bench, tmp_path, capsys):
    """`--model /path/sub/..` makes the slug '..': the store would land in <out>/<bench>/traces, over another
    benchmark's. Every stage refuses it before loading a model (the folder here is not even a model: a
    stage that loaded first would say "unknown model" instead)."""
    sub = tmp_path / "models" / "m" / "sub"
    sub.mkdir(parents=True)
    model, out = f"{sub}/..", tmp_path / "runs"
    argv = {"capture": (data_main, ["capture", "--bench", bench, "--model", model, "--out", str(out), "--quiet"]),
            "census": (census_main, ["--bench", bench, "--model", model, "--out", str(out), "--quiet"]),
            "replay": (decoder_main, ["replay", "--bench", bench, "--model", model, "--out", str(out), "--quiet"]),
            "decode": (decoder_main, ["--bench", bench, "--model", model, "--out", str(out), "--quiet"]),
            "profile": (decoder_main, ["profile", "--model", model, "--out", str(out), "--quiet"])}[stage]
    err = _one_error(*_cli(*argv, capsys))
    assert "model slug '..'" in err
    assert not out.exists()  # nothing made


def test_every_runs_path_refuses_a_leaving_component(tmp_path):
    """layout's one check (component) guards the bench, the model slug and the pool of every runs/ path."""
    from data.store.layout import census_dir, grid_dir, replay_dir

    for bad in ("", ".", "..", "a/b"):
        builds = [lambda: store_dir(tmp_path, "apibank", bad), lambda: grid_dir(tmp_path, bad),
                  lambda: census_dir(tmp_path, "apibank", "m", bad), lambda: replay_dir(tmp_path, "apibank", "m", bad)]
        if bad != "a/b":  # a benchmark name's '/' and ':' are normalised to '_' (tau:retail/x -> tau_retail_x)
            builds.append(lambda: model_dir(tmp_path, bad, "m"))
        for build in builds:
            with pytest.raises(OilbirdError, match="cannot name a folder"):
                build()
    assert model_dir(tmp_path, "../a/..", "m") == tmp_path / ".._a_.." / "m"
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ 8: deep JSON

def test_deeply_nested_jsonl_line_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    depth = 100_000
    path.write_text('{"id": "ok", "prompt": "fine"}\n'
                    + '{"id": "a", "prompt": "p", "extra": ' + "[" * depth + "]" * depth + "}\n")
    with pytest.raises(OilbirdError, match=f"{path} line 2: JSON nested too deeply"):
        load_requests(f"jsonl:{path}")
    err = _one_error(*_cli(data_main, ["capture", "--bench", f"jsonl:{path}", "--model", "stories260k",
                                       "--out", str(tmp_path / "runs"), "--quiet"], capsys))
    assert "nested too deeply" in err


# ------------------------------------------------------------------ 9: an --out that cannot be written

def test_capture_out_not_writable(bench, tmp_path, capsys):
    for label, out in _bad_outs(tmp_path):
        err = _one_error(*_cli(data_main, ["capture", "--bench", bench, "--model", "stories260k", "--out", str(out),
                                           "--max-new-tokens", str(MAX_NEW), "--quiet"], capsys))
        assert "--out" in err, (label, err)
    locked = tmp_path / "locked"
    locked.mkdir()
    with _unwritable(locked):
        err = _one_error(*_cli(data_main, ["capture", "--bench", bench, "--model", "stories260k", "--out",
                                           str(locked), "--max-new-tokens", str(MAX_NEW), "--quiet"], capsys))
    assert f"cannot write {locked}" in err and "--out" in err
    assert not any(locked.iterdir())


def test_census_into_a_folder_it_cannot_write(runs, bench, tmp_path, capsys):
    """The store's folder cannot take census/: one line before any work, and the store is intact."""
    out = _copy_runs(runs, tmp_path / "runs")
    shutil.rmtree(model_dir(out, bench, "stories260k") / "census")
    with _unwritable(model_dir(out, bench, "stories260k")):
        err = _one_error(*_cli(census_main, ["--bench", bench, "--model", "stories260k", "--out", str(out),
                                             "--no-embeddings", "--bootstrap", "10", "--quiet"], capsys))
        assert "cannot write" in err
    assert verify_store(str(_store(out, bench))).startswith("OK")


def test_replay_out_not_writable(runs, bench, tmp_path, capsys):
    store = _store(runs, bench)
    common = ["--bench", bench, "--model", "stories260k", "--store", str(store), "--arms", "lexical",
              "--bootstrap", "0", "--quiet"]
    for label, out in _bad_outs(tmp_path):
        err = _one_error(*_cli(decoder_main, ["replay", *common, "--out", str(out)], capsys))
        assert "--out" in err, (label, err)
    locked = tmp_path / "locked"
    locked.mkdir()
    with _unwritable(locked):
        _one_error(*_cli(decoder_main, ["replay", *common, "--out", str(locked)], capsys))
    assert verify_store(str(store)).startswith("OK")


def test_replay_write_failure_after_the_work_is_one_line(runs, bench, tmp_path, capsys):
    """replay called without the entry point's check (`python -m decoder.replay.run`): the OSError its write
    meets after the work is one line naming the path (data/errors.py cli_entry), not a traceback."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    err = _one_error(*_cli(replay_main, ["--bench", bench, "--model", "stories260k", "--store",
                                         str(_store(runs, bench)), "--arms", "lexical", "--bootstrap", "0",
                                         "--out", str(afile), "--quiet"], capsys))
    assert str(afile) in err


def test_decoder_out_not_writable(bench, tmp_path, capsys):
    for label, out in _bad_outs(tmp_path):
        err = _one_error(*_cli(decoder_main, ["--bench", bench, "--model", "stories260k", "--arms", "ar",
                                              "--max-new-tokens", "2", "--out", str(out), "--quiet"], capsys))
        assert "--out" in err, (label, err)


def test_reports_out_not_writable(runs, tmp_path, capsys, monkeypatch):
    for label, out in _bad_outs(tmp_path):
        err = _one_error(*_cli(reports_main, ["--runs", str(runs), "--out", str(out), "--quiet"], capsys))
        assert "--out" in err and str(out) in err, (label, err)
    locked = tmp_path / "locked"
    locked.mkdir()
    with _unwritable(locked):
        _one_error(*_cli(reports_main, ["--runs", str(runs), "--out", str(locked), "--quiet"], capsys))
        # a folder that turns unwritable after the check (the check skipped here): the write's OSError
        # is one line naming the path
        import data.store.layout

        monkeypatch.setattr(data.store.layout, "check_writable", lambda path, flag="--out": Path(path))
        err = _one_error(*_cli(reports_main, ["--runs", str(runs), "--out", str(locked), "--quiet"], capsys))
        assert str(locked) in err
    assert not any(locked.iterdir())


def test_cli_entry_os_errors_are_one_line(capsys):
    @cli_entry
    def fails(exc):
        raise exc

    err = _one_error(*_cli(fails, PermissionError(13, "Permission denied", "/x/y"), capsys))
    assert err == "error: /x/y: Permission denied"
    err = _one_error(*_cli(fails, OSError("Can't load tokenizer for 'x'.\n\nIf you were trying ..."), capsys))
    assert err == "error: Can't load tokenizer for 'x'. If you were trying ..."
    # a BrokenPipeError while stdout is fine (a worker's pipe): a real failure, not a quiet exit
    err = _one_error(*_cli(fails, BrokenPipeError(32, "Broken pipe"), capsys))
    assert "Broken pipe" in err


# ------------------------------------------------------------------ 10: stdout closed by its reader

def _run_into_closed_pipe(args: list[str], unbuffered: bool) -> subprocess.CompletedProcess:
    """`python -m ARGS | head -0`, deterministically: the pipe's reader is closed before the command writes."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:  # a print fails at once; buffered, the flush at exit fails
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("unbuffered", [True, False], ids=["unbuffered", "buffered"])
def test_stdout_closed_by_its_reader_is_a_quiet_exit(runs, bench, unbuffered):
    for args in (["data", "list"], ["data", "show", str(_store(runs, bench))]):
        proc = _run_into_closed_pipe(args, unbuffered)
        assert proc.returncode == 0 and "Error" not in proc.stderr and "Traceback" not in proc.stderr, \
            (args, proc.returncode, proc.stderr[-2000:])


# ------------------------------------------------------------------ 11: one huge JSONL line

def test_line_over_the_bound_is_refused_with_bounded_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"id": "small", "prompt": "hi"}) + "\n")
        f.write(json.dumps({"id": "big", "prompt": "word " * (4 * DEFAULT_MAX_LINE_BYTES // 5)}) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(OilbirdError, match=f"{path} line 2 is longer than {DEFAULT_MAX_LINE_BYTES} bytes.*"
                                               "--max-line-bytes"):
            load_requests(f"jsonl:{path}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * DEFAULT_MAX_LINE_BYTES, peak  # the 4 MB line was never read whole
    with line_bound("8M"):
        assert [r.id for r in load_requests(f"jsonl:{path}")] == ["small", "big"]
    with pytest.raises(OilbirdError, match="longer than"):  # the bound is back to the default after the block
        load_requests(f"jsonl:{path}")


def test_line_bound_counts_bytes_without_the_newline(tmp_path):
    path = tmp_path / "t.jsonl"
    line = json.dumps({"id": "a", "prompt": "é" * 10})
    path.write_bytes((line + "\r\n" + line.replace('"a"', '"b"')).encode())  # \r counts, the last line has no \n
    size = len((line + "\r").encode())
    with line_bound(size):
        assert [r.id for r in load_requests(f"jsonl:{path}")] == ["a", "b"]
    with line_bound(size - 1), pytest.raises(OilbirdError, match="line 1 is longer"):
        load_requests(f"jsonl:{path}")


def test_max_line_bytes_flag(bench, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": STORY_PROMPTS[0]}) + "\n")
    argv = ["capture", "--bench", f"jsonl:{path}", "--model", "stories260k", "--out", str(tmp_path / "runs"),
            "--max-new-tokens", "2", "--quiet"]
    err = _one_error(*_cli(data_main, [*argv, "--max-line-bytes", "40"], capsys))
    assert "line 1 is longer than 40 bytes" in err and not (tmp_path / "runs").exists()
    for bad in ("0", "lots", "-5"):
        err = _one_error(*_cli(data_main, [*argv, "--max-line-bytes", bad], capsys))
        assert "--max-line-bytes" in err
    assert data_main([*argv, "--max-line-bytes", "1K"]) == 0
