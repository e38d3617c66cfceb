"""`make bench-decode`: tau, tokens/s, speedup over ar and drafting overhead of every arm, side by side.

Serves API-Bank (first 100 requests) and GSM8K (first 50) with SmolLM2 on this machine's default
device (CPU here; on a CUDA machine the same command measures the GPU, reported separately by the
device column), every arm in one process, ar first, through `decoder.live.harness.run_decode`, so the
per-arm outputs also land under runs/<bench>/<model>/decode/<arm>/. Each arm's output is audited
token for token against ar (ar's round-1 tokens).

Two greedy references run by default: `ar` (our loop, one forward per token, dynamic cache) and
`ar-static` (transformers' generate with a static cache, compiled: the greedy decoder a GPU user runs;
decoder/verify/reference.py; --no-compile runs it eager). `--rounds R` (default 3): every arm serves each
benchmark R times, the arm order rotated each round (round r starts at arm r mod n, so round 1 starts
with ar), so machine drift spreads over every arm instead of landing in one ratio. Per round, speedup =
the arm's tok/s over that round's ar, vs fastest ar = over that round's faster of ar and ar-static. The
table prints each as the median over the rounds with [min-max]; tau, the audit and the time split come
from round 1; `--json` holds every summary (tokens_per_s_rounds, speedup_rounds,
speedup_vs_fastest_ar_rounds, their _range, round_order, rounds_identical).

`oilbird+graph` and `oilbird+eager` are the same arm through the graph verifier (fixed shapes, compiled in the
warm-up: decoder/verify/graph.py) and the eager one; the cost-aware arms are sized by this machine's harness
profile (--profile auto, measured once and cached; docs/decoder.md).

Drafting beside the verify (decoder/loop.py): `path ms` is the drafter's work per pass on the critical path,
`beside ms` what ran beside the verify (the previous pass's deferred bookkeeping; --overlap on, or auto with a
GPU); `oilbird+serial` is the same arm with that work before the verify, so the two sit side by side.
`--benches grid` serves the cross-benchmark grid's 8 benchmarks (data/benchmarks/registry.py GRID_BENCHES).

Usage: python benchmarks/bench_decode.py [--model smollm2-135m] [--benches apibank,gsm8k|grid]
[--apibank-limit 100] [--gsm8k-limit 50] [--limit N (every benchmark)] [--arms ar,ar-static,pld,...] [--nodes 60]
[--max-new-tokens N] [--rounds 3] [--no-compile] [--verifier auto|graph|eager] [--overlap auto|on|off]
[--profile auto|flat|PATH] [--out runs] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from data.benchmarks.registry import GRID_BENCHES
from data.capture.models import load_model
from data.errors import OilbirdError, cli_entry
from decoder.live.harness import DEFAULT_ARMS, DecodeConfig, run_decode
from decoder.live.results import with_range
from decoder.verify.reference import STATIC_ARM

# the harness's default arms with ar-static beside ar, and oilbird through both verifiers (decoder/verify/graph.py
# and the eager one), side by side in one run
BENCH_ARMS = (DEFAULT_ARMS[0], STATIC_ARM, *DEFAULT_ARMS[1:-1], "oilbird+graph", "oilbird+eager")
SPEED_HEADS = ("tok/s", "speedup", "vs fastest ar")


def speed_columns(rows: list[dict]) -> tuple[list[tuple[str, str, str]], list[int]]:
    """Per row: tok/s, speedup over ar and over the fastest ar, each the median [min-max] over the rounds;
    and each column's width."""
    cols = [(with_range(s, "tokens_per_s", 1), with_range(s, "speedup", 2, "x"),
             with_range(s, "speedup_vs_fastest_ar", 2, "x")) for s in rows]
    return cols, [max([len(h), *(len(c[i]) for c in cols)]) for i, h in enumerate(SPEED_HEADS)]


def speed_notes(rows: list[dict]) -> list[str]:
    """The lines under a table: how the speed columns are made, and any arm that decoded differently across rounds."""
    rounds = max([s.get("rounds") or 1 for s in rows] or [1])
    notes = [f"tok/s, speedup, vs fastest ar: median over {rounds} round(s) [min-max]; per round, the arm's tok/s over "
             f"that round's ar (speedup) and over the faster of ar and {STATIC_ARM} (vs fastest ar); arm order "
             "rotated each round"]
    static = [s for s in rows if s["arm"] == STATIC_ARM]
    notes += [f"{STATIC_ARM} ({s['bench']}): compiled {str(s.get('compiled')).lower()}" for s in static]
    notes += [f"warning: {s['bench']} {s['arm']} decoded differently in round(s) "
              f"{', '.join(str(m['round']) for m in s['round_mismatches'])} than in round 1"
              for s in rows if s.get("round_mismatches")]
    return notes


