"""Report rendering time for a large census: synthetic positions, the real census summary, all pages.

Writes runs/<bench>/<model>/census/{positions.parquet, summary.json} for N synthetic positions
(census.summary.summarize computes the summary, so its schema is the real one) plus three decoder
arms, then times `reports` reading and rendering them (tokenizer of stories260k when ../shared is
there, token ids otherwise). Target: under 30 s for 200k positions.
Usage: python benchmarks/bench_reports.py [--positions 200000] [--requests 400] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from data.errors import cli_entry
from data.store.layout import RUNS, census_dir, decode_dir, store_dir

SHARED_STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"


def synthetic_positions(n: int, requests: int, vocab: int, seed: int = 0) -> pl.DataFrame:
    """Census-shaped positions with the paper's qualitative structure (novel tokens open gaps, cliffs)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), size=requests - 1, replace=False))
    lengths = np.diff(np.r_[0, cuts, n])
    request = np.repeat(np.arange(requests, dtype=np.int32), lengths)
    position = (np.arange(n) - np.repeat(np.r_[0, cuts], lengths)).astype(np.int32)
    novel = rng.random(n) < 0.06
    available = rng.random(n) < np.where(novel, 0.7, 0.9)
    p_gap = np.where(novel, 0.35, 0.05) * np.linspace(1.5, 0.5, n)  # gap rate falls as the pool grows
    gap = available & (rng.random(n) < p_gap)
    producible = available & ~gap & (rng.random(n) < 0.97)
    sem_cos = np.clip(rng.beta(8, 2, n), 0, 1)
    sem_hit = rng.random(n) < np.where(gap, sem_cos * 0.95, 0.8)
    longest = np.where(producible, 16 - np.minimum(rng.geometric(0.5, n) - 1, 14),
                       np.minimum(rng.geometric(0.6, n) - 1, 16)).astype(np.int32)
    oracle = np.where(producible, np.minimum(longest, 16 - rng.integers(0, 3, n)), 0).astype(np.int32)
    return pl.DataFrame({
        "request": request, "position": position, "target": rng.integers(3, vocab, n, dtype=np.int32),
        "available": available, "producible": producible, "gap": gap, "oracle_suffix_len": oracle,
        "longest_match_len": longest, "sem_hit": sem_hit, "sem_best_cos": sem_cos.astype(np.float64),
        "emb_hit": rng.random(n) < 0.5, "adj_hit": rng.random(n) < 0.8, "novel_prev": novel,
        "payload_len": np.where(gap & sem_hit, rng.integers(1, 12, n), 0).astype(np.int32),
        "neighbour_match_len": np.where(gap & sem_hit, rng.integers(0, 10, n), 0).astype(np.int32),
    })


def write_decode(folder: Path, requests: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for k, (arm, speed, sources) in enumerate((("ar", 1.0, []), ("lexical", 2.1, ["sam", "adjacency"]),
                                                ("oilbird", 2.4, ["sam", "adjacency", "semantic"]))):
        passes = requests * 50
        labels = [] if not sources else [
            "|".join(sorted(set(rng.choice(sources, size=rng.integers(1, len(sources) + 1)))))
            for _ in range(passes * 2)]
        accepted: dict[str, int] = {}
        for lab in labels:
            for src in lab.split("|"):
                accepted[src] = accepted.get(src, 0) + 1
        per_pass = np.array_split(np.array(labels, dtype=object), passes) if labels else [[]] * passes
        d = folder / arm
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"request": pa.array(np.arange(passes) // 50, pa.int32()),
                                 "pass": pa.array(np.arange(passes) % 50, pa.int32()),
                                 "sources": pa.array([list(x) for x in per_pass], pa.list_(pa.string()))}),
                       d / "cycles.parquet")
        (d / "summary.json").write_text(json.dumps({
            "arm": arm, "requests": requests, "tau": 1 + 2 * speed / 2.4 * (k > 0), "tokens_per_s": 40 * speed,
            "speedup": speed, "overhead_fraction": 0.03 * k, "mean_nodes": 60 if k else 0,
            "lossless": {"matched": requests, "requests": requests}, "accepted_by_source": accepted}))


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=200_000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--keep", default=None, help="write runs/ and the pages here instead of a temp folder")
    args = ap.parse_args(argv)

    from census.definitions import CensusConfig
    from census.summary import summarize
    from reports.render import render_site, write_site
    from reports.results import find_results

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_reports."))
    try:
        runs = root / RUNS
        census, traces = census_dir(runs, "synthetic", "stories260k"), store_dir(runs, "synthetic", "stories260k")
        model = str(SHARED_STORIES) if SHARED_STORIES.is_dir() else None
        df = synthetic_positions(args.positions, args.requests, 512 if model else 49152)
        summary = summarize(df, CensusConfig(), meta={"bench": "synthetic", "model": model or "synthetic",
                                                      "layer": 4, "n_requests": args.requests})
        census.mkdir(parents=True, exist_ok=True)
        df.write_parquet(census / "positions.parquet")
        (census / "summary.json").write_text(json.dumps(summary))
        if model:
            traces.mkdir(parents=True, exist_ok=True)
            (traces / "meta.json").write_text(json.dumps({"model": model}))
        write_decode(decode_dir(runs, "synthetic", "stories260k"), args.requests)

        t0 = time.perf_counter()
        results = find_results(runs)
        t1 = time.perf_counter()
        pages = render_site(results)
        t2 = time.perf_counter()
        written = write_site(root / "html", pages)
        t3 = time.perf_counter()
        sizes = {p.name: p.stat().st_size for p in written}
        print(f"positions={args.positions} requests={args.requests} tokenizer={'stories260k' if model else 'ids'}")
        print(f"read {t1 - t0:.2f} s, render {t2 - t1:.2f} s, write {t3 - t2:.2f} s, total {t3 - t0:.2f} s "
              f"(target < 30 s)")
        print("page sizes: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))
        if args.keep:
            print(f"pages in {root / 'html'}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
