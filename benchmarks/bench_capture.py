"""`make bench-capture`: capture throughput (prompt and generated tokens/s), batch 1 vs batched, side by side.

Generate mode (default): runs the same first N requests of a benchmark three ways: batch 1 with a
fresh prefill each, batch 1 reusing the previous prompt's KV for a shared start, and continuous
batching at --batch-size (with prefix reuse); checks the tokens are equal to batch 1, and
extrapolates the full-benchmark capture time from the measured rates.

Reference mode (`--mode reference`, teacher-forced over the benchmark's references; default
benchmark taubench-retail): the same first N requests three ways: `cached` (the prefix cache of
--prefix-cache entries / --prefix-cache-mb, and logits only where the store needs them),
`keep-logits` (no reuse, logits only where needed) and `old` (the plain path, as `--prefix-cache 0`:
one full forward per request, logits at every position). The cached arm first runs alone, for its
peak RSS (ru_maxrss, which only grows); then the arms are timed interleaved request by request (the
arm order rotating), so a slow spell of a shared machine lands on all of them alike; the states and
top-8 of each are compared with `old`'s; last, a batching probe: the forward of one request's new tokens at batch 1 against the same
forward repeated over B rows (equal lengths, so no padding: batching's best case).

Usage: python benchmarks/bench_capture.py [--mode generate|reference] [--bench B] [--model smollm2-135m]
[--limit N] [--batch-size 32] [--max-new-tokens N] [--prefix-cache 4] [--prefix-cache-mb 1024]
[--arms cached,keep-logits,old] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from data.benchmarks.registry import get_benchmark, load_requests
from data.capture.greedy import PrefixCache, greedy_batch
from data.capture.models import LayerTap, cache_kwargs, encode_prompt, load_model
from data.capture.run import fit_prompts
from data.capture.teacher import (
    ReferencePrefixCache,
    reference_tokens,
    teacher_forced,
    teacher_forced_cached,
)
from data.errors import OilbirdError, cli_entry


@torch.no_grad()
def prefill_rate(lm, tap, prompts) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        lm.model(input_ids=torch.tensor([p], device=lm.device), logits_to_keep=1)
        tap.take()
    return sum(map(len, prompts)) / (time.perf_counter() - t0)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


REFERENCE_ARMS = ("cached", "keep-logits", "old")


def one_request(arm, lm, tap, prompt, ref, cache):
    if arm == "old":
        return teacher_forced(lm, tap, prompt, ref)  # today's path: full forward, logits everywhere
    return teacher_forced_cached(lm, tap, prompt, ref, cache if arm == "cached" else None)


def interleaved(arms, lm, tap, prompts, refs, cache):
    """Every arm over the same requests, request by request (the arm order rotating), so a slow
    spell of a shared machine lands on every arm alike; returns results and seconds per arm."""
    results = {a: [] for a in arms}
    seconds = dict.fromkeys(arms, 0.0)
    for i, (p, o) in enumerate(zip(prompts, refs)):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            t0 = time.perf_counter()
            results[arm].append(one_request(arm, lm, tap, p, o, cache))
            seconds[arm] += time.perf_counter() - t0
    return results, seconds


def compare(a, b) -> dict:
    """States and top-8 of two teacher-forced captures of the same requests."""
    import numpy as np

    tok = sum(x.tokens == y.tokens for x, y in zip(a, b))
    hid = max(max(float(np.abs(x.hidden - y.hidden).max(initial=0.0)),
                  float(np.abs(x.prompt_last_hidden - y.prompt_last_hidden).max())) for x, y in zip(a, b))
    rel = max(float(np.abs(x.hidden - y.hidden).max(initial=0.0)) / max(1e-9, float(np.abs(y.hidden).max(initial=0.0)))
              for x, y in zip(a, b))
    rows = sum(len(x.tokens) + 1 for x in a)
    top8 = sum(int((x.topk == y.topk).all(1).sum()) + int((x.prompt_last_topk == y.prompt_last_topk).all())
               for x, y in zip(a, b))
    top1 = sum(int((x.topk[:, 0] == y.topk[:, 0]).sum()) + int(x.prompt_last_topk[0] == y.prompt_last_topk[0])
               for x, y in zip(a, b))
    return {"tokens_equal": f"{tok}/{len(a)}", "max_abs_state_diff": float(f"{hid:.3g}"),
            "max_rel_state_diff": float(f"{rel:.3g}"), "top8_rows_equal": f"{top8}/{rows}",
            "top1_equal": f"{top1}/{rows}"}


@torch.no_grad()
def batching_probe(lm, tap, prompts, refs, widths=(1, 2, 4), repeats=3) -> dict:
    """The forward of one request's new tokens (after its shared prefix, as the cached arm runs it)
    at batch 1 against the same forward over B identical rows: no padding, batching's best case."""
    cache = ReferencePrefixCache(4, 1e9)
    probe = None
    for i, (p, o) in enumerate(zip(prompts, refs)):
        if i and cache._entries:
            seq = p + o
            reuse, _ = cache.begin(seq, len(p) - 1)
            if reuse:
                probe = (p, o)
                break
        teacher_forced_cached(lm, tap, p, o, cache)
    if probe is None:
        return {"note": "no request reuses an earlier prefix; probe skipped"}
    p, o = probe
    seq, keep = p + o, len(o) + 1
    out = {"request_new_tokens": None, "widths": {}}
    for width in widths:
        best = float("inf")
        for _ in range(repeats):
            reuse, kv = cache.begin(seq, len(p) - 1)
            for layer in kv.layers:
                layer.adopt(layer._kbuf.repeat(width, 1, 1, 1), layer._vbuf.repeat(width, 1, 1, 1), reuse)
            ids = torch.tensor([seq[reuse:]] * width, device=lm.device)
            pos = torch.arange(reuse, len(seq), device=lm.device)[None].expand(width, -1)
            t0 = time.perf_counter()
            lm.model(input_ids=ids, position_ids=pos, **cache_kwargs(lm.model, kv), use_cache=True, logits_to_keep=keep)
            best = min(best, time.perf_counter() - t0)
            tap.take()
            del kv
        out["request_new_tokens"] = len(seq) - reuse
        out["widths"][str(width)] = {"seconds_per_forward": round(best, 3),
                                     "seconds_per_request": round(best / width, 3)}
    base = out["widths"]["1"]["seconds_per_request"]
    for w in out["widths"].values():
        w["speedup_over_batch1"] = round(base / w["seconds_per_request"], 2)
    return out


