"""The census, end to end: per-position answers (census_positions), the summary, and the outputs.

census_positions replays the requests in serving order. For each request it reads the pool as it
stands (past mode: the automaton holds exactly the earlier requests; warm mode: it holds all of
them), answers every generated position, then (past mode) adds the request's generated tokens to
the automaton. The semantic and static-embedding keys are one batched top-k per request against
the pool's rows (pool rows of request q are a contiguous range, so the past pool is a prefix and
an excluded trace a masked range).
"""

from __future__ import annotations

import bisect
import os
import shutil
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from census.definitions import POSITION_COLUMNS, CensusConfig, CensusInput, build_entries
from census.index import PoolView, SuffixAutomaton
from census.knn import exact_cosines, float32_margin, pick_device, set_exact_matmul, topk_exact, unit_rows
from census.summary import summarize
from data.errors import OilbirdError
from data.models import model_slug, same_model
from data.store import (atomic_write_json, atomic_write_table, clean_leftovers, fault_point, is_stale, make_tmp_dir,
                        open_store, store_dir)


# ---------------------------------------------------------------- pool bookkeeping

class TokenEntries:
    """token -> its valid entries in serving order, with 'latest before hi, outside ranges'."""

    def __init__(self, tokens: np.ndarray, valid: np.ndarray):
        idx = np.nonzero(valid)[0]
        order = np.argsort(tokens[idx], kind="stable")
        idx = idx[order]
        toks = tokens[idx]
        cuts = np.nonzero(np.diff(toks))[0] + 1
        self.lists: dict[int, list[int]] = {
            int(t): grp.tolist() for t, grp in zip(toks[np.r_[0, cuts]] if len(toks) else [], np.split(idx, cuts))
        }

    def latest(self, token: int, hi: int, excluded: list[tuple[int, int]]):
        """Entries of `token` below hi, outside the excluded [a, b) ranges, latest first."""
        lst = self.lists.get(int(token))
        if not lst:
            return
        starts = [a for a, _ in excluded]
        i = bisect.bisect_left(lst, hi) - 1
        while i >= 0:
            e = lst[i]
            k = bisect.bisect_right(starts, e) - 1
            if k >= 0 and e < excluded[k][1]:
                i = bisect.bisect_left(lst, excluded[k][0]) - 1
                continue
            yield e
            i -= 1


class LexicalPool:
    """The automata a request's pool is read from: `main` holds every trace the mode pools so far
    (past: the requests before this one; warm: all of them), and one automaton per prompt_hash
    holds the traces of `main` that share it, to be subtracted."""

    def __init__(self, mode: str, count_len: int, hashes: list[str], outputs: list[np.ndarray]):
        self.mode, self.count_len, self.hashes, self.outputs = mode, count_len, hashes, outputs
        self.main = SuffixAutomaton(count_len)
        self.groups: dict[str, SuffixAutomaton] = {}
        self.by_hash: dict[str, list[int]] = {}
        for q, h in enumerate(hashes):
            self.by_hash.setdefault(h, []).append(q)
        if mode == "warm":
            for out in outputs:
                self.main.add_trace(out)

    def members(self, r: int) -> list[int]:
        """Traces of r's hash group that `main` holds (and r's pool must leave out)."""
        group = self.by_hash[self.hashes[r]]
        return group if self.mode == "warm" else group[:bisect.bisect_left(group, r)]

    def view(self, r: int, members: list[int]) -> PoolView:
        if not members:
            return PoolView(self.main)
        sam = self.groups.setdefault(self.hashes[r], SuffixAutomaton(self.count_len))
        for q in members[sam.n_traces:]:  # members only grow, in order
            sam.add_trace(self.outputs[q])
        return PoolView(self.main, sam)

    def finish_request(self, r: int) -> None:
        if self.mode == "past":
            self.main.add_trace(self.outputs[r])


