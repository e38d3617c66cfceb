"""Issue 35, process-level exits: an error exit after a store read is exit code 2, never an abort
(rc 134); --nodes, --jobs, --index specs and arm-variant values bounded in one line; a kill -9 of a
replay parent leaves no helper process; a full disk names the file; JSON in hostile prompt text is
tolerated and benchmark result files are read with bounds (data/readfile.py).

Run: python -m pytest -q tests/test_trust_exits.py
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data.errors import OilbirdError, cli_entry
from data.index.stateindex import parse_index_spec
from data.readfile import MAX_JSON_DEPTH
from data.store.schema import PROMPT_HASH_SCHEME, TOPK, prompt_hash
from data.store.writer import StoreWriter, TraceRecord
from decoder.__main__ import main as decoder_main
from tests.conftest import STORY_PROMPTS, capture_story_store, write_jsonl

REPO = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")


# ---------------------------------------------------------------- stores

def _records(n_req: int, n_tok: int, d: int, salt: int) -> list[TraceRecord]:
    out = []
    for r in range(n_req):
        rng = np.random.default_rng(r + 1000 * salt)
        prompt = [1 + r, 5, 9]
        out.append(TraceRecord(
            request=r, id=f"r{r}", group="g", prompt_hash=prompt_hash(prompt), prompt_tokens=prompt,
            output_tokens=[int(t) for t in rng.integers(3, 90, n_tok)], stop_reason="length", seconds=0.5,
            hidden=rng.standard_normal((n_tok, d)).astype(np.float16), hidden_valid=np.arange(n_tok) < n_tok - 1,
            topk=rng.integers(3, 90, (n_tok, TOPK)).astype(np.int32),
            prompt_last_hidden=rng.standard_normal(d).astype(np.float16),
            prompt_last_topk=rng.integers(3, 90, TOPK).astype(np.int32)))
    return out


def _synthetic_store(path: Path, salt: int, n_req: int = 20, n_tok: int = 32, d: int = 256) -> Path:
    meta = dict(model="synthetic", model_fingerprint="fp", layer=1, n_layers=1, d_model=d, dtype="float32",
                tokenizer_hash="t", chat_template_hash="c", bench="b", data_fingerprint="f", mode="generate",
                max_new_tokens=64, versions={}, created="2026-01-01T00:00:00", vocab_size=100,
                prompt_hash_scheme=PROMPT_HASH_SCHEME)
    w = StoreWriter(path, meta)
    w.append(_records(n_req, n_tok, d, salt))
    w.finish()
    return path


@pytest.fixture(scope="module")
def replay_store(tmp_path_factory, stories):
    """A small stories260k store to replay (3 requests of 24 tokens)."""
    return capture_story_store(tmp_path_factory, stories, "exits_store", STORY_PROMPTS[:3], 24)


def _replay(replay_store, *extra: str) -> int:
    bench, out = replay_store
    return decoder_main(["replay", "--bench", bench, "--model", "stories260k", "--out", out, "--bootstrap", "0",
                         "--quiet", *extra])


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


# ---------------------------------------------------------------- rc 134 at exit

def _one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_error_exit_after_a_store_read_is_rc_2_not_an_abort(tmp_path):
    """A store whose positions part is another store's: `data verify` refuses right after reading it.
    Arrow's CPU pool used to drop the Python-owned read buffer after the read returned; at interpreter
    exit that aborted (rc 134, "terminate called without an active exception"; data/store/arrowmem.py).
    One CPU for the child makes the woken main thread pre-empt the pool worker, the race seen under
    load: about 1 in 3 runs aborted before the fix."""
    store = _synthetic_store(tmp_path / "a" / "traces", salt=0)
    other = _synthetic_store(tmp_path / "b" / "traces", salt=1)
    shutil.copy(other / "positions-00000.parquet", store / "positions-00000.parquet")
    codes, errs = [], set()
    for _ in range(12):
        r = subprocess.run([sys.executable, "-m", "data", "verify", str(store)], cwd=REPO, capture_output=True,
                           text=True, timeout=120, preexec_fn=_one_cpu)
        codes.append(r.returncode)
        errs.add(r.stderr.strip())
    assert codes == [2] * len(codes), (codes, errs)
    assert len(errs) == 1 and "does not match its checksum" in next(iter(errs)), errs


# ---------------------------------------------------------------- --nodes, --jobs, --index, arm options

def test_live_decoder_refuses_nodes_above_the_bound(tmp_path, capsys):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:1])
    code = decoder_main(["--bench", bench, "--model", "stories260k", "--nodes", "100000", "--out",
                         str(tmp_path / "runs"), "--quiet"])
    assert code == 2
    _one_line_error(capsys, "--nodes", "0..256", "100000")


def test_every_cli_bounds_nodes_with_one_constant(replay_store, capsys):
    import decoder.cost.profile
    from decoder.draft import MAX_NODES

    assert decoder.cost.profile.MAX_NODES is MAX_NODES
    assert _replay(replay_store, "--arms", "suffix", "--nodes", str(MAX_NODES + 1)) == 2
    _one_line_error(capsys, "--nodes", f"1..{MAX_NODES}")


@pytest.mark.parametrize("jobs", ["1000", "-1"])
def test_replay_bounds_jobs(replay_store, jobs, capsys):
    assert _replay(replay_store, "--arms", "suffix", "--jobs", jobs) == 2
    _one_line_error(capsys, "--jobs", f"(got {jobs})")


@pytest.mark.parametrize("spec", ["hnsw0", "hnsw1", "ivf0", "opq0,pq4", "pca0,sq8", "hnsw100000", "ivf1000000,sq8",
                                  "opq3,pq4"])
def test_degenerate_index_specs_are_refused(spec):
    with pytest.raises(OilbirdError, match=r"index spec '.*': .*(out of range|dividing)"):
        parse_index_spec(spec, d=16)


def test_replay_refuses_hnsw0_in_one_line(replay_store, capsys):
    assert _replay(replay_store, "--arms", "oilbird", "--index", "hnsw0") == 2
    _one_line_error(capsys, "hnsw0", "2..256")


@pytest.mark.parametrize("arm, field", [("oilbird@theta=nan", "theta"), ("oilbird@theta=1.5", "theta"),
                                        ("oilbird@k=0", "k"), ("pld@max_ngram=-1", "max_ngram"),
                                        ("suffix@min_token_prob=inf", "min_token_prob"),
                                        ("oilbird@depth_schedule=0.9x48_nanx8", "depth_schedule")])
def test_arm_option_out_of_range_is_one_line(arm, field):
    from decoder.drafters import make_drafter

    with pytest.raises(OilbirdError, match="out of range") as e:
        make_drafter(arm, vocab_size=100)
    assert repr(arm) in str(e.value) and field in str(e.value)


def test_replay_refuses_theta_nan(replay_store, capsys):
    assert _replay(replay_store, "--arms", "oilbird@theta=nan") == 2
    _one_line_error(capsys, "oilbird@theta=nan", "theta")


def test_every_numeric_arm_option_has_a_range():
    from decoder.drafters import DRAFTERS, OPTION_RANGES

    for name, cls in DRAFTERS.items():
        config = cls.Config()
        for f in dataclasses.fields(config):
            v = getattr(config, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                assert f.name in OPTION_RANGES, f"{name}: numeric option {f.name} has no range"


# ---------------------------------------------------------------- kill -9 of a replay parent

def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return kids


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.mark.skipif(not LINUX or not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_kill_9_of_a_replay_parent_leaves_no_helper(replay_store):
    bench, out = replay_store
    proc = subprocess.Popen([sys.executable, "-m", "decoder", "replay", "--bench", bench, "--model", "stories260k",
                             "--out", out, "--arms", "suffix,pld,sam", "--jobs", "2", "--bootstrap", "0", "--quiet",
                             "--if-missing"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, helpers = time.monotonic() + 90, set()
        while time.monotonic() < deadline and proc.poll() is None:
            helpers = _children(proc.pid)
            if len(helpers) >= 4:  # the resource tracker, the Manager's server, two pool workers
                break
            time.sleep(0.05)
        assert proc.poll() is None and len(helpers) >= 4, f"replay did not start its workers ({helpers})"
        helpers |= {g for h in helpers for g in _children(h)}
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(map(_alive, helpers)):
            time.sleep(0.05)
        survivors = sorted(p for p in helpers if _alive(p))
    finally:
        proc.kill()
    for p in survivors:  # not to leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"helpers still running 5 s after kill -9 of their parent: {survivors}"


# ---------------------------------------------------------------- a full disk

def test_full_disk_names_the_file(tmp_path, monkeypatch, capsys):
    import data.store.files as files

    def full(fd, mode="r", *a, **k):  # the temporary file's writes go to /dev/full (ENOSPC)
        os.close(fd)
        return open("/dev/full", mode)

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    monkeypatch.setattr(files.os, "fdopen", full)
    target = tmp_path / "summary.json"
    assert cli_entry(lambda: files.atomic_write_json(target, {"a": 1}))() == 2
    _one_line_error(capsys, f"{target}: No space left on device", "free space")
    assert not target.exists() and not list(tmp_path.iterdir())  # the temporary file is gone too


def test_full_disk_names_the_page_and_the_trace(tmp_path, monkeypatch, capsys):
    """The report's pages and the vLLM recorder's traces: a full disk names the file, no temporary is left."""
    import numpy as np

    import data.capture.vllm_capture as vc
    import reports.render as render

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    real_fdopen = os.fdopen
    monkeypatch.setattr(render.os, "fdopen", lambda fd, mode="r", *a, **k: (os.close(fd), open("/dev/full", mode))[1])
    site = tmp_path / "html"
    assert cli_entry(lambda: render.write_site(site, {"index.html": "<p>x</p>"}))() == 2
    _one_line_error(capsys, f"{site / 'index.html'}: No space left on device", "free space")
    assert not list(site.iterdir())
    monkeypatch.setattr(render.os, "fdopen", real_fdopen)

    real_open = open
    monkeypatch.setattr(vc, "open", lambda p, mode="r", *a, **k: real_open("/dev/full", mode), raising=False)
    trace = vc.Trace(**{k: np.zeros(2, dtype=np.int32) for k in vc.Trace.__dataclass_fields__})
    folder = tmp_path / "traces"
    assert cli_entry(lambda: vc.write_trace(folder, 3, trace))() == 2
    _one_line_error(capsys, "No space left on device", "-00000003.npz")
    assert not list(folder.iterdir())


# ---------------------------------------------------------------- JSON read with bounds

def test_toolspec_tolerates_deeply_nested_json_in_prompt_text():
    from decoder.drafters.toolspec import extract_schema

    line = '{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert extract_schema("tools:\n" + line + "\n") == {}


def test_bench_vllm_result_nested_too_deep_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("benchmarks.bench_vllm")
    import benchmarks.bench_vllm as bv

    out = tmp_path / "result.json"

    def fake_run(cmd, **kw):  # vllm-run "succeeds" and leaves a result nested past the bound
        out.write_text("[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bv.subprocess, "run", fake_run)
    with pytest.raises(OilbirdError, match="nested deeper"):
        bv.run_one("m", tmp_path / "p.jsonl", "oilbird-chain", 1, 8, 16, 60, out)


def test_store_bytes_are_read_into_arrow_owned_memory(tmp_path):
    """What the rc-134 fix rests on: the bytes a store read hands pyarrow are in memory Arrow allocated,
    equal to the file's, whatever the buffer they came from."""
    import pyarrow as pa

    from data.store.arrowmem import arrow_owned, read_file_buffer

    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(256)) * 3)
    buf = read_file_buffer(f)
    assert isinstance(buf, pa.Buffer) and buf.to_pybytes() == f.read_bytes()
    for data in (b"abc", memoryview(b"abcdef")[1:4], bytearray(b"xy"), b""):
        assert arrow_owned(data).to_pybytes() == bytes(data)
