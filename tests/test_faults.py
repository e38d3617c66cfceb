"""Every fault class a skeptical user tried, one test each: `python -m pytest -q tests/test_faults.py`.

Kills: a real `python -m data capture` / `python -m census` subprocess on stories260k, SIGKILLed by
the OILBIRD_FAULT hook (data/store/files.py fault_point) at a named moment:
  - a plain capture killed at each of the four steps of a commit (after the part's write, after
    meta.json notes it as pending, after the commit point requests.parquet, after meta.json
    records it): readers refuse the store and say to rerun (never --force); rerunning resumes to a
    store identical to an uninterrupted one;
  - extending a complete store (a larger --limit) killed after a part's write and after a commit:
    the store is incomplete on disk, readers say rerun, rerunning finishes it; a store that older
    code left "complete" but short is refused too, and the census counts requests from the rows;
  - a census killed between positions.parquet and summary.json, and between the two renames of
    its folder swap: census/ holds the old pair or the new pair, and the next census cleans up.
Corruption: a changed hidden state in a positions part, a changed prompt token in
  requests.parquet, a flipped byte: refused on open, by `data verify`, by the census; a store
  older than checksums is checked by its prompt hashes and shown as unverified.
Mislabelled stores: a census under another --model than the store's; a meta.json edited to
  name another model, or another fingerprint.
One `error:` line, exit 2: --max-new-tokens 0; a lone surrogate in a JSONL prompt; --device cuda
  on a CPU build and an unknown --device (capture, census, decoder). A JSONL path of 254+
  characters works (short store folder).
Rough edges: a prompt longer than the context (refused, or --truncate left, recorded); a hub id
  with the hub unreachable fails at once; a schema mismatch names the real difference first; a
  JSONL line without id is noted; resumed captures record batch widths and seconds; temporary
  leftovers of a kill are cleaned.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from census.__main__ import main as census_main
from census.definitions import CensusConfig
from census.output import run_census
from data.__main__ import main as data_main
from data.capture.models import encode_prompt, load_model
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.layout import model_dir, model_slug, store_dir
from data.store.parquetfile import _schema_difference
from data.store.reader import open_store
from data.store.schema import request_schema
from data.store.verify import verify_store
from data.store.writer import StoreWriter
from tests.conftest import STORY_PROMPTS, write_jsonl

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 12


def _cfg(bench, out, **kw):
    return CaptureConfig(bench=bench, model="stories260k", out=str(out),
                         max_new_tokens=kw.pop("max_new_tokens", MAX_NEW), flush_every=kw.pop("flush_every", 1),
                         progress=False, **kw)


def _cli(main, argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip()


def _subprocess(module: str, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("OILBIRD_FAULT", None)
    if fault:
        env["OILBIRD_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def _capture_cli(bench: str, out: Path, limit: int, fault: str | None = None) -> subprocess.CompletedProcess:
    return _subprocess("data", ["capture", "--bench", bench, "--model", "stories260k", "--out", str(out),
                                "--limit", str(limit), "--max-new-tokens", str(MAX_NEW), "--flush-every", "1",
                                "--quiet"], fault)


def _assert_killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


def _assert_refused_rerun(path: Path, capsys, bench: str, out: Path) -> str:
    """Every reader refuses the interrupted store in one line that says to rerun, not to --force."""
    with pytest.raises(OilbirdError) as e:
        open_store(path)
    msg = str(e.value)
    assert "rerun" in msg and "--force" not in msg and "\n" not in msg, msg
    code, err = _cli(data_main, ["show", str(path)], capsys)
    assert code == 2 and "rerun" in err and "--force" not in err and err.count("\n") == 0, err
    code, err = _cli(census_main, ["--bench", bench, "--model", "stories260k", "--out", str(out),
                                   "--no-embeddings", "--quiet"], capsys)
    assert code == 2 and "rerun" in err and "--force" not in err and err.count("\n") == 0, err
    return msg


def _assert_same_store(a, b) -> None:
    assert a.n_requests == b.n_requests
    assert a.positions.equals(b.positions)
    timing = ["seconds", "finished_at"]  # wall times: when each request ran and was committed
    assert a.requests.drop(timing).equals(b.requests.drop(timing))
    np.testing.assert_array_equal(a.hidden, b.hidden)
    np.testing.assert_array_equal(a.hidden_valid, b.hidden_valid)
    np.testing.assert_array_equal(a.topk, b.topk)
    np.testing.assert_array_equal(a.prompt_last_hidden, b.prompt_last_hidden)
    np.testing.assert_array_equal(a.prompt_last_topk, b.prompt_last_topk)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bench") / "b.jsonl", STORY_PROMPTS[:4])


@pytest.fixture(scope="module")
def whole(stories, bench, tmp_path_factory):
    """The uninterrupted capture of the 4 requests, in process."""
    return open_store(capture(_cfg(bench, tmp_path_factory.mktemp("whole")), lm=stories))


# ------------------------------------------------------------------ kills

def test_plain_capture_killed_at_each_commit_step_resumes_identically(stories, bench, whole, tmp_path, capsys):
    out = tmp_path / "runs"
    path = store_dir(out, bench, "stories260k")
    # 1: killed after the second request's part was written, before requests.parquet named it
    _assert_killed(_capture_cli(bench, out, 4, fault="after_part_write:2"))
    assert len(list(path.glob("positions-*.parquet"))) == 2  # one committed, one orphan
    _assert_refused_rerun(path, capsys, bench, out)
    assert open_store(path, allow_incomplete=True).n_requests == 1
    # 2: killed with the next part written and noted as pending in meta.json, requests.parquet not yet
    _assert_killed(_capture_cli(bench, out, 4, fault="after_pending_meta:1"))
    assert "pending" in json.loads((path / "meta.json").read_text())
    _assert_refused_rerun(path, capsys, bench, out)
    assert open_store(path, allow_incomplete=True).n_requests == 1  # not committed: redone
    # 3: killed after the commit point (requests.parquet), before meta.json recorded its checksum
    _assert_killed(_capture_cli(bench, out, 4, fault="after_requests_write:1"))
    assert "pending" in json.loads((path / "meta.json").read_text())
    _assert_refused_rerun(path, capsys, bench, out)
    assert open_store(path, allow_incomplete=True).n_requests == 2  # committed, so kept
    # 4: killed just after a whole commit
    _assert_killed(_capture_cli(bench, out, 4, fault="after_commit:1"))
    _assert_refused_rerun(path, capsys, bench, out)
    assert open_store(path, allow_incomplete=True).n_requests == 3
    # rerunning the same command resumes and finishes
    capture(_cfg(bench, out, limit=4), lm=stories)
    done = open_store(path)
    _assert_same_store(done, whole)
    assert done.verified and done.meta["complete"] and done.meta["n_requests"] == 4
    assert [(r["requests_from"], r["requests_to"]) for r in done.meta["runs"]] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert done.meta["seconds_total"] == pytest.approx(sum(r["seconds"] for r in done.meta["runs"]), abs=5e-3)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json"] + [f"positions-{i:05d}.parquet" for i in range(4)] \
        + ["requests.parquet"]
    assert verify_store(path).startswith("OK")


def test_extending_a_complete_store_killed(stories, bench, whole, tmp_path, capsys):
    out = tmp_path / "runs"
    path = store_dir(out, bench, "stories260k")
    capture(_cfg(bench, out, limit=2), lm=stories)
    assert open_store(path).n_requests == 2
    # killed between a part's write and its commit: incomplete on disk, readers say rerun (not --force)
    _assert_killed(_capture_cli(bench, out, 4, fault="after_part_write:1"))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["complete"] is False and meta["n_requests"] == 2
    _assert_refused_rerun(path, capsys, bench, out)
    # killed after a commit: 3 requests on disk, still incomplete (not "complete, 2 requests")
    _assert_killed(_capture_cli(bench, out, 4, fault="after_commit:1"))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["complete"] is False and meta["n_requests"] == 3
    _assert_refused_rerun(path, capsys, bench, out)
    capture(_cfg(bench, out, limit=4), lm=stories)
    done = open_store(path)
    _assert_same_store(done, whole)
    assert done.meta["limit"] == 4 and done.meta["n_requests"] == 4

    # what older code left behind: "complete": true with n_requests short of the rows
    meta = json.loads((path / "meta.json").read_text())
    meta["n_requests"] = 3
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="says 3 requests but requests.parquet holds 4.*rerun"):
        open_store(path)
    meta["n_requests"] = 4
    (path / "meta.json").write_text(json.dumps(meta))
    _, summary = run_census(bench, "stories260k", CensusConfig(bootstrap=0), out, embeddings=None, progress=False)
    assert summary["requests"] == 4 == summary["requests_with_positions"]


def test_store_from_before_checksums_resumes(stories, bench, whole, tmp_path):
    """A capture started by older code (no checksums, no runs) and killed with an orphan part
    resumes under this code, which then records checksums."""
    path = Path(capture(_cfg(bench, tmp_path, limit=3), lm=stories))
    meta = json.loads((path / "meta.json").read_text())
    for key in ("checksums", "n_requests", "store_format", "runs", "prompt_hash_scheme", "truncate", "truncated", "limit",
                "meta_sha256"):
        meta.pop(key, None)
    meta.update(complete=False, seconds_total=1.5)
    (path / "meta.json").write_text(json.dumps(meta))
    table = pq.read_table(path / "requests.parquet")
    pq.write_table(table.slice(0, 2), path / "requests.parquet")  # part 2 is now an uncommitted orphan
    with pytest.raises(OilbirdError, match="incomplete"):
        open_store(path)
    assert open_store(path, allow_incomplete=True).n_requests == 2
    capture(_cfg(bench, tmp_path, limit=4), lm=stories)
    done = open_store(path)
    _assert_same_store(done, whole)
    assert done.verified and len(done.meta["checksums"]) == 5
    assert [(r["batch_size"], r["requests_to"]) for r in done.meta["runs"]] == [(None, 2), (1, 4)]
    assert verify_store(path).startswith("OK")


def _census_pair(cdir: Path) -> tuple[bytes, bytes]:
    return (cdir / "positions.parquet").read_bytes(), (cdir / "summary.json").read_bytes()


def test_census_killed_keeps_old_or_new_pair(stories, bench, tmp_path):
    out = tmp_path / "runs"
    capture(_cfg(bench, out), lm=stories)
    cdir = run_census(bench, "stories260k", CensusConfig(bootstrap=0), out, embeddings=None, progress=False)[0]
    old = _census_pair(cdir)
    # killed with the new positions.parquet written and summary.json not: census/ is the old pair
    proc = _subprocess("census", ["--bench", bench, "--model", "stories260k", "--out", str(out), "--no-embeddings",
                                  "--bootstrap", "7", "--quiet"], fault="census_after_positions")
    _assert_killed(proc)
    assert _census_pair(cdir) == old
    leftovers = [p.name for p in cdir.parent.iterdir() if p.name.startswith(".census")]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")
    # the next census replaces the pair and removes the leftover
    _, summary = run_census(bench, "stories260k", CensusConfig(bootstrap=5), out, embeddings=None, progress=False)
    assert [p.name for p in cdir.parent.iterdir() if p.name.startswith(".census")] == []
    assert summary["config"]["bootstrap"] == 5 and json.loads((cdir / "summary.json").read_text()) == summary
    assert pl.read_parquet(cdir / "positions.parquet").height == summary["positions"]


def test_census_mid_swap_kill_in_a_real_process(stories, bench, tmp_path):
    out = tmp_path / "runs"
    capture(_cfg(bench, out), lm=stories)
    cdir = run_census(bench, "stories260k", CensusConfig(bootstrap=0), out, embeddings=None, progress=False)[0]
    old = _census_pair(cdir)
    _assert_killed(_subprocess("census", ["--bench", bench, "--model", "stories260k", "--out", str(out),
                                          "--no-embeddings", "--bootstrap", "7", "--quiet"], fault="census_mid_swap"))
    assert not cdir.exists()  # never half of each: the reader finds no census until the next run
    aside = [p for p in cdir.parent.iterdir() if p.name.endswith(".old")]
    assert len(aside) == 1 and _census_pair(aside[0]) == old
    # the next census first puts the old pair back (so a failure leaves it in place) and drops the new one
    from census.output import _restore_or_clean

    _restore_or_clean(cdir)
    assert _census_pair(cdir) == old and not [p for p in cdir.parent.iterdir() if p.name.startswith(".census")]


# ------------------------------------------------------------------ corruption

@pytest.fixture
def store_copy(whole, tmp_path):
    path = tmp_path / "b" / "stories260k" / "traces"
    shutil.copytree(whole.path, path)
    return path


def _rewrite(path: Path, change) -> None:
    table = pq.read_table(path)
    pq.write_table(change(table), path, compression="zstd")


def test_changed_hidden_state_is_refused(store_copy, capsys):
    part = sorted(store_copy.glob("positions-*.parquet"))[1]

    def bump(table):
        hidden = table.column("hidden").combine_chunks()
        values = hidden.values.to_numpy(zero_copy_only=False).copy()
        values[3] += np.float16(1.85)
        new = pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float16()), hidden.type.list_size,
                                                mask=hidden.is_null())
        return table.set_column(3, table.schema.field("hidden"), new)

    _rewrite(part, bump)  # a valid Parquet file holding other numbers: only the checksum can tell
    with pytest.raises(OilbirdError, match=f"damaged: {part.name} does not match its checksum") as e:
        open_store(store_copy)
    assert "\n" not in str(e.value)
    code, err = _cli(data_main, ["verify", str(store_copy)], capsys)
    assert code == 2 and err.startswith("error: ") and "checksum" in err and err.count("\n") == 0
    code, err = _cli(census_main, ["--bench", "b", "--model", "stories260k", "--out", str(store_copy.parents[2]),
                                   "--no-embeddings"], capsys)
    assert code == 2 and "checksum" in err


def test_changed_prompt_token_is_refused_and_flipped_bytes_too(store_copy, capsys):
    req = store_copy / "requests.parquet"
    good = req.read_bytes()

    def bump(table):
        prompts = table.column("prompt_tokens").to_pylist()
        prompts[1][2] += 1
        return table.set_column(4, table.schema.field("prompt_tokens"), pa.array(prompts, pa.list_(pa.int32())))

    _rewrite(req, bump)
    with pytest.raises(OilbirdError, match="requests.parquet does not match its checksum"):
        open_store(store_copy)
    # a store written before checksums: the prompt hash still catches it
    meta = json.loads((store_copy / "meta.json").read_text())
    legacy = {k: v for k, v in meta.items()
              if k not in ("checksums", "n_requests", "store_format", "prompt_hash_scheme", "meta_sha256")}
    (store_copy / "meta.json").write_text(json.dumps(legacy))
    with pytest.raises(OilbirdError, match=r"request 1 \(r1\) has prompt_hash .* but its prompt tokens hash to"):
        open_store(store_copy)
    req.write_bytes(good)
    st = open_store(store_copy)  # an older store opens, unverified
    assert not st.verified
    code = data_main(["show", str(store_copy)])
    assert code == 0 and "unverified" in capsys.readouterr().out
    code = data_main(["verify", str(store_copy)])
    assert code == 0 and "unverified" in capsys.readouterr().out
    # flipped bytes, anywhere in a file: one line, exit 2
    (store_copy / "meta.json").write_text(json.dumps(meta))
    part = sorted(store_copy.glob("positions-*.parquet"))[0]
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    part.write_bytes(bytes(blob))
    code, err = _cli(data_main, ["verify", str(store_copy)], capsys)
    assert code == 2 and err.count("\n") == 0 and ("checksum" in err or "corrupt" in err), err


def test_verify_ok_and_show_verified(store_copy, capsys):
    code = data_main(["verify", str(store_copy)])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("OK: ") and "match their checksums" in out and "prompt hashes" in out
    assert data_main(["show", str(store_copy)]) == 0
    assert "checksums: verified" in capsys.readouterr().out


# ------------------------------------------------------------------ mislabelled stores

def test_census_refuses_another_model(stories, store_copy, tiny_dirs, capsys):
    out = store_copy.parents[2]
    other = out / "b" / "smollm2-135m" / "traces"
    shutil.copytree(store_copy, other)  # a stories260k store where smollm2-135m's should be
    code, err = _cli(census_main, ["--bench", "b", "--model", "smollm2-135m", "--out", str(out), "--no-embeddings"],
                     capsys)
    assert code == 2 and "captured with model 'stories260k', not 'smollm2-135m'" in err and err.count("\n") == 0
    # meta.json edited to name another model (here a random tiny Llama of the same shape)
    tiny = Path(tiny_dirs["llama"])
    edited = out / "b" / tiny.name / "traces"
    shutil.copytree(store_copy, edited)
    meta = json.loads((edited / "meta.json").read_text())
    meta.update(model=str(tiny), model_path=str(tiny))
    (edited / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="edited after capture"):  # meta.json's seal (data/store/meta.py)
        run_census("b", str(tiny), CensusConfig(bootstrap=0), out, progress=False)
    meta.pop("meta_sha256")  # a store written before the seal: the model's fingerprint catches it
    (edited / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="holds other weights|loads with fingerprint .* captured with"):
        run_census("b", str(tiny), CensusConfig(bootstrap=0), out, progress=False)
    # or to another fingerprint
    meta = json.loads((store_copy / "meta.json").read_text())
    meta["model_fingerprint"] = "0" * 16
    meta.pop("meta_sha256")
    (store_copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="fingerprint"):
        run_census("b", "stories260k", CensusConfig(bootstrap=0), out, progress=False)
    assert not (out / "b" / "stories260k" / "census").exists()


# ------------------------------------------------------------------ bad input: one line, exit 2

def test_max_new_tokens_zero_is_refused(bench, tmp_path, capsys):
    code, err = _cli(data_main, ["capture", "--bench", bench, "--model", "stories260k", "--out", str(tmp_path),
                                 "--max-new-tokens", "0"], capsys)
    assert code == 2 and err == "error: --max-new-tokens must be at least 1 (got 0)"


def test_path_components_that_leave_their_folder_are_refused(tmp_path):
    """Issue 23: `--model /path/sub/..` gave the slug '..', and the store landed in runs/<bench>/traces
    over another benchmark's; every runs/ path is built by data/store/layout.py, which refuses such a name."""
    sub = tmp_path / "sub"
    sub.mkdir()
    assert model_slug(f"{sub}/..") == ".."
    for slug in ("", ".", "..", "a/b", model_slug(f"{sub}/..")):
        with pytest.raises(OilbirdError, match="cannot name a folder") as e:
            store_dir(tmp_path, "apibank", slug)
        assert "\n" not in str(e.value)
    for bench in ("", ".", ".."):
        with pytest.raises(OilbirdError, match="cannot name a folder"):
            model_dir(tmp_path, bench, "stories260k")
    assert store_dir(tmp_path, "tau:retail/x", "m") == tmp_path / "tau_retail_x" / "m" / "traces"
    assert not list(tmp_path.rglob("traces"))  # nothing was made