class SemanticKey:
    """The semantic key: unit rows of every entry state in one device tensor. Request r's queries
    are its own entries' states (entry (r, t) holds the state that predicts x_t); its pool is a
    prefix of the rows (past) or all of them (warm), with excluded traces masked."""

    def __init__(self, ent, dev: torch.device):
        self.ent = ent
        self.norm, unit = unit_rows(ent.state, ent.valid)
        self.ok = ent.valid & (self.norm > 0)
        self.pool = torch.from_numpy(unit).to(dev)
        self.pool_ok = torch.from_numpy(self.ok).to(dev)
        self.dev = dev
        self.later_first = -np.arange(len(self.ok), dtype=np.int64)
        self.margin = float32_margin(ent.state.shape[1])

    def topk(self, off: int, n: int, hi: int, excluded: list[tuple[int, int]], k: int):
        """(entry index [n, k], exact cosine [n, k], query present [n]) for request rows off..off+n."""
        ok = self.pool_ok[:hi].clone()
        for a, b in excluded:
            ok[a:min(b, hi)] = False
        query_ok = self.ok[off:off + n]
        rows = off + np.nonzero(query_ok)[0]  # a missing query state asks nothing
        idx = np.full((n, k), -1, np.int64)
        cos = np.full((n, k), np.nan)
        state, norm = self.ent.state, self.norm
        idx[query_ok], cos[query_ok] = topk_exact(
            self.pool[torch.from_numpy(rows).to(self.dev)], self.pool[:hi], ok, k,
            lambda qi, pi: exact_cosines(state[rows[qi]], norm[rows[qi]], state[pi], norm[pi]),
            self.later_first[:hi], self.margin)
        return idx, cos, query_ok


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


# ---------------------------------------------------------------- the census

def census_positions(data: CensusInput, cfg: CensusConfig, embeddings: np.ndarray | None = None,
                     progress: bool = False, timings: dict[str, float] | None = None) -> pl.DataFrame:
    """One row per generated position (columns: definitions.POSITION_COLUMNS).

    embeddings: the model's input embedding matrix [vocab, d] for the static-embedding key (None:
    emb_hit is null). timings, when given, accumulates seconds per part of the work."""
    timings = {} if timings is None else timings
    clock = [time.perf_counter()]

    def lap(part: str) -> None:
        now = time.perf_counter()
        timings[part] = timings.get(part, 0.0) + now - clock[0]
        clock[0] = now

    cfg.validate()
    data.check()
    ent = build_entries(data)
    N, R = data.n_positions, data.n_requests
    offsets = data.offsets
    dev = pick_device(cfg.device)
    set_exact_matmul()
    C = cfg.candidates
    adj_width = min(C, ent.topk.shape[1])
    outputs = [data.tokens[offsets[r]:offsets[r + 1]] for r in range(R)]
    hashes = list(data.prompt_hash)

    sem = SemanticKey(ent, dev)
    emb = None
    if embeddings is not None:
        E = np.asarray(embeddings)
        top_token = max(int(ent.input.max()), int(data.tokens.max()))
        if E.ndim != 2 or E.shape[0] <= top_token:
            raise OilbirdError(f"embedding matrix {tuple(E.shape)} does not cover token id {top_token}: wrong model")
        emb = EmbeddingKey(E, ent, dev, C)

    token_entries = TokenEntries(ent.input, ent.valid)
    lex = LexicalPool(cfg.pool, cfg.count_len, hashes, outputs)

    cols = {name: [] for name in POSITION_COLUMNS}
    lap("prepare")
    for r in tqdm(range(R), desc="census", unit="req", disable=not progress, leave=False):
        off, n = int(offsets[r]), int(offsets[r + 1] - offsets[r])
        members = lex.members(r)
        excluded = [(int(offsets[q]), int(offsets[q + 1])) for q in members]
        hi = off if cfg.pool == "past" else N
        out = outputs[r]
        if n == 0:
            lex.finish_request(r)
            continue

        # lexical: available / producible / suffix lengths
        view = lex.view(r, members)
        lx = view.lexical_pass(data.prompts[r], out, horizon=cfg.horizon, min_suffix=cfg.min_suffix,
                               max_suffix=cfg.max_suffix, candidates=C)
        lap("lexical")

        # semantic key: top-C pool entries by exact cosine with the query state
        sem_idx, sem_cos, sem_query_ok = sem.topk(off, n, hi, excluded, C)
        sem_next = np.where(sem_idx >= 0, ent.next[np.maximum(sem_idx, 0)], -1)
        sem_hit = (sem_next == out[:, None]).any(axis=1)
        lap("semantic")

        # static-embedding key
        emb_hit = None
        if emb is not None:
            emb_hit = emb.hits(ent, token_entries, off, n, out, hi, excluded)
            lap("static_embedding")

        adj_hit = adjacency_hits(ent, token_entries, off, out, hi, excluded, adj_width)
        gap = lx.available & ~lx.producible
        payload, neighbour = payload_lengths(view, ent, data.tokens, offsets, out, sem_idx,
                                             gap & sem_hit & sem_query_ok, cfg.payload_cap)

        cols["request"].append(np.full(n, r))
        cols["position"].append(np.arange(n))
        cols["target"].append(out)
        cols["available"].append(lx.available)
        cols["producible"].append(lx.producible)
        cols["gap"].append(gap)
        cols["oracle_suffix_len"].append(lx.oracle_suffix_len)
        cols["longest_match_len"].append(lx.longest_match_len)
        cols["sem_hit"].append(np.where(sem_query_ok, sem_hit, None))
        cols["sem_best_cos"].append(np.where(sem_query_ok & ~np.isnan(sem_cos[:, 0]), sem_cos[:, 0], None))
        cols["emb_hit"].append(np.full(n, None) if emb_hit is None else emb_hit)
        cols["adj_hit"].append(adj_hit)
        cols["novel_prev"].append(lx.longest_match_len == 0)
        cols["payload_len"].append(np.where(payload >= 0, payload, None))
        cols["neighbour_match_len"].append(np.where(neighbour >= 0, neighbour, None))
        lap("adjacency_payload")
        lex.finish_request(r)
        lap("lexical")

    df = pl.DataFrame({name: pl.Series(name, np.concatenate(cols[name]).tolist() if cols[name] else [], dtype=dtype)
                       for name, dtype in POSITION_COLUMNS.items()})
    lap("frame")
    return df


