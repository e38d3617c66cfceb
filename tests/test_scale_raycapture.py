"""Capture on many workers (`python -m data capture --ray ...`, data/capture/ray_capture.py) on a local Ray
cluster of 2 CPUs (ray.init(num_cpus=2), started once for the module; the commands use it).

Covers: the round-robin split into shard stores whose requests and tokens are the one-store capture's (the
harness on stories260k, and vLLM on the tiny Llama: 2 actors against one engine), and which verify and read as
one store set (data/store/storeset.py); an actor that dies is one
line naming its shard, and the rerun resumes that shard and leaves the finished one byte for byte; the
refusals (ray missing, an address that does not answer, a bad --ray, --workers below 1 or above the cluster's
CPUs or the requests, --workers without --ray, --agree-with, a set and a store in one folder, another
--workers on a rerun), each one `error:` line and exit 2.

Run: /work/main/.venv/bin/python -m pytest -q tests/test_scale_raycapture.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data.__main__ import main
from data.capture.ray_capture import EXIT_AFTER_ENV
from data.store.reader import open_store
from data.store.storeset import open_store_or_set, verify_store_or_set
from data.store.verify import verify_store
from tests.conftest import STORY_PROMPTS, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--max-new-tokens", "24", "--flush-every", "2", "--quiet"]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """12 requests (the story prompts twice: same-prompt requests land on both shards)."""
    return write_jsonl(tmp_path_factory.mktemp("raycap") / "b.jsonl", STORY_PROMPTS * 2)


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["capture", *argv])
    got = capsys.readouterr()
    return code, got.out.strip(), got.err.strip()


def _by_id(path: str | Path) -> dict[str, list[int]]:
    st = open_store(path, load_hidden=False)
    return dict(zip(st.requests["id"].to_list(), st.requests["output_tokens"].to_list()))


@pytest.fixture(scope="module")
def one_store(bench, stories, tmp_path_factory):
    """The one-store harness capture of the 12 requests, in this process."""
    from data.capture.run import CaptureConfig, capture

    out = tmp_path_factory.mktemp("one")
    return Path(capture(CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=24,
                                      flush_every=2, progress=False), lm=stories))


@pytest.fixture(scope="module")
def ray_set(bench, ray_local, tmp_path_factory):
    """The same requests captured on 2 Ray actors (the harness), through the command line: a first run whose
    shard-01 actor dies after its first commit, then the rerun that resumes it. Returns what each run left."""
    out = tmp_path_factory.mktemp("set")
    argv = ["capture", "--bench", bench, "--model", "stories260k", "--out", str(out), *COMMON, "--ray", "local:2",
            "--workers", "2"]
    seen = {}
    os.environ[EXIT_AFTER_ENV] = "1:1"  # shard 1's process ends right after its first commit
    try:
        seen["died"] = _cli_out(argv)
    finally:
        del os.environ[EXIT_AFTER_ENV]
    folder = _set_folder(out)
    seen["cut_meta"] = json.loads((folder / "shard-01" / "meta.json").read_text())
    seen["shard0_meta"] = json.loads((folder / "shard-00" / "meta.json").read_text())
    seen["shard0_files"] = {p.name: p.read_bytes() for p in (folder / "shard-00").iterdir()}
    seen["resumed"] = _cli_out(argv)
    return out, folder, seen


def _cli_out(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) with its stdout and stderr (a module fixture cannot take capsys)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue().strip(), err.getvalue().strip()


def _set_folder(out: Path) -> Path:
    (folder,) = list(out.glob("*/stories260k/traces"))
    return folder


def test_shards_split_round_robin_and_hold_the_one_store_tokens(ray_set, one_store):
    """After the resumed run: shard s holds requests s, s+2, ... with the one store's tokens and states."""
    _, folder, seen = ray_set
    code, out, err = seen["resumed"]
    assert code == 0 and out == str(folder), err
    one = open_store(one_store)
    ids = one.requests["id"].to_list()
    assert sorted(p.name for p in folder.iterdir()) == ["shard-00", "shard-01"]
    for s in range(2):
        shard = folder / f"shard-{s:02d}"
        assert verify_store(shard).startswith("OK")
        st = open_store(shard)
        assert st.meta["shard"] == {"index": s, "of": 2, "split": "round-robin"} and st.meta["complete"]
        assert st.requests["id"].to_list() == ids[s::2]  # request i on shard i % 2, in serving order
        assert st.requests["tenant"].to_list() == one.requests["tenant"].to_list()[s::2]
        for local, i in enumerate(range(s, len(ids), 2)):
            assert st.requests["output_tokens"][local].to_list() == one.requests["output_tokens"][i].to_list()
        # the same request's states, to float16 rounding (the shard's process runs one thread, and reuses the
        # KV of other earlier prompts)
        lo, hi = st.offsets[1], st.offsets[2]
        one_lo, one_hi = one.offsets[s + 2], one.offsets[s + 3]
        np.testing.assert_allclose(np.asarray(st.hidden[lo:hi], np.float32),
                                   np.asarray(one.hidden[one_lo:one_hi], np.float32), rtol=1e-2, atol=2e-3)
    assert sum(len(v) for v in _by_id(one_store).values()) > 12 * 5
    # the folder is one store set to every reader: verified whole, one stream ordered by finished_at
    said = verify_store_or_set(folder).splitlines()  # each member, then the set
    assert len(said) == 3 and all(line.startswith("OK: ") for line in said)
    assert said[-1].startswith(f"OK: store set {folder}: 2 stores, 12 requests") and "(finished_at)" in said[-1]
    merged = open_store_or_set(folder, load_hidden=False)
    assert merged.order == "finished_at" and sorted(merged.requests["id"].to_list()) == sorted(ids)
    assert dict(zip(merged.requests["id"].to_list(), merged.requests["output_tokens"].to_list())) == \
        _by_id(one_store)


