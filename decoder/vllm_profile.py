"""`python -m decoder profile --engine vllm`: the verification-cost profile measured inside vLLM.

The same grid and file format as the harness's profile (decoder/profile.py): verify_s[context][nodes], the
seconds of one engine step that verifies the anchor plus `nodes` draft tokens with `context` tokens already
in the KV cache, and prefill_s(prompt length). How, at batch size 1 (the batch curve is make bench-vllm's):
  - `ProfileProposer`, a custom_class proposer, proposes exactly N tokens at every step, N walking through
    the grid's node counts (each held for `reps` steps after one warm-up step); the tokens are ids no
    model puts first (so nothing is accepted and every step commits one token), and the time between two
    `propose` calls is the step that verified the N proposed at the first of them (the engine's forward,
    sampling and rejection, its scheduler and our proposer: what a speculative step costs in vLLM);
  - per context length L, one request with a fresh random prompt of L tokens runs the whole walk (its
    context grows by one token a step, about 3 x 10 steps past L); the median over the reps is kept;
  - prefill_s(L): one request of a fresh random prompt of L tokens and one new token, timed whole.
The file says `"engine": "vllm"`; replay prices arms with it like the harness's and names the engine.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from data.errors import OilbirdError

SCHEDULE_ENV = "OILBIRD_VLLM_PROFILE"  # "n,n,n:reps:out_path"


class ProfileProposer:
    """vLLM custom_class proposer for the profile (module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        nodes, reps, out = os.environ[SCHEDULE_ENV].split(":", 2)
        self.schedule = [int(n) for n in nodes.split(",") for _ in range(1 + int(reps))]  # 1 warm-up + reps
        self.out = out
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self.step = 0  # proposals made in this request
        self.request = b""  # the served request's first tokens
        self.last: tuple[float, int] | None = None  # (time, nodes proposed) of the last call

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, *args: Any, **kwargs: Any) -> list[list[int]]:
        now = time.perf_counter()
        if len(sampled_token_ids) != 1 or not sampled_token_ids[0]:
            self.last = None
            return [[] for _ in sampled_token_ids]
        key = token_ids_cpu[0, :16].tobytes()
        if key != self.request:  # a new request starts the walk over
            self.request, self.step, self.last = key, 0, None
        if self.last is not None:
            t, n = self.last
            with open(self.out, "a") as f:
                f.write(json.dumps({"nodes": n, "s": now - t, "index": self.step - 1}) + "\n")
        n = self.schedule[self.step % len(self.schedule)]
        self.step += 1
        self.last = (time.perf_counter(), n)
        return [[self.vocab - 1 - (i % 7) for i in range(n)]]  # ids at the vocabulary's end: never a greedy pick


def measure_vllm_profile(model_dir: str, name: str, fingerprint: str, contexts: Sequence[int],
                         nodes: Sequence[int], reps: int, dtype: str = "float32", seed: int = 0,
                         progress=None) -> dict:
    """The profile dict (decoder/profile.py's format, with "engine": "vllm")."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from data.vllm_engine import VLLM_VERSION, EngineConfig, make_llm, model_max_len

    nodes = sorted({int(n) for n in nodes})
    top = max(nodes)
    limit = model_max_len(model_dir)
    steps = len(nodes) * (1 + reps) + 2
    if limit and max(contexts) + steps + top + 1 > limit:
        raise OilbirdError(f"context {max(contexts)} + {steps} profiled steps does not fit the model's {limit} positions")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "steps.jsonl"
        os.environ[SCHEDULE_ENV] = f"{','.join(map(str, nodes))}:{reps}:{samples}"
        llm = make_llm(EngineConfig(model_dir, dtype=dtype, max_num_seqs=1, prefix_caching=False),
                       {"method": "custom_class", "model": "decoder.vllm_profile.ProfileProposer",
                        "num_speculative_tokens": max(1, top)})
        vocab = llm.llm_engine.model_config.get_vocab_size()

        def prompt(n: int):
            return TokensPrompt(prompt_token_ids=rng.integers(3, max(4, vocab // 2), n).tolist())

        llm.generate([prompt(8)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        verify_s, prefill_s = [], {}
        for L in contexts:
            samples.unlink(missing_ok=True)
            llm.generate([prompt(L)], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                         use_tqdm=False)
            rows = [json.loads(line) for line in samples.read_text().splitlines()]
            # each node count's first step is its warm-up (the schedule holds it 1 + reps steps)
            by: dict[int, list[float]] = {n: [] for n in nodes}
            held = 1 + reps
            for r in rows:
                if r["index"] % held != 0 and r["index"] < len(nodes) * held:
                    by[r["nodes"]].append(r["s"])
            missing = [n for n, v in by.items() if not v]
            if missing:
                raise OilbirdError(f"vLLM profile: no step measured for {missing} nodes at context {L}")
            verify_s.append([statistics.median(by[n]) for n in nodes])
            t0 = time.perf_counter()
            llm.generate([prompt(L)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            prefill_s[L] = time.perf_counter() - t0
            if progress is not None:
                progress(L)
        del llm
    import datetime
    import platform

    import torch

    lengths = sorted(prefill_s)
    return {"format": 1, "model": name, "model_fingerprint": fingerprint, "engine": "vllm",
            "engine_version": VLLM_VERSION, "device": "cuda" if torch.cuda.is_available() else "cpu", "device_name": platform.processor() or platform.machine(),
            "dtype": dtype, "threads": torch.get_num_threads(), "torch": torch.__version__, "batch_size": 1,
            "nodes": nodes, "contexts": list(contexts), "verify_s": verify_s, "prefill_lengths": lengths,
            "prefill_s": [prefill_s[p] for p in lengths], "reps": reps,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
