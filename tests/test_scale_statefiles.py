"""States left in the store's files (issue 36: the census's driver at scale): `open_store(defer_hidden=True)`
reads every column but the states, and `StateFiles` reads any rows' states back, exactly as a full read
holds them: a store of several parts, a store set whose order interleaves its members, a tenant's subset;
a part rewritten after the driver read it is refused in one line; the census on Ray leaves the states to
its shards (tests/test_scale_raycensus.py checks its outputs equal the single process's).

Run: /work/main/.venv/bin/python -m pytest -q tests/test_scale_statefiles.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from census.definitions import CensusInput
from census.pool import Part, PoolPlan
from census.ray_census import census_shard, slice_part
from data.errors import OilbirdError
from data.store.layout import store_dir
from data.store.reader import can_defer_states, open_store
from data.store.storeset import open_store_or_set
from data.store.writer import StoreWriter, TraceRecord
from tests.test_census_scale import traffic

META = dict(model="no-such-model", model_fingerprint="x", layer=1, n_layers=1, dtype="float32", tokenizer_hash="t",
            chat_template_hash="c", bench="traffic", data_fingerprint="f", mode="generate", max_new_tokens=64,
            versions={}, created="now")


def write_parts(out, traces, per_part: int, tenants: str = "", t0: float = 0.0, step: float = 1.0):
    """A store of `traces` committed `per_part` requests at a time (so it has several positions parts);
    request i finished at t0 + i x step."""
    d = int(np.asarray(traces[0].prompt_last_hidden).shape[-1])
    path = store_dir(out, "traffic", "no-such-model")
    w = StoreWriter(path, dict(META, d_model=d))
    for lo in range(0, len(traces), per_part):
        w.append([TraceRecord(request=i, id=f"r{i}", group="", prompt_hash=tr.prompt_hash, prompt_tokens=tr.prompt,
                              output_tokens=tr.output, stop_reason="length", seconds=0.0, hidden=tr.hidden,
                              hidden_valid=np.arange(len(tr.output)) < len(tr.output) - 1, topk=tr.topk,
                              prompt_last_hidden=tr.prompt_last_hidden, prompt_last_topk=tr.prompt_last_topk,
                              tenant=tenants[i % len(tenants)] if tenants else "", finished_at=t0 + i * step)
                  for i, tr in enumerate(traces) if lo <= i < lo + per_part])
    w.finish()
    return path


def _same_as_loaded(deferred, loaded):
    assert deferred.hidden.shape == (0, loaded.d_model) and deferred.state_files is not None
    assert np.array_equal(deferred.hidden_valid, loaded.hidden_valid)
    n = int(loaded.offsets[-1])
    hidden, valid = deferred.state_files.read_rows(np.arange(n))
    assert np.array_equal(hidden, loaded.hidden) and np.array_equal(valid, loaded.hidden_valid)
    rows = np.random.default_rng(0).choice(n, 37, replace=False)  # any rows, in any order
    hidden, valid = deferred.state_files.read_rows(rows)
    assert np.array_equal(hidden, loaded.hidden[rows]) and np.array_equal(valid, loaded.hidden_valid[rows])


def test_deferred_store_reads_back_the_states_a_full_read_holds(tmp_path):
    path = write_parts(tmp_path, traffic(3, R=10, d=8), per_part=3)
    deferred = open_store(path, defer_hidden=True)
    assert len(deferred.state_files.files) == 4  # 3 + 3 + 3 + 1 requests
    _same_as_loaded(deferred, open_store(path))
    assert deferred.fingerprint == open_store(path).fingerprint
    assert open_store(path).state_files is None  # a full read leaves nothing to read later


def test_store_set_interleaving_its_members(tmp_path):
    """Two stores whose requests finished alternately: the set's order is neither member's concatenation."""
    traces = traffic(4, R=12, d=8)
    a = write_parts(tmp_path / "a", traces[0::2], per_part=2, t0=0.0, step=2.0)
    b = write_parts(tmp_path / "b", traces[1::2], per_part=4, t0=1.0, step=2.0)
    spec = f"{b},{a}"  # listed in the other order too
    deferred, loaded = open_store_or_set(spec, defer_hidden=True), open_store_or_set(spec)
    assert deferred.state_files.take is not None
    assert deferred.positions.equals(loaded.positions)
    _same_as_loaded(deferred, loaded)


def test_a_tenant_subset_reads_its_own_rows(tmp_path):
    path = write_parts(tmp_path, traffic(5, R=9, d=8), per_part=4, tenants="ab")
    deferred = CensusInput.from_store(open_store(path, defer_hidden=True))
    loaded = CensusInput.from_store(open_store(path))
    groups = loaded.tenant_groups()
    assert len(groups) == 2
    for reqs in groups:
        sub_d, rows_d = deferred.subset(reqs)
        sub_l, rows_l = loaded.subset(reqs)
        assert np.array_equal(rows_d, rows_l)
        assert np.array_equal(sub_d.with_states().hidden, sub_l.hidden)


def test_a_shard_reads_its_slice_and_censuses_as_from_memory(tmp_path):
    """census_shard on a part whose states are in the store equals the same shard given them in memory."""
    from census.definitions import CensusConfig
    from census.pool import prepare

    path = write_parts(tmp_path, traffic(6, R=14, d=8), per_part=5)
    cfg = CensusConfig(bootstrap=0, store_budget="60")
    got = []
    for defer in (True, False):
        data = CensusInput.from_store(open_store(path, defer_hidden=defer)).check()
        setup = prepare(data, cfg)
        got.append(census_shard(setup.parts[0], cfg, setup.spec, None, 6, 11).frame)
    assert got[0].height > 0 and got[0].equals(got[1])
    # the slice alone (rows of its window) reads only its rows
    data = CensusInput.from_store(open_store(path, defer_hidden=True)).check()
    part = Part(data, np.arange(data.n_requests), np.arange(data.n_positions),
                PoolPlan(data, "past", np.zeros(data.n_requests, np.int64)))
    sub = slice_part(part, 4, 9)
    a, b = int(data.offsets[4]), int(data.offsets[9])
    assert np.array_equal(sub.data.with_states().hidden, open_store(path).hidden[a:b])


def test_a_part_rewritten_after_the_read_is_refused(tmp_path):
    path = write_parts(tmp_path, traffic(7, R=6, d=8), per_part=2)
    deferred, loaded = open_store(path, defer_hidden=True), open_store(path)
    with open(deferred.state_files.files[1].path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(OilbirdError, match="changed after the census read its store") as e:
        deferred.state_files.read_rows(np.arange(int(deferred.offsets[-1])))
    assert "\n" not in str(e.value)
    rows = np.arange(int(deferred.offsets[2]))  # the first part's rows only: that part is unchanged
    assert np.array_equal(deferred.state_files.read_rows(rows)[0], loaded.hidden[rows])


def test_only_stores_that_can_vouch_for_a_later_read_defer(tmp_path):
    """A store without checksums (older than them) or of format 1 (null rows, no validity column) loads its
    states at once: a later read could not be checked, or parsed as the driver's was."""
    path = write_parts(tmp_path, traffic(8, R=4, d=8), per_part=2)
    meta = json.loads((path / "meta.json").read_text())
    assert can_defer_states(meta) and open_store(path, defer_hidden=True).state_files is not None
    assert not can_defer_states({k: v for k, v in meta.items() if k != "checksums"})
    assert not can_defer_states(dict(meta, store_format=1))


def test_a_part_missing_where_the_reader_runs_names_the_shared_filesystem(tmp_path):
    """A Ray worker on another node without the store at the same path: one line saying what is needed."""
    path = write_parts(tmp_path, traffic(9, R=4, d=8), per_part=2)
    deferred = open_store(path, defer_hidden=True)
    (path / deferred.state_files.files[0].path.rsplit("/", 1)[-1]).unlink()
    with pytest.raises(OilbirdError, match="needs the store at the same path, on a filesystem every node mounts"):
        deferred.state_files.read_rows(np.arange(3))
