"""`python -m decoder profile --engine vllm`: the verification-cost profile measured inside vLLM.

The same grid and file format as the harness's profile (decoder/cost/profile.py): verify_s[context][nodes], the
seconds of one engine step that verifies the anchor plus `nodes` draft tokens with `context` tokens already
in the KV cache, and prefill_s(prompt length). With --batch-sizes B,B the same grid is measured with B
requests in every step (`verify_s_by_batch`: the seconds of one step that verifies B rows of `nodes` draft
tokens each); `verify_s` stays batch 1, what replay prices (one stream). How:
  - `ProfileProposer`, a custom_class proposer, proposes exactly N tokens at every step, N walking through
    the grid's node counts (each held for `reps` steps after one warm-up step); the tokens are ids no
    model puts first (so nothing is accepted and every step commits one token), and the time between two
    `propose` calls is the step that verified the N proposed at the first of them (the engine's forward,
    sampling and rejection, its scheduler and our proposer: what a speculative step costs in vLLM);
  - per context length L (and batch size B), B requests with fresh random prompts of L tokens run the whole
    walk together, in lockstep (every row proposes N and commits one token a step; their contexts grow by
    one token a step, about 3 x 10 steps past L); the median over the reps is kept, and at batch 1 the fastest
    and the slowest of them (`verify_s_min`, `verify_s_max`: decoder/cost/spread.py);
  - prefill_s(L): one request of a fresh random prompt of L tokens and one new token, timed whole.
The file says `"engine": "vllm"` and `"vllm_mode"`: `compiled` (vLLM's default compilation, the mode that
serves, and the default here) or `eager` (`--vllm-eager`); a profile written before the mode was recorded was
measured eager. Replay prices arms with it like the harness's and names the engine and the mode.
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
from decoder.cost.spread import spread_fields

# "n,n,n:reps:out_path"; <out_path>.batch holds the rows of the walk. Not OILBIRD_VLLM_PROFILE: that one
# names the proposer's profile file, which the settings check reads (data/capture/vllm_settings.py)
SCHEDULE_ENV = "OILBIRD_VLLM_PROFILE_SCHEDULE"


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
        self.rows = 1  # requests the walk runs together

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, *args: Any, **kwargs: Any) -> list[list[int]]:
        now = time.perf_counter()
        if len(sampled_token_ids) != self.rows:  # the walk's batch size (the parent sets it per walk) is read
            self.rows = _walk_rows(self.out)    # only when a step's rows differ: no file read in a timed step
        rows = self.rows
        if len(sampled_token_ids) != rows or not all(len(ids) for ids in sampled_token_ids):
            self.last = None  # a step that is not the walk's (a row prefilling, or finishing)
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
        draft = [self.vocab - 1 - (i % 7) for i in range(n)]  # ids at the vocabulary's end: never a greedy pick
        return [list(draft) for _ in range(rows)]


def _walk_rows(out: str) -> int:
    path = Path(out).with_suffix(".batch")
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 1


def measure_vllm_profile(model_dir: str, name: str, fingerprint: str, contexts: Sequence[int],
                         nodes: Sequence[int], reps: int, dtype: str = "float32", seed: int = 0,
                         progress=None, batch_sizes: Sequence[int] = (1,), eager: bool = False) -> dict:
    """The profile dict (decoder/cost/profile.py's format, with "engine": "vllm" and "vllm_mode": compiled (vLLM's
    default compilation, what serves) or eager; `verify_s_by_batch` when a batch size above 1 is asked for)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from data.capture.vllm_engine import (
        VLLM_VERSION,
        EngineConfig,
        make_llm,
        model_max_len,
        vllm_mode,
    )

    nodes = sorted({int(n) for n in nodes})
    batches = sorted({1, *(int(b) for b in batch_sizes)})
    top = max(nodes)
    limit = model_max_len(model_dir)
    steps = len(nodes) * (1 + reps) + 2 + (8 if batches[-1] > 1 else 0)  # rows may enter decoding a few steps apart
    if limit and max(contexts) + steps + top + 1 > limit:
        raise OilbirdError(f"context {max(contexts)} + {steps} profiled steps does not fit the model's {limit} positions")
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "steps.jsonl"
        os.environ[SCHEDULE_ENV] = f"{','.join(map(str, nodes))}:{reps}:{samples}"
        llm = make_llm(EngineConfig(model_dir, dtype=dtype, max_num_seqs=batches[-1], prefix_caching=False,
                                    enforce_eager=eager),
                       {"method": "custom_class", "model": "decoder.cost.vllm_profile.ProfileProposer",
                        "num_speculative_tokens": max(1, top)})
        vocab = llm.llm_engine.model_config.get_vocab_size()

        def prompt(n: int):
            return TokensPrompt(prompt_token_ids=rng.integers(3, max(4, vocab // 2), n).tolist())

        def walk(length: int, rows: int) -> list[tuple[float, float, float]]:
            """Per node count, the (median, fastest, slowest) seconds of a step verifying `rows` rows of that many
            draft tokens."""
            samples.with_suffix(".batch").write_text(str(rows))
            samples.unlink(missing_ok=True)
            llm.generate([prompt(length) for _ in range(rows)],
                         SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
            lines = [json.loads(line) for line in samples.read_text().splitlines()] if samples.exists() else []
            # each node count's first step is its warm-up (the schedule holds it 1 + reps steps)
            by: dict[int, list[float]] = {n: [] for n in nodes}
            held = 1 + reps
            for r in lines:
                if r["index"] % held != 0 and r["index"] < len(nodes) * held:
                    by[r["nodes"]].append(r["s"])
            missing = [n for n, v in by.items() if not v]
            if missing:
                raise OilbirdError(f"vLLM profile: no step measured for {missing} nodes at context {length}, "
                                   f"batch {rows}")
            return [(statistics.median(by[n]), min(by[n]), max(by[n])) for n in nodes]

        llm.generate([prompt(8)], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        verify_s, prefill_s, ends = [], {}, []  # ends: per context, (fastest, slowest) at each node count
        by_batch: dict[str, list[list[float]]] = {str(b): [] for b in batches if b > 1}
        for L in contexts:
            row = walk(L, 1)
            verify_s.append([m for m, _, _ in row])
            ends.append([(lo, hi) for _, lo, hi in row])
            for b in batches[1:]:
                by_batch[str(b)].append([m for m, _, _ in walk(L, b)])
            samples.with_suffix(".batch").write_text("1")
            t0 = time.perf_counter()
            llm.generate([prompt(L)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            prefill_s[L] = time.perf_counter() - t0
            if progress is not None:
                progress(L)
        llm = None  # the engine and its child process go before the profile is written
    import datetime
    import platform

    import torch

    lengths = sorted(prefill_s)
    return {"format": 1, "model": name, "model_fingerprint": fingerprint, "engine": "vllm",
            "engine_version": VLLM_VERSION, "vllm_mode": vllm_mode(eager), "device": "cuda" if torch.cuda.is_available() else "cpu", "device_name": platform.processor() or platform.machine(),
            "dtype": dtype, "threads": torch.get_num_threads(), "torch": torch.__version__, "batch_size": 1,
            "nodes": nodes, "contexts": list(contexts), "verify_s": verify_s, "prefill_lengths": lengths,
            "prefill_s": [prefill_s[p] for p in lengths], "reps": reps, **spread_fields(ends),
            **({"batch_sizes": batches, "verify_s_by_batch": by_batch} if by_batch else {}),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