class EmbeddingKey:
    """The static-embedding key. The query is E[y]; the pool's keys are the distinct input tokens
    of its entries, held in a buffer in order of first appearance (so the past pool's tokens are a
    prefix of it). The top `keep` tokens of every query token seen so far are cached and, when
    tokens join the pool, extended by ranking only the new ones (the top-K of a union is the top-K
    of the parts' top-Ks), so each (query token, pool token) pair is scored once per census."""

    def __init__(self, E: np.ndarray, ent, dev: torch.device, candidates: int):
        first_idx = np.nonzero(ent.valid)[0]
        utok, first_pos = np.unique(ent.input[first_idx], return_index=True)
        order = np.argsort(first_idx[first_pos], kind="stable")
        self.E = E
        self.utok = utok[order]
        self.u_first = first_idx[first_pos][order]
        self.u_norm, unit = unit_rows(E[self.utok])
        self.u_ok = self.u_norm > 0
        self.pool = torch.from_numpy(unit).to(dev)
        self.dev = dev
        self.margin = float32_margin(E.shape[1])
        self.candidates = candidates
        self.keep = candidates + 8  # slack so excluded tokens can be dropped without a rescan
        self.done = 0  # every cached ranking covers buffer rows [0, done)
        self.row: dict[int, int] = {}  # query token -> its row in the cache
        self.c_idx = np.zeros((0, self.keep), np.int64)
        self.c_cos = np.zeros((0, self.keep))

    def _rank(self, ys: np.ndarray, lo: int, hi: int, k: int, ok: np.ndarray | None = None,
              floor: np.ndarray | None = None):
        """Top-k buffer rows in [lo, hi) for each query token, by (-cosine, token id); rows below
        floor (a cosine per query) may be left out."""
        q_norm, q_unit = unit_rows(self.E[ys])
        pool_ok = self.u_ok[lo:hi] if ok is None else self.u_ok[lo:hi] & ok[lo:hi]
        idx, cos = topk_exact(
            torch.from_numpy(q_unit).to(self.dev), self.pool[lo:hi], torch.from_numpy(pool_ok).to(self.dev), k,
            lambda qi, pi: exact_cosines(self.E[ys[qi]], q_norm[qi], self.E[self.utok[lo + pi]], self.u_norm[lo + pi]),
            self.utok[lo:hi].astype(np.int64), self.margin, floor)
        idx[idx >= 0] += lo
        return idx, cos

    def _merge(self, a_idx, a_cos, b_idx, b_cos):
        idx = np.concatenate([a_idx, b_idx], axis=1)
        cos = np.where(idx >= 0, np.concatenate([a_cos, b_cos], axis=1), -np.inf)
        tie = np.where(idx >= 0, self.utok[np.maximum(idx, 0)], np.iinfo(np.int64).max)
        order = np.lexsort((tie, -cos), axis=-1)[:, :self.keep]
        return np.take_along_axis(idx, order, 1), np.take_along_axis(np.where(idx >= 0, cos, np.nan), order, 1)

    def hits(self, ent, token_entries: TokenEntries, off: int, n: int, out: np.ndarray, hi: int,
             excluded: list[tuple[int, int]]) -> np.ndarray:
        """emb_hit over one request (object array: True / False / None for a zero query embedding)."""
        C = self.candidates
        u_count = int(np.searchsorted(self.u_first, hi))
        masked = np.zeros(len(self.utok), bool)  # tokens all of whose pool entries are excluded
        if excluded:
            ex_tokens = np.unique(np.concatenate([ent.input[a:b] for a, b in excluded]))
            for i in np.nonzero(np.isin(self.utok[:u_count], ex_tokens))[0]:
                masked[i] = next(token_entries.latest(int(self.utok[i]), hi, excluded), -1) < 0
        ys = ent.input[off:off + n]
        uniq_y, inverse = np.unique(ys, return_inverse=True)
        asked = np.linalg.norm(self.E[uniq_y], axis=1) > 0  # a zero embedding asks nothing
        if u_count > self.done:  # tokens joined the pool: extend every cached ranking by them
            if self.row:
                cached = np.array(list(self.row), np.int64)
                floor = np.where(self.c_idx[:, -1] >= 0, self.c_cos[:, -1], -np.inf)  # the keep-th so far
                idx, cos = self._rank(cached, self.done, u_count, self.keep, floor=floor)
                self.c_idx, self.c_cos = self._merge(self.c_idx, self.c_cos, idx, cos)
            self.done = u_count
        fresh = np.array([y for y in uniq_y[asked].tolist() if y not in self.row], np.int64)
        if len(fresh):
            idx, cos = self._rank(fresh, 0, u_count, self.keep)
            self.row.update({y: len(self.row) + j for j, y in enumerate(fresh.tolist())})
            self.c_idx = np.concatenate([self.c_idx, idx])
            self.c_cos = np.concatenate([self.c_cos, cos])
        cand_sets = {}
        for y in uniq_y[asked].tolist():
            ranked = self.c_idx[self.row[y]]
            ranked = ranked[ranked >= 0]
            usable = ranked[~masked[ranked]]
            if len(usable) < C and len(ranked) == self.keep:  # the slack ran out: rank this one afresh
                usable = self._rank(np.array([y], np.int64), 0, u_count, C, ok=~masked)[0][0]
                usable = usable[usable >= 0]
            cands: set[int] = set()
            taken = 0
            for i in usable[:C]:
                for e in token_entries.latest(int(self.utok[i]), hi, excluded):
                    cands.add(int(ent.next[e]))
                    taken += 1
                    if taken >= C:
                        break
                if taken >= C:
                    break
            cand_sets[y] = cands
        hit = np.empty(n, dtype=object)
        for t in range(n):
            y = int(uniq_y[inverse[t]])
            hit[t] = (int(out[t]) in cand_sets[y]) if asked[inverse[t]] else None
        return hit