def reference_main(args) -> int:
    bench = args.bench or "taubench-retail"
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in REFERENCE_ARMS]
    if bad or "old" not in arms or "cached" not in arms:
        raise OilbirdError(f"--arms: choose from {','.join(REFERENCE_ARMS)}, with cached and old")
    arms = [a for a in REFERENCE_ARMS if a in arms]
    all_requests = load_requests(bench)
    requests = all_requests[:args.limit]
    lm = load_model(args.model)
    refs = [reference_tokens(lm, r) for r in requests]
    prompts, truncated = fit_prompts(lm, requests, 1, None, refs)
    total_tokens = sum(len(p) + len(o) for p, o in zip(prompts, refs))
    print(f"{bench} (reference mode): {len(requests)} of {len(all_requests)} requests, mean prompt "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens, mean reference {sum(map(len, refs)) / len(refs):.1f}, "
          f"model {args.model}, threads {torch.get_num_threads()}, prefix cache {args.prefix_cache} entries / "
          f"{args.prefix_cache_mb:g} MB", file=sys.stderr)
    out = {"bench": bench, "mode": "reference", "model": args.model, "requests": len(requests),
           "benchmark_requests": len(all_requests), "prompt_tokens": sum(map(len, prompts)),
           "reference_tokens": sum(map(len, refs)), "threads": torch.get_num_threads(),
           "prefix_cache_bound": {"entries": args.prefix_cache, "mb": args.prefix_cache_mb},
           "peak_rss_mb": {"after_model_load": round(peak_rss_mb(), 1)}}
    with LayerTap(lm.model, lm.layer) as tap:
        with torch.no_grad():  # warm-up, so no arm pays the first forward's one-time costs
            lm.model(input_ids=torch.tensor([prompts[0][:32]], device=lm.device), logits_to_keep=1)
            tap.take()
        # 1. the cached arm alone first: its own peak memory (ru_maxrss only grows; the old arm's is higher)
        cache = ReferencePrefixCache(args.prefix_cache, args.prefix_cache_mb)
        t0 = time.perf_counter()
        alone = [one_request("cached", lm, tap, p, o, cache) for p, o in zip(prompts, refs)]
        out["cached_alone_seconds"] = round(time.perf_counter() - t0, 2)
        out["peak_rss_mb"]["after_cached_alone"] = round(peak_rss_mb(), 1)
        out["prefix_cache_peak_mb"] = round(cache.peak_bytes / 2**20, 1)
        reused = sum(g.prompt_tokens_reused for g in alone)
        out["cached_prompt_tokens_reused"] = f"{reused}/{out['prompt_tokens']}"
        out["cached_reuse_ratio"] = round(reused / out["prompt_tokens"], 4)
        out["cached_requests_with_reuse"] = f"{sum(g.prompt_tokens_reused > 0 for g in alone)}/{len(alone)}"
        print(f"  cached alone: {out['cached_alone_seconds']} s; now every arm, request by request", file=sys.stderr)
        del alone, cache
        # 2. the timed comparison, interleaved request by request (a fresh prefix cache)
        cache = ReferencePrefixCache(args.prefix_cache, args.prefix_cache_mb)
        results, seconds = interleaved(arms, lm, tap, prompts, refs, cache)
        out["peak_rss_mb"]["after_all_arms"] = round(peak_rss_mb(), 1)
        out["prefix_cache_entries_at_end"] = len(cache)
        del cache
        for arm in arms:
            secs = seconds[arm]
            out[f"{arm}_seconds"] = round(secs, 2)
            out[f"{arm}_requests_per_s"] = round(len(requests) / secs, 4)
            out[f"{arm}_tokens_per_s"] = round(total_tokens / secs, 1)
            print(f"  {arm}: {secs:.1f} s, {len(requests) / secs:.3f} requests/s", file=sys.stderr)
        for arm in arms:
            if arm != "old":
                out[f"{arm}_over_old"] = round(seconds["old"] / seconds[arm], 2)
                out[f"{arm}_vs_old"] = compare(results[arm], results["old"])
        if not args.no_batching_probe:
            out["batching_probe"] = batching_probe(lm, tap, prompts, refs)
            out["peak_rss_mb"]["after_batching_probe"] = round(peak_rss_mb(), 1)
    per_old, per_new = seconds["old"] / len(requests), seconds["cached"] / len(requests)
    out["old_seconds_per_request"] = round(per_old, 2)
    out["cached_seconds_per_request"] = round(per_new, 2)
    out["extrapolated_full_benchmark_minutes_old"] = round(per_old * len(all_requests) / 60, 1)
    out["extrapolated_full_benchmark_minutes_cached_upper_bound"] = round(per_new * len(all_requests) / 60, 1)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["generate", "reference"], default="generate")
    ap.add_argument("--bench", default=None, help="default apibank (generate), taubench-retail (reference)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=None, help="first N requests (default 48 generate, 100 reference)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--prefix-cache", type=int, default=4, help="reference mode: prefix cache entries (default 4)")
    ap.add_argument("--prefix-cache-mb", type=float, default=1024.0, help="reference mode: its bound in MB")
    ap.add_argument("--arms", default=",".join(REFERENCE_ARMS), help="reference mode: which arms (cached and old required)")
    ap.add_argument("--no-batching-probe", action="store_true", help="reference mode: skip the batching probe")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.mode == "reference":
        if args.prefix_cache < 1:
            raise OilbirdError("--prefix-cache: the cached arm needs at least 1 entry (the old arm is the 0 case)")
        args.limit = 100 if args.limit is None else args.limit
        return reference_main(args)
    args.bench = args.bench or "apibank"
    args.limit = 48 if args.limit is None else args.limit

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
