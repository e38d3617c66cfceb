"""The census on Ray (issue 36, census/ray_census.py): shards of requests give the single-process census's
positions and summary to the digit (tenants, a store budget, warm pool, the static-embedding key), a worker
lost mid-run is retried by Ray with the same result, and every refusal is one line with exit code 2.

Every comparison is against the single-process census computed in the same test. One local Ray cluster
(2 CPUs, tests/conftest.py ray_cluster) serves the module.
Run: python -m pytest -q tests/test_scale_raycensus.py
"""

from __future__ import annotations

import json
import socket

import numpy as np
import polars as pl
import pytest

from census.__main__ import main
from census.definitions import CensusConfig, CensusInput
from census.pool import prepare
from census.positions import census_run
from census.ray_census import (
    CRASH_ONCE_ENV,
    RayParts,
    census_shard,
    plan_shards,
)
from data.errors import OilbirdError
from tests.test_census import write_store
from tests.test_census_scale import traffic

EMB = np.random.default_rng(7).standard_normal((6, 4)).astype(np.float32)  # traffic()'s vocabulary is 6
CONFIGS = {
    "past": CensusConfig(bootstrap=0),
    "budget": CensusConfig(bootstrap=0, store_budget="40"),
    "warm": CensusConfig(bootstrap=0, pool="warm"),
}


