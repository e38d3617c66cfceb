"""`python -m decoder vllm-run`: one arm served by vLLM over a list of prompts, in this process (one engine).

    python -m decoder vllm-run --model DIR --prompts P.json --arm oilbird --k 8 --batch 4 --max-new 64 --out R.json

Arms: `vllm-greedy` (no speculation), `vllm-ngram` and `vllm-suffix` (vLLM's own methods at vLLM's
defaults; suffix is ArcticInference's SuffixDecoding), or any Oilbird arm (decoder/vllm/proposer.py).
Prompts: a JSON list of token-id lists, fed to vLLM as token ids (no template, no re-tokenising), greedy
(temperature 0), at most --max-new tokens each. `--batch B` runs them in waves of B concurrent requests
(the engine holds B rows), so every arm sees the same batches; `--batch 4,1` serves them at each size in turn
in one engine (the result's `by_batch`). `--sample N` then serves N sampled requests of one prompt
(`--temperature`, `--top-p`, request i seeded `--seed` + i; the result's `sampled`). vLLM runs at its default
compilation; `--eager` runs it eager (enforce_eager); the result's `vllm_mode` says which. Before the timed waves one warm-up request
(the first prompt's first 8 tokens, 4 new tokens) runs, so one-time compilation (vLLM's ngram JIT) is not
timed; with an Oilbird arm its 4-token trace enters the pool.
Writes R.json: the outputs, wall seconds of the timed waves, tokens/s, vLLM's spec-decode counters over the
timed waves (mean_acceptance_length = 1 + accepted / drafts), and the proposer's counters for Oilbird arms.
vLLM's metric registry is process-wide: run each arm in its own process (benchmarks/bench_vllm.py does).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from data.capture.vllm_engine import (
    EngineConfig,
    make_llm,
    model_max_len,
    require_vllm,
    spec_counters,
    vllm_mode,
)
from data.errors import OilbirdError, cli_entry
from data.readfile import read_json
from data.store.files import atomic_write_json

VLLM_ARMS = ("vllm-greedy", "vllm-ngram", "vllm-suffix")
WARMUP_PROMPT, WARMUP_NEW = 8, 4


def spec_config_for(arm: str, k: int, nodes: int, index: str, stats: str, profile: str = "") -> dict | None:
    """vLLM's speculative_config for an arm (None: plain greedy)."""
    if arm == "vllm-greedy":
        return None
    if arm == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if arm == "vllm-suffix":
        import importlib.util

        if importlib.util.find_spec("arctic_inference") is None:
            raise OilbirdError("vllm-suffix needs ArcticInference (make install builds arctic-inference==0.3.0)")
        return {"method": "suffix", "num_speculative_tokens": k}
    from decoder.vllm.proposer import speculative_config

    return speculative_config(arm, k, nodes=nodes, index=index, stats=stats, profile=profile)


def read_prompts(path: Path) -> list[list[int]]:
    prompts = read_json(path, "--prompts")
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and t >= 0 for t in p) for p in prompts):
        raise OilbirdError(f"{path}: expected a JSON list of non-empty token-id lists")
    return prompts


