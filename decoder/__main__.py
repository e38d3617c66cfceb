"""`python -m decoder --bench B --model M --arms ar,sam,lexical`: serve a benchmark with every arm, side by side."""

from __future__ import annotations

import argparse
import sys

from data.errors import cli_entry


def _known_arms() -> list[str]:
    from decoder.harness import REFERENCE_ARM, library_drafters

    return [REFERENCE_ARM, *library_drafters()]


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m decoder",
        description="Serve a benchmark in order with each arm (ar first, the reference), writing "
                    "runs/<bench>/<model>/decode/<arm>/{cycles.parquet,requests.parquet,summary.json}.")
    p.add_argument("--bench", required=True, help="benchmark name (python -m data list) or jsonl:PATH")
    p.add_argument("--model", default="smollm2-135m", help="HF id, local dir, or alias smollm2-135m | stories260k")
    p.add_argument("--arms", default=None,
                   help="comma-separated arms (default: all of them); ar is always run first")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--nodes", type=int, default=60, help="draft node budget per verification pass (default 60)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="token cap (default: the benchmark's)")
    p.add_argument("--out", default="runs", help="output root (default runs/)")
    p.add_argument("--warm-from", default=None, metavar="STORE",
                   help="a captured trace store (runs/<bench>/<model>/traces) whose requests start every pool")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 CPU, bf16 CUDA)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from decoder.harness import DecodeConfig, format_table, run_decode

    arms = tuple(args.arms.split(",")) if args.arms is not None else tuple(_known_arms())
    cfg = DecodeConfig(bench=args.bench, model=args.model, arms=arms, limit=args.limit, nodes=args.nodes,
                       max_new_tokens=args.max_new_tokens, out=args.out, warm_from=args.warm_from,
                       dtype=args.dtype, device=args.device, progress=not args.quiet)
    summaries = run_decode(cfg)
    print(format_table(summaries))
    print(f"written: {next(iter(summaries.values()))['decode_dir']}/<arm>/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
