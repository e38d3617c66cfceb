"""Which engine a verification-cost profile is measured on: `python -m decoder profile --engine auto`.

`make census` prices the verdict on vLLM, the engine users serve with; but vLLM cannot run every model (on a
CPU its attention takes some head dims only: stories260k's 8 is refused at the first step, deep in a child
process). `--engine auto` (the Makefile's PROFILE_ENGINE default) measures vLLM's step where vLLM can run the
model, else the harness's forward, saying so in one line; the replay then prices, and the verdict compares, the
harness's form (trees: decoder/policy.py). Deciding starts no engine: it reads the model's config.json only.
"""

from __future__ import annotations

from typing import Sequence

from data.errors import OilbirdError

ENGINES = ("auto", "harness", "vllm")


def choose_engine(requested: str, model_dir: str, batch_sizes: Sequence[int] = (1,)) -> tuple[str, str | None]:
    """(the engine a profile is measured on, the one line saying so when `auto` falls back to the harness).

    auto: vLLM where it can run the model (installed, and on a CPU a head dim its attention takes:
    data/capture/vllm_engine.py), else the harness, whose profile prices batch 1 only (the batch sizes above
    1 are then left out, and the verdict names the harness's form, trees); harness or vllm: as asked (vllm
    then refuses in one line where it cannot run). Starts no engine."""
    if requested != "auto":
        return requested, None
    from data.capture.vllm_engine import check_cpu_head_dim, require_vllm

    try:
        require_vllm()
        check_cpu_head_dim(model_dir)
    except OilbirdError as e:
        dropped = sorted(b for b in batch_sizes if b > 1)
        return "harness", (f"profile engine: the harness, not vLLM ({e})"
                           + (f"; batch sizes {','.join(map(str, dropped))} left out (the harness verifies one "
                              "request a pass)" if dropped else ""))
    return "vllm", None
