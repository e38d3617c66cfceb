"""Agreement between two captures of the same requests (one engine against another: vLLM serving
against the harness), defined once here.

Over the requests both stores hold (matched by request id, and only where the prompt tokens are the
same; a request whose prompts differ is counted apart, never compared):
  - identical          requests whose generated tokens are equal, token for token, length included;
  - first_divergence   per differing request, the first position where the tokens differ (the shorter
                       length when one output is a prefix of the other); summarised as min / median / max;
  - state_cosine_min   over the positions both stores hold a state for, in the identical requests, the
                       smallest cosine between the two engines' states (the capture layer's numerics);
  - topk_agree         over those positions, the fraction whose top-8 ids are equal as sets.
`agreement(a, b)` takes two opened stores (data.store.reader.TraceStore) and returns the dict that a store's
meta.json keeps under "agreement" (with the other store's path and fingerprint) and the benches print;
`record_agreement` writes it there (`python -m data capture --agree-with OTHER_STORE`).
"""

from __future__ import annotations

import statistics

import numpy as np


def first_difference(a, b) -> int:
    """The first index where two token lists differ; the shorter length when one is a prefix of the other."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _rows_cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = x.astype(np.float64), y.astype(np.float64)
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    ok = (nx > 0) & (ny > 0)
    return (x[ok] * y[ok]).sum(axis=1) / (nx[ok] * ny[ok])


def agreement(a, b) -> dict:
    """The agreement of store `b` with store `a` over their common requests (module docstring)."""
    from data.store.reader import store_fingerprint

    index_a = {rid: r for r, rid in enumerate(a.requests["id"].to_list())}
    compared, identical, prompt_differs = 0, 0, 0
    divergences: list[dict] = []
    cos_min, topk_same, topk_total = None, 0, 0
    for rb, rid in enumerate(b.requests["id"].to_list()):
        ra = index_a.get(rid)
        if ra is None:
            continue
        if a.prompt(ra) != b.prompt(rb):
            prompt_differs += 1
            continue
        compared += 1
        ta, tb = a.tokens(ra), b.tokens(rb)
        if len(ta) != len(tb) or not np.array_equal(ta, tb):
            divergences.append({"id": rid, "position": first_difference(ta, tb), "tokens": [len(ta), len(tb)]})
            continue
        identical += 1
        sa, sb = slice(a.offsets[ra], a.offsets[ra + 1]), slice(b.offsets[rb], b.offsets[rb + 1])
        both = a.hidden_valid[sa] & b.hidden_valid[sb]
        if both.any():
            cos = _rows_cosine(a.hidden[sa][both], b.hidden[sb][both])
            if len(cos):
                cos_min = float(cos.min()) if cos_min is None else min(cos_min, float(cos.min()))
            ka, kb = np.sort(a.topk[sa][both], axis=1), np.sort(b.topk[sb][both], axis=1)
            topk_same += int((ka == kb).all(axis=1).sum())
            topk_total += int(both.sum())
    positions = [d["position"] for d in divergences]
    return {
        "with": str(a.path), "with_fingerprint": store_fingerprint(a.meta), "with_engine": a.meta.get("engine", "harness"),
        "requests": compared, "identical": identical, "prompt_differs": prompt_differs,
        "first_divergence": ({"min": min(positions), "median": statistics.median(positions), "max": max(positions)}
                             if positions else None),
        "divergent": divergences[:20],  # the first few, for a reader to look at
        "state_cosine_min": round(cos_min, 7) if cos_min is not None else None,
        "topk_agree": round(topk_same / topk_total, 6) if topk_total else None,
    }


def record_agreement(path, other) -> dict:
    """Compare the store at `path` with the store `other` and record the result in `path`'s meta.json
    (under the store's write lock); one line on stderr says what was found."""
    import sys
    from pathlib import Path

    from data.store.reader import open_store, read_meta
    from data.store.writer import StoreWriter

    result = agreement(open_store(other), open_store(path))
    with StoreWriter(path, read_meta(Path(path))) as writer:
        writer.finish(agreement=result)
    div = result["first_divergence"]
    print(f"agreement with {other}: {result['identical']} of {result['requests']} common requests identical"
          + (f", first divergence at token {div['min']}-{div['max']} (median {div['median']})" if div else "")
          + (f"; state cosine >= {result['state_cosine_min']}" if result["state_cosine_min"] is not None else ""),
          file=sys.stderr)
    return result
