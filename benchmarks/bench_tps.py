"""`make bench-tps BENCH=apibank`: tokens per second, not tokens per pass: the targets of the cost-aware drafts.

One replay of the whole store (pool past, the main job's two workers) priced on the vLLM profile `make census`
measured (`--profile`), and one on a flat profile (every step the same cost, as measured on an H100: about
25 ms from 0 to 64 nodes; `--flat-ms`), side by side. Checks, each printed as PASS or MISS with its numbers:
  tree     oilbird (nodes auto) estimated speedup >= 1.15x suffix-arctic-tree's (ArcticInference, tree mode)
  chain    oilbird-chain (auto) >= 1.10x suffix-arctic's (vLLM's `suffix` method with vLLM's settings)
  flat     with the flat profile, oilbird's tau >= 99% of oilbird-fixed's (where verification is free the
           budget fills)
  ece      the expected calibration error of every source of oilbird's node probabilities <= 0.05
  drafting oilbird's drafting time per pass: p99 <= 0.5 ms and mean <= 1.5x oilbird-no-semantic's, in every
           pool-size band (requests 1-24, 25-100, 101-250, 251-end of the store)
Results: runs/<bench>/<model>/bench/tps.json (replay folders under runs/<bench>/<model>/bench/tps-*/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.errors import OilbirdError, cli_entry  # noqa: E402
from data.readfile import read_json  # noqa: E402
from data.store.files import atomic_write_json  # noqa: E402
from data.store.layout import model_slug, store_dir  # noqa: E402

TREE_ARMS = ("oilbird", "oilbird-fixed", "oilbird-no-semantic", "oilbird-no-semantic-fixed", "suffix-arctic-tree")
CHAIN_ARMS = ("oilbird-chain", "oilbird-no-semantic-chain", "suffix-arctic")
BANDS = ((0, 24), (24, 100), (100, 250), (250, None))  # request index ranges: the pool grows with them
TARGETS = {"tree": 1.15, "chain": 1.10, "flat": 0.99, "ece": 0.05, "p99_ms": 0.5, "mean_ratio": 1.5}


def flat_profile(profile: dict, ms: float) -> dict:
    """`profile` with every verification step costing `ms` (prefill kept): a free verification."""
    return {**profile, "engine": profile.get("engine", "harness") + "-flat",
            "verify_s": [[ms / 1e3] * len(profile["nodes"]) for _ in profile["contexts"]],
            **({"verify_s_by_batch": {b: [[ms / 1e3] * len(profile["nodes"]) for _ in profile["contexts"]]
                                      for b in profile["verify_s_by_batch"]}} if profile.get("verify_s_by_batch") else {})}


def drafting_bands(folder: Path) -> list[dict]:
    """Drafting ms per pass, per band of request index (cycles.parquet of one arm)."""
    t = pq.read_table(folder / "cycles.parquet", columns=["request", "draft_s"]).to_pydict()
    req, draft = np.asarray(t["request"]), np.asarray(t["draft_s"]) * 1e3
    out = []
    for lo, hi in BANDS:
        sel = (req >= lo) & (req < (hi if hi is not None else req.max() + 1))
        if sel.any():
            out.append({"requests": [lo + 1, int(req[sel].max()) + 1], "passes": int(sel.sum()),
                        "mean_ms": float(draft[sel].mean()), "p99_ms": float(np.percentile(draft[sel], 99)),
                        "max_ms": float(draft[sel].max())})
    return out


def oracle_speedup(folder: Path, traces, cost) -> tuple[float, float]:
    """(the arm's estimated speedup without drafting time, the same passes verifying only the nodes they accepted):
    the headroom of the cost rule over this arm's candidates, were the accepted path known before verifying.
    Both without drafting and update time (the replay's estimate adds them)."""
    t = pq.read_table(folder / "cycles.parquet", columns=["request", "nodes", "accepted", "committed"]).to_pydict()
    req, nodes, acc, com = (np.asarray(t[k]) for k in ("request", "nodes", "accepted", "committed"))
    ar = arm = best = 0.0
    for r, tr in enumerate(traces):
        sel = req == r
        past0, prefill = len(tr.prompt) - 1, float(cost.prefill_s(len(tr.prompt)))
        ar += prefill + float(np.sum(cost.verify_s(np.zeros(len(tr.tokens)), past0 + np.arange(len(tr.tokens)))))
        past = past0 + np.concatenate([[0], np.cumsum(com[sel])[:-1]])
        arm += prefill + float(np.sum(cost.verify_s(nodes[sel], past)))
        best += prefill + float(np.sum(cost.verify_s(acc[sel], past)))
    return ar / arm, ar / best


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


@cli_entry
def main(argv=None) -> int:
    from decoder.replay.run import ReplayConfig, run_replay

    ap = argparse.ArgumentParser(prog="bench_tps.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--profile", default=None, help="the vLLM profile (default runs/profiles/<model>-cpu-vllm.json)")
    ap.add_argument("--flat-ms", type=float, default=25.0, help="the flat profile's step, ms (default 25)")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests only")
    ap.add_argument("--jobs", type=int, default=2, help="replay workers (default 2, as the main job)")
    a = ap.parse_args(argv)
    from decoder.cost.profile import profile_path

    slug = model_slug(a.model)
    profile = Path(a.profile) if a.profile else profile_path(a.out, slug, "cpu", "vllm")
    if not profile.is_file():
        raise OilbirdError(f"no vLLM profile at {profile}: `make census BENCH={a.bench}` measures it")
    if not (store_dir(a.out, a.bench, slug) / "meta.json").exists():
        raise OilbirdError(f"no trace store for {a.bench}: `make census BENCH={a.bench}` captures it")
    if a.flat_ms <= 0:
        raise OilbirdError("--flat-ms must be positive")
    bench_dir = store_dir(a.out, a.bench, slug).parent / "bench"
    t0 = time.perf_counter()
    common = dict(bench=a.bench, model=a.model, out=a.out, limit=a.limit, jobs=a.jobs, bootstrap=1000, progress=True)
    priced = run_replay(ReplayConfig(arms=TREE_ARMS + CHAIN_ARMS, profile=str(profile),
                                     results_dir=str(bench_dir / "tps-vllm"), **common))
    with tempfile.TemporaryDirectory() as tmp:
        flat_path = Path(tmp) / "flat.json"
        flat_path.write_text(json.dumps(flat_profile(read_json(profile, "profile"), a.flat_ms)))
        flat = run_replay(ReplayConfig(arms=("oilbird", "oilbird-fixed"), profile=str(flat_path),
                                       results_dir=str(bench_dir / "tps-flat"), **common))
    s = {arm: summ for (arm, _), summ in priced.items()}
    speed = {arm: (x["estimate"] or {}).get("speedup") for arm, x in s.items()}
    f = {arm: summ for (arm, _), summ in flat.items()}
    cal = (s["oilbird"].get("drafter_stats") or {}).get("calibration") or {}
    cal_chain = (s["oilbird-chain"].get("drafter_stats") or {}).get("calibration") or {}
    from data.store.reader import open_store
    from decoder.cost.profile import CostModel
    from decoder.replay.traces import load_traces

    traces = load_traces(open_store(store_dir(a.out, a.bench, slug), load_hidden=False), a.limit, None)
    cost = CostModel.load(profile)
    headroom = {arm: oracle_speedup(bench_dir / "tps-vllm" / arm, traces, cost)
                for arm in ("oilbird-fixed", "oilbird", "suffix-arctic-tree", "oilbird-chain", "suffix-arctic")}
    bands_on = drafting_bands(bench_dir / "tps-vllm" / "oilbird")
    bands_off = drafting_bands(bench_dir / "tps-vllm" / "oilbird-no-semantic")
    checks = {
        "tree": {"oilbird": speed["oilbird"], "suffix-arctic-tree": speed["suffix-arctic-tree"],
                 "ratio": speed["oilbird"] / speed["suffix-arctic-tree"], "target": TARGETS["tree"]},
        "chain": {"oilbird-chain": speed["oilbird-chain"], "suffix-arctic": speed["suffix-arctic"],
                  "ratio": speed["oilbird-chain"] / speed["suffix-arctic"], "target": TARGETS["chain"]},
        "flat": {"oilbird_tau": f["oilbird"]["tau"]["value"], "oilbird_fixed_tau": f["oilbird-fixed"]["tau"]["value"],
                 "ratio": f["oilbird"]["tau"]["value"] / f["oilbird-fixed"]["tau"]["value"], "target": TARGETS["flat"]},
        "ece": {"tree": {k: v["ece"] for k, v in cal.items()}, "chain": {k: v["ece"] for k, v in cal_chain.items()},
                "target": TARGETS["ece"]},
        "headroom": {arm: {"without_drafting": x, "verify_accepted_only": y} for arm, (x, y) in headroom.items()},
        "drafting": {"oilbird": bands_on, "oilbird-no-semantic": bands_off,
                     "mean_ratio": [x["mean_ms"] / y["mean_ms"] for x, y in zip(bands_on, bands_off)],
                     "target_p99_ms": TARGETS["p99_ms"], "target_mean_ratio": TARGETS["mean_ratio"]},
    }
    eces = [v for v in list(checks["ece"]["tree"].values()) + list(checks["ece"]["chain"].values()) if v is not None]
    ok = {"tree": checks["tree"]["ratio"] >= TARGETS["tree"], "chain": checks["chain"]["ratio"] >= TARGETS["chain"],
          "flat": checks["flat"]["ratio"] >= TARGETS["flat"], "ece": bool(eces) and max(eces) <= TARGETS["ece"],
          "drafting": all(b["p99_ms"] <= TARGETS["p99_ms"] for b in bands_on)
          and all(r <= TARGETS["mean_ratio"] for r in checks["drafting"]["mean_ratio"])}
    print("arm                          tau     nodes/pass  accepted/node  est. speedup (vLLM profile, batch 1)")
    for arm in TREE_ARMS + CHAIN_ARMS:
        x = s[arm]
        print(f"{arm:<28} {x['tau']['value']:6.3f} {x['mean_nodes']:10.2f} {x['accepted_per_node'] or 0:14.3f}  "
              f"{speed[arm]:.3f}x {x['estimate']['speedup_interval']}")
    c = checks
    print(f"{verdict(ok['tree'])} tree: oilbird {c['tree']['oilbird']:.3f}x / suffix-arctic-tree "
          f"{c['tree']['suffix-arctic-tree']:.3f}x = {c['tree']['ratio']:.3f} (target >= {TARGETS['tree']})")
    print(f"{verdict(ok['chain'])} chain: oilbird-chain {c['chain']['oilbird-chain']:.3f}x / suffix-arctic "
          f"{c['chain']['suffix-arctic']:.3f}x = {c['chain']['ratio']:.3f} (target >= {TARGETS['chain']})")
    print(f"{verdict(ok['flat'])} flat {a.flat_ms:g} ms profile: tau oilbird {c['flat']['oilbird_tau']:.3f} / "
          f"oilbird-fixed {c['flat']['oilbird_fixed_tau']:.3f} = {c['flat']['ratio']:.4f} (target >= {TARGETS['flat']})")
    print(f"{verdict(ok['ece'])} ECE per source, tree: "
          + ", ".join(f"{k} {v:.3f}" for k, v in c["ece"]["tree"].items() if v is not None)
          + "; chain: " + ", ".join(f"{k} {v:.3f}" for k, v in c["ece"]["chain"].items() if v is not None)
          + f" (target <= {TARGETS['ece']})")
    for arm, (x, y) in headroom.items():
        print(f"  headroom {arm}: {x:.3f}x without drafting time; {y:.3f}x had each pass verified only the nodes it "
              "accepted (the accepted path known in advance)")
    for b, r in zip(bands_on, c["drafting"]["mean_ratio"]):
        print(f"  drafting, requests {b['requests'][0]}-{b['requests'][1]}: oilbird mean {b['mean_ms']:.3f} ms, "
              f"p99 {b['p99_ms']:.3f} ms, max {b['max_ms']:.2f} ms; x{r:.2f} oilbird-no-semantic's mean")
    print(f"{verdict(ok['drafting'])} drafting: p99 <= {TARGETS['p99_ms']} ms and mean <= {TARGETS['mean_ratio']}x "
          "in every band")
    result = {"kind": "bench-tps", "bench": a.bench, "model": a.model, "profile": str(profile), "flat_ms": a.flat_ms,
              "requests": s["oilbird"]["requests"], "store_fingerprint": s["oilbird"]["store_fingerprint"],
              "checks": checks, "ok": ok, "seconds": time.perf_counter() - t0,
              "arms": {arm: {"tau": x["tau"], "mean_nodes": x["mean_nodes"], "accepted_per_node": x["accepted_per_node"],
                             "estimate": x["estimate"], "estimate_by_batch": x.get("estimate_by_batch")}
                       for arm, x in s.items()},
              "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(bench_dir / "tps.json", result)
    print(bench_dir / "tps.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