@dataclass(frozen=True)
class Sampling:
    """The sampled section of a run (`--sample N`): N requests of one prompt, temperature > 0, each seeded."""

    requests: int = 0  # 0: none (the run is greedy only)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0  # request i is seeded seed + i: a run is repeatable, every request draws its own tokens (< 0: none)
    prompt: int = 0  # which of the prompts
    max_new: int = 8
    batch: int = 16  # concurrent sampled requests

    def check(self, prompts: int) -> None:
        if self.requests < 0 or self.requests and (self.max_new < 1 or self.batch < 1):
            raise OilbirdError("--sample, --sample-max-new and --sample-batch must be at least 1")
        if self.requests and not (0 < self.temperature <= 10):
            raise OilbirdError(f"--temperature must be in (0, 10] (got {self.temperature}); greedy runs need no --sample")
        if not 0 < self.top_p <= 1:
            raise OilbirdError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.prompt < prompts:
            raise OilbirdError(f"--sample-prompt {self.prompt}: there are {prompts} prompts")

    def params(self):
        from vllm import SamplingParams

        return [SamplingParams(temperature=self.temperature, top_p=self.top_p,
                               seed=self.seed + i if self.seed >= 0 else None, max_tokens=self.max_new)
                for i in range(self.requests)]

    def record(self) -> dict:
        return {"requests": self.requests, "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "prompt": self.prompt, "max_new": self.max_new, "batch": self.batch}


def run_arm(model: str, prompts: list[list[int]], arm: str, k: int = 8, batch: int | Sequence[int] = 1,
            max_new: int = 64, nodes: int = 60, index: str = "auto", prefix_caching: bool = True,
            max_model_len: int | None = None, dtype: str = "float32", profile: str = "", eager: bool = False,
            sampling: Sampling = Sampling()) -> dict:
    """Serve `prompts` with one arm (module docstring); the result R.json holds. `batch` may list several
    batch sizes: one engine (max_num_seqs the largest) serves the prompts in waves of each, in turn; the result's
    top-level figures are the first's, `by_batch` holds each."""
    batches = [batch] if isinstance(batch, int) else list(batch)
    if not batches or min(batches) < 1:
        raise OilbirdError(f"--batch {batch}: batch sizes must be at least 1")
    sampling.check(len(prompts))
    if arm not in VLLM_ARMS:  # an Oilbird arm: every setting checked before vLLM loads (one line, no engine)
        from decoder.vllm.proposer import proposer_settings

        proposer_settings(arm=arm, k=k, nodes=nodes, index=index, profile=profile, stats="")
    require_vllm()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_model_len = max_model_len or model_max_len(model)
    longest = max(map(len, prompts)) + max(max_new, sampling.max_new) + k + 1
    if max_model_len and longest > max_model_len:
        raise OilbirdError(f"a prompt of {max(map(len, prompts))} tokens + {max_new} new does not fit "
                           f"max_model_len {max_model_len}")
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "proposer.json")
        spec = spec_config_for(arm, k, nodes, index, stats, profile)
        t0 = time.perf_counter()
        llm = make_llm(EngineConfig(model, dtype=dtype, max_model_len=max_model_len,
                                    max_num_seqs=max(batches + [sampling.batch if sampling.requests else 1]),
                                    prefix_caching=prefix_caching, enforce_eager=eager), spec)
        load_s = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:WARMUP_PROMPT])],
                     SamplingParams(temperature=0.0, max_tokens=WARMUP_NEW), use_tqdm=False)

        def waves(items: list, params, size: int) -> tuple[list[list[int]], dict, float]:
            before = spec_counters(llm)
            outputs: list[list[int]] = []
            t0 = time.perf_counter()
            for lo in range(0, len(items), size):
                wave = [TokensPrompt(prompt_token_ids=p) for p in items[lo:lo + size]]
                got = llm.generate(wave, params if not isinstance(params, list) else params[lo:lo + size],
                                   use_tqdm=False)
                outputs += [list(r.outputs[0].token_ids) for r in got]
            wall = time.perf_counter() - t0
            return outputs, spec_delta(before, spec_counters(llm)), wall

        by_batch = {}
        for b in batches:
            outputs, counters, wall = waves(prompts, greedy, b)
            generated = sum(map(len, outputs))
            by_batch[str(b)] = {"batch": b, "generated_tokens": generated, "wall_s": round(wall, 4),
                                "tok_s": round(generated / wall, 3) if wall > 0 else None, "spec": counters,
                                "outputs": outputs}
        sampled = None
        if sampling.requests:
            outputs, counters, wall = waves([prompts[sampling.prompt]] * sampling.requests, sampling.params(),
                                            sampling.batch)
            sampled = {**sampling.record(), "wall_s": round(wall, 4), "spec": counters, "outputs": outputs}
        # one more short request: vLLM tells a proposer that a request finished only at the next step, so this
        # one makes it see the last wave finish (they enter its pool and its stats are written whole)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:WARMUP_PROMPT])],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        proposer = read_json(stats, "the proposer's stats") if os.path.exists(stats) else None
        del llm
    first = by_batch[str(batches[0])]
    return {"arm": arm, "k": k if arm != "vllm-greedy" else 0, **first, "batches": batches, "requests": len(prompts),
            "max_new": max_new, "prefix_caching": prefix_caching, "vllm_mode": vllm_mode(eager),
            "load_s": round(load_s, 2), "proposer": proposer, "by_batch": by_batch, "sampled": sampled}


