"""`make bench-oilbird`: Oilbird against its hosts and its ablations, with the sole-source share.

Serves each benchmark (default: API-Bank first 200 requests, then GSM8K first 50 as the control) with
SmolLM2 through `decoder.live.harness.run_decode` (ar first, every arm audited token for token against it;
per-arm outputs under runs/<bench>/<model>/decode/<arm>/) and prints per arm: tau, tokens/s, speedup over
ar and over the faster of ar and ar-static (transformers' generate with a static cache, compiled; run by
default beside ar), each the median over `--rounds R` rounds (default 3, the arm order rotated each round,
bench_decode.py) with [min-max], the sole-source share (the paper's: accepted tokens only the
semantic source proposed / all committed tokens, bonus tokens included), the retrieval cost as a fraction of cycle time (the key's queries + the ring buffer's
lookups, timed inside the drafter, over draft + verify + update time), the drafting overhead, and
the semantic store's bytes per generated token (float16 state + token + row pointers).

Usage: python benchmarks/bench_oilbird.py [--bench apibank,gsm8k] [--limit 200,50] [--model smollm2-135m]
[--arms ar,ar-static,recycling,...] [--max-new-tokens N] [--nodes 60] [--rounds 3] [--no-compile] [--out runs]
[--json PATH]
"""

from __future__ import annotations

import argparse
import sys

from bench_decode import (  # benchmarks/ is on sys.path
    add_serve_args,
    lead_columns,
    serve,
    speed_notes,
)

from data.benchmarks.registry import get_benchmark
from data.errors import OilbirdError, cli_entry

DEFAULT_ARMS = ("ar", "ar-static", "recycling", "sam", "suffix", "lexical", "oilbird", "oilbird-no-semantic",
                "semantic-only", "semantic-null", "oilbird-root-attached", "oilbird-request-key", "oilbird-fixed-depth", "pld",
                "pld+key", "recycling+key")


def _pct(x) -> str:
    return f"{100 * x:>6.1f}%" if isinstance(x, (int, float)) else f"{'-':>7}"


def table(rows: list[dict]) -> str:
    head, leads = lead_columns(rows)
    head += f" {'sole':>7} {'retrieval':>9} {'overhead':>8} {'B/token':>8} {'lossless':>9}"
    lines = [head, "-" * len(head)]
    for s, lead in zip(rows, leads):
        audit = s["lossless"]
        share = s.get("sole_source_share")
        bpt = s.get("store_bytes_per_token")
        lines.append(f"{lead} {_pct(share and share['value'])} {_pct(s.get('retrieval_fraction')):>9} "
                     f"{_pct(s['overhead_fraction']):>8} {(f'{bpt:.0f}' if bpt else '-'):>8} "
                     f"{audit['matched']:>4}/{audit['requests']:<4}")
    return "\n".join(lines + speed_notes(rows))


def parse_limits(text: str, n: int) -> list[int | None]:
    parts = [p.strip() for p in text.split(",")] if text else []
    if len(parts) == 1:
        parts = parts * n
    if len(parts) != n:
        raise OilbirdError(f"--limit gives {len(parts)} values for {n} benchmarks; give one, or one per benchmark")
    try:
        limits = [None if p in ("", "all") else int(p) for p in parts]
    except ValueError:
        raise OilbirdError(f"--limit must be integers or 'all' (got {text!r})") from None
    if any(x is not None and x < 1 for x in limits):
        raise OilbirdError("limits must be at least 1")
    return limits


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="apibank,gsm8k", help="comma-separated benchmarks (default apibank,gsm8k)")
    ap.add_argument("--limit", default="200,50", help="first N requests: one value, or one per benchmark")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help="comma-separated arms (ar always runs first; ar-static: the compiled generate reference)")
    add_serve_args(ap)
    args = ap.parse_args(argv)

    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    if not benches:
        raise OilbirdError("--bench is empty")
    limits = parse_limits(args.limit, len(benches))
    for bench in benches:
        get_benchmark(bench)  # an unknown name fails here, before the model loads
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    rows = serve(args, dict(zip(benches, limits)), arms,
                 legend="sole = accepted tokens only the semantic source proposed / all committed tokens "
                        "(bonus included); retrieval = key + ring-buffer time / cycle time; B/token = semantic store "
                        "bytes per pooled token")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
