"""The census's exact semantic key per pooled row, on a device: what `c_row` in docs/scale.md's cluster
arithmetic costs on one CPU thread and on a GPU.

The census scores each request's positions against every pooled row (census/knn.py `topk_exact`: a float32
matrix product on the device, a top-k, then the float64 rescore of the shortlist on the CPU). This bench
runs that function as census/keys.py `SemanticKey.topk` calls it, on random float16 states, for pools of
several sizes and widths, and reports nanoseconds per (position x pooled row). Random states have fewer
near-ties than real ones, so the shortlist (the CPU part) is at its smallest here; the pooled-row term,
which dominates large pools, is the same.

    python benchmarks/bench_knn_device.py --device cpu --pools 20000 --d 576            # one thread here
    python benchmarks/bench_knn_device.py --device cuda --pools 20000,200000,1000000 --d 576,4096

Writes one JSON (--out) with a row per (device, d, pool): seconds per request, ns per position-row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from census.knn import (
    exact_cosines,
    float32_margin,
    set_exact_matmul,
    topk_exact,
    unit_rows,
)


def measure(device: str, d: int, pool_rows: int, positions: int, requests: int, k: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((pool_rows + positions * requests, d), dtype=np.float32).astype(np.float16)
    norm, unit = unit_rows(states)
    dev = torch.device(device)
    pool = torch.from_numpy(unit[:pool_rows]).to(dev)
    ok = torch.ones(pool_rows, dtype=torch.bool, device=dev)
    tie = -np.arange(pool_rows, dtype=np.int64)  # later rows first, as the census ranks ties
    margin = float32_margin(d)
    times = []
    for r in range(requests + 1):  # the first request warms the device up and is not counted
        q0 = pool_rows + (r % requests) * positions
        rows = np.arange(q0, q0 + positions)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        queries = torch.from_numpy(unit[rows]).to(dev)
        topk_exact(queries, pool, ok, k,
                   lambda qi, pi: exact_cosines(states[rows[qi]], norm[rows[qi]], states[pi], norm[pi]),
                   tie, margin)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    per_request = float(np.median(times))
    return {"device": device, "name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu, 1 thread",
            "d": d, "pool_rows": pool_rows, "positions_per_request": positions, "requests": requests,
            "seconds_per_request": round(per_request, 6),
            "ns_per_position_row": round(per_request / (positions * pool_rows) * 1e9, 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pools", default="20000,200000")
    p.add_argument("--d", default="576")
    p.add_argument("--positions", type=int, default=300, help="positions per request (one query batch)")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    set_exact_matmul()
    rows = []
    for d in (int(x) for x in a.d.split(",")):
        for n in (int(x) for x in a.pools.split(",")):
            row = measure(a.device, d, n, a.positions, a.requests, a.k, a.seed)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        Path(a.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