def spec_delta(before: dict, after: dict) -> dict:
    """vLLM's spec-decode counters between two readings (mean_acceptance_length as spec_counters defines it)."""
    counters = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    counters["mean_acceptance_length"] = (1 + counters["num_accepted_tokens"] / counters["num_drafts"]
                                          if counters["num_drafts"] else None)
    return counters


@cli_entry
def vllm_run_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decoder vllm-run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--prompts", required=True, type=Path, help="JSON list of token-id lists")
    ap.add_argument("--arm", required=True, help=f"{', '.join(VLLM_ARMS)} or an Oilbird arm (oilbird, ...)")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per row and step (default 8)")
    ap.add_argument("--batch", default="1", help="concurrent requests (default 1); several, comma-separated (4,1): "
                                                 "one engine serves the prompts at each in turn")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request at most (default 64)")
    ap.add_argument("--nodes", type=int, default=60, help="Oilbird arms: the tree's node budget (default 60)")
    ap.add_argument("--index", default="auto", help="Oilbird arms: the semantic key's index (default auto)")
    ap.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--profile", default="", help="Oilbird arms: the vLLM profile that sizes their chains (default: "
                                                  "none, a flat cost: every chain runs to k)")
    ap.add_argument("--eager", action="store_true",
                    help="vLLM in eager mode (enforce_eager); default: vLLM's default compilation")
    ap.add_argument("--sample", type=int, default=0, metavar="N",
                    help="after the greedy waves, N sampled requests of one prompt (--sample-prompt, default the first), "
                         "request i seeded --seed + i; their outputs go to the result's 'sampled'")
    ap.add_argument("--temperature", type=float, default=1.0, help="the sampled requests' temperature (default 1.0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the sampled requests' top_p (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="the first sampled request's seed (default 0; -1: unseeded)")
    ap.add_argument("--sample-prompt", type=int, default=0, help="which prompt the sampled requests repeat")
    ap.add_argument("--sample-max-new", type=int, default=8, help="new tokens per sampled request (default 8)")
    ap.add_argument("--sample-batch", type=int, default=16, help="concurrent sampled requests (default 16)")
    ap.add_argument("--out", required=True, type=Path, help="the result JSON")
    a = ap.parse_args(argv)
    try:
        batches = [int(b) for b in a.batch.split(",") if b.strip()]
    except ValueError:
        raise OilbirdError(f"--batch {a.batch!r}: write batch sizes as 4 or 4,1") from None
    for name, v in (("--k", a.k), ("--batch", min(batches, default=0)), ("--max-new", a.max_new), ("--nodes", a.nodes)):
        if v < 1:
            raise OilbirdError(f"{name} must be at least 1 (got {v})")
    if not Path(a.model).is_dir():
        raise OilbirdError(f"--model {a.model}: not a model directory")
    sampling = Sampling(a.sample, a.temperature, a.top_p, a.seed, a.sample_prompt, a.sample_max_new, a.sample_batch)
    result = run_arm(a.model, read_prompts(a.prompts), a.arm, a.k, batches, a.max_new, a.nodes, a.index,
                     a.prefix_caching == "on", a.max_model_len, a.dtype, a.profile, a.eager, sampling)
    atomic_write_json(a.out, result)
    return 0
