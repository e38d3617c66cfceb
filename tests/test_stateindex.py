"""data/index/stateindex.py and data/index/budget.py against brute force: specs, the warm-up, exclusion, eviction,
the window of a budget."""

from __future__ import annotations

import numpy as np
import pytest

from data.errors import OilbirdError
from data.index.budget import (
    LOW_WATER,
    bytes_per_token,
    check_budget,
    parse_budget,
    pool_tokens,
    state_bytes,
    window_starts,
)
from data.index.stateindex import StateIndex, check_trainable, parse_index_spec

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_topk(pool: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int, lo: int, exclude) -> list[list[int]]:
    u = pool / np.linalg.norm(pool, axis=1, keepdims=True)
    qu = q / np.linalg.norm(q, axis=1, keepdims=True)
    ok = ids >= lo
    for a, b in exclude:
        ok &= ~((ids >= a) & (ids < b))
    out = []
    for row in qu @ u.T:
        cand = np.nonzero(ok)[0]
        order = cand[np.argsort(-row[cand], kind="stable")][:k]
        out.append(ids[order].tolist())
    return out


def test_parse_specs_canonical_and_refusals():
    assert parse_index_spec("exact").exact
    assert parse_index_spec("").text == "exact"
    s = parse_index_spec("IVF64,PQ16,nprobe=4", d=32)
    assert (s.text, s.factory, s.knobs["nprobe"], s.train_min) == ("ivf64,pq16,nprobe=4", "IVF64,PQ16", 4, 256)
    assert parse_index_spec("ivf8,sq8").knobs == {"nprobe": 16}
    assert parse_index_spec("pca16,sq8", d=32).factory == "PCA16,L2norm,SQ8"
    assert parse_index_spec("hnsw8,sq8").factory == "HNSW8_SQ8"
    assert not parse_index_spec("hnsw8").evictable
    for bad, words in [("pq7", "dividing"), ("foo", "unknown index spec"), ("sq8,pca8", "write it as"),
                       ("sq8,nprobe=2", "nprobe needs"), ("ivf8,hnsw8", "at most one"), ("pca64", "pca64 needs")]:
        with pytest.raises(OilbirdError, match=words):
            parse_index_spec(bad, d=32)


def test_check_trainable_names_the_need():
    spec = parse_index_spec("ivf64,sq8", d=16)
    check_trainable(spec, 64)
    with pytest.raises(OilbirdError, match="needs at least 64 states to train.*the store has 10"):
        check_trainable(spec, 10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flat_equals_brute_force_with_lo_and_exclusion(seed):
    rng = np.random.default_rng(seed)
    d, n = 16, 300
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids = np.sort(rng.choice(5 * n, n, replace=False)).astype(np.int64)
    ix = StateIndex("flat", d)
    ix.add(x[:100], ids[:100])
    ix.add(x[100:], ids[100:])
    q = rng.standard_normal((7, d)).astype(np.float32)
    lo = int(ids[40])
    exclude = [(int(ids[120]), int(ids[200])), (int(ids[250]), int(ids[260]) + 1)]
    got, scores = ix.search(q, 5, lo=lo, exclude=exclude)
    assert got.tolist() == brute_topk(x, ids, q, 5, lo, exclude)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)


@pytest.mark.parametrize("spec", ["sq8", "pq4x4", "ivf8,sq8,nprobe=2", "pca8,sq8"])
def test_compressed_specs_never_return_blocked_ids_and_evict(spec):
    rng = np.random.default_rng(3)
    d, n = 16, 700
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[500:520] = x[0]  # near-copies of query 0 inside the excluded range: the filter must widen
    ids = np.arange(n, dtype=np.int64) * 2
    ix = StateIndex(spec, d, train_size=200)
    assert not ix.trained
    ix.add(x[:150], ids[:150])
    # warm-up: exact over the buffer
    q = x[:3] + 0.01
    got, _ = ix.search(q, 4)
    assert got.tolist() == brute_topk(x[:150], ids[:150], q, 4, 0, [])
    assert ix.warmup_queries == 3
    ix.add(x[150:], ids[150:])
    assert ix.trained and ix.ntotal == n
    exclude = [(1000, 1040)]  # rows 500..519
    got, scores = ix.search(x[:5], 8, lo=100, exclude=exclude)
    assert (got >= 100).all() and not ((got >= 1000) & (got < 1040)).any()
    assert (got >= 0).all()  # exhaustive coders fill k when the pool holds enough
    assert len(set(got[0].tolist())) == 8
    ix.evict_below(600)
    assert ix.ntotal == n - 300
    got, _ = ix.search(x[:5], 8)
    assert (got >= 600).all() and set(got.ravel().tolist()) <= set(ids[300:].tolist())
    assert 0 < ix.bytes_per_state() < 4 * d + 16


