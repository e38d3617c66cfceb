"""`python -m decoder ablations` (`make ablations`): the paper's ablation table and transplant ladder,
by replay over a whole trace store (pool past), in one command.

Ablations (every arm paired with `oilbird`, the merged tree, on the same requests: tau ratio and
its joint request-bootstrap interval):
  draft sources removed   oilbird-no-semantic (lexical only), semantic-only, semantic-null (the null
                          control: root branching declared, nothing retrieved)
  the merge itself        oilbird-root-attached (each retrieved chain its own root branch),
                          oilbird-one-source (one source chosen per step instead of merged, SAM-Decoding's
                          rule: the lexical draft when its automaton match is >= 5 tokens, else the
                          semantic draft; decoder/drafters/oilbird.py)
  the key                 oilbird-request-key (one query per request), oilbird-fixed-depth (depth by rank)
  knobs (arm variants, `arm@field=value`, decoder/drafters/__init__.py):
                          theta 0.7 / 0.9 (the entry floor), calib_window=0 (self-calibration off),
                          rollouts=0 (ring buffer off), retrieval_budget 8 / 32 (B_ret), k 4 / 16,
                          a shallower depth schedule 0.9x16_0.82x4 (default 0.9x48_0.82x8)
Transplant ladder (paper: three published drafters at three rungs): pld, recycling and toolspec (the
ToolSpec host, decoder/drafters/toolspec.py) at base,
+pool (the host's own exact key over the pool), +key (that key replaced by the semantic key at the same
node budget, asked on every pass) and +key-added (the key beside the host's exact key, asked only where
that key matched), each with tau and its interval.
Headline (`HEADLINE`): the lexical baselines suffix, sam, lexical, recycling and pld, each against
oilbird on the same requests: tau, arm / oilbird (`vs_merged`) and oilbird / arm (`oilbird_over_arm`,
its interval from the replay's own bootstrap draws over both arms' per-request passes), each with its
interval; `best_lexical` is the one with the highest tau and `target_met` says whether oilbird /
best_lexical >= 1.25 with the interval's lower end above 1 (decoder/policy.py; no interval, --bootstrap 0:
not met).
All arms run in one replay (an arm in two lists, e.g. pld, is replayed once).

Every arm drafts at the fixed node budget (`--sizing flat`: the size-auto arms keep every candidate, the
paper's B = 60), so the table reads as the paper's; the tree sized for tokens per second is the replay's
(`make census`).
Not measured: in replay the ring buffer records nothing, so rollouts=0 equals oilbird there
(decoder/replay/run.py).
Where the arm runs go: worker processes on this machine (`--jobs`, one per core by default), or one Ray
task per arm (`--ray auto|local:N|HOST:PORT`, decoder/replay/arms.py: the same results, timings aside;
`make ablations RAY=local:8`).
Results: runs/<bench>/<model>/ablations/<arm>/ (replay's folders) and ablations.json beside them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from data.errors import OilbirdError, cli_entry
from data.results import check_written
from data.store.files import atomic_write_json
from data.store.layout import ABLATIONS_FILE, ablations_dir, model_dir, model_slug
from decoder.draft import nodes_error
from decoder.policy import LEXICAL_ARMS, TARGET_LOWER, TARGET_RATIO, target_status

MERGED = "oilbird"
ABLATIONS = (
    ("lexical only", "oilbird-no-semantic"),
    ("semantic only", "semantic-only"),
    ("null control", "semantic-null"),
    ("semantic only, no root branching", "semantic-only@root_branching=0"),
    ("null control, no root branching", "semantic-null@root_branching=0"),
    ("root-attached instead of merged", "oilbird-root-attached"),
    ("one source per step (SAM-Decoding)", "oilbird-one-source"),
    ("request-level key", "oilbird-request-key"),
    ("fixed depth by rank", "oilbird-fixed-depth"),
    ("entry floor theta 0.7", "oilbird@theta=0.7"),
    ("entry floor theta 0.9", "oilbird@theta=0.9"),
    ("self-calibration off", "oilbird@calib_window=0"),
    ("ring buffer off", "oilbird@rollouts=0"),
    ("B_ret 8", "oilbird@retrieval_budget=8"),
    ("B_ret 32", "oilbird@retrieval_budget=32"),
    ("k 4", "oilbird@k=4"),
    ("k 16", "oilbird@k=16"),
    ("shallow depth schedule", "oilbird@depth_schedule=0.9x16_0.82x4"),
)
# base, +pool, +key (the pool's exact key replaced by the semantic key, the paper's rung), +key-added (the key
# beside the host's exact key, gated by it: a named extra rung)
LADDER = (("pld", ("pld", "pld+pool", "pld+key", "pld+key-added")),
          ("recycling", ("recycling", "recycling+pool", "recycling+key", "recycling+key-added")),
          ("toolspec", ("toolspec", "toolspec+pool", "toolspec+key", "toolspec+key-added")))
# the headline comparison: oilbird against the training-free lexical baselines (published ones and our lexical tree)
HEADLINE = (
    ("SuffixDecoding (ours)", "suffix"),
    ("SuffixDecoding (ArcticInference, tree mode)", "suffix-arctic-tree"),
    ("SuffixDecoding (ArcticInference, vLLM's defaults)", "suffix-arctic"),
    ("SAM-Decoding", "sam"),
    ("lexical tree (spine, branches, adjacency)", "lexical"),
    ("Token Recycling", "recycling"),
    ("prompt lookup (PLD)", "pld"),
)


def request_passes(folder: Path, arm: str, n_requests: int) -> np.ndarray:
    """Verification passes per request of an arm, from the cycles.parquet its replay wrote."""
    import pyarrow.parquet as pq

    request = pq.read_table(folder / arm / "cycles.parquet", columns=["request"])["request"].to_numpy()
    return np.bincount(request, minlength=n_requests).astype(float)


def inverse_gain(folder: Path, arm: str, n_requests: int, bootstrap: int,
                 seed: int) -> tuple[float | None, list | None]:
    """oilbird's tau over the arm's, tau_oilbird / tau_arm = passes_arm / passes_oilbird (both commit the same
    tokens), and its request-bootstrap interval: the replay's own draws (same request count and seed),
    each resampling both arms' requests jointly, so it is the bootstrap of this ratio itself (not 1/hi..1/lo)."""
    from data.stats import RequestBootstrap
    from decoder.verify.passes import paired_ratio

    boot = RequestBootstrap(n_requests, bootstrap, seed) if bootstrap > 0 else None
    return paired_ratio(request_passes(folder, arm, n_requests), request_passes(folder, MERGED, n_requests), boot)