def _one_line(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# ---------------------------------------------------------------- the split, in this process (no Ray)

@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_shards_in_process_equal_the_whole(name, seed):
    """census_shard over random cuts of each tenant, concatenated, is the part's census row for row."""
    cfg = CONFIGS[name]
    data = CensusInput.from_traces(traffic(seed, R=20, tenants="ab"))
    whole = census_run(data, cfg, EMB).positions
    setup = prepare(data, cfg)
    rng = np.random.default_rng(seed)
    frames, windowed = [], 0
    for part in setup.parts:
        R = part.data.n_requests
        cuts = np.unique(np.r_[0, rng.integers(1, R, 3), R])
        windowed += sum(int(part.plan.starts[a]) > 0 for a in cuts[:-1])  # shards that start past the stream's start
        frames += [census_shard(part, cfg, setup.spec, EMB, int(a), int(b)).frame for a, b in zip(cuts[:-1], cuts[1:])]
    got = pl.concat(frames).sort(["request", "position"])
    assert len(setup.parts) == 2 and got.height == whole.height
    assert (windowed > 0) == (name == "budget")  # with a budget, shards really hold only their window
    assert got.equals(whole)


def test_plan_cuts_each_tenant_and_covers_every_request():
    data = CensusInput.from_traces(traffic(2, R=24, tenants="abc"))
    setup = prepare(data, CONFIGS["past"])
    plan = plan_shards(setup, 9)
    for p, part in enumerate(setup.parts):
        mine = [s for s in plan if s.part == p]
        assert len(mine) >= 2  # every tenant is cut
        assert mine[0].first == 0 and mine[-1].last == part.data.n_requests
        assert all(a.last == b.first or part.data.offsets[a.last] == part.data.offsets[b.first]
                   for a, b in zip(mine, mine[1:]))
        assert sum(s.positions for s in mine) == part.data.n_positions


# ---------------------------------------------------------------- on Ray

@pytest.mark.parametrize("name", list(CONFIGS))
def test_ray_census_identical(ray_cluster, name):
    cfg = CONFIGS[name]
    data = CensusInput.from_traces(traffic(5, R=30, tenants="ab"))
    want = census_run(data, cfg, EMB)
    runner = RayParts(shards=7, progress=False)
    got = census_run(data, cfg, EMB, runner=runner)
    assert runner.report["shards"] >= 6  # really split, over both tenants
    assert got.positions.equals(want.positions)
    assert got.index == want.index and got.pool == want.pool


def test_lost_worker_is_retried_with_the_same_result(ray_cluster, tmp_path, monkeypatch):
    """The first shard's worker dies (os._exit) on its first attempt; Ray retries it."""
    marker = tmp_path / "crashed"
    monkeypatch.setenv(CRASH_ONCE_ENV, str(marker))
    cfg = CONFIGS["budget"]
    data = CensusInput.from_traces(traffic(6, R=24, tenants="ab"))
    want = census_run(data, cfg, EMB)
    runner = RayParts(shards=4, progress=False, max_retries=2)
    got = census_run(data, cfg, EMB, runner=runner)
    assert marker.exists()  # a worker did die
    assert got.positions.equals(want.positions) and got.index == want.index


def test_lost_worker_without_retries_is_one_line(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(CRASH_ONCE_ENV, str(tmp_path / "crashed"))
    data = CensusInput.from_traces(traffic(6, R=12))
    with pytest.raises(OilbirdError, match="lost on the Ray cluster after retries"):
        census_run(data, CONFIGS["past"], None, runner=RayParts(shards=2, progress=False, max_retries=0))


def test_cli_ray_writes_the_single_process_census(ray_cluster, tmp_path, capsys):
    """`python -m census --ray local:2` on the same store: the same positions.parquet and summary.json
    (timing aside)."""
    import shutil

    write_store(tmp_path, "traffic", traffic(8, R=30))
    common = ["--bench", "traffic", "--model", "no-such-model", "--out", str(tmp_path), "--bootstrap", "200",
              "--quiet"]
    folder = tmp_path / "traffic" / "no-such-model" / "census"
    assert main(common) == 0
    one = shutil.copytree(folder, tmp_path / "single")
    assert main(common + ["--ray", "local:2", "--ray-shards", "5"]) == 0
    assert "on Ray (local:2): 5 shards" in capsys.readouterr().out
    assert pl.read_parquet(folder / "positions.parquet").equals(pl.read_parquet(one / "positions.parquet"))
    s_one, s_ray = (json.loads((d / "summary.json").read_text()) for d in (one, folder))
    assert s_ray["timing"]["ray"]["shards"] == 5 and "ray" not in s_one["timing"]
    # the driver left the states in the store; each shard read its own rows (data/store/statefiles.py)
    assert "read_states" in s_ray["timing"]["parts_s"] and "read_states" not in s_one["timing"]["parts_s"]
    s_one.pop("timing")
    s_ray.pop("timing")
    assert s_ray == s_one


# ---------------------------------------------------------------- refusals: one line, exit 2

def _store(tmp_path):
    write_store(tmp_path, "traffic", traffic(1, R=6))
    return ["--bench", "traffic", "--model", "no-such-model", "--out", str(tmp_path), "--quiet"]


@pytest.mark.parametrize("spec, words", [("local:0", "local:N"), ("local:x", "local:N"), ("nowhere", "HOST:PORT")])
def test_bad_ray_spec(tmp_path, capsys, spec, words):
    assert main(_store(tmp_path) + ["--ray", spec]) == 2
    _one_line(capsys, "--ray", words)


def test_address_that_does_not_answer(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(_store(tmp_path) + ["--ray", f"127.0.0.1:{port}"]) == 2
    _one_line(capsys, f"127.0.0.1:{port}", "no Ray cluster answers")


def test_trained_index_refused_on_ray(tmp_path, capsys):
    assert main(_store(tmp_path) + ["--ray", "local:2", "--index", "sq8"]) == 2
    _one_line(capsys, "--ray", "--index sq8", "exact")
    assert not (tmp_path / "traffic" / "no-such-model" / "census").exists()


def test_ray_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # `import ray` then fails
    assert main(_store(tmp_path) + ["--ray", "auto"]) == 2
    _one_line(capsys, "ray", "make install")


def test_grid_on_ray_is_the_grid(ray_cluster, tmp_path):
    """`python -m census grid --ray`: one task per benchmark; the same table and census files."""
    from census.grid import grid_table

    benches = ["alpha", "beta"]
    for out in ("one", "ray"):
        for i, b in enumerate(benches):
            write_store(tmp_path / out, b, traffic(20 + i, R=16))
    cfg = CensusConfig(bootstrap=100)
    want = grid_table(benches, "no-such-model", cfg, tmp_path / "one", progress=False)
    got = grid_table(benches, "no-such-model", cfg, tmp_path / "ray", progress=False, ray="local:2")
    assert got == want
    for b in benches:
        one, ray = (tmp_path / k / b / "no-such-model" / "census" / "positions.parquet" for k in ("one", "ray"))
        assert pl.read_parquet(ray).equals(pl.read_parquet(one))


def test_bench_scale_arms_and_cpu_model(monkeypatch):
    """benchmarks/bench_scale.py --ray: the arms, and the efficiency it derives from shard CPU seconds."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_scale

    assert [a for a, _ in bench_scale.ray_arms("local:2")] == ["single", "ray-1", "ray-2"]
    assert [a for a, _ in bench_scale.ray_arms("auto")] == ["single", "ray auto"]
    run = {"shard_cpu_s": [4.0, 1.0, 1.0, 1.0, 1.0], "wall_s": 12.0, "shards_wall_s": 8.0}
    m = bench_scale.cpu_model(run, 2)  # in order: worker 0 takes 4, worker 1 the four 1s -> makespan 4
    assert m["makespan_s"] == 4.0 and m["shards"] == round(8 / (2 * 4), 3)
    assert m["wall"] == round((4 + 8) / (2 * (4 + 4)), 3)


def test_store_set_on_ray_is_the_set_censused_in_one_process(ray_cluster, tmp_path, capsys):
    """A store set (issue 36's sets: several stores read as one stream) reaches the Ray path as one input."""
    import shutil

    traces = traffic(9, R=24, tenants="ab")
    for i in range(3):  # three stores of consecutive ranges, written one after the other
        write_store(tmp_path / f"m{i}", "traffic", traces[8 * i:8 * i + 8])
    folder = tmp_path / "set"
    folder.mkdir()
    for i in range(3):
        shutil.copytree(tmp_path / f"m{i}" / "traffic" / "no-such-model" / "traces", folder / f"s{i}")
    common = ["--bench", "traffic", "--model", "no-such-model", "--out", str(tmp_path / "o"), "--store", str(folder),
              "--no-embeddings", "--bootstrap", "50", "--quiet"]
    census = tmp_path / "o" / "traffic" / "no-such-model" / "census"
    assert main(common) == 0, capsys.readouterr().err
    one = shutil.copytree(census, tmp_path / "single")
    assert main(common + ["--ray", "local:2", "--ray-shards", "6"]) == 0, capsys.readouterr().err
    assert pl.read_parquet(census / "positions.parquet").equals(pl.read_parquet(one / "positions.parquet"))
    s_one, s_ray = (json.loads((d / "summary.json").read_text()) for d in (one, census))
    assert s_one["requests"] == 24 and s_one["store_set"]["members"] == 3
    assert "read_states" in s_ray["timing"]["parts_s"]
    assert {k: v for k, v in s_ray.items() if k != "timing"} == {k: v for k, v in s_one.items() if k != "timing"}
