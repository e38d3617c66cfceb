"""summary.json: the census in numbers, each proportion with a Wilson and a bootstrap interval.

Top level: bench, model, model_fingerprint, d_model, layer, pool, positions, requests,
requests_with_positions, config (the CensusConfig used), store (its path), store_fingerprint (the
store it was computed on: data/store/reader.py `TraceStore.fingerprint`; the reports mark the census stale
when the store's current one differs) and store_verified (false: the store had no checksums to check
its files against; a note says so too), store_sealed (false: an unsealed meta.json; a note says so), emb_key,
notes, timing, and four proportions
  available   over all positions
  producible  over all positions
  gap         over all positions (available and not producible)
  recall      sem_hit over gap positions
each {value, wilson: [lo, hi], bootstrap: [lo, hi], k, n}. A missing semantic query state
(sem_hit null) counts as a miss everywhere below.

mechanism (why and when the exact key fails, what a recovered position is worth):
  median_context_at_success       median longest_match_len where producible
  median_context_at_recovered_gap median longest_match_len at gap positions with sem_hit
  gap_rate_after_novel            gap rate where novel_prev (the last context token is in no pooled trace)
  gap_rate_base                   gap rate where not novel_prev
  gap_rate_after_producible       gap rate at t >= 1 where position t-1 was producible
  after_producible_relative       gap_rate_after_producible / gap_rate_base
  recall_semantic                 sem_hit over gap positions (= recall)
  recall_static_embedding         emb_hit over gap positions (null without embeddings)
  recall_adjacency                adj_hit over gap positions
  payload_tokens                  mean payload_len at recovered gap positions (gap and sem_hit)
  payload_matched_by_neighbour_tokens  mean neighbour_match_len there
  blind_lexical                   share of positions where neither lexical key (exact suffix
                                  oracle, adjacency) has x_t among its candidates
  blind_with_semantic             ... and neither has the semantic key
  mean_run_lexical                mean length of the maximal runs of consecutive non-blind
                                  positions inside a request (blind = blind_lexical)
  mean_run_with_semantic          the same with blind_with_semantic
  blind_after_blind               share of lexically blind positions at t >= 1 whose position t-1
                                  was lexically blind too
Proportions carry {value, wilson, bootstrap, k, n}; medians, means and ratios {value, bootstrap, n}.

run_census adds blocks that are not functions of positions.parquet:
  index        the semantic key (--index): StateIndex.describe() (spec, factory, trained,
               train_size, bytes_per_state, fixed_bytes, queries, warmup_queries; exact: float16
               states), bytes_per_token (what a pooled token costs: data/index/budget.py bytes_per_token), and
               against the exact key on the same pools: knn_recall (recall@candidates of the key's
               neighbour ids, over knn_sample seeded positions), gap_recall_exact /
               gap_recall_index (each key's sem hit rate at gap_sample seeded gap positions) and
               gap_recall_ratio (index / exact). Up to recall_sample positions each.
  pool_bounds  store_budget, budget_tokens, bytes_per_token, low_water, mean_pool_tokens (tokens in a
               request's pool, mean over requests), tenants (number of tenants, censused apart)
  timing       read_s, census_s, positions_per_s, parts_s (seconds per part of the work), device
  sampled_requests  {count, of, unknown}: the store's requests whose tokens were sampled (requests.parquet
               `sampling`, data/store/sampling.py), of all, and those whose sampling it did not record; a count
               above 0 is said in one line on stderr (what it means: docs/replay.md, "Sampled traces")

coverage (the universe: available positions; keys exact_suffix = producible, adjacency = adj_hit,
static_embedding = emb_hit, semantic = sem_hit; a key that was not computed is null and left out
of the others' "only it" and unions):
  universe                 number of available positions
  reaches[key]             share of the universe where the key has x_t among its candidates
  only_it[key]             share where it does and no other key does
  unions                   exact_suffix|adjacency, exact_suffix|adjacency|semantic, all keys
  lift["a~b"]              P(a and b) / (P(a) P(b)) over the universe (1 = independent)
  semantic_recovers_missed_by[key]  share of the universe positions the key misses where the
                           semantic key hits
"""

