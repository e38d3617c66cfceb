"""`make bench-census`: census throughput on synthetic traces, and how its time grows with size.

Synthetic traffic shaped like tool calls: requests of --out-len generated tokens made of recurring
frames (fixed token spans) whose slots hold a recurring value or, with probability --mint, a token
minted for that request; states are one base vector per frame slot plus noise (float16), so the
lexical index, the oracle's back-off and the semantic key all have real work. Reports, per size
and state width, positions/s and the seconds spent in each part (lexical = suffix automaton,
oracle, availability; semantic = the batched exact kNN; static_embedding; adjacency_payload), and
the growth exponent between consecutive sizes (time ~ positions^k: 1 is linear; the kNN is
quadratic by nature, one product of every position against the pool before it).
Usage: python benchmarks/bench_census.py [--sizes 10k,50k,200k] [--dims 576,4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from census.definitions import CensusConfig, CensusInput
from census.positions import census_positions
from data.capture.models import pick_device
from data.errors import OilbirdError, cli_entry


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = 1000 if text.endswith("k") else 1
    try:
        return int(float(text.rstrip("k")) * scale)
    except ValueError:
        raise OilbirdError(f"cannot read size '{text}' (use e.g. 10k or 50000)") from None


def synthetic(n_positions: int, d: int, *, vocab: int = 32000, out_len: int = 200, mint: float = 0.3,
              seed: int = 0) -> tuple[CensusInput, np.ndarray]:
    """Tool-call-like traces (see the module docstring) and a random embedding matrix."""
    rng = np.random.default_rng(seed)
    n_frames, n_values = 60, 400
    frames = [rng.integers(1000, vocab, int(rng.integers(6, 30))) for _ in range(n_frames)]
    values = rng.integers(1000, vocab, n_values)
    slot_base = rng.standard_normal((n_frames * 32 + 1, d)).astype(np.float32)  # last row: filler
    R = math.ceil(n_positions / out_len)
    tokens, slots, prompts, offsets = [], [], [], [0]
    for r in range(R):
        n = min(out_len, n_positions - offsets[-1])
        toks, sl = [], []
        while len(toks) < n:
            f = int(rng.integers(n_frames))
            for i, tok in enumerate(frames[f]):
                toks.append(int(tok))
                sl.append(f * 32 + i)
            if rng.random() < mint:  # a value minted for this request
                toks.append(int(rng.integers(1000, vocab)))
            else:
                toks.append(int(values[rng.integers(n_values)]))
            sl.append(f * 32 + 31)
        tokens += toks[:n]
        slots += sl[:n]
        offsets.append(offsets[-1] + n)
        prompts.append(rng.integers(1000, vocab, 64))
    N = offsets[-1]
    slots = np.asarray(slots)
    hidden = np.empty((N, d), np.float16)
    for lo in range(0, N, 8192):  # chunked: a float32 copy of the widest case is 3 GB
        hi = min(N, lo + 8192)
        noise = rng.standard_normal((hi - lo, d), dtype=np.float32)
        hidden[lo:hi] = slot_base[slots[lo:hi]] + 0.6 * noise
    valid = np.ones(N, bool)
    valid[np.asarray(offsets[1:]) - 1] = False
    data = CensusInput(
        prompts=prompts, tokens=np.asarray(tokens, np.int64), offsets=np.asarray(offsets, np.int64), hidden=hidden,
        hidden_valid=valid, topk=rng.integers(1000, vocab, (N, 8)), prompt_last_hidden=rng.standard_normal((R, d)).astype(np.float16),
        prompt_last_topk=rng.integers(1000, vocab, (R, 8)), prompt_hash=[f"p{r}" for r in range(R)],
        meta={"bench": "synthetic", "model": "synthetic", "d_model": d})
    embeddings = rng.standard_normal((vocab, d), dtype=np.float32)
    return data, embeddings


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10k,50k,200k", help="generated positions per run (comma-separated)")
    ap.add_argument("--dims", default="576,4096", help="state widths (comma-separated)")
    ap.add_argument("--out-len", type=int, default=200, help="generated tokens per request")
    ap.add_argument("--pool", choices=["past", "warm"], default="past")
    ap.add_argument("--device", default=None, help="kNN device (default: cuda when available)")
    ap.add_argument("--no-embeddings", action="store_true", help="skip the static-embedding key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    dims = [int(x) for x in args.dims.split(",") if x.strip()]
    print(f"census benchmark: sizes {sizes}, dims {dims}, {args.out_len} tokens/request, pool {args.pool}, "
          f"device {pick_device(args.device)}, torch threads {torch.get_num_threads()}")
    results = []
    for d in dims:
        prev = None
        for n in sizes:
            data, emb = synthetic(n, d, out_len=args.out_len, seed=args.seed)
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            df = census_positions(data, CensusConfig(pool=args.pool, device=args.device),
                                  embeddings=None if args.no_embeddings else emb, timings=timings)
            total = time.perf_counter() - t0
            row = {"positions": n, "d": d, "requests": data.n_requests, "seconds": round(total, 2),
                   "positions_per_s": round(n / total, 1), "parts_s": {k: round(v, 2) for k, v in timings.items()},
                   "gap": round(float(df["gap"].mean()), 4), "recall": round(float(df.filter(df["gap"])["sem_hit"].mean()), 4)}
            if prev is not None:
                ratio = math.log(n / prev["positions"])
                row["growth_total"] = round(math.log(total / prev["seconds"]) / ratio, 2)
                row["growth_lexical"] = round(math.log(timings["lexical"] / prev["parts_s"]["lexical"]) / ratio, 2)
            results.append(row)
            prev = row
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["parts_s"].items())
            growth = f"; growth total ^{row['growth_total']}, lexical ^{row['growth_lexical']}" if "growth_total" in row else ""
            print(f"  {n:>7} positions, d={d:<5}: {total:7.1f} s, {n / total:8.0f} positions/s  ({parts}){growth}",
                  flush=True)
            del data, emb, df
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