def test_a_dead_actor_is_one_line_and_the_rerun_resumes_its_shard(ray_set):
    out_dir, folder, seen = ray_set
    code, out, err = seen["died"]
    # stdout: nothing of ours (Ray's driver may print its raylet's "a worker died" notice there)
    assert code == 2 and str(out_dir) not in out and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {folder / 'shard-01'}: its Ray actor died") and "resumes" in err
    assert seen["shard0_meta"]["complete"] and seen["shard0_meta"]["n_requests"] == 6
    assert not seen["cut_meta"]["complete"] and seen["cut_meta"]["n_requests"] == 2  # its first commit, kept
    code, out, err = seen["resumed"]
    assert "shard-01" in err and "resuming after request 1" in err
    assert {p.name: p.read_bytes() for p in (folder / "shard-00").iterdir()} == seen["shard0_files"]  # left alone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("extra, says", [
    (["--ray", "local:2", "--workers", "0"], "--workers must be at least 1"),
    (["--ray", "local:2", "--workers", "3"], "more than --ray local:2's 2 CPU(s)"),
    (["--ray", "auto", "--workers", "3"], "more than the Ray cluster's 2 CPU(s)"),  # the module's running cluster
    (["--workers", "2"], "it needs --ray"),
    (["--ray", "local:0"], "local:N needs a whole number"),
    (["--ray", "head-without-port"], "use auto, local:N"),
    (["--ray", "local:2", "--limit", "1", "--workers", "2"], "more than the 1 request(s)"),
    (["--ray", "local:2", "--agree-with", "."], "--agree-with compares one store"),
])
def test_refusals_are_one_line_and_write_nothing(extra, says, bench, ray_local, tmp_path, capsys):
    code, out, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(tmp_path / "o"), *COMMON,
                           *extra], capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert says in err, err
    assert not (tmp_path / "o").exists()


def test_an_address_that_refuses_is_one_line(bench, ray_local, tmp_path, capsys):
    port = _free_port()
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(tmp_path), *COMMON,
                         "--ray", f"127.0.0.1:{port}"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"127.0.0.1:{port}: no Ray cluster answers" in err, err


