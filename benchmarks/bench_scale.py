"""`make bench-scale`: the census and the decoder's retrieval over a 1M-position store.

The store: a real trace store (default API-Bank, SmolLM2; 67,324 positions) tiled until it holds
--positions positions (benchmarks/tiling.py, shared with bench_draft.py). Tile 0 is the store
itself. Every later tile k is a disguised copy: its token ids go through a random permutation of
the vocabulary, its states through a random orthogonal rotation plus Gaussian noise (--noise x the
rows' rms), and its prompts change with its tokens, so its prompt hashes differ. The tiles are
interleaved in serving order (request r of every tile, then request r + 1), like 15 independent
streams of traffic mixed in one deployment, so an index trained on the first states sees every
stream. Each tile has the statistics of real traffic (the same repetition within the tile, real
state geometry), while no tile can draft from another (its tokens are another vocabulary, its
states point elsewhere): it is the workload of a 1M-position pool, not new evidence about recall.
The tiled store is written once under
runs/scale-<bench>-<N>/<model>/traces and reused.

Measured, in one run:
  1. census of the whole tiled store with --index (default the best sweep spec), as a child
     process: wall time, its peak RSS, the seconds per part; against the targets 10 min / 8 GB;
  2. lexical linearity: the lexical seconds per position at 1M against the source store's census
     (the same code on 67k positions) — a ratio near 1 is linear;
  3. decoder retrieval: one query (batch 1, as the decoder asks once per pass) against a pool of
     --positions states, with --index and with the exact float16 product the decoder uses by
     default, median over --queries queries; as a share of this machine's cycle (the verify
     forward at --nodes nodes from the decoder's profile, at its largest profiled context).

With --ray TARGET (`make bench-scale RAY=local:2`), step 1 is instead the census of the tiled store
with the exact key (a trained --index is not sharded: census/ray_census.py) and a store budget
(--store-budget, default 20k tokens) in the single process and on Ray, arms interleaved (--rounds), every process and worker on one thread: wall time, peak memory
of the driver and per worker, whether the outputs are identical, and the scaling efficiency
time(1 worker) / (N x time(N workers)) (docs/scale.md).

Usage: python benchmarks/bench_scale.py [--bench apibank] [--model smollm2-135m] [--positions 1000000]
  [--index SPEC] [--noise 0.02] [--queries 200] [--nodes 60] [--recall-sample 512] [--skip-census] [--json PATH]
  [--ray auto|local:N|ADDRESS [--rounds R] [--ray-shards S]] [--skip-retrieval]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tiling import (  # benchmarks/tiling.py, beside this script
    make_disguise,
    noise_scale,
    store_vocab,
)

from data.errors import OilbirdError, cli_entry
from data.readfile import read_json
from data.store.layout import census_dir, default_profile_path, model_slug, store_dir
from data.store.reader import open_store
from data.store.schema import prompt_hash
from data.store.writer import StoreWriter, TraceRecord

DEFAULT_INDEX = "ivf1024,pq64,nprobe=8"
# requests per positions part of the tiled store (~16k positions): parts of the size a capture writes, so a Ray
# shard reads the few parts its rows lie in (data/store/statefiles.py), not a file of half the store
PART_REQUESTS = 128
RAY_BUDGET = "20k"  # --ray's store budget in tokens (docs/scale.md: the per-position cost is then c_row x 20k)


def tile_records(store, k: int, tiles: int, rng: np.random.Generator, noise: float, vocab: int) -> list[TraceRecord]:
    """Tile k of the store (k = 0: the store itself; benchmarks/tiling.py)."""
    req = store.requests
    disguise = make_disguise(k, rng, store.d_model, vocab)
    hidden = store.hidden.astype(np.float32)
    last = store.prompt_last_hidden.astype(np.float32)
    if not disguise.identity:
        scale = noise_scale(noise, hidden[store.hidden_valid])
        hidden = disguise.states(hidden, scale, rng)
        last = disguise.states(last, scale, rng)
    R = store.n_requests
    ids = req["id"].to_list()
    groups = req["group"].to_list()
    records = []
    for r in range(R):
        lo, hi = int(store.offsets[r]), int(store.offsets[r + 1])
        prompt = disguise.tokens(store.prompt(r))
        out = disguise.tokens(store.tokens(r))
        records.append(TraceRecord(
            request=r * tiles + k, id=f"{ids[r]}~{k}", group=f"{groups[r]}~{k}", prompt_hash=prompt_hash(prompt),
            prompt_tokens=prompt.tolist(), output_tokens=out.tolist(), stop_reason="length",
            seconds=0.0, hidden=hidden[lo:hi], hidden_valid=store.hidden_valid[lo:hi],
            topk=disguise.tokens(store.topk[lo:hi]), prompt_last_hidden=last[r],
            prompt_last_topk=disguise.tokens(store.prompt_last_topk[r])))
    return records


def build_scaled(src: Path, dst: Path, positions: int, noise: float, seed: int = 0) -> dict:
    store = open_store(src, load_hidden=True)
    n = int(store.offsets[-1])
    tiles = math.ceil(positions / n)
    if (dst / "meta.json").exists():
        have = read_json(dst / "meta.json", "scaled store meta.json")
        if have.get("complete") and have.get("scale", {}).get("tiles") == tiles \
                and have["scale"].get("noise") == noise and have["scale"].get("order") == "interleaved" \
                and have["scale"].get("part_requests") == PART_REQUESTS:
            return have["scale"]
    vocab = store_vocab(store)
    content = ("checksums", "n_requests", "complete", "format", "pending", "prompt_tokens_reused", "runs",
               "seconds_total", "scale")  # what describes the source's rows, not its settings
    meta = {k: v for k, v in store.meta.items() if k not in content}
    meta["bench"] = dst.parent.parent.name
    meta["data_fingerprint"] = f"{store.meta.get('data_fingerprint')}-tiles{tiles}-noise{noise}"
    meta["max_new_tokens"] = store.meta.get("max_new_tokens")
    w = StoreWriter(dst, meta, force=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    per_tile = []
    for k in range(tiles):
        per_tile.append(tile_records(store, k, tiles, rng, noise, vocab))
        print(f"  tile {k + 1}/{tiles} made ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    R = store.n_requests
    step = max(1, PART_REQUESTS // tiles)
    for lo in range(0, R, step):  # serving order: request r of every tile, then r + 1
        w.append([per_tile[k][r] for r in range(lo, min(R, lo + step)) for k in range(tiles)])
        print(f"  requests {min(R, lo + step) * tiles}/{R * tiles} written ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    scale = {"source": str(src), "tiles": tiles, "noise": noise, "positions": tiles * n, "requests": tiles * R,
             "order": "interleaved", "part_requests": PART_REQUESTS}
    w.finish(scale=scale)
    return scale


def run_census(bench: str, model: str, out: str, index: str, bootstrap: int, recall_sample: int,
               extra: tuple[str, ...] = (), env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "census", "--bench", bench, "--model", model, "--out", out, "--index", index,
           "--no-embeddings", "--bootstrap", str(bootstrap), "--recall-sample", str(recall_sample), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True,  # its progress bar shows on stderr
                          env=None if env is None else {**os.environ, **env})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise OilbirdError(f"the census of the scaled store failed (exit {proc.returncode}; its error is above)")
    summary = read_json(census_dir(out, bench, model_slug(model)) / "summary.json", "census summary")
    # the census process's own peak (RUSAGE_CHILDREN would be the largest child so far, over every arm)
    peak = summary["timing"].get("peak_rss_gib")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20  # KiB -> GiB
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(peak, 2), "summary": summary}


# Every arm on one thread per process; Ray's workers at the single process's priority (Ray starts them at
# niceness 15 by default, which on a machine shared with other work would slow only the Ray arms).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "RAY_worker_niceness": "0"}


def cpu_model(run: dict, n: int) -> dict:
    """Scaling efficiency from measured CPU seconds, for a machine whose cores other work holds (the wall
    times of 1 vs N workers then measure the other work): each shard's CPU seconds handed to the first
    free of n workers in order; the driver's serial part (wall less the shards' wall) added to both."""
    shards = run["shard_cpu_s"]
    free = [0.0] * n
    for c in shards:
        i = free.index(min(free))
        free[i] += c
    serial = run["wall_s"] - run["shards_wall_s"]
    one, many = sum(shards), max(free)
    return {"shards": round(one / (n * many), 3), "wall": round((serial + one) / (n * (serial + many)), 3),
            "serial_s": round(serial, 1), "shards_cpu_s": round(one, 1), "makespan_s": round(many, 1)}


def ray_arms(target: str) -> list[tuple[str, tuple[str, ...]]]:
    """The arms of --ray: the single process, then Ray with 1 worker and with N (local:N), or the target."""
    arms = [("single", ())]
    if target.startswith("local:") and target[6:].isdigit() and int(target[6:]) > 1:
        arms += [("ray-1", ("--ray", "local:1")), (f"ray-{target[6:]}", ("--ray", target))]
    else:
        arms.append((f"ray {target}", ("--ray", target)))
    return arms


def census_on_ray(bench: str, model: str, out: str, target: str, rounds: int, bootstrap: int, recall_sample: int,
                  shards: int | None, budget: str | None = None) -> dict:
    """Single process against Ray on the same store, arms interleaved over `rounds`, every process and
    worker on one thread: wall time, peak memory, the outputs compared (positions, summary less timing)."""
    import polars as pl

    folder = census_dir(out, bench, model_slug(model))
    arms = ray_arms(target)
    if shards is None and target.startswith("local:") and target[6:].isdigit():
        # one shard plan for every Ray arm (4 per worker of the largest), so 1 vs N workers differ only in workers
        shards = 4 * int(target[6:])
    runs: dict[str, list[dict]] = {name: [] for name, _ in arms}
    first = None
    for k in range(rounds):
        for name, flags in arms:
            extra = (*flags, *(("--ray-shards", str(shards)) if shards and flags else ()),
                     *(("--store-budget", budget) if budget else ()))
            c = run_census(bench, model, out, "exact", bootstrap, recall_sample, extra, env=ONE_THREAD)
            s = c.pop("summary")
            frame = pl.read_parquet(folder / "positions.parquet")
            rest = {key: v for key, v in s.items() if key != "timing"}
            if first is None:
                first = (frame, rest)
            ray = s["timing"].get("ray") or {}
            runs[name].append({"wall_s": c["wall_s"], "census_s": s["timing"]["census_s"],
                               "driver_peak_rss_gib": c["peak_rss_gib"],
                               "shards_wall_s": ray.get("shards_wall_s"), "shards": ray.get("shards"),
                               "workers": ray.get("workers"),
                               "worker_peak_rss_gib": ray.get("peak_rss_gib_per_worker"),
                               "shard_s": ray.get("shard_s"), "shard_cpu_s": ray.get("shard_cpu_s"),
                               "shard_positions": ray.get("shard_positions"),
                               "parts_s": s["timing"]["parts_s"],
                               "identical": bool(frame.equals(first[0]) and rest == first[1])})
            print(f"  round {k + 1} {name}: {c['wall_s']:.1f} s wall, census {s['timing']['census_s']:.1f} s, "
                  f"identical {runs[name][-1]['identical']}", file=sys.stderr)
    best = {name: min(r["wall_s"] for r in rs) for name, rs in runs.items()}
    out_ = {"positions": first[1]["positions"], "store_budget": budget, "rounds": rounds, "arms": runs,
            "best_wall_s": best,
            "identical": all(r["identical"] for rs in runs.values() for r in rs)}
    many = [name for name, _ in arms if name.startswith("ray-") and name != "ray-1"]
    if "ray-1" in runs and many:
        n = int(many[0][4:])
        census = {name: min(r["census_s"] for r in runs[name]) for name in ("ray-1", many[0])}
        cpu = {name: min(sum(r["shard_cpu_s"]) for r in runs[name]) for name in ("ray-1", many[0])}
        out_["scaling_efficiency"] = {
            "workers": n, "wall": round(best["ray-1"] / (n * best[many[0]]), 3),
            "census": round(census["ray-1"] / (n * census[many[0]]), 3),
            # the shards' CPU seconds, 1 worker over N: below 1 when N workers do more work (not load-dependent)
            "work": round(cpu["ray-1"] / cpu[many[0]], 3),
            # what N free cores would give: the 1-worker arm's shard CPU seconds list-scheduled on N workers in
            # submission order (as Ray hands them out), plus its serial part (wall less the shards' wall)
            "from_cpu_s": cpu_model(min(runs["ray-1"], key=lambda r: r["wall_s"]), n),
            "target": 0.8}
    return out_


def retrieval(states: np.ndarray, index: str, queries: int, seed: int = 0) -> dict:
    """Median single-query latency against `states`: the index, and the exact float16 product."""
    from data.index.stateindex import StateIndex, unit

    rng = np.random.default_rng(seed)
    q_rows = rng.choice(len(states), queries, replace=False)
    qs = unit(states[q_rows]) + 0.01 * rng.standard_normal((queries, states.shape[1])).astype(np.float32)
    t0 = time.perf_counter()
    ix = StateIndex(index, states.shape[1])
    for lo in range(0, len(states), 65536):
        ix.add(states[lo:lo + 65536], np.arange(lo, min(len(states), lo + 65536)))
    build_s = time.perf_counter() - t0
    times = []
    for q in qs:
        t = time.perf_counter()
        ix.search(q[None], 8)
        times.append(time.perf_counter() - t)
    mat = torch.from_numpy(unit(states)).to(torch.float16)
    exact = []
    for q in qs[: max(10, queries // 10)]:
        qq = torch.from_numpy(q).to(torch.float16)
        t = time.perf_counter()
        (mat @ qq).topk(8)
        exact.append(time.perf_counter() - t)
    return {"pool": len(states), "index": ix.spec.text, "build_s": round(build_s, 1),
            "bytes_per_state": round(ix.bytes_per_state(), 1),
            "index_query_ms": round(1e3 * float(np.median(times)), 3),
            "exact_fp16_query_ms": round(1e3 * float(np.median(exact)), 3)}


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_scale.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--index", default=DEFAULT_INDEX)
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--recall-sample", type=int, default=512, help="positions whose neighbours are checked against exact")
    ap.add_argument("--skip-census", action="store_true")
    ap.add_argument("--ray", default=None, metavar="auto|local:N|ADDRESS",
                    help="the census on Ray against the single process on the same store (exact key, one thread "
                         "per worker; local:N also runs local:1 for the scaling efficiency), arms interleaved")
    ap.add_argument("--rounds", type=int, default=1, help="--ray: rounds of the interleaved arms")
    ap.add_argument("--store-budget", default=RAY_BUDGET,
                    help=f"--ray: the census's --store-budget (default {RAY_BUDGET}: a serving store is bounded, and the "
                         "exact key over an unbounded 1M-position pool is ~10^4 CPU-seconds; 'none': unbounded)")
    ap.add_argument("--ray-shards", type=int, default=None,
                    help="--ray: shards of every Ray arm (default 4 x N for local:N, else 4 per cluster CPU)")
    ap.add_argument("--skip-retrieval", action="store_true", help="no decoder retrieval measurement")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    slug = model_slug(args.model)
    src = store_dir(args.out, args.bench, slug)
    if not (src / "meta.json").exists():
        raise OilbirdError(f"no trace store at {src}: run `make census BENCH={args.bench}` first")
    scaled_bench = f"scale-{args.bench}-{args.positions // 1000}k"
    dst = store_dir(args.out, scaled_bench, slug)
    t0 = time.perf_counter()
    scale = build_scaled(src, dst, args.positions, args.noise)
    print(f"store: {scale['positions']:,} positions in {scale['requests']:,} requests ({scale['tiles']} tiles of "
          f"{args.bench}), built or reused in {time.perf_counter() - t0:.0f} s: {dst}")
    result = {"store": scale, "index": args.index}

    if args.ray:
        if args.rounds < 1:
            raise OilbirdError(f"--rounds must be >= 1 (got {args.rounds})")
        r = census_on_ray(scaled_bench, args.model, args.out, args.ray, args.rounds, args.bootstrap, args.recall_sample,
                          args.ray_shards, None if args.store_budget == "none" else args.store_budget)
        result["census_ray"] = r
        for name, rs in r["arms"].items():
            w = rs[0]
            mem = f", worker peak {w['worker_peak_rss_gib']:.2f} GiB" if w["worker_peak_rss_gib"] is not None else ""
            print(f"census {name}: best {r['best_wall_s'][name]:.1f} s wall, driver peak "
                  f"{w['driver_peak_rss_gib']:.2f} GiB{mem}")
        print(f"  outputs identical across arms: {r['identical']}")
        if "scaling_efficiency" in r:
            e = r["scaling_efficiency"]
            print(f"  scaling efficiency 1 -> {e['workers']} workers: {e['census']:.2f} (census), {e['wall']:.2f} "
                  f"(wall) (target >= {e['target']}); CPU seconds 1 worker / {e['workers']}: {e['work']:.2f}")
            m = e["from_cpu_s"]
            print(f"  from the shards' CPU seconds on {e['workers']} free cores: {m['shards']:.2f} (shards), "
                  f"{m['wall']:.2f} (wall, {m['serial_s']:.0f} s serial)")
    elif not args.skip_census:
        c = run_census(scaled_bench, args.model, args.out, args.index, args.bootstrap, args.recall_sample)
        s = c.pop("summary")
        parts = s["timing"]["parts_s"]
        c.update(positions=s["positions"], parts_s=parts, index=s.get("index"),
                 gap=s.get("gap"), recall=s.get("recall"))
        base = census_dir(args.out, args.bench, slug) / "summary.json"
        if base.exists():
            b = read_json(base, "census summary")
            bl = b["timing"]["parts_s"].get("lexical")
            if bl:
                per_small = bl / b["positions"]
                per_large = parts.get("lexical", float("nan")) / s["positions"]
                c["lexical_us_per_position"] = {"source": round(1e6 * per_small, 2), "scaled": round(1e6 * per_large, 2),
                                                "ratio": round(per_large / per_small, 2)}
        result["census"] = c
        print(f"census, {s['positions']:,} positions, --index {args.index}: {c['wall_s']:.0f} s wall "
              f"(target <= 600 s), peak RSS {c['peak_rss_gib']:.2f} GiB (target <= 8)")
        print("  parts: " + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()))
        if "lexical_us_per_position" in c:
            lx = c["lexical_us_per_position"]
            print(f"  lexical: {lx['scaled']} us/position at this size vs {lx['source']} on {args.bench} alone "
                  f"(x{lx['ratio']}; 1 = linear)")

    if args.skip_retrieval:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    store = open_store(dst, load_hidden=True)
    states = store.hidden[store.hidden_valid][: args.positions].astype(np.float32)
    del store
    r = retrieval(states, args.index, args.queries)
    from decoder.cost.profile import CostModel

    prof_path = default_profile_path(args.out, slug, "cpu")
    if Path(prof_path).exists():
        cost = CostModel.load(prof_path)
        ctx = int(max(cost.contexts))
        cycle = float(cost.verify_s(args.nodes, ctx))
        r.update(cycle_ms=round(1e3 * cycle, 1), cycle_from=f"{prof_path} (verify {args.nodes} nodes, context {ctx})",
                 index_share=round(r["index_query_ms"] / (1e3 * cycle), 4),
                 exact_share=round(r["exact_fp16_query_ms"] / (1e3 * cycle), 4))
    result["retrieval"] = r
    line = (f"decoder retrieval, pool {r['pool']:,} states: {r['index']} {r['index_query_ms']:.2f} ms/query "
            f"({r['bytes_per_state']} B/state, built in {r['build_s']:.0f} s); exact float16 {r['exact_fp16_query_ms']:.1f} ms")
    if "cycle_ms" in r:
        line += (f"; of a {r['cycle_ms']:.0f} ms cycle: {100 * r['index_share']:.2f}% vs {100 * r['exact_share']:.1f}% "
                 f"(target <= 3%)")
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
