"""Issue 23, part A: what two writers, a rerun with a smaller --limit, --store-budget 0 and a token cap
beyond the model's context did, each ending now in a correct store or one `error:` line and exit 2.

  - two `python -m data capture` into one store at once: both finish, or the second stops with one
    line naming the first's pid; the store verifies and holds every request once (the lock:
    data/store/lock.py; its unit tests: tests/test_store_lock.py);
  - a capture killed with -9 leaves its lock file behind: the rerun takes it over;
  - an extension killed, then rerun with a smaller --limit: meta.json's limit says what the store holds;
  - --store-budget 0 is refused (it meant "unbounded" without a word);
  - a token cap past the model's context (stories260k: 512 positions) stops at the context, with one
    note, in capture and in the live decoder, which refuses a prompt longer than the context.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from census.__main__ import main as census_main
from data.__main__ import main as data_main
from data.capture.models import encode_prompt
from data.capture.run import capture
from data.errors import OilbirdError
from data.index.budget import parse_budget
from data.store.layout import store_dir
from data.store.lock import LOCK_NAME
from data.store.reader import open_store
from tests.conftest import STORY_PROMPTS, write_jsonl
from tests.test_faults import (
    REPO,
    _assert_killed,
    _assert_same_store,
    _capture_cli,
    _cfg,
    _subprocess,
)

LIMIT = 12  # long enough (about 300 generated tokens) for a second capture to start while the first runs
MAX_NEW = 24


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "b.jsonl", STORY_PROMPTS * 2)


@pytest.fixture(scope="module")
def whole(stories, bench, tmp_path_factory):
    """The uninterrupted capture of the LIMIT requests, in process (one thread: conftest.py `one_thread`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return open_store(capture(_cfg(bench, tmp_path_factory.mktemp("whole"), limit=LIMIT,
                                       max_new_tokens=MAX_NEW), lm=stories))
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread_everywhere(one_thread, monkeypatch):
    """Tiny models run far faster on one thread, in this process and in the captures it starts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _args(bench: str, out: Path) -> list[str]:
    return ["capture", "--bench", bench, "--model", "stories260k", "--out", str(out), "--limit", str(LIMIT),
            "--max-new-tokens", str(MAX_NEW), "--flush-every", "1", "--quiet"]


def _start(bench: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OILBIRD_FAULT", None)
    return subprocess.Popen([sys.executable, "-m", "data", *_args(bench, out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_refused_by(err: str, holder: int) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"is being written by another process (pid {holder})" in lines[0], err


def _assert_whole(path: Path, whole, capsys) -> None:
    """The store verifies (`python -m data verify`) and holds every request once, as an uninterrupted capture."""
    assert data_main(["verify", str(path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("OK: ")
    done = open_store(path)
    assert done.requests["id"].to_list() == whole.requests["id"].to_list()  # none lost, none doubled
    _assert_same_store(done, whole)
    assert not (path / LOCK_NAME).exists()


def test_two_captures_started_together(stories, bench, whole, tmp_path, capsys):
    out = tmp_path / "runs"
    procs = [_start(bench, out), _start(bench, out)]
    results = [(p.pid, *p.communicate(timeout=600), p.returncode) for p in procs]
    assert any(code == 0 for *_, code in results), results
    for k, (pid, _, err, code) in enumerate(results):
        if code != 0:  # it came while the other one wrote: one line naming the other's pid, exit 2
            assert code == 2, err
            _assert_refused_by(err, results[1 - k][0])
    _assert_whole(store_dir(out, bench, "stories260k"), whole, capsys)


def test_a_second_capture_stops_while_the_first_writes(stories, bench, whole, tmp_path, capsys):
    """Deterministic: the first capture is paused (SIGSTOP) between its commits while the second runs."""
    out = tmp_path / "runs"
    path = store_dir(out, bench, "stories260k")
    first = _start(bench, out)
    try:
        deadline = time.monotonic() + 300
        while True:  # until the first has committed a request and is still writing
            try:
                meta = json.loads((path / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            if meta.get("n_requests", 0) >= 1:
                break
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)
        assert not json.loads((path / "meta.json").read_text())["complete"], "paused too late: it had finished"
        before = {p.name: p.read_bytes() for p in path.iterdir()}
        second = _subprocess("data", _args(bench, out))
        assert second.returncode == 2, second.stderr[-2000:]
        _assert_refused_by(second.stderr, first.pid)
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # it touched nothing
        # a reader meanwhile sees the committed requests, never a half-written part
        assert open_store(path, allow_incomplete=True).n_requests >= 1
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    _assert_whole(path, whole, capsys)


def test_a_killed_captures_lock_is_taken_over(stories, bench, whole, tmp_path, capsys):
    out = tmp_path / "runs"
    path = store_dir(out, bench, "stories260k")
    killed = _subprocess("data", _args(bench, out), fault="after_part_write:2")
    _assert_killed(killed)
    assert (path / LOCK_NAME).exists()  # kill -9 cleans nothing up; the kernel freed the flock
    capture(_cfg(bench, out, limit=LIMIT, max_new_tokens=MAX_NEW), lm=stories)
    _assert_whole(path, whole, capsys)


def test_an_extension_killed_then_rerun_with_a_smaller_limit(stories, bench, tmp_path, capsys):
    """meta.json's limit says what the store holds (4), not what the last run asked for (3)."""
    out = tmp_path / "runs"
    path = Path(capture(_cfg(bench, out, limit=2), lm=stories))
    _assert_killed(_capture_cli(bench, out, 6, fault="after_commit:2"))  # killed at 4 of 6
    assert open_store(path, allow_incomplete=True).n_requests == 4
    capsys.readouterr()
    capture(_cfg(bench, out, limit=3), lm=stories)
    assert "holds 4 requests, more than the 3 asked for" in capsys.readouterr().err
    st = open_store(path)
    assert st.meta["complete"] and st.n_requests == 4 and st.meta["limit"] == 4
    assert data_main(["verify", str(path)]) == 0
    capture(_cfg(bench, out, limit=3), lm=stories)  # complete now: left as it is
    assert json.loads((path / "meta.json").read_text())["limit"] == 4


def test_store_budget_zero_is_refused(capsys):
    for text in ("0", "0k", "0.0", "0MB"):
        with pytest.raises(OilbirdError, match="must be positive") as e:
            parse_budget(text)
        assert "\n" not in str(e.value)
    assert parse_budget("all") is None and parse_budget(None) is None  # unbounded is said, not zero
    code = census_main(["--bench", "b", "--model", "m", "--store-budget", "0", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --store-budget 0: must be positive") and "\n" not in err


def _near_context_bench(stories, tmp_path: Path) -> tuple[str, int]:
    """A JSONL benchmark whose first prompt leaves 15 positions of stories260k's 512, and its length."""
    text = "the cat sat on the mat. " * 48
    n = len(encode_prompt(stories, [{"role": "user", "content": text}]))
    assert stories.context == 512 and n == 497
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": text}) + "\n"
                    + json.dumps({"id": "short", "prompt": STORY_PROMPTS[1]}) + "\n")
    return f"jsonl:{path}", n


def test_capture_stops_at_the_context_with_one_note(stories, tmp_path, capsys):
    bench, n = _near_context_bench(stories, tmp_path)
    st = open_store(capture(_cfg(bench, tmp_path / "runs", max_new_tokens=40), lm=stories))
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and "1 request(s) stop at the model's context of 512 positions" in err, err
    lens = st.requests["output_tokens"].list.len().to_list()
    assert lens[0] == 512 - n and st.requests["stop_reason"][0] == "length"  # not 40: past the context
    assert 512 - n < lens[1] <= 40 or st.requests["stop_reason"][1] == "eos"  # the short prompt keeps its cap
    assert data_main(["verify", str(st.path)]) == 0


def test_decoder_stops_at_the_context_and_refuses_a_longer_prompt(stories, tmp_path, capsys):
    from decoder.live.harness import DecodeConfig, run_decode
    from decoder.verify.reference import STATIC_ARM

    bench, n = _near_context_bench(stories, tmp_path)
    captured = open_store(capture(_cfg(bench, tmp_path / "runs", max_new_tokens=40), lm=stories))
    capsys.readouterr()
    arms = ("ar", STATIC_ARM, "suffix")
    summaries = run_decode(DecodeConfig(bench=bench, model="stories260k", arms=arms, max_new_tokens=40,
                                        out=str(tmp_path / "runs"), progress=False, static_compile=False), lm=stories)
    err = capsys.readouterr().err
    assert err.count("request(s) stop at the model's context") == 1, err
    for arm in arms:
        got = pq.read_table(Path(summaries[arm]["decode_dir"]) / arm / "requests.parquet").to_pydict()
        assert got["output_tokens"] == captured.requests["output_tokens"].to_list(), arm  # capture's tokens
        assert got["stop_reason"][0] == "length" and len(got["output_tokens"][0]) == 512 - n, arm
        assert summaries[arm]["lossless"]["lossless"], arm
    path = tmp_path / "longer.jsonl"
    path.write_text(json.dumps({"id": "longer", "prompt": "the cat sat on the mat. " * 60}) + "\n")
    with pytest.raises(OilbirdError, match="request longer: the prompt is .* longer than the model's context of 512"):
        run_decode(DecodeConfig(bench=f"jsonl:{path}", model="stories260k", arms=("ar",), max_new_tokens=8,
                                out=str(tmp_path / "runs"), progress=False), lm=stories)
