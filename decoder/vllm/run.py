"""`python -m decoder vllm-run`: one arm served by vLLM over a list of prompts, in this process (one engine).

    python -m decoder vllm-run --model DIR --prompts P.json --arm oilbird --k 8 --batch 4 --max-new 64 --out R.json

Arms: `vllm-greedy` (no speculation), `vllm-ngram` and `vllm-suffix` (vLLM's own methods at vLLM's
defaults; suffix is ArcticInference's SuffixDecoding), or any Oilbird arm (decoder/vllm/proposer.py).
Prompts: a JSON list of token-id lists, fed to vLLM as token ids (no template, no re-tokenising), greedy
(temperature 0), at most --max-new tokens each. `--batch B` runs them in waves of B concurrent requests
(the engine holds B rows), so every arm sees the same batches. Before the timed waves one warm-up request
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
from pathlib import Path

from data.capture.vllm_engine import (
    EngineConfig,
    make_llm,
    model_max_len,
    require_vllm,
    spec_counters,
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


def run_arm(model: str, prompts: list[list[int]], arm: str, k: int = 8, batch: int = 1, max_new: int = 64,
            nodes: int = 60, index: str = "auto", prefix_caching: bool = True, max_model_len: int | None = None,
            dtype: str = "float32", profile: str = "") -> dict:
    """Serve `prompts` with one arm (module docstring); the result R.json holds."""
    if arm not in VLLM_ARMS:  # an Oilbird arm: every setting checked before vLLM loads (one line, no engine)
        from decoder.vllm.proposer import proposer_settings

        proposer_settings(arm=arm, k=k, nodes=nodes, index=index, profile=profile, stats="")
    require_vllm()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    max_model_len = max_model_len or model_max_len(model)
    longest = max(map(len, prompts)) + max_new + k + 1
    if max_model_len and longest > max_model_len:
        raise OilbirdError(f"a prompt of {max(map(len, prompts))} tokens + {max_new} new does not fit "
                           f"max_model_len {max_model_len}")
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "proposer.json")
        spec = spec_config_for(arm, k, nodes, index, stats, profile)
        t0 = time.perf_counter()
        llm = make_llm(EngineConfig(model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=batch,
                                    prefix_caching=prefix_caching), spec)
        load_s = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0.0, max_tokens=max_new)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:WARMUP_PROMPT])],
                     SamplingParams(temperature=0.0, max_tokens=WARMUP_NEW), use_tqdm=False)
        before = spec_counters(llm)
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for lo in range(0, len(prompts), batch):
            wave = [TokensPrompt(prompt_token_ids=p) for p in prompts[lo:lo + batch]]
            for r in llm.generate(wave, greedy, use_tqdm=False):
                outputs.append(list(r.outputs[0].token_ids))
        wall = time.perf_counter() - t0
        after = spec_counters(llm)
        counters = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        counters["mean_acceptance_length"] = (1 + counters["num_accepted_tokens"] / counters["num_drafts"]
                                              if counters["num_drafts"] else None)
        proposer = read_json(stats, "the proposer's stats") if os.path.exists(stats) else None
        del llm
    generated = sum(map(len, outputs))
    return {"arm": arm, "k": k if arm != "vllm-greedy" else 0, "batch": batch, "requests": len(prompts),
            "max_new": max_new, "prefix_caching": prefix_caching, "generated_tokens": generated,
            "wall_s": round(wall, 4), "tok_s": round(generated / wall, 3) if wall > 0 else None,
            "load_s": round(load_s, 2), "spec": counters, "proposer": proposer, "outputs": outputs}


@cli_entry
def vllm_run_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m decoder vllm-run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--prompts", required=True, type=Path, help="JSON list of token-id lists")
    ap.add_argument("--arm", required=True, help=f"{', '.join(VLLM_ARMS)} or an Oilbird arm (oilbird, ...)")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per row and step (default 8)")
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests (default 1)")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per request at most (default 64)")
    ap.add_argument("--nodes", type=int, default=60, help="Oilbird arms: the tree's node budget (default 60)")
    ap.add_argument("--index", default="auto", help="Oilbird arms: the semantic key's index (default auto)")
    ap.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's own")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--profile", default="", help="Oilbird arms: the vLLM profile that sizes their chains (default: "
                                                  "none, a flat cost: every chain runs to k)")
    ap.add_argument("--out", required=True, type=Path, help="the result JSON")
    a = ap.parse_args(argv)
    for name, v in (("--k", a.k), ("--batch", a.batch), ("--max-new", a.max_new), ("--nodes", a.nodes)):
        if v < 1:
            raise OilbirdError(f"{name} must be at least 1 (got {v})")
    if not Path(a.model).is_dir():
        raise OilbirdError(f"--model {a.model}: not a model directory")
    result = run_arm(a.model, read_prompts(a.prompts), a.arm, a.k, a.batch, a.max_new, a.nodes, a.index,
                     a.prefix_caching == "on", a.max_model_len, a.dtype, a.profile)
    atomic_write_json(a.out, result)
    return 0
