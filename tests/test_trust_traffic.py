"""Issue 35, traffic: growing JSONL traffic extends its store, and the capture input's bad cases are one line.

- a JSONL file that only gained lines at its end extends its store (the held requests stay byte-identical,
  the census equals one of a store captured from the whole file at once); an edited, removed or reordered
  line is refused in one line naming it, with --force as the way out (data/capture/traffic.py);
- a FIFO or a folder given as the JSONL path is named as such, never opened (a FIFO would block);
- a truncated model.safetensors, a model folder without a tokenizer and a chat template that refuses a
  conversation are one line (naming the file, the folder, the request) in capture, the decoder and the profile.

Run: .venv/bin/python -m pytest -q tests/test_trust_traffic.py
"""

from __future__ import annotations

import json
import os
import shutil
import re
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from census.definitions import CensusConfig
from census.output import run_census
from data.__main__ import main as data_main
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.reader import open_store
from data.store.verify import verify_store
from tests.conftest import STORIES, STORY_PROMPTS


# two tenants, and a prompt repeated within a tenant (rows 0 and 2) and across the growth (row 4 = row 1):
# the census's same-prompt and tenant rules must treat the appended requests as a whole capture would
ROWS = [{"id": f"r{i}", "prompt": STORY_PROMPTS[i], **({"tenant": "acme"} if i % 2 else {})} for i in range(4)]
ROWS.append({"id": "r4", "prompt": STORY_PROMPTS[1], "tenant": "acme"})


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def _cfg(bench: str, out: Path, **kw) -> CaptureConfig:
    return CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=8, progress=False,
                         flush_every=2, **kw)


def _census(bench: str, out: Path) -> tuple[pl.DataFrame, dict]:
    cdir, summary = run_census(bench, "stories260k", CensusConfig(bootstrap=0), out, embeddings=None, progress=False)
    for volatile in ("timing", "store", "store_fingerprint", "created"):
        summary.pop(volatile, None)
    return pl.read_parquet(cdir / "positions.parquet"), summary


def test_grown_traffic_extends_its_store(stories, tmp_path, capsys, one_thread):
    traffic = tmp_path / "t.jsonl"
    bench = _write(traffic, ROWS[:3])
    grown = tmp_path / "grown"
    path = Path(capture(_cfg(bench, grown), lm=stories))
    held = pq.read_table(path / "requests.parquet").to_pylist()
    parts_before = {p.name: p.read_bytes() for p in path.glob("positions-*.parquet")}
    with open(traffic, "a") as f:  # the log grows by two lines
        f.write("".join(json.dumps(r) + "\n" for r in ROWS[3:]))
    capsys.readouterr()
    capture(_cfg(bench, grown), lm=stories)
    assert "gained 2 request(s)" in capsys.readouterr().err
    store = open_store(path)
    assert store.n_requests == 5 and store.meta["requests_total"] == 5
    after = pq.read_table(path / "requests.parquet").to_pylist()
    assert after[:3] == held  # the first three requests are byte-identical (hidden states included)
    assert all((path / name).read_bytes() == blob for name, blob in parts_before.items())
    assert verify_store(path).startswith("OK")
    assert [r["tenant"] for r in after] == ["", "acme", "", "acme", "acme"]

    whole = tmp_path / "whole"
    whole_path = Path(capture(_cfg(bench, whole), lm=stories))
    assert open_store(whole_path).meta["data_fingerprint"] == store.meta["data_fingerprint"]
    positions, summary = _census(bench, grown)
    whole_positions, whole_summary = _census(bench, whole)
    assert positions.height > 0 and summary["requests"] == 5
    assert summary == whole_summary
    assert positions.equals(whole_positions)

    # a third run with nothing new captures nothing and changes nothing
    capture(_cfg(bench, grown), lm=stories)
    assert "nothing to capture" in capsys.readouterr().err
    assert pq.read_table(path / "requests.parquet").to_pylist() == after


