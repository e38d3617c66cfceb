"""The semantic key's compiled query path (data/index/keyscan.c) against its numpy reference (data/index/pruner.py's
`nearest_reference` and `encode_reference`, decoder/drafters/semantic.py's `semantic_chains`), and the
fallback when the kernel cannot be built; the key's pass on the kernel's worker thread against the inline one.
The main suite builds the kernel: a machine without a C compiler
fails `test_the_kernel_is_built_here` (CI has one; the numpy path is the fallback, not the product)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data.index import keyscan
from data.index.pruner import PrunerConfig
from data.index.stateindex import unit_vector
from decoder.drafters.semantic import (
    DEPTH_SCHEDULE,
    RANK_DEPTHS,
    SemanticPool,
    copy_depth,
    semantic_chains,
)

D = 64
CONFIG = PrunerConfig(prune_from=256, min_lists=8, nprobe_min=2, train_per_list=40)


def _pool(seed: int = 0, n_traces: int = 80, length: int = 24, d: int = D, config: PrunerConfig = CONFIG):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(30, d))
    pool = SemanticPool("auto", pruner=config)
    traffic = []
    for t in range(n_traces):
        states = centres[rng.integers(0, len(centres), size=length)] + 0.3 * rng.normal(size=(length, d))
        tokens = list(rng.integers(0, 500, size=length))
        pool.add_trace(tokens, states.astype(np.float32), ("prompt", t % 9))
        traffic.append(states)
    return pool, traffic, rng


def _queries(traffic, rng, count=60):
    return [traffic[int(rng.integers(0, len(traffic)))][int(rng.integers(0, 24))] + 0.1 * rng.normal(size=traffic[0].shape[1])
            for _ in range(count)]


def _same_answer(a, b):
    """Rank by rank the same cosine (the kernel sums in another order: last-bit differences), and the same
    row wherever the cosine is not tied."""
    (sa, ra), (sb, rb) = a, b
    assert len(ra) == len(rb)
    np.testing.assert_allclose(sa, sb, atol=1e-6)
    untied = np.abs(np.diff(np.concatenate([[np.inf], sb, [-np.inf]]))) > 1e-6
    alone = untied[:-1] & untied[1:]
    np.testing.assert_array_equal(ra[alone], rb[alone])


def test_the_kernel_is_built_here():
    status = keyscan.status()
    assert status["path"] == "c", status["why"]


def test_query_equals_the_numpy_reference():
    pool, traffic, rng = _pool()
    pr = pool.pruner
    assert pr.trained and keyscan.library() is not None
    for excluded in (("prompt", 4), None):
        pool.exclude(excluded)
        for q in _queries(traffic, rng):
            for k in (1, 8, 12):
                got = pr.nearest(q, k, pool.matrix, pool.row_base, pool.n, pool._excluded_group)
                want = pr.nearest_reference(q, k, pool.matrix, pool.row_base, pool.n, pool._excluded_group)
                _same_answer(got, want)
                assert len(got[1]) == k and (pool.row_group[got[1]] != pool._excluded_group).all()
                # the returned cosines are the exact float16 ones
                np.testing.assert_allclose(got[0], pool.matrix[got[1]].double().numpy() @ unit_vector(q), atol=1e-6)


def test_the_projected_query_path_equals_the_reference():
    """States wide enough to be PCA-projected (d >= 2 x pca_dims): the projection and the float16 matrices."""
    pool, traffic, rng = _pool(d=96, config=PrunerConfig(prune_from=256, min_lists=8, nprobe_min=2,
                                                       train_per_list=40, pca_dims=40))
    pr = pool.pruner
    assert pr.dims == 40 and pr.dims != pr.d
    pool.exclude(("prompt", 1))
    for q in _queries(traffic, rng, 40):
        _same_answer(pr.nearest(q, 8, pool.matrix, pool.row_base, pool.n, pool._excluded_group),
                     pr.nearest_reference(q, 8, pool.matrix, pool.row_base, pool.n, pool._excluded_group))
    lists, codes = pr.encode(pool.matrix[: pool.n])
    ref_lists, ref_codes = pr.encode_reference(pool.matrix[: pool.n])
    assert (lists == ref_lists).mean() >= 0.99
    assert np.abs(codes.astype(int) - ref_codes).max() <= 1


def test_encode_equals_the_reference_and_files_every_row_once():
    pool, _, _ = _pool(seed=2)
    pr = pool.pruner
    lists, codes = pr.encode(pool.matrix[: pool.n])
    ref_lists, ref_codes = pr.encode_reference(pool.matrix[: pool.n])
    assert (lists == ref_lists).mean() >= 0.99
    assert np.abs(codes.astype(int) - ref_codes).max() <= 1
    filed = np.sort(np.concatenate([ids[:n] for ids, n in zip(pr.ids, pr.sizes)]))
    np.testing.assert_array_equal(filed, np.arange(pool.row_base, pool.row_base + pool.n))
    groups = np.concatenate([g[:n] for g, n in zip(pr.groups, pr.sizes)])
    order = np.argsort(np.concatenate([ids[:n] for ids, n in zip(pr.ids, pr.sizes)]))
    np.testing.assert_array_equal(groups[order], pool.row_group[: pool.n])


@pytest.mark.parametrize("rank_depths", [None, RANK_DEPTHS])
def test_chains_equal_the_python_function(rank_depths):
    pool, traffic, rng = _pool(seed=3)
    depth = ((lambda s, r: rank_depths[r] if r < len(rank_depths) else 0) if rank_depths is not None
             else (lambda s, r: copy_depth(s, DEPTH_SCHEDULE)))
    checked = 0
    for q in _queries(traffic, rng, 80):
        s, rows = pool.query(q, 8)
        s = (s * 0 + rng.uniform(0.75, 1.0, size=len(s))).astype(np.float32)  # every depth band
        s[::-1].sort()
        for offset, min_len in ((2, 2), (0, 3), (5, 1)):
            want = semantic_chains(s, pool.row_flat[rows], pool.row_end[rows], pool.tokens, depth, offset, min_len)
            got = pool.chains(s, rows, DEPTH_SCHEDULE, rank_depths, offset, min_len)
            assert got == want
            checked += len(want)
    assert checked > 100
    # repeats are dropped, chains are cut at their trace's end
    row = int(np.flatnonzero(pool.row_end - pool.row_flat > 3)[0])
    end_row = int(np.flatnonzero(pool.row_end - pool.row_flat == 3)[0])  # 3 tokens to its trace's end
    two = np.array([0.95, 0.95, 0.95], np.float32)
    got = pool.chains(two, np.array([row, row, end_row]), DEPTH_SCHEDULE, None, 2, 1)
    lo = pool.row_flat[row] + 2
    assert got == [pool.tokens[lo: min(lo + 48, pool.row_end[row])].tolist(),
                   pool.tokens[pool.row_flat[end_row] + 2: pool.row_end[end_row]].tolist()]
    assert len(got[1]) == 1


def test_the_key_pass_in_one_call_equals_query_then_chains():
    pool, traffic, rng = _pool(seed=4)
    pool.exclude(("prompt", 2))
    fired = 0
    for q in _queries(traffic, rng):
        for theta in (0.8, 0.97):
            s, rows, chains = pool.key(q, 8, theta)
            s2, rows2 = pool.query(q, 8)
            _same_answer((s, rows), (s2, rows2))
            if s2[0] >= theta:
                fired += 1
                assert chains == pool.chains(s, rows)
            else:
                assert chains is None
    assert 0 < fired < 2 * 60  # both branches met


def test_the_key_pass_on_the_worker_equals_the_inline_one():
    """key_start / key_finish (the query on the kernel's worker thread, data/index/keyscan.c keyscan_submit) answer what
    `key` answers, fired or not."""
    pool, traffic, rng = _pool(seed=6)
    pool.exclude(("prompt", 3))
    fired = 0
    for q in _queries(traffic, rng):
        for theta in (0.8, 0.97):
            handle = pool.key_start(q, 8, theta)
            assert handle[0] == "worker"
            got, want = pool.key_finish(handle), pool.key(q, 8, theta)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert got[2] == want[2]
            fired += got[2] is not None
    assert 0 < fired < 2 * 60
    assert pool.overlapped_queries == 2 * 60 and keyscan.worker_stats()["worker_queries"] >= 2 * 60


def test_a_replaced_or_drained_worker_query_is_refused_not_misread():
    """One query is out on the worker per process: a second pool's start replaces the first's, and an append
    (which drains the worker before the arrays move) drops it; the first's finish then raises."""
    a, traffic, rng = _pool(seed=7)
    b, _, _ = _pool(seed=8)
    q = _queries(traffic, rng, 1)[0]
    first = a.key_start(q, 8, 0.8)
    second = b.key_start(q, 8, 0.8)
    with pytest.raises(RuntimeError, match="replaced"):
        a.key_finish(first)
    assert b.key_finish(second)[1].tolist() == b.key(q, 8, 0.8)[1].tolist()
    pending = a.key_start(q, 8, 0.8)
    a.add_trace(list(range(24)), traffic[0].astype(np.float32), ("late", 0))
    with pytest.raises(RuntimeError, match="replaced"):
        a.key_finish(pending)


def test_a_forked_child_starts_its_own_worker():
    pool, traffic, rng = _pool(seed=9)
    q = _queries(traffic, rng, 1)[0]
    pool.key_finish(pool.key_start(q, 8, 0.8))  # the parent's worker exists
    want = pool.key(q, 8, 0.8)[1].tolist()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not there; a new worker answers
        try:
            got = pool.key_finish(pool.key_start(q, 8, 0.8))[1].tolist()
            os.write(write, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        got = json.loads(f.read() or "null")
    os.waitpid(pid, 0)
    assert got == want


def test_after_eviction_and_growth_the_kernel_reads_the_new_arrays():
    pool, traffic, rng = _pool(seed=5, n_traces=60)
    pool.evict_traces(20)
    for t in range(40):  # the matrix and row arrays grow (replaced), the lists re-train at 4x
        pool.add_trace(list(range(24)), traffic[t % len(traffic)].astype(np.float32), ("late", t))
    pr = pool.pruner
    assert pr.ntotal == pool.n
    for q in _queries(traffic, rng, 30):
        got = pool.query(q, 8)
        _same_answer(got, pr.nearest_reference(q, 8, pool.matrix, pool.row_base, pool.n, pool._excluded_group))
        assert got[1].max() < pool.n


def test_the_numpy_path_when_the_kernel_is_unavailable(tmp_path):
    """No compiler: one note on stderr, the same answers from numpy; OILBIRD_KEYSCAN=numpy selects it quietly."""
    code = """
import numpy as np
from data.index import keyscan
from tests.test_keyscan import _pool, _queries
pool, traffic, rng = _pool()
s, rows = pool.query(_queries(traffic, rng, 1)[0], 8)
print(keyscan.status()["path"], len(rows))
"""
    env = {"PATH": "/usr/bin:/bin", "OILBIRD_CACHE": str(tmp_path), "CC": str(tmp_path / "no-such-cc"),
           "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=_root())
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["numpy", "8"]
    notes = [line for line in run.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "no-such-cc" in notes[0] and "numpy path" in notes[0]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "OILBIRD_KEYSCAN": "numpy"}, cwd=_root())
    assert run.returncode == 0 and run.stdout.split() == ["numpy", "8"] and "note:" not in run.stderr


def _root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])
