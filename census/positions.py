"""The census's per-position answers: census_run replays the requests in serving order.

census_run replays the requests tenant by tenant (census/pool.py's `Part`: a tenant's requests form
an input of their own, and their rows keep their store request index). For each request it reads
the pool as it stands (past mode: the automaton holds exactly the earlier requests; warm mode: it
holds all of them; with a store budget, the traces that left the window are subtracted), answers
every generated position, then (past mode) adds the request's generated tokens to the automaton
and, with an index, its states to the index. The exact semantic and static-embedding keys are one
batched top-k per request against the pool's rows (census/keys.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from census.definitions import (
    POSITION_COLUMNS,
    CensusConfig,
    CensusInput,
    Entries,
    build_entries,
    entry_valid,
)
from census.index import PoolView
from census.keys import EmbeddingKey, IndexedKey, SemanticKey, make_key
from census.knn import set_exact_matmul
from census.pool import LexicalPool, Part, Setup, TokenEntries, local_rows, prepare
from census.recall import index_block
from data.capture.models import pick_device
from data.errors import OilbirdError
from data.index.budget import LOW_WATER
from data.index.stateindex import IndexSpec


def adjacency_hits(ent, token_entries: TokenEntries, off: int, out: np.ndarray, hi: int,
                   excluded: list[tuple[int, int]], width: int) -> np.ndarray:
    """adj_hit over one request: the topk of the latest earlier entry with the same input."""
    hit = np.zeros(len(out), bool)
    own_latest: dict[int, int] = {}
    pool_latest: dict[int, int] = {}
    for t in range(len(out)):
        y = int(ent.input[off + t])
        e = own_latest.get(y)
        if e is None:
            e = pool_latest.get(y)
            if e is None:
                e = pool_latest[y] = next(token_entries.latest(y, hi, excluded), -1)
        if e >= 0:
            hit[t] = int(out[t]) in ent.topk[e, :width]
        if ent.valid[off + t]:  # entry t becomes an earlier occurrence for the positions after it
            own_latest[y] = off + t
    return hit


def payload_lengths(view: PoolView, ent, tokens: np.ndarray, offsets: np.ndarray, out: np.ndarray,
                    sem_idx: np.ndarray, recovered: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """payload_len and neighbour_match_len at the recovered gap positions (-1 elsewhere)."""
    payload = np.full(len(out), -1, np.int64)
    neighbour = np.full(len(out), -1, np.int64)
    for t in np.nonzero(recovered)[0]:
        fut = out[t:t + cap]
        payload[t] = view.prefix_len(fut, cap)
        best = 0
        for e in sem_idx[t]:
            if e >= 0 and ent.next[e] == out[t]:
                cont = tokens[e:min(int(offsets[ent.request[e] + 1]), e + len(fut))]
                diff = np.nonzero(cont != fut[:len(cont)])[0]
                best = max(best, int(diff[0]) if len(diff) else len(cont))
        neighbour[t] = best
    return payload, neighbour


@dataclass
class CensusResult:
    positions: pl.DataFrame  # one row per generated position (definitions.POSITION_COLUMNS)
    index: dict  # summary.json's "index" block
    pool: dict  # summary.json's "pool_bounds" block


def census_positions(data: CensusInput, cfg: CensusConfig, embeddings: np.ndarray | None = None,
                     progress: bool = False, timings: dict[str, float] | None = None) -> pl.DataFrame:
    """One row per generated position (columns: definitions.POSITION_COLUMNS).

    embeddings: the model's input embedding matrix [vocab, d] for the static-embedding key (None:
    emb_hit is null). timings, when given, accumulates seconds per part of the work."""
    return census_run(data, cfg, embeddings, progress, timings).positions


# What censuses the parts when not this process, part by part (census/ray_census.py `RayParts`):
# (setup, cfg, embeddings, knn_rows, timings) -> (a frame per part with positions, its key, its top-k ids
# at the knn rows), the same lists as the loop in census_run builds.
PartsRunner = Callable[[Setup, CensusConfig, "np.ndarray | None", np.ndarray, dict], tuple[list, list, list]]


def census_run(data: CensusInput, cfg: CensusConfig, embeddings: np.ndarray | None = None,
               progress: bool = False, timings: dict[str, float] | None = None,
               runner: PartsRunner | None = None) -> CensusResult:
    """census_positions, with the index block (recall against exact) and the pool block. runner:
    what censuses the parts (None: this process, in order); everything else (the recall sample,
    the frame, the index and pool blocks) is computed here either way, so the result is the same."""
    timings = {} if timings is None else timings
    clock = [time.perf_counter()]

    def lap(part: str) -> None:
        now = time.perf_counter()
        timings[part] = timings.get(part, 0.0) + now - clock[0]
        clock[0] = now

    if runner is None:  # this process censuses every part: the states it left in the store, read now
        data = data.with_states()
    setup = prepare(data, cfg)
    dev = pick_device(cfg.device)
    set_exact_matmul()
    rng = np.random.default_rng(cfg.seed)
    knn_rows = np.zeros(0, np.int64)
    if not setup.spec.exact:  # the positions whose index neighbours are checked against the exact ones
        valid = np.nonzero(entry_valid(data))[0]
        knn_rows = np.sort(rng.choice(valid, min(len(valid), cfg.recall_sample), replace=False))
    frames, keys, knn_ids = [], [], []
    if runner is not None:
        frames, keys, knn_ids = runner(setup, cfg, embeddings, knn_rows, timings)
        clock[0] = time.perf_counter()
    for part in setup.parts if runner is None else []:
        if not part.data.n_positions:  # a tenant with no generated token has nothing to census
            continue
        df, key, ids = census_part(part, cfg, setup.spec, embeddings, local_rows(part, knn_rows), dev, progress, lap)
        frames.append(df)
        keys.append(key)
        knn_ids.append(ids)
    df = frames[0] if len(frames) == 1 else pl.concat(frames).sort(["request", "position"])
    lap("frame")
    index = index_block(setup, cfg, df, keys, knn_rows, knn_ids, rng, dev)
    lap("recall_check")
    pool_tokens = [part.plan.pool_tokens(r) for part in setup.parts for r in range(part.data.n_requests)]
    pool = {"store_budget": setup.budget.text if setup.budget else None, "budget_tokens": setup.budget_tokens,
            "bytes_per_token": setup.bytes_per_token, "low_water": LOW_WATER if setup.budget else None,
            "mean_pool_tokens": float(np.mean(pool_tokens)), "tenants": len(setup.parts)}
    return CensusResult(df, index, pool)


@dataclass
class PartKeys:
    """What one tenant's census reads each request from: its entries, the keys, the lexical automata."""

    ent: Entries  # census/definitions.py build_entries of the part
    sem: SemanticKey | IndexedKey  # the semantic key (exact, or --index)
    emb: EmbeddingKey | None  # the static-embedding key (None: no embedding matrix)
    token_entries: TokenEntries
    lex: LexicalPool
    outputs: list[np.ndarray]  # each request's generated tokens