def test_extension_killed_midway_resumes(stories, tmp_path, monkeypatch, one_thread):
    """Killed before the grown traffic's first commit: the store already says so (incomplete, the new
    fingerprint), and the same command resumes it into the five requests."""
    from data.store.writer import StoreWriter
    from tests.conftest import crash_on_call

    traffic = tmp_path / "t.jsonl"
    bench = _write(traffic, ROWS[:3])
    out = tmp_path / "runs"
    path = Path(capture(_cfg(bench, out), lm=stories))
    _write(traffic, ROWS)
    real = crash_on_call(monkeypatch, StoreWriter, "append", 1)
    with pytest.raises(KeyboardInterrupt):
        capture(_cfg(bench, out), lm=stories)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["complete"] is False and meta["n_requests"] == 3 and meta["requests_total"] == 5
    monkeypatch.setattr(StoreWriter, "append", real)
    capture(_cfg(bench, out), lm=stories)
    store = open_store(path)
    assert store.n_requests == 5 and store.meta["complete"] and verify_store(path).startswith("OK")


def _grown_then(tmp_path, stories, change) -> tuple[str, Path, str]:
    """Capture 3 lines, rewrite the file with `change`(rows), rerun: the refusal's text."""
    traffic = tmp_path / "t.jsonl"
    bench = _write(traffic, ROWS[:3])
    out = tmp_path / "runs"
    capture(_cfg(bench, out), lm=stories)
    _write(traffic, change([dict(r) for r in ROWS]))
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, out), lm=stories)
    return bench, out, str(e.value)


def _edit_prompt(rows):
    rows[1]["prompt"] = "Tom had a blue ball."
    return rows


def test_edited_line_is_refused_naming_it_and_force_recaptures(stories, tmp_path, one_thread):
    bench, out, msg = _grown_then(tmp_path, stories, _edit_prompt)
    assert "\n" not in msg and "line 2 of" in msg and "id 'r1'" in msg and "its prompt changed" in msg
    assert "--force" in msg
    path = Path(capture(_cfg(bench, out, force=True), lm=stories))
    assert open_store(path).n_requests == 5


@pytest.mark.parametrize("change, expect", [
    (lambda rows: [rows[1], rows[0]] + rows[2:], "line 1 of .* id 'r1'.*id 'r0' -> 'r1'"),  # reordered
    (lambda rows: rows[:1] + rows[2:], "line 2 of .*id 'r2'.*id 'r1' -> 'r2'"),  # removed
    (lambda rows: [rows[0], dict(rows[1], tenant="other")] + rows[2:], "line 2 of .*tenant 'acme' -> 'other'"),
    (lambda rows: rows[:2], "holds 3 requests but the traffic now has 2"),  # shrunk
])
def test_reordered_removed_or_retenanted_lines_are_refused(stories, tmp_path, one_thread, change, expect):
    _, _, msg = _grown_then(tmp_path, stories, change)
    assert "\n" not in msg and "--force" in msg
    assert re.search(expect, msg), msg


def test_edited_line_beyond_the_held_requests_is_refused(stories, tmp_path, one_thread):
    """A line the store does not hold (captured with --limit) changed: refused, though no held row differs."""
    traffic = tmp_path / "t.jsonl"
    bench = _write(traffic, ROWS[:3])
    out = tmp_path / "runs"
    capture(_cfg(bench, out, limit=2), lm=stories)
    rows = [dict(r) for r in ROWS]
    rows[2]["prompt"] = "Something else."
    _write(traffic, rows)
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, out), lm=stories)
    msg = str(e.value)
    assert "\n" not in msg and "the 2 it holds are unchanged" in msg and "--force" in msg


def test_reference_mode_names_an_edited_reference(stories, tmp_path, one_thread):
    traffic = tmp_path / "t.jsonl"
    rows = [dict(r, reference=STORY_PROMPTS[(i + 1) % len(STORY_PROMPTS)]) for i, r in enumerate(ROWS)]
    bench = _write(traffic, rows[:3])
    out = tmp_path / "runs"
    capture(_cfg(bench, out, mode="reference"), lm=stories)
    rows[2]["reference"] = "A different answer."
    _write(traffic, rows)
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, out, mode="reference"), lm=stories)
    assert "line 3 of" in str(e.value) and 'its "reference" changed' in str(e.value)
    rows[2]["reference"] = STORY_PROMPTS[3]  # as it was: the grown traffic extends the teacher-forced store
    _write(traffic, rows)
    assert open_store(capture(_cfg(bench, out, mode="reference"), lm=stories)).n_requests == 5


