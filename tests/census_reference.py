"""Plain-loop brute force of every census definition (census/definitions.py), for the tests.

Nothing here is shared with the fast implementation: the pool is re-listed for every request,
every n-gram question is answered by scanning every pooled trace, and every kNN by scoring every
pool entry. Cosines are exact dot products (math.fsum) over the stored values. A store budget is
replayed literally (traces join, the oldest leave), tenants by filtering the pool.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


def _occurs(v: list[int], seq: list[int]) -> bool:
    L = len(v)
    return any(seq[i:i + L] == v for i in range(len(seq) - L + 1))


def _cos(a, b) -> float | None:
    a = [float(x) for x in a]
    b = [float(x) for x in b]
    na = math.sqrt(math.fsum(x * x for x in a))
    nb = math.sqrt(math.fsum(x * x for x in b))
    if na == 0 or nb == 0:
        return None
    return math.fsum(x * y for x, y in zip(a, b)) / (na * nb)


def _valid(tr) -> list[bool]:
    if tr.hidden_valid is not None:
        return [bool(v) for v in tr.hidden_valid][:len(tr.output)]
    return [i < len(tr.output) - 1 for i in range(len(tr.output))]


def _entry(tr, j: int):
    """(input, state, topk, has_state) of the computation that predicted tr.output[j]."""
    if j == 0:
        return int(tr.prompt[-1]), tr.prompt_last_hidden, list(tr.prompt_last_topk), True
    return int(tr.output[j - 1]), tr.hidden[j - 1], list(tr.topk[j - 1]), _valid(tr)[j - 1]


def reference_windows(lengths: list[int], budget_tokens: int | None, low_water: float = 0.875) -> list[list[int]]:
    """The requests each request's bounded pool holds, replayed: a request's trace joins when it is
    served; a join that takes the pool above the budget makes the oldest traces leave until the pool
    holds at most low_water x budget tokens."""
    held: list[int] = []
    windows = []
    for r, n in enumerate(lengths):
        windows.append(list(held))
        held.append(r)
        if budget_tokens is not None and sum(lengths[q] for q in held) > budget_tokens:
            while held and sum(lengths[q] for q in held) > low_water * budget_tokens:
                held.pop(0)
    return windows


def reference_census(traces, cfg, embeddings=None) -> list[dict]:
    """Every position's answers (exact semantic key). cfg.store_budget in tokens, or in MB at 2 d + 20
    bytes per token (float16 state, two int64 row pointers, int32 token); tenants from Trace.tenant."""
    from data.index.budget import parse_budget

    R = len(traces)
    start = [0]
    for tr in traces:
        start.append(start[-1] + len(tr.output))
    hashes = [tr.prompt_hash for tr in traces]
    tenants = [getattr(tr, "tenant", "") or "" for tr in traces]
    budget = parse_budget(getattr(cfg, "store_budget", None))
    d = len(np.asarray(traces[0].prompt_last_hidden))
    budget_tokens = None if budget is None else budget.in_tokens(2 * d + 20)
    windows = reference_windows([len(tr.output) for tr in traces], budget_tokens)
    C = cfg.candidates
    rows = []
    for r, tr in enumerate(traces):
        if cfg.pool == "past":
            pool = [q for q in windows[r] if hashes[q] != hashes[r] and tenants[q] == tenants[r]]
        else:
            pool = [q for q in range(R) if q != r and hashes[q] != hashes[r] and tenants[q] == tenants[r]]
        seqs = [[int(x) for x in traces[q].output] for q in pool]
        entries = []
        for q in pool:
            for j in range(len(traces[q].output)):
                inp, state, topk, ok = _entry(traces[q], j)
                if ok:
                    entries.append({"index": start[q] + j, "request": q, "j": j, "input": inp, "state": state,
                                    "topk": topk, "next": int(traces[q].output[j])})
        out = [int(x) for x in tr.output]
        prompt = [int(x) for x in tr.prompt]
        for t, x in enumerate(out):
            ctx = prompt + out[:t]
            y = ctx[-1]
            available = any(_occurs(out[t:t + cfg.horizon], s) for s in seqs)

            longest = max([L for L in range(1, min(cfg.max_suffix, len(ctx)) + 1)
                           if any(_occurs(ctx[-L:], s) for s in seqs)], default=0)

            cands, found, used = [], 0, 0
            for L in range(min(cfg.max_suffix, len(ctx)), cfg.min_suffix - 1, -1):
                u = ctx[-L:]
                counts = Counter()
                for s in seqs:
                    for i in range(len(s) - L):  # an occurrence followed by a token of the same trace
                        if s[i:i + L] == u:
                            counts[s[i + L]] += 1
                if not counts:
                    continue
                used = used or L
                for a in sorted(counts, key=lambda a: (-counts[a], a)):
                    if a not in cands:
                        cands.append(a)
                        if a == x:
                            found = L
                        if len(cands) >= C:
                            break
                if len(cands) >= C:
                    break
            producible = x in cands

            _, query, _, query_ok = _entry(tr, t)
            sem_hit = best = None
            top = []
            if query_ok and _cos(query, query) is not None:
                scored = [(_cos(query, e["state"]), e) for e in entries]
                scored = sorted([(c, e) for c, e in scored if c is not None], key=lambda ce: (-ce[0], -ce[1]["index"]))
                top = scored[:C]
                sem_hit = any(e["next"] == x for _, e in top)
                best = top[0][0] if top else None

            emb_hit = None
            if embeddings is not None and _cos(embeddings[y], embeddings[y]) is not None:
                scored = [(_cos(embeddings[y], embeddings[e["input"]]), e) for e in entries]
                scored = sorted([(c, e) for c, e in scored if c is not None],
                                key=lambda ce: (-ce[0], ce[1]["input"], -ce[1]["index"]))
                emb_hit = any(e["next"] == x for _, e in scored[:C])

            occurrence = None
            for j in range(t):  # own context: the latest earlier entry with input y and a topk
                inp, _, topk, ok = _entry(tr, j)
                if ok and inp == y:
                    occurrence = topk
            if occurrence is None:
                pool_hits = [e for e in entries if e["input"] == y]
                if pool_hits:
                    occurrence = max(pool_hits, key=lambda e: e["index"])["topk"]
            adj_hit = occurrence is not None and x in occurrence[:min(C, len(occurrence))]

            gap = available and not producible
            payload = neighbour = None
            if gap and sem_hit:
                fut = out[t:t + cfg.payload_cap]
                payload = max([L for L in range(1, len(fut) + 1) if any(_occurs(fut[:L], s) for s in seqs)], default=0)
                neighbour = 0
                for _, e in top:
                    if e["next"] != x:
                        continue
                    cont = [int(v) for v in traces[e["request"]].output[e["j"]:]]
                    m = 0
                    while m < len(fut) and m < len(cont) and cont[m] == fut[m]:
                        m += 1
                    neighbour = max(neighbour, m)

            rows.append({
                "request": r, "position": t, "target": x, "available": available, "producible": producible,
                "gap": gap, "oracle_suffix_len": found if producible else used, "longest_match_len": longest,
                "sem_hit": sem_hit, "sem_best_cos": best, "emb_hit": emb_hit, "adj_hit": adj_hit,
                "novel_prev": not any(y in s for s in seqs), "payload_len": payload, "neighbour_match_len": neighbour,
            })
    return rows


def as_rows(df) -> list[dict]:
    return df.to_dicts()


def compare(fast_rows: list[dict], ref_rows: list[dict], tol: float = 1e-9) -> list[str]:
    """Human-readable differences (empty when the two agree)."""
    problems = []
    if len(fast_rows) != len(ref_rows):
        return [f"{len(fast_rows)} fast rows vs {len(ref_rows)} reference rows"]
    for f, g in zip(fast_rows, ref_rows):
        for k, v in g.items():
            w = f[k]
            if k == "sem_best_cos" and v is not None and w is not None:
                same = abs(w - v) <= tol
            else:
                same = (w == v) if not isinstance(v, (float, np.floating)) else w == v
            if not same:
                problems.append(f"request {g['request']} position {g['position']}: {k} fast={w!r} ref={v!r}")
    return problems
