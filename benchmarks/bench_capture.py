"""`make bench-capture`: capture throughput (prompt and generated tokens/s), batch 1 vs batched, side by side.

Runs the same first N requests of a benchmark three ways: batch 1 with a fresh prefill each,
batch 1 reusing the previous prompt's KV for a shared start, and continuous batching at
--batch-size (with prefix reuse); checks the tokens are equal to batch 1, and extrapolates the full-benchmark capture time from the measured
rates. Usage: python benchmarks/bench_capture.py [--bench apibank] [--model smollm2-135m] [--limit 48]
[--batch-size 32] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from data.benchmarks import get_benchmark, load_requests
from data.capture import PrefixCache, greedy_batch
from data.errors import cli_entry
from data.models import LayerTap, encode_prompt, load_model


@torch.no_grad()
def prefill_rate(lm, tap, prompts) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        lm.model(input_ids=torch.tensor([p], device=lm.device), logits_to_keep=1)
        tap.take()
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    info = get_benchmark(args.bench)
    all_requests = load_requests(args.bench)
    requests = all_requests[:args.limit]
    max_new = args.max_new_tokens or info.max_new_tokens
    lm = load_model(args.model)
    prompts = [encode_prompt(lm, r.messages) for r in requests]
    print(f"{args.bench}: {len(requests)} of {len(all_requests)} requests, mean prompt "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens, model {args.model}, threads {torch.get_num_threads()}")
    with LayerTap(lm.model, lm.layer) as tap:
        rate_prefill = prefill_rate(lm, tap, prompts)
        t0 = time.perf_counter()
        single = greedy_batch(lm, tap, prompts, max_new, info.stop_strings, batch_size=1)
        t_single = time.perf_counter() - t0
        t0 = time.perf_counter()
        prefix = PrefixCache()
        reused = greedy_batch(lm, tap, prompts, max_new, info.stop_strings, prefix, batch_size=1)
        t_reuse = time.perf_counter() - t0
        t0 = time.perf_counter()
        batched = greedy_batch(lm, tap, prompts, max_new, info.stop_strings, PrefixCache(), batch_size=args.batch_size)
        t_batch = time.perf_counter() - t0
    gen = sum(len(g.tokens) for g in single)
    equal = sum(a.tokens == b.tokens for a, b in zip(single, batched))
    equal_reuse = sum(a.tokens == b.tokens for a, b in zip(single, reused))
    per_req_1 = t_single / len(requests)
    per_req_b = t_batch / len(requests)
    out = {
        "bench": args.bench, "model": args.model, "requests": len(requests), "generated_tokens": gen,
        "prompt_tokens_per_s": round(rate_prefill, 1),
        "batch1_generated_tokens_per_s": round(gen / t_single, 2), "batch1_seconds": round(t_single, 1),
        "batch1_prefix_reuse_seconds": round(t_reuse, 1),
        "prefix_reuse_over_batch1": round(t_single / t_reuse, 2),
        "prefix_reused_prompt_tokens": f"{prefix.reused_tokens}/{sum(map(len, prompts))}",
        "prefix_reuse_tokens_equal_batch1": f"{equal_reuse}/{len(requests)}",
        f"batch{args.batch_size}_generated_tokens_per_s": round(gen / t_batch, 2),
        f"batch{args.batch_size}_seconds": round(t_batch, 1),
        "batched_over_batch1": round(t_single / t_batch, 2),
        "batched_tokens_equal_batch1": f"{equal}/{len(requests)}",
        "stop_reasons": {r: sum(g.stop_reason == r for g in single) for r in ("eos", "stop_string", "length")},
        "extrapolated_full_capture_minutes_batch1": round(per_req_1 * len(all_requests) / 60, 1),
        "extrapolated_full_capture_minutes_batch1_prefix_reuse": round(t_reuse / len(requests) * len(all_requests) / 60, 1),
        f"extrapolated_full_capture_minutes_batch{args.batch_size}": round(per_req_b * len(all_requests) / 60, 1),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