# ---------------------------------------------------------------------------------------------------------
# The JSONL path


@pytest.mark.parametrize("kind, said", [("fifo", "is a FIFO (named pipe), not a regular file"),
                                         ("dir", "is a folder, not a regular file")])
def test_jsonl_path_that_is_a_fifo_or_a_folder(tmp_path, capsys, kind, said):
    path = tmp_path / "traffic.jsonl"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    # a FIFO opened for reading blocks until a writer comes: the check must stat it, never open it
    rc = data_main(["capture", "--bench", f"jsonl:{path}", "--model", "stories260k", "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"error: jsonl file {path} {said}\n"


# ---------------------------------------------------------------------------------------------------------
# Models: truncated weights, no tokenizer, a chat template that refuses the conversation


@pytest.fixture(scope="module")
def damaged_models(tmp_path_factory):
    """Copies of stories260k: weights cut in half, no tokenizer files, a template insisting on alternation."""
    if not STORIES.is_dir():
        pytest.skip(f"stories260k not found at {STORIES}")
    root = tmp_path_factory.mktemp("damaged")
    out = {}
    for name in ("truncated", "no_tokenizer", "alternating"):
        out[name] = root / name
        shutil.copytree(STORIES, out[name])
        for f in out[name].iterdir():
            f.chmod(0o644)
    weights = out["truncated"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    for f in out["no_tokenizer"].glob("tokenizer*"):
        f.unlink()
    config = out["alternating"] / "tokenizer_config.json"
    tok = json.loads(config.read_text())
    tok["chat_template"] = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                            "{% endif %}{{ m['content'] }}{% endfor %}")
    config.write_text(json.dumps(tok))
    return out


TWO_REQUESTS = [{"id": "a", "prompt": "Once upon a time"},
                {"id": "b", "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]}]


def _run_stage(stage: str, model: Path, tmp_path, capsys) -> str:
    bench = _write(tmp_path / "t.jsonl", TWO_REQUESTS)
    out = str(tmp_path / "runs")
    if stage == "capture":
        rc = data_main(["capture", "--bench", bench, "--model", str(model), "--out", out, "--max-new-tokens", "4"])
    elif stage == "decoder":
        from decoder.__main__ import main as decoder_main

        rc = decoder_main(["--bench", bench, "--model", str(model), "--out", out, "--arms", "ar",
                           "--max-new-tokens", "4", "--quiet"])
    else:
        from decoder.__main__ import main as decoder_main

        rc = decoder_main(["profile", "--model", str(model), "--out", out, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("stage", ["capture", "decoder", "profile"])
def test_truncated_weights_are_one_line_naming_the_file(damaged_models, tmp_path, capsys, stage):
    err = _run_stage(stage, damaged_models["truncated"], tmp_path, capsys)
    assert f"{damaged_models['truncated'] / 'model.safetensors'} is damaged or incomplete" in err
    assert "download the model again" in err


def test_model_folder_without_tokenizer_is_a_whole_line(damaged_models, tmp_path, capsys):
    err = _run_stage("capture", damaged_models["no_tokenizer"], tmp_path, capsys)
    folder = damaged_models["no_tokenizer"]
    assert f"model folder {folder}" in err and "has no tokenizer" in err and "tokenizer.json" in err
    assert not err.rstrip().endswith(":")


@pytest.mark.parametrize("stage", ["capture", "decoder"])
def test_chat_template_refusal_names_the_request(damaged_models, tmp_path, capsys, stage):
    err = _run_stage(stage, damaged_models["alternating"], tmp_path, capsys)
    assert "request 1 (id 'b')" in err and "Conversation roles must alternate" in err and "system/user" in err