# ---------------------------------------------------------------- the store, the outputs

def census_dir(out: str | Path, bench: str, slug: str, pool: str = "past") -> Path:
    base = store_dir(out, bench, slug).parent
    return base / ("census" if pool == "past" else f"census-{pool}")


def load_embeddings(meta: dict) -> tuple[np.ndarray | None, str | None]:
    """The model's input embedding matrix, or (None, why not) when the model cannot be loaded here.
    A model that loads but is not the one the store was captured with is refused (one line)."""
    try:
        from data.models import load_model

        lm = load_model(meta["model"], dtype="float32", device="cpu")
    except Exception as e:  # any failure to load only costs the static-embedding key
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"static-embedding key not computed: cannot load model '{meta.get('model')}' ({first})"
    if meta.get("model_fingerprint") and lm.fingerprint != meta["model_fingerprint"]:
        raise OilbirdError(f"model '{meta['model']}' loads with fingerprint {lm.fingerprint}, but the trace store was "
                           f"captured with {meta['model_fingerprint']}: the store's meta.json names the wrong model, "
                           "or the model changed since the capture; recapture with --force")
    if int(meta.get("d_model") or lm.d_model) != lm.d_model:
        raise OilbirdError(f"model '{meta['model']}' has d_model {lm.d_model}, the trace store {meta['d_model']}: "
                           "wrong model for this store")
    return lm.model.get_input_embeddings().weight.detach().float().cpu().numpy(), None


def check_store_model(meta: dict, model: str, path: Path) -> None:
    """--model must name the model the store was captured with (alias, directory or hub id)."""
    captured = [meta.get("model"), meta.get("model_path")]
    if not any(c and same_model(str(c), model) for c in captured):
        raise OilbirdError(f"trace store {path} was captured with model '{meta.get('model')}', not '{model}': "
                           "it sits in another model's folder, or its meta.json was edited; recapture with "
                           f"--model {model}")