def run(bench: str, model: str, out: str, nodes: int, bootstrap: int, jobs: int, progress: bool,
        ray: str | None = None) -> dict:
    """The table: one replay of every arm (jobs: worker processes; ray: one Ray task per arm instead)."""
    from decoder.replay.run import ReplayConfig, run_replay

    arms = list(dict.fromkeys([MERGED, *(a for _, a in ABLATIONS), *(a for _, rungs in LADDER for a in rungs),
                               *(a for _, a in HEADLINE)]))  # one replay; an arm named twice runs once
    folder = ablations_dir(out, bench, model_slug(model))
    cfg = ReplayConfig(bench=bench, model=model, arms=tuple(arms), nodes=(nodes,), pool="past", out=out,
                       bootstrap=bootstrap, jobs=jobs, progress=progress, results_dir=str(folder), ray=ray,
                       pair_against=MERGED, sizing="flat")  # the paper's fixed budget: every candidate verified
    t0 = time.perf_counter()
    summaries = run_replay(cfg)
    seconds = time.perf_counter() - t0

    def row(label: str, arm: str) -> dict:
        s = summaries[(arm, nodes)]
        g = s.get("paired_gain") or {}
        return {"label": label, "arm": arm, "tau": s["tau"]["value"], "tau_interval": s["tau"]["interval"],
                "vs_merged": g.get("tau_ratio"), "vs_merged_interval": g.get("interval"),
                "sole_source_share": s.get("sole_source_share"), "exact": s.get("exact"),
                "speedup": (s.get("estimate") or {}).get("speedup"),
                # the per-node counters: which source placed the accepted tokens (a node several sources proposed
                # counts for each)
                "accepted_by_source": s.get("accepted_by_source")}

    n_requests = summaries[(MERGED, nodes)]["requests"]

    def headline_row(label: str, arm: str) -> dict:
        ratio, iv = inverse_gain(folder, arm, n_requests, bootstrap, cfg.seed)
        return {**row(label, arm), "oilbird_over_arm": ratio, "oilbird_over_arm_interval": iv}

    headline = [headline_row(label, arm) for label, arm in HEADLINE]
    lexical = [h for h in headline if h["arm"] in LEXICAL_ARMS and h["tau"] is not None]
    best = max(lexical, key=lambda h: h["tau"]) if lexical else None
    best_lexical = None if best is None else {k: best[k] for k in ("arm", "tau", "tau_interval", "oilbird_over_arm",
                                                                  "oilbird_over_arm_interval")}
    # no interval (bootstrap 0) cannot show the lower end above 1: "not established", so not met
    met = best is not None and target_status(best["oilbird_over_arm"], best["oilbird_over_arm_interval"]) == "met"
    result = {"bench": bench, "model": model, "pool": "past", "nodes": nodes, "requests": n_requests,
              "seconds": round(seconds, 1), "merged": row("merged (oilbird)", MERGED),
              "ablations": [row(label, arm) for label, arm in ABLATIONS],
              "ladder": [{"drafter": d, "rungs": [row(r, r) for r in rungs]} for d, rungs in LADDER],
              "headline": headline, "best_lexical": best_lexical,
              "target": f"oilbird / best_lexical >= {TARGET_RATIO} with the 95% interval's lower end above "
                        f"{TARGET_LOWER:g}",
              "target_met": met,
              "missing": ["ring buffer off: replay records no rejected branches, so it equals oilbird here",
                          "null control and semantic only: the rejected-branch pool records nothing in replay (the "
                          "argmax after a rejected node needs that node's forward), so their rollouts are not "
                          "measured here, only their root branching; live decoding measures both "
                          "(docs/benchmarks.md)"]}
    check_written(result, "ablations", str(folder / "ablations.json"))  # data/results.py: what the reports accept
    atomic_write_json(folder / "ablations.json", result)
    return result