def test_ray_missing_is_one_line(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(tmp_path), *COMMON,
                         "--ray", "local:2"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "needs the ray package" in err, err


def test_a_store_and_a_set_never_share_a_folder(bench, ray_set, one_store, ray_local, capsys):
    set_out, folder, _ = ray_set
    one_out = one_store.parents[2]
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(one_out), *COMMON,
                         "--ray", "local:2"], capsys)
    assert code == 2 and "holds one trace store, not a store set" in err and len(err.splitlines()) == 1, err
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(set_out), *COMMON], capsys)
    assert code == 2 and "holds a store set captured on Ray (2 shard stores" in err, err
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(set_out), *COMMON,
                         "--ray", "local:2", "--workers", "1"], capsys)
    assert code == 2 and "holds a store set split round robin over 2 shards" in err and "--workers 2" in err, err
    assert not (folder / "meta.json").exists()


def test_an_address_that_never_answers_times_out(bench, tmp_path):
    """A port that takes the connection and says nothing (no Ray head): ray.init alone waits minutes; the
    command ends in one line after the connect timeout (3 s here). A subprocess: the hang is the point."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    code = ("import sys; import data.raycluster as c; c.CONNECT_TIMEOUT_S = 3.0; "
            "from data.__main__ import main; "
            f"sys.exit(main(['capture', '--bench', {bench!r}, '--model', 'stories260k', '--out', {str(tmp_path)!r}, "
            f"'--quiet', '--ray', '127.0.0.1:{port}']))")
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        srv.close()
    assert r.returncode == 2 and time.monotonic() - t0 < 45, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: --ray 127.0.0.1:")
    assert "no Ray cluster answered within 3 s" in r.stderr, r.stderr[-2000:]


def test_vllm_on_two_actors_gives_the_one_engine_tokens(bench, tiny_llama64, ray_local, tmp_path, capsys):
    """The tiny Llama (head dim 64, which vLLM's CPU attention takes) served by one engine, and by 2 Ray actors
    each with its own engine: every request's tokens are the one engine's, and its states agree. (Eager: what
    this pins is the sharding; vLLM's default compilation is tests/test_vllm.py's, and three engines compiling at
    once on 2 cores take minutes.)"""
    args = ["--bench", bench, "--model", tiny_llama64, *COMMON, "--batch-size", "4", "--engine", "vllm", "--vllm-eager"]
    r = subprocess.run([sys.executable, "-m", "data", "capture", *args, "--out", str(tmp_path / "one")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    code, out, err = _cli([*args, "--out", str(tmp_path / "set"), "--ray", "local:2"], capsys)
    assert code == 0, err
    one = open_store(r.stdout.strip().splitlines()[-1])
    one_id = {k: i for i, k in enumerate(one.requests["id"].to_list())}
    seen = 0
    for s in range(2):
        shard = Path(out) / f"shard-{s:02d}"
        assert verify_store(shard).startswith("OK")
        st = open_store(shard)
        assert st.meta["engine"] == "vllm" and st.meta["shard"]["of"] == 2
        for local, rid in enumerate(st.requests["id"].to_list()):
            i = one_id[rid]
            assert i % 2 == s
            assert st.requests["output_tokens"][local].to_list() == one.requests["output_tokens"][i].to_list()
            n = st.offsets[local + 1] - st.offsets[local] - 1  # the last token's row is never computed
            a = np.asarray(st.hidden[st.offsets[local]: st.offsets[local] + n], np.float32)
            b = np.asarray(one.hidden[one.offsets[i]: one.offsets[i] + n], np.float32)
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)
            seen += 1
    assert seen == 12 and int(one.offsets[-1]) > 12 * 5
    assert verify_store_or_set(out).splitlines()[-1].startswith(f"OK: store set {out}: 2 stores, 12 requests")


def test_a_folder_of_stores_not_split_by_ray_is_refused(bench, one_store, tmp_path, capsys):
    """A store under shard-00/ that no --ray capture made (no meta.json "shard"): --ray would take it for a
    shard and resume the wrong requests into it."""
    import shutil

    folder = tmp_path / one_store.relative_to(one_store.parents[2])
    shutil.copytree(one_store, folder / "shard-00")
    code, _, err = _cli(["--bench", bench, "--model", "stories260k", "--out", str(tmp_path), *COMMON,
                         "--ray", "local:2"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and 'without meta.json "shard"' in err, err
