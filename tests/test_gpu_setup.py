"""What a GPU user runs, checked as far as a CPU allows (docs/install.md): the CUDA install line, the device
and dtype a stage picks, and a bfloat16 capture (the CUDA default) through the state tap, the store and
the census."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from census.definitions import CensusConfig
from census.output import run_census
from data.capture.models import LayerTap, load_model, pick_device, pick_dtype
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.reader import open_store
from tests.conftest import STORY_PROMPTS, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def _install_lines(**variables) -> list[str]:
    args = ["make", "-n", "-B", "install", *(f"{k}={v}" for k, v in variables.items())]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "pip install" in line]


def test_install_cuda_index_and_kept_torch():
    index = "https://download.pytorch.org/whl/cu130"
    lines = _install_lines(TORCH_INDEX=index)
    torch_lines = [line for line in lines if '"torch==' in line]
    assert len(torch_lines) == 1 and torch_lines[0].endswith(f"--index-url {index}"), lines
    assert not any("--index-url" in line for line in lines if line not in torch_lines)  # only torch comes from there
    kept = _install_lines(TORCH_SPEC="", VENV_FLAGS="--system-site-packages")
    assert not any('"torch' in line for line in kept) and any('-e ".[test,faiss,ray]"' in line for line in kept), kept
    default = _install_lines()
    assert any(line.rstrip().endswith('"torch==2.13.0"') for line in default), default  # the CPU wheel, no index


def test_device_and_dtype_choice():
    assert pick_dtype(None, torch.device("cuda")) == torch.bfloat16  # the CUDA default
    assert pick_dtype(None, torch.device("cpu")) == torch.float32
    assert pick_dtype("fp32", torch.device("cuda")) == torch.float32
    with pytest.raises(OilbirdError, match="unknown dtype"):
        pick_dtype("int8", torch.device("cpu"))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device(None).type == expected
    if not torch.cuda.is_available():
        with pytest.raises(OilbirdError, match="CUDA"):
            pick_device("cuda")


def test_bfloat16_capture_tap_store_and_census(tmp_path, one_thread):
    """A bf16 model (as on CUDA): the tap keeps the layer's bf16 output, the store holds it as float16 within
    bf16 rounding of a float32 forward, and the census runs on the store."""
    lm = load_model("stories260k", dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:4])
    path = capture(CaptureConfig(bench=bench, model="stories260k", out=str(tmp_path / "runs"), max_new_tokens=24,
                                 progress=False, dtype="bfloat16"), lm=lm)
    st = open_store(path, model_fingerprint=lm.fingerprint, d_model=lm.d_model)
    assert st.meta["dtype"] in ("bfloat16", "torch.bfloat16") and st.verified
    fp32 = load_model("stories260k")
    assert fp32.fingerprint == lm.fingerprint  # one store identity whatever the dtype
    for r in range(st.n_requests):
        seq = st.prompt(r) + st.tokens(r).tolist()
        with LayerTap(fp32.model, fp32.layer) as tap, torch.no_grad():
            fp32.model(torch.tensor([seq]))
            ref = tap.take()[0].numpy()
        rows = slice(st.offsets[r], st.offsets[r + 1])
        valid = st.hidden_valid[rows]
        p = len(st.prompt(r))
        got = st.hidden[rows][valid].astype(np.float32)
        want = ref[p:p + len(valid)][valid]
        scale = np.abs(want).max()
        assert np.isfinite(got).all() and np.abs(got - want).max() <= 0.05 * scale  # bf16 has 8 mantissa bits
    _, summary = run_census(bench, "stories260k", CensusConfig(bootstrap=0), tmp_path / "runs", embeddings=None,
                            progress=False)
    assert summary["requests"] == 4 and summary["positions"] == int(st.offsets[-1]), summary
