"""`make bench-numerics`: how far tree scoring moves the logits from one-token scoring, per dtype.

The lossless audit (decoder/verify/audit.py) calls a mismatch `numeric` when both logit gaps at the first
differing position are within T = NUMERIC_MARGIN[dtype]. This script measures what T must cover:
for each request, greedy decoding (decode_greedy, one token a forward) records the top-2 logit gap
(a = its token, c = the runner-up) at every position; then the same tokens are re-scored the way a
speculative arm scores them, in tree passes of 2, 8, 32 and 60 chained nodes in turn over the same
cache convention, and |delta| = |(l_tree(a) - l_tree(c)) - (l_ar(a) - l_ar(c))| is taken at every
position. It prints per dtype: positions, flips (the tree's argmax differs from greedy's token),
|delta| median / p99 / p99.9 / max, the largest greedy top-2 gap among flipped positions, and the
threshold the audit uses beside twice the measured max.

Usage: python benchmarks/bench_numerics.py [--model smollm2-135m] [--bench apibank] [--limit 8]
[--max-new-tokens 96] [--dtypes float32,bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from data.benchmarks.registry import get_benchmark, load_requests
from data.capture.models import encode_prompt, load_model
from data.errors import OilbirdError, cli_entry
from decoder.verify.audit import NUMERIC_MARGIN
from decoder.verify.engine import _new_cache, decode_greedy, prefill, stop_rule, verify_tree
from decoder.verify.tree import compact_cache

CHAIN_LENGTHS = (2, 8, 32, 60)  # tree sizes of the re-scoring passes, in turn (arms verify up to 60 nodes)


@torch.no_grad()
def rescore(lm, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits [n, V] of each greedy token's choosing row, scored in chained tree passes."""
    cache = _new_cache()
    prefill(lm.model, cache, prompt)
    context, rows, done, k = list(prompt), [], 0, 0
    while done < len(tokens):
        chain = tokens[done:done + CHAIN_LENGTHS[k % len(CHAIN_LENGTHS)]]
        done, k = done + len(chain), k + 1
        past_len = len(context) - 1
        fwd = verify_tree(lm.model, cache, past_len, context[-1], chain, list(range(-1, len(chain) - 1)))
        rows.append(fwd.logits[:len(chain)].cpu().numpy())  # row j chose chain[j]
        compact_cache(cache, past_len, list(range(len(chain))))  # anchor + all but the last node
        context.extend(chain)
    return np.concatenate(rows)


def measure(model: str, dtype: str, bench: str, limit: int, max_new: int) -> dict:
    lm = load_model(model, dtype=dtype)
    info = get_benchmark(bench)
    stop = stop_rule(lm, info.stop_strings, max_new)
    deltas, flips, flip_gaps = [], 0, []
    t0 = time.perf_counter()
    for req in load_requests(bench, limit):
        prompt = encode_prompt(lm, req.messages)
        g = decode_greedy(lm, prompt, stop)
        tree = rescore(lm, prompt, g.tokens)
        a, c = g.chosen_ids[:, 0], g.chosen_ids[:, 1]
        gap_ar = g.chosen_logits[:, 0] - g.chosen_logits[:, 1]
        idx = np.arange(len(g.tokens))
        gap_tree = tree[idx, a] - tree[idx, c]
        deltas.append(np.abs(gap_tree - gap_ar))
        flipped = tree.argmax(-1) != np.asarray(g.tokens)
        flips += int(flipped.sum())
        flip_gaps += gap_ar[flipped].tolist()
    d = np.concatenate(deltas)
    return {"dtype": dtype, "positions": int(d.size), "flips": flips,
            "delta_median": float(np.median(d)), "delta_p99": float(np.quantile(d, 0.99)),
            "delta_p999": float(np.quantile(d, 0.999)), "delta_max": float(d.max()),
            "max_gap_of_flips": max(flip_gaps) if flip_gaps else None,
            "threshold": NUMERIC_MARGIN.get(dtype), "twice_max": 2 * float(d.max()),
            "seconds": time.perf_counter() - t0}


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in NUMERIC_MARGIN for d in dtypes):
        raise OilbirdError(f"--dtypes takes names from {', '.join(NUMERIC_MARGIN)} (got {args.dtypes!r})")
    if args.limit < 1 or args.max_new_tokens < 1:
        raise OilbirdError("--limit and --max-new-tokens must be at least 1")
    rows = [measure(args.model, d, args.bench, args.limit, args.max_new_tokens) for d in dtypes]
    fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    print(f"{'dtype':<9} {'positions':>9} {'flips':>5} {'|d| med':>8} {'p99':>8} {'p99.9':>8} {'max':>8} "
          f"{'flip gap':>8} {'2*max':>8} {'T':>8}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['positions']:>9} {r['flips']:>5} {fmt(r['delta_median']):>8} "
              f"{fmt(r['delta_p99']):>8} {fmt(r['delta_p999']):>8} {fmt(r['delta_max']):>8} "
              f"{fmt(r['max_gap_of_flips']):>8} {fmt(r['twice_max']):>8} {fmt(r['threshold']):>8}")
    print(f"model {args.model}, {args.bench} first {args.limit} requests, cap {args.max_new_tokens}, "
          f"device cpu ({torch.get_num_threads()} threads)" if not torch.cuda.is_available() else "device cuda")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bench": args.bench, "limit": args.limit, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
