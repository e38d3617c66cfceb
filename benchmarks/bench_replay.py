"""`make bench-replay`: replay over the `make census` store, timed, against the issue's targets.

Runs `decoder.replay.run.run_replay` over runs/<bench>/<model>/traces (default: the API-Bank store of
`make census BENCH=apibank`, pool past, all requests) and prints, measured in this one run:
  - the wall time of replaying the four decision arms (suffix, lexical, oilbird, oilbird-no-semantic)
    in one command (target: at most 3 minutes on 2 cores);
  - per arm: tau [95% request-bootstrap interval], the drafting time per pass and its share of the
    estimated cycle time (target: at most 3%; needs a profile, `python -m decoder profile`);
  - our `suffix` arm against the published SuffixDecoding cache (ArcticInference's C++ tree) replayed
    over the same API-Bank store (534 requests, 67,324 tokens, cap 256): tau 6.32 in path mode at
    vLLM's default spec factor 1.0, 8.05 in tree mode at factor 4 (quoted figures, brief "Known facts");
  - `oilbird` against the best of suffix, sam, lexical (target: at least 1.25x; `sam` is replayed in a
    second, untimed call when it is not among --arms).

Usage: python benchmarks/bench_replay.py [--bench apibank] [--model smollm2-135m] [--out runs]
       [--arms suffix,lexical,oilbird,oilbird-no-semantic] [--limit N] [--nodes 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from data.errors import OilbirdError, cli_entry
from data.store.layout import bench_replay_dir, model_slug
from decoder.policy import DECISION_ARMS, TARGET_RATIO
from decoder.replay.run import ReplayConfig, run_replay
from decoder.replay.table import format_table

PUBLISHED_SUFFIX = {"path mode, spec factor 1.0": 6.32, "tree mode, spec factor 4": 8.05}
TARGET_SECONDS = 180.0
TARGET_DRAFT_FRACTION = 0.03


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--arms", default=",".join(DECISION_ARMS))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not arms:
        raise OilbirdError("--arms is empty")

    def replay(arm_list, quiet=False):
        # written beside, never over, the replay/ the reports read (a --limit run would cut it short)
        folder = bench_replay_dir(args.out, args.bench, model_slug(args.model))
        cfg = ReplayConfig(bench=args.bench, model=args.model, arms=arm_list, nodes=(args.nodes,), limit=args.limit,
                           out=args.out, jobs=args.jobs, progress=not quiet, results_dir=str(folder))
        t0 = time.perf_counter()
        out = run_replay(cfg)
        return out, time.perf_counter() - t0

    summaries, seconds = replay(arms)
    extra = tuple(a for a in ("sam",) if a not in arms)
    if extra:
        more, _ = replay(extra, quiet=True)
        summaries.update(more)
    print(format_table(summaries))
    first = next(iter(summaries.values()))
    print(f"\nstore: {first['store']} ({first['requests']} requests, {first['generated_tokens']:,} tokens, "
          f"cap {first['max_new_tokens']}, pool {first['pool']})")
    verdict = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    print(f"replay of {','.join(arms)} in one command: {seconds:.1f} s "
          f"(target <= {TARGET_SECONDS:.0f} s: {verdict(seconds <= TARGET_SECONDS)})")
    figures = {"seconds": seconds, "arms": list(arms), "requests": first["requests"],
               "generated_tokens": first["generated_tokens"], "per_arm": {}}
    for (arm, nodes), s in summaries.items():
        est = s.get("estimate") or {}
        frac = est.get("draft_fraction")
        figures["per_arm"][arm] = {"tau": s["tau"], "draft_s_per_pass": s["draft_s_per_pass"]["mean"],
                                   "draft_fraction": frac, "speedup": est.get("speedup"),
                                   "sole_source_share": (s.get("sole_source_share") or {}).get("value")}
        if frac is None:
            print(f"  {arm}: drafting share of cycle time n/a (no profile)")
        else:
            print(f"  {arm}: drafting {1000 * s['draft_s_per_pass']['mean']:.3f} ms/pass = {100 * frac:.2f}% of the "
                  f"estimated cycle (target <= 3%: {verdict(frac <= TARGET_DRAFT_FRACTION)})")
    tau = {arm: s["tau"]["value"] for (arm, _), s in summaries.items()}
    if "suffix" in tau:
        for mode, ref in PUBLISHED_SUFFIX.items():
            print(f"suffix tau {tau['suffix']:.2f} vs published SuffixDecoding {ref:.2f} ({mode}): "
                  f"{tau['suffix'] / ref:.2f}x ({verdict(tau['suffix'] >= ref)})")
    lexical = {a: tau[a] for a in ("suffix", "sam", "lexical") if a in tau}
    if "oilbird" in tau and lexical:
        best = max(lexical, key=lexical.get)
        gain = tau["oilbird"] / lexical[best]
        figures["oilbird_over_best_lexical"] = {"best": best, "ratio": gain}
        print(f"oilbird tau {tau['oilbird']:.2f} vs best of {','.join(lexical)} ({best} {lexical[best]:.2f}): {gain:.3f}x "
              f"(target >= {TARGET_RATIO}: {verdict(gain >= TARGET_RATIO)}"
              + ("" if gain >= TARGET_RATIO else f", short by {100 * (TARGET_RATIO - gain) / TARGET_RATIO:.1f}%")
              + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
