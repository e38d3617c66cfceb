"""The auto index (data/index/pruner.py under decoder/drafters/semantic.py's SemanticPool) against brute force:
exact while small, pruned then, the same-prompt exclusion and the store budget kept; and the key's
per-request patience."""

from __future__ import annotations

import numpy as np
import pytest

from data.index.pruner import PrunerConfig
from data.index.stateindex import parse_index_spec, unit, unit_vector
from decoder.drafters.keygate import RequestPatience
from decoder.drafters.semantic import SemanticPool

D = 64
SMALL = PrunerConfig(prune_from=256, min_lists=8, nprobe_min=2, train_per_list=40)


def _traffic(n_traces=60, length=24, seed=0):
    """Traces of states around a few dozen centres (tool-call-like traffic: many near-repeats)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(40, D))
    out = []
    for t in range(n_traces):
        idx = rng.integers(0, len(centres), size=length)
        states = centres[idx] + 0.3 * rng.normal(size=(length, D))
        out.append((list(rng.integers(0, 500, size=length)), states.astype(np.float32), ("prompt", t % 7)))
    return out


def _brute(pool: SemanticPool, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact cosine over the pool's float16 rows in float64, the excluded group masked."""
    rows = pool.matrix[: pool.n].double().numpy()
    s = rows @ unit(q).astype(np.float64).reshape(-1)
    s[pool.row_group[: pool.n] == pool._excluded_group] = -np.inf
    order = np.argsort(-s, kind="stable")[:k]
    return s[order], order


def _fill(pool, traffic):
    for tokens, states, h in traffic:
        pool.add_trace(tokens, states, h)


def test_spec_parses_and_defaults():
    spec = parse_index_spec("auto")
    assert spec.auto and not spec.exact and spec.factory is None and spec.text == "auto"
    assert parse_index_spec("exact").exact and not parse_index_spec("exact").auto
    q = np.arange(1, D + 1, dtype=np.float64)
    np.testing.assert_allclose(unit_vector(q), unit(q).reshape(-1), rtol=1e-6)
    assert not unit_vector(np.zeros(D)).any()


def test_small_pool_is_the_exact_key():
    auto, exact = SemanticPool("auto", pruner=SMALL), SemanticPool("exact")
    traffic = _traffic(n_traces=8)  # 192 states < prune_from
    _fill(auto, traffic)
    _fill(exact, traffic)
    assert auto.pruner is None or not auto.pruner.trained
    assert auto.active_index == "auto:exact"
    for h in (("prompt", 1), None):
        auto.exclude(h)
        exact.exclude(h)
        for q in traffic[3][1][:5]:
            a, e = auto.query(q, 8), exact.query(q, 8)
            np.testing.assert_array_equal(a[1], e[1])
            np.testing.assert_array_equal(a[0], e[0])


def test_pruned_pool_scores_exactly_and_finds_the_neighbours():
    pool = SemanticPool("auto", recall_every=1, pruner=SMALL)
    traffic = _traffic()
    _fill(pool, traffic)
    assert pool.n == 60 * 24 and pool.pruner.trained and pool.active_index.startswith("auto:ivf")
    pool.exclude(("prompt", 2))
    rng = np.random.default_rng(1)
    hits = total = 0
    for _ in range(60):
        q = traffic[int(rng.integers(0, 60))][1][int(rng.integers(0, 24))] + 0.1 * rng.normal(size=D)
        s, rows = pool.query(q, 8)
        bs, brows = _brute(pool, q, 8)
        # every returned row is a real, non-excluded row, with its exact (float16) cosine, best first
        assert len(rows) == 8 and (pool.row_group[rows] != pool._excluded_group).all()
        exact_s = pool.matrix[rows].float().numpy() @ unit_vector(q)
        np.testing.assert_allclose(s, exact_s, atol=1e-5)
        assert (np.diff(s) <= 1e-6).all()
        hits += int((s >= bs[-1] - 1e-3).sum())  # tie-aware: float16 rows
        total += 8
    assert hits / total >= 0.9, hits / total
    assert pool.pruned_queries == 60 and pool.recall_queries == 60  # the shadow repeats every pruned query
    info = pool.index_info()
    assert info["active_index"] == pool.active_index and info["index_trainings"] >= 1
    assert info["bytes_per_state"] == 2 * D + D + 12  # float16 row + the pruner's 8-bit row (d < 256), id, group


