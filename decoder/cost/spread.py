"""The spread of a profile's repetitions, and the cost models at its two ends (issue 45, item 2).

A verification-cost profile (decoder/cost/profile.py, decoder/cost/vllm_profile.py) times every (context, nodes) point
`reps` times and keeps the median in `verify_s`; it also keeps the fastest and the slowest of those reps,
`verify_s_min` and `verify_s_max` (the same contexts x nodes grid). The profile sizes the cost-sized drafts and
prices every arm, so the sole-source share and the speedups, and with them the verdict, move with it. Two
ends of the measured spread:

  fast   every verify step at the fastest of its reps (verify_s_min)
  slow   every verify step at the slowest of its reps (verify_s_max)

Prefill stays at its median (it prices greedy and every arm alike, and sizes nothing), as do the batch-size
grids (`verify_s_by_batch`: the verdict's pair is sized for batch 1). Replay sizes and prices the verdict's
pair at both ends (decoder/replay/run.py `profile_spread`) and the decision block says whether the verdict holds
at both (decoder/verdict.py `spread_line`). This is the spread taken whole, every point at one end at once;
a mix of ends (one point fast, its neighbour slow) can size the drafts differently again, and is not tried.

A profile written before the spread was kept (no verify_s_min / verify_s_max), or timed once a point
(`reps` 1), has no spread: "spread unknown". One that holds a spread which is not one (another shape, a
time that is not a positive finite number, a fastest rep above the median or a slowest below it) is refused
in one line: the file is damaged.
"""

from __future__ import annotations

import math

import numpy as np

from data.errors import OilbirdError

SPREAD_KEYS = ("verify_s_min", "verify_s_max")
ENDS = {"fast": "verify_s_min", "slow": "verify_s_max"}
END_TEXT = {"fast": "every step at the fastest of its repetitions",
            "slow": "every step at the slowest of its repetitions"}


def spread_fields(ends: list[list[tuple[float, float]]]) -> dict:
    """The profile's spread fields from, per context, the (fastest, slowest) rep of each node count."""
    return {"verify_s_min": [[lo for lo, _ in row] for row in ends],
            "verify_s_max": [[hi for _, hi in row] for row in ends]}


def _remeasure(cost) -> str:
    model = cost.meta.get("model", "M")
    engine = cost.meta.get("engine", "harness")
    where = f" --file {cost.meta['path']}" if cost.meta.get("path") else ""
    return f"`python -m decoder profile --model {model} --engine {engine}{where}` measures it again with its spread"


def spread_ends(cost) -> tuple[dict | None, str | None]:
    """({"fast": CostModel, "slow": CostModel}, None) for a profile that kept its spread, else (None, the line
    saying why it is unknown). A spread that is not one is an OilbirdError naming the file. The ends are
    built as `cost`'s own class (decoder/cost/model.py's CostModel): this module imports none of
    decoder/cost/profile.py, which imports it."""
    meta = cost.meta
    name = meta.get("path") or "the profile"
    present = [k for k in SPREAD_KEYS if meta.get(k) is not None]
    if not present:
        return None, (f"spread unknown: {name} keeps only the median of its repetitions (measured before the "
                      f"spread was recorded); {_remeasure(cost)}")
    if len(present) == 1:
        raise OilbirdError(f"{name} is not a decoder profile ({present[0]} without "
                           f"{next(k for k in SPREAD_KEYS if k not in present)}); {_remeasure(cost)}")
    median = cost.verify
    grids = {}
    for end, key in ENDS.items():
        try:
            grid = np.asarray(meta[key], dtype=np.float64)
        except (TypeError, ValueError):
            grid = None
        if grid is None or grid.shape != median.shape:
            raise OilbirdError(f"{name} is not a decoder profile ({key} is not a grid of {median.shape[0]} contexts x "
                               f"{median.shape[1]} nodes like verify_s); {_remeasure(cost)}")
        if not (np.all(np.isfinite(grid)) and np.all(grid > 0)):
            raise OilbirdError(f"{name} is not a decoder profile ({key} holds a time that is not a positive finite "
                               f"number); {_remeasure(cost)}")
        grids[end] = grid
    slack = 1e-9 * np.maximum(1.0, median)
    if np.any(grids["fast"] > median + slack) or np.any(grids["slow"] < median - slack):
        raise OilbirdError(f"{name} is not a decoder profile (a fastest repetition above its median, or a slowest "
                           f"below it); {_remeasure(cost)}")
    reps = meta.get("reps")
    if isinstance(reps, int) and not isinstance(reps, bool) and reps < 2:
        return None, f"spread unknown: {name} timed each point once (--reps {reps}); {_remeasure(cost)}"
    base = {k: v for k, v in meta.items() if k not in SPREAD_KEYS}
    return {end: type(cost)(cost.contexts, cost.nodes, grid, cost.prefill_lengths, cost.prefill,
                           {**base, "spread_end": end}) for end, grid in grids.items()}, None


def spread_width(cost) -> float | None:
    """The widest spread of a verify point, slowest / fastest - 1 (0.2: its slowest rep 20% above its fastest),
    for the summary; None without a (valid) spread."""
    lo, hi = cost.meta.get("verify_s_min"), cost.meta.get("verify_s_max")
    try:
        width = np.asarray(hi, np.float64) / np.asarray(lo, np.float64) - 1
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    value = float(np.max(width)) if lo is not None and hi is not None and width.size else None
    return value if value is not None and math.isfinite(value) and value >= 0 else None