def write_census(target: Path, df: pl.DataFrame, summary: dict) -> None:
    """positions.parquet and summary.json as one unit: both are written into a fresh folder beside
    `target`, which then replaces it, so census/ holds the old pair or the new pair, never one of
    each. A kill leaves at most a dot-named leftover, removed by the next census."""
    _restore_or_clean(target)
    tmp = make_tmp_dir(target)
    old = None
    try:
        atomic_write_table(tmp / "positions.parquet", df.to_arrow())
        fault_point("census_after_positions")
        atomic_write_json(tmp / "summary.json", summary)
        if target.exists():
            old = target.with_name(f".{target.name}.{os.getpid()}.x.old")
            target.rename(old)
        fault_point("census_mid_swap")
        tmp.rename(target)
    except BaseException:
        if old is not None and not target.exists():
            old.rename(target)  # put the previous census back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _restore_or_clean(target: Path) -> None:
    """Leftovers of a census killed while writing: a temporary folder (dropped), and the previous
    census moved aside for the swap (put back when nothing replaced it, else dropped)."""
    for aside in sorted(target.parent.glob(f".{target.name}.*.old")):
        if not target.exists() and aside.is_dir() and is_stale(aside):
            aside.rename(target)
    clean_leftovers(target.parent, f".{target.name}.*.tmp")
    clean_leftovers(target.parent, f".{target.name}.*.old")


def run_census(bench: str, model: str, cfg: CensusConfig, out: str | Path = "runs", *,
               embeddings: np.ndarray | None | str = "load", progress: bool = True) -> tuple[Path, dict]:
    """Read runs/<bench>/<model>/traces, write census/positions.parquet and summary.json as one unit."""
    cfg.validate()
    slug = model_slug(model)
    path = store_dir(out, bench, slug)
    if not (path / "meta.json").exists():
        raise OilbirdError(f"no trace store for {bench} / {slug} at {path}: run `python -m data capture "
                           f"--bench {bench} --model {model} --out {out}` first (or `make census BENCH={bench}`)")
    target = census_dir(out, bench, slug, cfg.pool)
    _restore_or_clean(target)  # leftovers of a census killed while writing
    t0 = time.perf_counter()
    store = open_store(path)
    check_store_model(store.meta, model, path)
    data = CensusInput.from_store(store).check()
    t_read = time.perf_counter() - t0
    notes = []
    if isinstance(embeddings, str):
        embeddings, why = load_embeddings(store.meta)
        if why:
            notes.append(why)
    t1 = time.perf_counter()
    parts: dict[str, float] = {}
    df = census_positions(data, cfg, embeddings=embeddings, progress=progress, timings=parts)
    t_census = time.perf_counter() - t1
    meta = dict(store.meta, n_requests=store.n_requests)  # counted from the rows, not taken from meta.json
    summary = summarize(df, cfg, meta=meta, notes=notes, emb_available=embeddings is not None)
    summary["store"] = str(path)
    summary["timing"] = {"read_s": round(t_read, 3), "census_s": round(t_census, 3),
                         "positions_per_s": round(len(df) / max(t_census, 1e-9), 1),
                         "parts_s": {k: round(v, 3) for k, v in parts.items()},
                         "device": str(pick_device(cfg.device))}
    write_census(target, df, summary)
    return target, summary


def format_summary(s: dict) -> str:
    def pct(p):
        if p is None or p.get("value") is None:
            return "n/a"
        w = p.get("wilson") or [None, None]
        b = p.get("bootstrap") or [None, None]
        txt = f"{100 * p['value']:.2f}% (n={p['n']})"
        if w[0] is not None:
            txt += f"  wilson {100 * w[0]:.2f}-{100 * w[1]:.2f}"
        if b and b[0] is not None:
            txt += f"  bootstrap {100 * b[0]:.2f}-{100 * b[1]:.2f}"
        return txt

    m = s["mechanism"]
    lines = [
        f"census {s['bench']} / {s['model']} (layer {s['layer']}, pool {s['pool']}): "
        f"{s['positions']} positions, {s['requests']} requests",
        f"  available   {pct(s['available'])}",
        f"  producible  {pct(s['producible'])}",
        f"  gap         {pct(s['gap'])}",
        f"  recall      {pct(s['recall'])}  (semantic key over gap positions)",
        f"  recall emb  {pct(m['recall_static_embedding'])}",
        f"  recall adj  {pct(m['recall_adjacency'])}",
        f"  blind lexical {pct(m['blind_lexical'])}; with semantic {pct(m['blind_with_semantic'])}",
    ]
    lines += [f"  note: {n}" for n in s.get("notes", [])]
    return "\n".join(lines)
