"""A store written here (pyarrow >= 26) is read, verified, censused and replayed under pyarrow 25.0.1,
the last release with apache/arrow#35692 (null rows of fixed-size lists unreadable from Parquet), as
GPU images ship it; and a format-1 store (null rows) is read there through the fallback reader.

`make install` puts pyarrow 25.0.1 in .venv/pyarrow25; each stage runs in a subprocess with it first
on PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import STORIES, STORY_PROMPTS, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
PA25 = ROOT / ".venv" / "pyarrow25"
GOLDEN = Path(__file__).parent / "golden" / "store-format1"

pytestmark = pytest.mark.skipif(not (PA25 / "pyarrow").is_dir(),
                                reason=f"pyarrow 25.0.1 not installed at {PA25} (make install puts it there)")


def _run(args: list[str], pyarrow25: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pyarrow25:
        env["PYTHONPATH"] = os.pathsep.join([str(PA25), str(ROOT)])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_subprocess_sees_pyarrow_25():
    out = _run(["-c", "import pyarrow; print(pyarrow.__version__)"])
    assert out.returncode == 0 and out.stdout.strip() == "25.0.1", out.stderr


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_store_written_here_runs_every_stage_under_pyarrow25(tmp_path):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:4])
    runs = str(tmp_path / "runs")
    common = ["--bench", bench, "--model", "stories260k", "--out", runs]
    cap = _run(["-m", "data", "capture", *common, "--max-new-tokens", "40", "--quiet"], pyarrow25=False)
    assert cap.returncode == 0, cap.stderr
    store = cap.stdout.strip().splitlines()[-1]
    for args in (["-m", "data", "verify", store], ["-m", "census", *common, "--quiet"],
                 ["-m", "decoder", "replay", *common, "--arms", "suffix,lexical,oilbird"]):
        out = _run(args)
        assert out.returncode == 0, (args, out.stderr[-2000:])
        assert "Traceback" not in out.stderr
    assert "OK" in _run(["-m", "data", "verify", store]).stdout


def test_format1_store_opens_under_pyarrow25(tmp_path):
    store = tmp_path / "old"
    shutil.copytree(GOLDEN, store)
    out = _run(["-m", "data", "verify", str(store)])
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stderr
