"""`make bench-decode`: tau, tokens/s, speedup over ar and drafting overhead of every arm, side by side.

Serves API-Bank (first 100 requests) and GSM8K (first 50) with SmolLM2 on this machine's default
device (CPU here; on a CUDA machine the same command measures the GPU, reported separately by the
device column), every arm in one process, ar first, through `decoder.harness.run_decode`, so the
per-arm outputs also land under runs/<bench>/<model>/decode/<arm>/. Each arm's output is audited
token for token against ar.

Usage: python benchmarks/bench_decode.py [--model smollm2-135m] [--apibank-limit 100]
[--gsm8k-limit 50] [--limit N (both)] [--arms ar,pld,...] [--nodes 60] [--max-new-tokens N]
[--out runs] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from data.errors import OilbirdError, cli_entry
from data.models import load_model
from decoder.harness import DEFAULT_ARMS, DecodeConfig, run_decode


def table(rows: list[dict]) -> str:
    head = (f"{'bench':<8} {'arm':<10} {'req':>4} {'tokens':>7} {'tau':>6} {'tok/s':>7} {'speedup':>8} "
            f"{'overhead':>9} {'draft':>6} {'update':>7} {'lossless':>9}")
    lines = [head, "-" * len(head)]
    for s in rows:
        audit = s["lossless"]
        lines.append(f"{s['bench']:<8} {s['arm']:<10} {s['requests']:>4} {s['generated_tokens']:>7} {s['tau']:>6.2f} "
                     f"{s['tokens_per_s']:>7.1f} {s['speedup']:>7.2f}x {100 * s['overhead_fraction']:>8.1f}% "
                     f"{100 * s['draft_fraction']:>5.1f}% {100 * s['update_fraction']:>6.1f}% "
                     f"{audit['matched']:>4}/{audit['requests']:<4}")
    return "\n".join(lines)


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--apibank-limit", type=int, default=100)
    ap.add_argument("--gsm8k-limit", type=int, default=50)
    ap.add_argument("--limit", type=int, default=None, help="overrides both per-benchmark limits")
    ap.add_argument("--arms", default=None, help="comma-separated (default: ar, the lexical baselines and oilbird)")
    add_serve_args(ap)
    args = ap.parse_args(argv)

    arms = tuple(args.arms.split(",")) if args.arms else DEFAULT_ARMS
    limits = {"apibank": args.apibank_limit, "gsm8k": args.gsm8k_limit}
    if args.limit is not None:
        limits = {b: args.limit for b in limits}
    if any(n < 1 for n in limits.values()):
        raise OilbirdError("limits must be at least 1")
    rows = serve(args, limits, arms)
    print(table(rows))
    return 0


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    """The options `serve` reads, shared with bench_oilbird.py."""
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: each benchmark's cap")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None, help="also write every summary here")


def serve(args, limits: dict, arms: tuple[str, ...], legend: str = "") -> list[dict]:
    """Load the model once, run every arm on each (benchmark, limit), print the device line; summaries."""
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    device = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"model {args.model} ({lm.dtype}), device {device}, arms {','.join(arms)}, nodes {args.nodes}", flush=True)
    rows = []
    t0 = time.perf_counter()
    for bench, limit in limits.items():
        cfg = DecodeConfig(bench=bench, model=args.model, arms=arms, limit=limit, nodes=args.nodes,
                           max_new_tokens=args.max_new_tokens, out=args.out, dtype=args.dtype, device=args.device)
        rows += list(run_decode(cfg, lm=lm).values())
    if legend:
        print(legend)
    print(f"device: {device}; wall {time.perf_counter() - t0:.0f} s; outputs under {args.out}/<bench>/{lm.slug}/decode/")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "summaries": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(main())