from __future__ import annotations

import numpy as np
import polars as pl

from census.definitions import CensusConfig
from data.stats import RequestBootstrap, mean_of, median_of, proportion

KEYS = ("exact_suffix", "adjacency", "static_embedding", "semantic")


def _runs(nonblind: np.ndarray, request: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request: positions inside non-blind runs, and the number of maximal runs."""
    starts = nonblind.copy()
    same = request[1:] == request[:-1]
    starts[1:] &= ~(nonblind[:-1] & same)
    return (np.bincount(request, weights=nonblind, minlength=R),
            np.bincount(request, weights=starts, minlength=R))


def _coverage(keys: dict, universe: np.ndarray, prop, cnt_r, boot: RequestBootstrap) -> dict:
    """The `coverage` block: over the available positions (the universe), what each key reaches, what only it
    reaches, the unions, the pairwise lift and what the semantic key recovers that each other key misses."""
    present = {k: v for k, v in keys.items() if v is not None}
    U = universe
    reaches = {k: (prop(v, U) if v is not None else None) for k, v in keys.items()}
    only_it = {}
    for k, v in keys.items():
        if v is None:
            only_it[k] = None
            continue
        others = np.zeros(len(U), bool)
        for k2, v2 in present.items():
            if k2 != k:
                others |= v2
        only_it[k] = prop(v & ~others, U)
    unions = {
        "exact_suffix|adjacency": prop(keys["exact_suffix"] | keys["adjacency"], U),
        "exact_suffix|adjacency|semantic": prop(keys["exact_suffix"] | keys["adjacency"] | keys["semantic"], U),
        "all": prop(np.logical_or.reduce(list(present.values())), U),
    }
    lift = {}
    names = list(present)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            A, B = present[a] & U, present[b] & U
            n, na, nb, nab = int(U.sum()), int(A.sum()), int(B.sum()), int((A & B).sum())
            lift[f"{a}~{b}"] = {
                "value": n * nab / (na * nb) if na and nb else None,
                "bootstrap": boot.interval(lambda n_, a_, b_, ab_: n_ * ab_ / (a_ * b_),
                                           cnt_r(U), cnt_r(A), cnt_r(B), cnt_r(A & B)),
            }
    recovers = {k: prop(keys["semantic"], U & ~v) for k, v in present.items() if k != "semantic"}
    coverage = {"universe": int(U.sum()), "reaches": reaches, "only_it": only_it, "unions": unions,
                "lift": lift, "semantic_recovers_missed_by": recovers}
    return coverage


def summarize(df: pl.DataFrame, cfg: CensusConfig, *, meta: dict | None = None, notes: list[str] | None = None,
              emb_available: bool | None = None) -> dict:
    """The summary dict of a positions frame (census_positions output, or positions.parquet).

    Longer than most functions here on purpose: the `mechanism` block's rates share the masks built at the
    top (gap, blind, the previous-position shifts) and read as one list in the schema's order; the
    `coverage` block, which needs only the keys' masks, is `_coverage`."""
    meta = meta or {}
    df = df.sort(["request", "position"])
    req_ids = df["request"].to_numpy()
    uniq, request = np.unique(req_ids, return_inverse=True)  # bootstrap over requests with positions
    R = len(uniq)
    boot = RequestBootstrap(R, cfg.bootstrap, cfg.seed)
    col = lambda name: df[name].fill_null(False).to_numpy().astype(bool)  # noqa: E731
    available, producible, gap, adj = col("available"), col("producible"), col("gap"), col("adj_hit")
    sem = col("sem_hit")
    if emb_available is None:
        emb_available = df["emb_hit"].null_count() < df.height
    emb = col("emb_hit") if emb_available else None
    novel = col("novel_prev")
    longest = df["longest_match_len"].to_numpy()
    everywhere = np.ones(df.height, bool)
    has_prev = np.r_[False, req_ids[1:] == req_ids[:-1]]
    prev = lambda x: np.r_[False, x[:-1]] & has_prev  # noqa: E731

    def prop(num, den):
        return proportion(num, den, request, boot)

    recovered = gap & sem
    blind_lex = ~producible & ~adj
    blind_sem = blind_lex & ~sem
    base, after_prod = prop(gap, ~novel), prop(gap, prev(producible))
    R_ = boot.n_requests
    gap_r = lambda m: np.bincount(request, weights=gap & m, minlength=R_)  # noqa: E731
    cnt_r = lambda m: np.bincount(request, weights=m, minlength=R_)  # noqa: E731
    relative = {
        "value": after_prod["value"] / base["value"] if after_prod["value"] is not None and base["value"] else None,
        "bootstrap": boot.interval(lambda a, b, c, d: (a / b) / (c / d), gap_r(prev(producible)),
                                   cnt_r(prev(producible)), gap_r(~novel), cnt_r(~novel)),
    }
    run_len_lex, runs_lex = _runs(~blind_lex, request, R_)
    run_len_sem, runs_sem = _runs(~blind_sem, request, R_)

    def mean_run(length_r, runs_r):
        total, count = length_r.sum(), runs_r.sum()
        return {"value": float(total / count) if count else None,
                "bootstrap": boot.interval(np.divide, length_r, runs_r), "n": int(count)}

    payload = df["payload_len"].fill_null(0).to_numpy()
    neighbour = df["neighbour_match_len"].fill_null(0).to_numpy()
    mechanism = {
        "median_context_at_success": median_of(longest, producible, request, boot),
        "median_context_at_recovered_gap": median_of(longest, recovered, request, boot),
        "gap_rate_after_novel": prop(gap, novel),
        "gap_rate_base": base,
        "gap_rate_after_producible": after_prod,
        "after_producible_relative": relative,
        "recall_semantic": prop(sem, gap),
        "recall_static_embedding": prop(emb, gap) if emb is not None else None,
        "recall_adjacency": prop(adj, gap),
        "payload_tokens": mean_of(payload, recovered, request, boot),
        "payload_matched_by_neighbour_tokens": mean_of(neighbour, recovered, request, boot),
        "blind_lexical": prop(blind_lex, everywhere),
        "blind_with_semantic": prop(blind_sem, everywhere),
        "mean_run_lexical": mean_run(run_len_lex, runs_lex),
        "mean_run_with_semantic": mean_run(run_len_sem, runs_sem),
        "blind_after_blind": prop(blind_lex, prev(blind_lex)),
    }

    keys = {"exact_suffix": producible, "adjacency": adj, "static_embedding": emb, "semantic": sem}
    coverage = _coverage(keys, available, prop, cnt_r, boot)

    out_notes = list(notes or [])
    if not emb_available and not any("static-embedding" in n for n in out_notes):
        out_notes.append("static-embedding key not computed (no embedding matrix): emb_hit is null")
    return {
        "bench": meta.get("bench"),
        "model": meta.get("model"),
        "model_fingerprint": meta.get("model_fingerprint"),
        "layer": meta.get("layer"),
        "d_model": meta.get("d_model"),
        "pool": cfg.pool,
        "positions": int(df.height),
        "requests": int(meta.get("n_requests") or R),
        "requests_with_positions": R,
        "config": cfg.as_dict(),
        "available": prop(available, everywhere),
        "producible": prop(producible, everywhere),
        "gap": prop(gap, everywhere),
        "recall": prop(sem, gap),
        "emb_key": bool(emb_available),
        "mechanism": mechanism,
        "coverage": coverage,
        "notes": out_notes,
    }