def _iv(v, iv) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f}" + (f" [{iv[0]:.2f}-{iv[1]:.2f}]" if iv else "")


def format_table(r: dict) -> str:
    lines = [f"ablations, {r['bench']} / {r['model']}: {r['requests']} requests, pool past, {r['nodes']} nodes "
             f"({r['seconds']:.0f} s)", f"{'':<34} {'arm':<38} {'tau [95%]':>18} {'vs merged [95%]':>18}"]
    m = r["merged"]
    lines.append(f"{'merged':<34} {m['arm']:<38} {_iv(m['tau'], m['tau_interval']):>18} {'1':>18}")
    for a in r["ablations"]:
        lines.append(f"{a['label']:<34} {a['arm']:<38} {_iv(a['tau'], a['tau_interval']):>18} "
                     f"{_iv(a['vs_merged'], a['vs_merged_interval']):>18}")
    for a in r["ablations"]:
        if a["arm"].startswith(("semantic-only", "semantic-null")) and a.get("accepted_by_source") is not None:
            by = ", ".join(f"{k} {v}" for k, v in sorted(a["accepted_by_source"].items(), key=lambda kv: -kv[1]))
            lines.append(f"  accepted by source, {a['arm']}: {by or 'nothing drafted'}")
    lines.append("transplant ladder (base / +pool / +key / +key-added):")
    for lad in r["ladder"]:
        lines.append(f"  {lad['drafter']:<12} " + "   ".join(f"{x['arm']} {_iv(x['tau'], x['tau_interval'])}"
                                                      for x in lad["rungs"]))
    if r.get("headline"):
        lines += ["headline, oilbird against each lexical baseline (same requests):",
                  f"  {'':<44} {'arm':<10} {'tau [95%]':>18} {'oilbird / arm [95%]':>22}"]
        for h in r["headline"]:
            lines.append(f"  {h['label']:<44} {h['arm']:<10} {_iv(h['tau'], h['tau_interval']):>18} "
                         f"{_iv(h['oilbird_over_arm'], h['oilbird_over_arm_interval']):>22}")
        b = r.get("best_lexical")
        if b:
            lines.append(f"  best lexical: {b['arm']}; oilbird / {b['arm']} = "
                         f"{_iv(b['oilbird_over_arm'], b['oilbird_over_arm_interval'])}; target ({r['target']}): "
                         f"{'met' if r['target_met'] else 'not met'}")
    lines += [f"not measured: {m}" for m in r["missing"]]
    return "\n".join(lines)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m decoder ablations", description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", default="apibank")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs")
    p.add_argument("--nodes", type=int, default=60)
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default one per core)")
    p.add_argument("--ray", default=None, metavar="auto|local:N|ADDRESS",
                   help="one Ray task per arm instead of worker processes: auto (a running cluster, else a local "
                        "one), local:N (N CPUs here) or a cluster's HOST:PORT; the same results (docs/scale.md); "
                        "not with --jobs")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if nodes_error(args.nodes, least=1):
        raise OilbirdError(nodes_error(args.nodes, least=1))
    r = run(args.bench, args.model, args.out, args.nodes, args.bootstrap, args.jobs, not args.quiet, args.ray)
    print(format_table(r))
    print(model_dir(args.out, args.bench, model_slug(args.model)) / ABLATIONS_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