def part_keys(part: Part, cfg: CensusConfig, spec: IndexSpec, embeddings: np.ndarray | None,
              dev: torch.device) -> PartKeys:
    """The keys and automata of one tenant's census, before its first request."""
    data = part.data
    ent = build_entries(data)
    offsets = data.offsets
    outputs = [data.tokens[offsets[r]:offsets[r + 1]] for r in range(data.n_requests)]
    sem = make_key(ent, spec, cfg, dev)
    emb = None
    if embeddings is not None:
        E = np.asarray(embeddings)
        top_token = max(int(ent.input.max()), int(data.tokens.max()))
        if E.ndim != 2 or E.shape[0] <= top_token:
            raise OilbirdError(f"embedding matrix {tuple(E.shape)} does not cover token id {top_token}: wrong model")
        emb = EmbeddingKey(E, ent, dev, cfg.candidates)
    return PartKeys(ent, sem, emb, TokenEntries(ent.input, ent.valid),
                    LexicalPool(cfg.pool, cfg.count_len, list(data.prompt_hash), outputs), outputs)


def request_columns(part: Part, keys: PartKeys, cfg: CensusConfig, r: int, lap: Callable[[str], None]
                    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Request r's rows (POSITION_COLUMNS -> array over its generated positions) against its pool as
    it stands, and the semantic key's top-C entry ids [n, C]."""
    data, ent, C = part.data, keys.ent, cfg.candidates
    off, n = int(data.offsets[r]), int(data.offsets[r + 1] - data.offsets[r])
    pool = part.plan.at(r)
    hi, excluded = pool.hi, pool.excluded
    out = keys.outputs[r]

    # lexical: available / producible / suffix lengths
    view = keys.lex.view(r, pool)
    lx = view.lexical_pass(data.prompts[r], out, horizon=cfg.horizon, min_suffix=cfg.min_suffix,
                           max_suffix=cfg.max_suffix, candidates=C)
    lap("lexical")

    # semantic key: top-C pool entries by cosine with the query state (exact, or the index's)
    sem_idx, sem_cos, sem_query_ok = keys.sem.topk(off, n, hi, excluded, C, pool.lo)
    sem_next = np.where(sem_idx >= 0, ent.next[np.maximum(sem_idx, 0)], -1)
    sem_hit = (sem_next == out[:, None]).any(axis=1)
    lap("semantic")

    # static-embedding key
    emb_hit = None
    if keys.emb is not None:
        emb_hit = keys.emb.hits(ent, keys.token_entries, off, n, out, hi, excluded, pool.lo)
        lap("static_embedding")

    adj_hit = adjacency_hits(ent, keys.token_entries, off, out, hi, excluded, min(C, ent.topk.shape[1]))
    gap = lx.available & ~lx.producible
    payload, neighbour = payload_lengths(view, ent, data.tokens, data.offsets, out, sem_idx,
                                         gap & sem_hit & sem_query_ok, cfg.payload_cap)
    cols = {
        "request": np.full(n, part.requests[r]), "position": np.arange(n), "target": out,
        "available": lx.available, "producible": lx.producible, "gap": gap,
        "oracle_suffix_len": lx.oracle_suffix_len, "longest_match_len": lx.longest_match_len,
        "sem_hit": np.where(sem_query_ok, sem_hit, None),
        "sem_best_cos": np.where(sem_query_ok & ~np.isnan(sem_cos[:, 0]), sem_cos[:, 0], None),
        "emb_hit": np.full(n, None) if emb_hit is None else emb_hit, "adj_hit": adj_hit,
        "novel_prev": lx.longest_match_len == 0, "payload_len": np.where(payload >= 0, payload, None),
        "neighbour_match_len": np.where(neighbour >= 0, neighbour, None),
    }
    lap("adjacency_payload")
    return cols, sem_idx


def census_part(part: Part, cfg: CensusConfig, spec: IndexSpec, embeddings: np.ndarray | None,
                sample: np.ndarray, dev: torch.device, progress: bool, lap: Callable[[str], None],
                first: int = 0, last: int | None = None):
    """The census of one tenant's requests: (positions frame with store request indices, the
    semantic key, the key's top-k ids at the `sample` rows [len(sample), candidates]).

    first, last: census only requests [first, last) of the part (a shard, census/ray_census.py);
    requests before `first` join the pool as they would have (the lexical automaton, the key)
    without being censused, so each censused request sees the pool it sees in the whole run."""
    data = part.data
    last = data.n_requests if last is None else last
    keys = part_keys(part, cfg, spec, embeddings, dev)
    sample_ids = np.full((len(sample), cfg.candidates), -1, np.int64)
    cols = {name: [] for name in POSITION_COLUMNS}
    lap("prepare")
    for r in tqdm(range(last), desc="census", unit="req", disable=not progress, leave=False):
        off, n = int(data.offsets[r]), int(data.offsets[r + 1] - data.offsets[r])
        if n and r >= first:
            rows, sem_idx = request_columns(part, keys, cfg, r, lap)
            for name, col in rows.items():
                cols[name].append(col)
            a, b = np.searchsorted(sample, [off, off + n])
            sample_ids[a:b] = sem_idx[sample[a:b] - off]
        keys.lex.finish_request(r)  # past mode: r joins the pool after its own positions
        if n:
            lap("lexical")
            keys.sem.finish(off, n)
            lap("semantic")

    df = pl.DataFrame({name: pl.Series(name, np.concatenate(cols[name]).tolist() if cols[name] else [], dtype=dtype)
                       for name, dtype in POSITION_COLUMNS.items()})
    return df, keys.sem, sample_ids