def test_lone_surrogate_is_one_line(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text('{"id": "ok", "prompt": "fine"}\n{"id": "bad", "prompt": "a \\ud800 b"}\n')
    code, err = _cli(data_main, ["capture", "--bench", f"jsonl:{path}", "--model", "stories260k",
                                 "--out", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 0 and f"{path} line 2" in err and "not valid Unicode" in err


def test_device_errors_are_one_line(bench, tmp_path, capsys):
    import torch

    bad = ["no-such-device"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        code, err = _cli(data_main, ["capture", "--bench", bench, "--model", "stories260k", "--out", str(tmp_path),
                                     "--device", device], capsys)
        assert code == 2 and err.count("\n") == 0 and device in err, err
        code, err = _cli(census_main, ["--bench", "x", "--model", "m", "--device", device], capsys)
        assert code == 2 and err.count("\n") == 0 and device in err, err
        from decoder.__main__ import main as decoder_main

        code, err = _cli(decoder_main, ["--bench", bench, "--model", "stories260k", "--arms", "ar", "--limit", "1",
                                        "--out", str(tmp_path), "--device", device, "--quiet"], capsys)
        assert code == 2 and err.count("\n") == 0 and device in err, err


def test_long_jsonl_path(stories, tmp_path):
    deep = tmp_path
    while len(str(deep)) < 260:
        deep = deep / ("d" * 40)
    deep.mkdir(parents=True)
    bench = write_jsonl(deep / "my traffic.jsonl", STORY_PROMPTS[:1])
    assert len(bench) > 254
    path = Path(capture(_cfg(bench, tmp_path / "runs", max_new_tokens=4), lm=stories))
    folder = path.parents[1].name
    assert folder.startswith("my_traffic-") and len(folder) == len("my_traffic-") + 8
    assert path == store_dir(tmp_path / "runs", bench, "stories260k") and open_store(path).n_requests == 1


# ------------------------------------------------------------------ rough edges

def test_prompt_longer_than_the_context(stories, tmp_path, capsys):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": "the cat sat on the mat. " * 120}) + "\n"
                    + json.dumps({"id": "short", "prompt": STORY_PROMPTS[0]}) + "\n")
    bench = f"jsonl:{path}"
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, tmp_path / "runs"), lm=stories)
    msg = str(e.value)
    assert msg.startswith("request long: the prompt is") and "context of 512 positions" in msg
    assert "--truncate left" in msg
    assert not list((tmp_path / "runs").rglob("meta.json"))  # refused before anything is written
    st = open_store(capture(_cfg(bench, tmp_path / "runs", truncate="left", max_new_tokens=8), lm=stories))
    assert "truncated 1 prompt(s)" in capsys.readouterr().err
    full = len(encode_prompt(stories, [{"role": "user", "content": "the cat sat on the mat. " * 120}]))
    assert st.meta["truncate"] == "left" and st.meta["truncated"] == {"long": full}
    assert len(st.prompt(0)) == 512 - 8 and st.prompt(0)[0] == stories.tokenizer.bos_token_id
    assert st.prompt(1) == encode_prompt(stories, [{"role": "user", "content": STORY_PROMPTS[0]}])  # fits: kept


def test_hub_unreachable_fails_at_once(monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    for var in ("HTTPS_PROXY", "https_proxy", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    t0 = time.perf_counter()
    with pytest.raises(OilbirdError) as e:
        load_model("oilbird-test/no-such-model")
    assert time.perf_counter() - t0 < 15
    assert "\n" not in str(e.value) and "offline" in str(e.value)
    assert "unreachable" in capsys.readouterr().err


def test_schema_mismatch_names_the_real_difference_first():
    want = request_schema(4)
    fields = [pa.field(f.name, pa.list_(pa.int64()) if f.name == "output_tokens" else f.type,
                       nullable=f.name != "id") for f in want]
    text = _schema_difference(pa.schema(fields), want)
    assert text.startswith("output_tokens: list<item: int64>") and text.index("dialect only: id") > 0
    assert _schema_difference(pa.schema([f for f in want if f.name != "group"]), want).startswith("group: missing")


def test_jsonl_without_id_is_noted_once(tmp_path, capsys):
    from data.benchmarks.registry import load_requests

    path = tmp_path / "noid.jsonl"
    path.write_text('{"prompt": "a"}\n{"id": "x", "prompt": "b"}\n{"prompt": "c"}\n')
    assert [r.id for r in load_requests(f"jsonl:{path}")] == ["1", "x", "3"]
    load_requests(f"jsonl:{path}")
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and '2 line(s) without "id" take their line number' in err


def test_resumed_capture_records_batch_widths_and_seconds(stories, bench, tmp_path):
    capture(_cfg(bench, tmp_path, limit=2, flush_every=8), lm=stories)
    st = open_store(capture(_cfg(bench, tmp_path, limit=4, batch_size=2, flush_every=8), lm=stories))
    runs = st.meta["runs"]
    assert [(r["batch_size"], r["requests_from"], r["requests_to"]) for r in runs] == [(1, 0, 2), (2, 2, 4)]
    assert st.meta["seconds_total"] == pytest.approx(sum(r["seconds"] for r in runs), abs=2e-3)
    assert all(r["seconds"] > 0 for r in runs)


def test_leftovers_of_a_kill_are_cleaned(stories, bench, tmp_path):
    out = tmp_path / "runs"
    path = Path(capture(_cfg(bench, out, limit=2), lm=stories))
    dead = path / ".requests.parquet.99999999.abcd1234.tmp"
    older = path / ".positions-00002.parquet.q1w2e3r4.tmp"  # older code's name, no pid
    live = path / f".requests.parquet.{os.getppid()}.zzzz.tmp"  # a running writer's: kept
    for p in (dead, older, live):
        p.write_bytes(b"partial")
    capture(_cfg(bench, out, limit=2), lm=stories)  # nothing to capture, but the writer opened the store
    assert not dead.exists() and not older.exists() and live.exists()
    live.unlink()
    leftover = path.parent / ".census.99999999.abcd1234.tmp"
    leftover.mkdir()
    (leftover / "positions.parquet").write_bytes(b"partial")
    run_census(bench, "stories260k", CensusConfig(bootstrap=0), out, embeddings=None, progress=False)
    assert not leftover.exists()
    grid = out / "grid" / "stories260k"
    grid.mkdir(parents=True)
    (grid / ".census_grid.json.99999999.abcd1234.tmp").write_text("{")
    assert census_main(["grid", "--benches", bench, "--model", "stories260k", "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in grid.iterdir()) == ["census_grid.json", "census_grid.txt"]


def test_writer_refuses_a_damaged_store_but_resumes_an_interrupted_one(stories, bench, tmp_path):
    path = Path(capture(_cfg(bench, tmp_path, limit=2), lm=stories))
    meta = json.loads((path / "meta.json").read_text())
    part = path / "positions-00001.parquet"
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    part.write_bytes(bytes(blob))
    with pytest.raises(OilbirdError, match="damaged.*--force"):
        StoreWriter(path, meta)
    capture(_cfg(bench, tmp_path, limit=2, force=True), lm=stories)  # --force starts over
    assert verify_store(path).startswith("OK")