def test_a_large_excluded_group_widens_the_search():
    """The nearest list holds only the served prompt's rows: the scan skips them all, and the search widens
    (one more list at a time) until it has k rows of other prompts, exactly scored."""
    rng = np.random.default_rng(3)
    pool = SemanticPool("auto", pruner=PrunerConfig(prune_from=256, min_lists=8, nprobe_min=1, train_per_list=40))
    target = unit(rng.normal(size=D)).reshape(-1)
    for t in range(30):  # 30 traces of the served prompt, all at the target: one list
        pool.add_trace(list(range(20)), np.tile(target, (20, 1)).astype(np.float32), "served")
    for t in range(10):  # the rest in clusters elsewhere
        centre = rng.normal(size=D)
        pool.add_trace(list(range(20)), (centre + 0.05 * rng.normal(size=(20, D))).astype(np.float32), ("other", t))
    pr = pool.pruner
    assert pr.trained and pr.nprobe == 1
    nearest_list = int(np.argmax(((target - pr.mean) @ pr.proj_t) @ pr.cent_t))
    filed = pr.groups[nearest_list][: pr.sizes[nearest_list]]
    assert len(filed) >= 8 and (filed == pool.group("served")).all()  # the one list visited holds the served rows
    pool.exclude("served")
    for s, rows in (pool.query(target, 8), pr.nearest_reference(target, 8, pool.matrix, pool.row_base, pool.n,
                                                                 pool._excluded_group)):
        assert len(rows) == 8 and (pool.row_group[rows] != pool.group("served")).all()
        np.testing.assert_allclose(s, pool.matrix[rows].float().numpy() @ target, atol=1e-5)


def test_retraining_as_the_pool_grows_and_eviction_by_id():
    pool = SemanticPool("auto", pruner=SMALL)
    traffic = _traffic(n_traces=120, seed=5)
    trainings = []
    for tokens, states, h in traffic:
        pool.add_trace(tokens, states, h)
        trainings.append(pool.pruner.trainings if pool.pruner else 0)
    # first at 256 rows, then at 4x the last training's rows
    first = next(i for i, t in enumerate(trainings) if t == 1)
    assert (first + 1) * 24 >= 256 > first * 24
    second = next(i for i, t in enumerate(trainings) if t == 2)
    assert (second + 1) * 24 >= 4 * (first + 1) * 24 > second * 24
    pool.evict_traces(50)
    assert pool.n == 70 * 24 and pool.row_base == 50 * 24 and pool.pruner.ntotal == pool.n
    assert min(ids[: n].min() for ids, n in zip(pool.pruner.ids, pool.pruner.sizes) if n) >= pool.row_base
    pool.exclude(None)
    for tokens, states, h in traffic[60:70]:
        s, rows = pool.query(states[5], 4)
        assert len(rows) == 4 and rows.max() < pool.n
        bs, _ = _brute(pool, states[5], 4)
        assert s[0] == pytest.approx(bs[0], abs=1e-3)  # the state itself is still in the pool


def test_exact_key_on_a_device_takes_no_faiss_spec():
    with pytest.raises(ValueError, match="runs on the CPU"):
        SemanticPool("sq8", device="meta")
    pool = SemanticPool("auto", device="cpu", pruner=SMALL)
    assert pool.pruning  # faiss is installed here: the CPU pool prunes


def test_request_patience_goes_quiet_and_probes():
    p = RequestPatience(patience=3, probe_every=2)
    allowed = []
    for hit in [False] * 7 + [True] + [False] * 3:  # the hit on a probe pass
        allowed.append(p.allow())
        p.record(hit)
    # passes 0-2 query; from pass 3 (3 misses in a row) every 2nd pass probes; a hit resets
    assert allowed == [True, True, True, True, False, True, False, True, True, True, True]
    assert p.skipped == 2 and p.probes == 3
    p.begin()
    assert p.allow() and p.since_hit == 0
    always = RequestPatience(patience=0)
    for _ in range(10):
        assert always.allow()
        always.record(False)


def test_census_refuses_the_serving_index():
    """The census's recall is defined on exact search or a named spec: auto is one line, not a silent exact."""
    from census.definitions import CensusConfig
    from data.errors import OilbirdError

    with pytest.raises(OilbirdError, match="--index auto is the decoder's serving index"):
        CensusConfig(index="auto").validate()
    CensusConfig(index="exact").validate()


def test_one_query_runs_on_one_faiss_thread_and_the_setting_comes_back():
    """A single faiss query (a faiss spec's StateIndex) runs on one OpenMP thread (a team of two waits at
    barriers when another process holds a core: 5-13 ms a query instead of 0.06); the process's setting is
    restored."""
    faiss = pytest.importorskip("faiss")
    from data.index.stateindex import one_faiss_thread

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        with one_faiss_thread(faiss):
            assert faiss.omp_get_max_threads() == 1
        assert faiss.omp_get_max_threads() == 2
    finally:
        faiss.omp_set_num_threads(before)


def test_request_patience_skips_after_a_far_answer():
    p = RequestPatience(patience=8, probe_every=4, floor=0.88, floor_skip=3)
    allowed = []
    for best in [0.95, 0.5, None, None, None, 0.99, 0.87, None, None, None, 0.9]:
        allowed.append(p.allow())
        if allowed[-1]:
            p.answered(best)
        p.record(False)
    # a far answer (0.5, 0.87) skips the next three passes; a near one (0.95, 0.99, 0.9) none
    assert allowed == [True, True, False, False, False, True, True, False, False, False, True]
    assert p.floor_skipped == 6 == p.skipped
    p.answered(0.1)
    p.begin()
    assert p.allow()  # a new request starts fresh
    always = RequestPatience(patience=0, floor=0.88, floor_skip=3)
    always.answered(0.1)
    assert always.allow()  # patience 0: every pass queries, the floor is off too