def test_sq8_recall_is_high():
    rng = np.random.default_rng(5)
    d = 32
    x = rng.standard_normal((3000, d)).astype(np.float32)
    ids = np.arange(3000, dtype=np.int64)
    ix = StateIndex("sq8", d, train_size=500)
    ix.add(x, ids)
    q = x[::97] + 0.3 * rng.standard_normal((len(x[::97]), d)).astype(np.float32)
    got, _ = ix.search(q, 8)
    want = brute_topk(x, ids, q, 8, 0, [])
    recall = np.mean([len(set(g) & set(w)) / 8 for g, w in zip(got.tolist(), want)])
    assert recall > 0.9


def test_hnsw_refuses_to_evict():
    rng = np.random.default_rng(0)
    ix = StateIndex("hnsw8", 8)
    ix.add(rng.standard_normal((50, 8)), np.arange(50))
    ix.evict_below(0)  # nothing to drop: fine
    with pytest.raises(OilbirdError, match="cannot evict"):
        ix.evict_below(10)


def test_exact_spec_is_not_a_state_index():
    with pytest.raises(OilbirdError, match="exact"):
        StateIndex("exact", 8)


# ---------------------------------------------------------------- budget

def brute_window(lengths, budget, low_water=LOW_WATER):
    pool, starts = [], []
    for r, n in enumerate(lengths):
        starts.append(pool[0] if pool else r)
        pool.append(r)
        if sum(lengths[q] for q in pool) > budget:
            while pool and sum(lengths[q] for q in pool) > low_water * budget:
                pool.pop(0)
    return starts


@pytest.mark.parametrize("seed", range(5))
def test_window_starts_brute_force(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, 60).tolist()
    budget = int(rng.integers(40, 300))
    starts = window_starts(lengths, budget)
    # brute force: an empty pool's start is the request itself; both mean "nothing before r"
    want = brute_window(lengths, budget)
    held = pool_tokens(lengths, starts)
    for r in range(len(lengths)):
        assert sum(lengths[starts[r]:r]) == sum(lengths[want[r]:r]) == held[r]
        assert held[r] <= budget
    assert (np.diff(starts) >= 0).all()
    assert window_starts(lengths, None).tolist() == [0] * len(lengths)


def test_parse_budget_and_refusals():
    assert parse_budget("200k").tokens == 200_000
    assert parse_budget("1.5M").tokens == 1_500_000
    assert parse_budget("50000").tokens == 50_000
    assert parse_budget("all") is None and parse_budget(None) is None
    b = parse_budget("64MB")
    assert b.megabytes == 64 and b.in_tokens(1024) == 65536
    with pytest.raises(OilbirdError, match="bytes per token"):
        b.in_tokens(None)
    with pytest.raises(OilbirdError, match="give tokens"):
        parse_budget("lots")
    with pytest.raises(OilbirdError, match="below one trace.*longest holds 30"):
        check_budget(20, [5, 30, 10])


def test_split_specs_joins_what_can_follow():
    from data.index.stateindex import split_specs

    assert split_specs("exact,sq8,pq64,pca128,pca128,sq8,ivf256,pq64,nprobe=8,pq64x4fs") == [
        "exact", "sq8", "pq64", "pca128", "pca128,sq8", "ivf256,pq64,nprobe=8", "pq64x4fs"]
    assert split_specs("hnsw32,sq8,efsearch=32;pca64;pq8") == ["hnsw32,sq8,efsearch=32", "pca64", "pq8"]


@pytest.mark.parametrize("spec", ["exact", "flat", "sq8", "sq4", "fp16", "pq8", "pq8x4fs", "pca16,sq8",
                                  "opq8,pq8", "ivf4,pq8", "ivf4,sq8"])
def test_bytes_per_token_is_what_a_pool_of_n_states_holds(spec):
    """The one bytes-per-token (data/index/budget.py) against the bytes a pool of N tokens actually holds:
    what N more states add to the index's serialized size (float16 rows for exact), the two int64
    row pointers and the int32 token of each."""
    d, n = 32, 1024  # n: a whole number of fast-scan blocks of 32
    rng = np.random.default_rng(5)
    states = rng.standard_normal((2 * n, d)).astype(np.float32)
    parsed = parse_index_spec(spec, d)
    if parsed.exact:
        held = states[n:].astype(np.float16).nbytes
    else:
        index = StateIndex(parsed, d, train_size=n)
        index.add(states[:n], np.arange(n))
        before = len(index.faiss.serialize_index(index.index))
        index.add(states[n:], np.arange(n, 2 * n))
        assert index.trained and index.ntotal == 2 * n
        held = len(index.faiss.serialize_index(index.index)) - before
    assert held / n == state_bytes(parsed, d)
    pointers, tokens = np.zeros((n, 2), np.int64), np.zeros(n, np.int32)  # the pool's other per-token arrays
    assert (held + pointers.nbytes + tokens.nbytes) / n == bytes_per_token(parsed, d)
    if parsed.exact:
        assert bytes_per_token(parsed, d) == 2 * d + 20