def lead_columns(rows: list[dict]) -> tuple[str, list[str]]:
    """The columns every bench table starts with (bench, arm, requests, tokens, tau and the speed columns): the
    header's start and each row's, widened to the longest benchmark and arm name."""
    width = max([10, *(len(s["arm"]) for s in rows)])
    bw = max([8, *(len(s["bench"]) for s in rows)])
    cols, w = speed_columns(rows)
    head = (f"{'bench':<{bw}} {'arm':<{width}} {'req':>4} {'tokens':>7} {'tau':>6} {SPEED_HEADS[0]:>{w[0]}} "
            f"{SPEED_HEADS[1]:>{w[1]}} {SPEED_HEADS[2]:>{w[2]}}")
    return head, [f"{s['bench']:<{bw}} {s['arm']:<{width}} {s['requests']:>4} {s['generated_tokens']:>7} "
                  f"{s['tau']:>6.2f} {tok:>{w[0]}} {speedup:>{w[1]}} {fastest:>{w[2]}}"
                  for s, (tok, speedup, fastest) in zip(rows, cols)]


def table(rows: list[dict]) -> str:
    head, leads = lead_columns(rows)
    head += f" {'overhead':>9} {'draft':>6} {'update':>7} {'path ms':>8} {'beside ms':>9} {'lossless':>9}"
    lines = [head, "-" * len(head)]
    for s, lead in zip(rows, leads):
        audit = s["lossless"]
        lines.append(f"{lead} {100 * s['overhead_fraction']:>8.1f}% "
                     f"{100 * s['draft_fraction']:>5.1f}% {100 * s['update_fraction']:>6.1f}% "
                     f"{_per_pass(s, 'critical_path_s'):>8} {_per_pass(s, 'beside_verify_s'):>9} "
                     f"{audit['matched']:>4}/{audit['requests']:<4}")
    notes = ["path ms / beside ms: the drafter's work per pass on the critical path, and beside the verify (the previous "
             "pass's deferred bookkeeping, where the verifier overlaps: --overlap, arm+serial)"]
    return "\n".join(lines + speed_notes(rows) + notes)


def _per_pass(summary: dict, key: str) -> str:
    drafting, passes = summary.get("drafting"), summary.get("passes") or 0
    if not drafting or not passes:
        return "-"
    return f"{1000 * drafting[key] / passes:.3f}"


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--apibank-limit", type=int, default=100)
    ap.add_argument("--gsm8k-limit", type=int, default=50)
    ap.add_argument("--limit", type=int, default=None, help="overrides every per-benchmark limit")
    ap.add_argument("--benches", default="apibank,gsm8k",
                    help="comma-separated benchmarks, or grid (the cross-benchmark grid's 8: "
                         f"{','.join(GRID_BENCHES)}); a benchmark other than apibank and gsm8k takes --limit "
                         "(default 50)")
    ap.add_argument("--arms", default=None,
                    help="comma-separated (default: ar, ar-static, the lexical baselines and oilbird)")
    add_serve_args(ap)
    args = ap.parse_args(argv)

    arms = tuple(args.arms.split(",")) if args.arms else BENCH_ARMS
    benches = GRID_BENCHES if args.benches == "grid" else tuple(b.strip() for b in args.benches.split(",") if b.strip())
    if not benches:
        raise OilbirdError("--benches is empty")
    own = {"apibank": args.apibank_limit, "gsm8k": args.gsm8k_limit}
    limits = {b: args.limit if args.limit is not None else own.get(b, 50) for b in benches}
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
    ap.add_argument("--rounds", type=int, default=3,
                    help="serve each benchmark R times with every arm, the order rotated each round; tok/s and "
                         "speedups are medians over the rounds [min-max] (default 3)")
    ap.add_argument("--no-compile", action="store_true", help="ar-static without torch.compile (static cache, eager)")
    ap.add_argument("--json", default=None, help="also write every summary here")
    ap.add_argument("--verifier", default="auto", choices=("auto", "graph", "eager"),
                    help="the verifier of arms written without +graph/+eager (default auto: graph on a GPU)")
    ap.add_argument("--profile", default="auto", metavar="PATH|auto|flat",
                    help="what sizes the cost-aware arms (default auto: this machine's harness profile)")
    ap.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                    help="the previous pass's bookkeeping beside the verify (on), before it (off), or on with a GPU "
                         "only (auto, default); an arm+serial runs with it off")


def serve(args, limits: dict, arms: tuple[str, ...], legend: str = "") -> list[dict]:
    """Load the model once, run every arm on each (benchmark, limit), print the device line; summaries."""
    if args.rounds < 1:  # before the model loads
        raise OilbirdError(f"--rounds must be at least 1 (got {args.rounds})")
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    device = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"model {args.model} ({lm.dtype}), device {device}, arms {','.join(arms)}, nodes {args.nodes}, "
          f"rounds {args.rounds}", flush=True)
    rows = []
    t0 = time.perf_counter()
    for bench, limit in limits.items():
        cfg = DecodeConfig(bench=bench, model=args.model, arms=arms, limit=limit, nodes=args.nodes,
                           max_new_tokens=args.max_new_tokens, out=args.out, dtype=args.dtype, device=args.device,
                           rounds=args.rounds, static_compile=False if args.no_compile else None,
                           verifier=args.verifier, profile=args.profile, overlap=args.overlap)
        rows += list(run_decode(cfg, lm=lm).values())
    if legend:
        print(legend)
    print(f"device: {device}; wall {time.perf_counter() - t0:.0f} s; outputs under {args.out}/<bench>/{lm.slug}/decode/")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rounds": args.rounds, "summaries": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    sys.exit(main())
