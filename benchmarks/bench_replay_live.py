"""`make bench-replay-live`: replay against the live decoder on the same requests, cap and pool.

Serves the first N requests of a benchmark (default API-Bank, 16 requests, cap 128) live with every arm
(`decoder.live.harness.run_decode`, pool strictly past: every arm starts empty, a request joins the pool
when it ends), then replays the same arms over the captured store of that benchmark cut to the same
requests and cap (`decoder.replay.run.run_replay`, --limit N --max-new-tokens C; written to
runs/<bench>/<model>/bench-replay-live/, never over the whole-store replay/), and prints per arm:
tau live / replay, the sole-source share live / replay (the paper's definition, over committed
tokens), whether replay is exact for that arm, and the measured live speedup over ar against the
speedup replay estimates from this machine's profile (runs/profiles/<model>-cpu.json, made by
`python -m decoder profile`). For exact arms tau must agree (tests/test_replay.py checks it pass by
pass on small models); for the others the difference is the measured effect of what the store lacks.

Usage: python benchmarks/bench_replay_live.py [--bench apibank] [--model smollm2-135m] [--limit 16]
       [--max-new-tokens 128] [--arms all] [--out runs] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from data.errors import OilbirdError, cli_entry


def _share(s: dict) -> float | None:
    share = s.get("sole_source_share")
    return share.get("value") if isinstance(share, dict) else None


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--arms", default="all", help="comma-separated arms, or all (every arm but ar)")
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from data.store.layout import bench_replay_dir, model_slug
    from decoder.live.harness import DecodeConfig, run_decode
    from decoder.replay.run import ReplayConfig, resolve_arms, run_replay

    arms = resolve_arms(args.arms.split(","))
    # the cut replay goes beside, never over, the whole-store replay the reports read (replay/)
    replay_folder = bench_replay_dir(args.out, args.bench, model_slug(args.model), live=True)
    if args.limit < 1:
        raise OilbirdError("--limit must be at least 1")
    t0 = time.perf_counter()
    replay = run_replay(ReplayConfig(bench=args.bench, model=args.model, arms=tuple(arms), nodes=(args.nodes,),
                                     limit=args.limit, max_new_tokens=args.max_new_tokens, out=args.out,
                                     progress=False, results_dir=str(replay_folder)))
    replay_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    live = run_decode(DecodeConfig(bench=args.bench, model=args.model, arms=("ar", *arms), limit=args.limit,
                                   nodes=args.nodes, max_new_tokens=args.max_new_tokens, out=args.out))
    live_s = time.perf_counter() - t0

    width = max(12, *(len(a) + 1 for a in arms))
    head = (f"{'arm':<{width}} {'exact':>5} {'tau live':>8} {'tau replay':>10} {'diff':>7} {'sole live':>9} "
            f"{'sole replay':>11} {'speedup live':>12} {'est. replay':>11} {'lossless':>8}")
    lines = [head, "-" * len(head)]
    rows = {}
    for arm in arms:
        lv, rp = live[arm], replay[(arm, args.nodes)]
        est = (rp.get("estimate") or {}).get("speedup")
        sl, sr = _share(lv), _share(rp)
        rows[arm] = {"exact": rp["exact"], "tau_live": lv["tau"], "tau_replay": rp["tau"]["value"],
                     "sole_live": sl, "sole_replay": sr, "speedup_live": lv["speedup"], "speedup_estimated": est,
                     "lossless": lv["lossless"]["lossless"], "passes_live": lv["passes"], "passes_replay": rp["passes"]}
        diff = rp["tau"]["value"] / lv["tau"] - 1 if lv["tau"] else float("nan")
        pct = lambda v: f"{100 * v:.1f}%" if v is not None else "-"  # noqa: E731
        lines.append(f"{arm:<{width}} {('yes' if rp['exact'] else 'no'):>5} {lv['tau']:>8.3f} "
                     f"{rp['tau']['value']:>10.3f} {100 * diff:>+6.1f}% {pct(sl):>9} {pct(sr):>11} "
                     f"{(lv['speedup'] or 0):>11.2f}x {(f'{est:.2f}x' if est else 'n/a'):>11} "
                     f"{lv['lossless']['matched']:>3}/{lv['lossless']['requests']:<4}")
    print("\n".join(lines))
    ar = live["ar"]
    print(f"\n{args.bench}: first {args.limit} requests, cap {args.max_new_tokens}, pool past, {args.nodes} nodes; "
          f"{ar['generated_tokens']} tokens; ar {ar['tokens_per_s']:.2f} tok/s; live {live_s:.0f} s, replay {replay_s:.1f} s")
    print(f"live: decode/<arm>/ beside the store; replay of the same requests: {replay_folder}/<arm>/")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "live_seconds": live_s, "replay_seconds": replay_s,
                       "tokens": ar["generated_tokens"], "ar_tokens_per_s": ar["tokens_per_s"]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
