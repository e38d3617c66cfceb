"""Census at scale (issue 13): the bounded pool (--store-budget), tenants, the semantic key over a
compressed index (--index), and the two sweeps. Answers are checked against the plain-loop reference
(tests/census_reference.py) or the exact key, never against stored numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from census.__main__ import main
from census.definitions import CensusConfig, CensusInput, Trace, build_entries
from census.keys import IndexedKey
from census.pool import prepare
from census.positions import census_positions, census_run
from data.errors import OilbirdError
from data.index.budget import window_starts
from data.store.reader import open_store
from tests.census_reference import compare, reference_census, reference_windows
from tests.test_census import clustered_traffic, trace_sets, write_store

TOPK = 8


def traffic(seed: int, R: int = 12, V: int = 6, d: int = 6, n_max: int = 24, prompts: int = 4,
            tenants: str = "") -> list[Trace]:
    """Phrase-heavy traces over a small vocabulary; prompts repeat (prompt_hash over `prompts`
    distinct prompts, the same prompt giving the same hash), tenants cycle through `tenants`."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, V, 10).tolist() for _ in range(3)]
    base = [rng.integers(0, V, int(rng.integers(1, 5))).tolist() for _ in range(prompts)]
    traces = []
    for r in range(R):
        out: list[int] = []
        while len(out) < n_max:
            out += phrases[int(rng.integers(3))][:int(rng.integers(3, 11))] + rng.integers(0, V, 2).tolist()
        n = int(rng.integers(1, n_max))
        p = int(rng.integers(prompts))
        traces.append(Trace(prompt=base[p], output=out[:n], hidden=rng.standard_normal((n, d)).astype(np.float16),
                            topk=rng.integers(0, V, (n, TOPK)),
                            prompt_last_hidden=rng.standard_normal(d).astype(np.float16),
                            prompt_last_topk=rng.integers(0, V, TOPK), prompt_hash=f"h{p}",
                            tenant=tenants[r % len(tenants)] if tenants else ""))
    return traces


def check(traces, cfg, emb=None):
    rows = census_positions(CensusInput.from_traces(traces), cfg, embeddings=emb).to_dicts()
    problems = compare(rows, reference_census(traces, cfg, emb))
    assert not problems, "\n".join(problems[:10])
    return rows


# ---------------------------------------------------------------- the bounded pool and tenants vs the reference

def test_reference_window_is_the_budget_module():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 30, int(rng.integers(1, 20))).tolist()
        budget = int(rng.integers(max(lengths + [1]), 100))
        starts = window_starts(lengths, budget)
        for r, w in enumerate(reference_windows(lengths, budget)):
            assert w == list(range(starts[r], r))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_budget_matches_reference(seed):
    traces = traffic(seed)
    longest = max(len(t.output) for t in traces)
    emb = np.random.default_rng(seed + 10).standard_normal((6, 4)).astype(np.float32)
    for factor in (1.0, 1.7, 3.0):
        budget = int(longest * factor)
        starts = window_starts([len(t.output) for t in traces], budget)
        assert starts[-1] > 0  # the window really moved
        rows = check(traces, CensusConfig(bootstrap=0, store_budget=str(budget)), emb)
        unbounded = census_positions(CensusInput.from_traces(traces), CensusConfig(bootstrap=0)).to_dicts()
        assert sum(r["available"] for r in rows) <= sum(r["available"] for r in unbounded)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace_sets(), st.data())
def test_random_budgets_and_tenants_match_reference(case, draw):
    """test_census's random trace sets (tiny vocabularies, lattice states with ties), with tenants
    and, in past mode, a budget between one trace and the whole store."""
    traces, cfg, embeddings = case
    lengths = [len(t.output) for t in traces]
    if sum(lengths) == 0:
        return
    for t in traces:
        t.tenant = draw.draw(st.sampled_from(["", "x", "y"]))
    if cfg.pool == "past" and draw.draw(st.booleans()):
        cfg.store_budget = str(draw.draw(st.integers(max(lengths), sum(lengths))))
    check(traces, cfg, embeddings)


def test_budget_evicts_tokens_from_the_static_embedding_key():
    """Each request draws its tokens from its own cluster of embeddings, so a query's nearest tokens
    are often those of a request that already left the window; the reference decides."""
    rng = np.random.default_rng(11)
    for case in range(8):
        traces, E = clustered_traffic(rng, V=40, R=10, clusters=4, n_range=(4, 16), own_share=0.8)
        longest = max(len(t.output) for t in traces)
        check(traces, CensusConfig(candidates=1 + case % 3, bootstrap=0, store_budget=str(longest + case)), E)


def test_budget_in_megabytes_converts_at_the_exact_key_cost():
    traces = traffic(5, d=6)
    longest = max(len(t.output) for t in traces)
    tokens = 2 * longest
    per_token = 2 * 6 + 20  # float16 state, two int64 row pointers, the int32 token (data/index/budget.py)
    mb = tokens * per_token / 2 ** 20 * 1.0000001  # just over `tokens` tokens
    cfg = CensusConfig(bootstrap=0, store_budget=f"{mb:.12f}MB")
    res = census_run(CensusInput.from_traces(traces), cfg)
    assert res.pool["budget_tokens"] == tokens and res.pool["bytes_per_token"] == per_token
    check(traces, cfg)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tenants_match_reference(seed):
    traces = traffic(seed, R=13, tenants="aab")
    longest = max(len(t.output) for t in traces)
    emb = np.random.default_rng(seed).standard_normal((6, 4)).astype(np.float32)
    check(traces, CensusConfig(bootstrap=0), emb)
    check(traces, CensusConfig(bootstrap=0, pool="warm"), emb)
    check(traces, CensusConfig(bootstrap=0, store_budget=str(2 * longest)), emb)
    # a tenant's rows are those of its requests censused alone (another tenant is invisible)
    data = CensusInput.from_traces(traces)
    rows = census_positions(data, CensusConfig(bootstrap=0)).to_dicts()
    a = [r for r in rows if traces[r["request"]].tenant == "a"]
    alone = census_positions(CensusInput.from_traces([t for t in traces if t.tenant == "a"]),
                             CensusConfig(bootstrap=0)).to_dicts()
    assert [{**r, "request": 0} for r in a] == [{**r, "request": 0} for r in alone]


def test_tenant_column_is_read_from_the_store(tmp_path):
    traces = traffic(1, R=4)
    store = open_store(write_store(tmp_path, "t", traces))
    assert len(set(CensusInput.from_store(store).tenant or [""])) == 1
    store.requests = store.requests.drop("tenant", strict=False)  # a store written before the column
    assert CensusInput.from_store(store).tenant is None
    store.requests = store.requests.with_columns(tenant=np.array(["x", None, "y", "x"], dtype=object))
    assert CensusInput.from_store(store).tenant == ["x", "", "y", "x"]


# ---------------------------------------------------------------- the index

def test_flat_index_gives_the_exact_hits():
    for seed, pool, budget in [(0, "past", None), (1, "warm", None), (2, "past", "40"), (3, "past", None)]:
        traces = traffic(seed, R=10, d=8, tenants="ab" if seed == 3 else "")
        data = CensusInput.from_traces(traces)
        exact = census_positions(data, CensusConfig(bootstrap=0, pool=pool, store_budget=budget)).to_dicts()
        res = census_run(data, CensusConfig(bootstrap=0, pool=pool, store_budget=budget, index="flat"))
        flat = res.positions.to_dicts()
        assert [r["sem_hit"] for r in flat] == [r["sem_hit"] for r in exact]
        for f, e in zip(flat, exact):
            assert (f["sem_best_cos"] is None) == (e["sem_best_cos"] is None)
            if e["sem_best_cos"] is not None:
                assert f["sem_best_cos"] == pytest.approx(e["sem_best_cos"], abs=1e-5)
        ix = res.index
        assert ix["spec"] == "flat" and ix["knn_recall"] == pytest.approx(1.0)
        assert ix["gap_recall_index"] == ix["gap_recall_exact"]


@pytest.mark.parametrize("spec,d,pool,budget", [("pq8x4", 16, "past", None), ("sq8", 32, "past", "60"),
                                                 ("pq8x4", 16, "warm", None), ("ivf4,sq8", 16, "past", "50")])
def test_faiss_index_never_returns_the_present_the_future_or_a_twin(monkeypatch, spec, d, pool, budget):
    traces = traffic(7, R=16, d=d, n_max=30, prompts=5)
    data = CensusInput.from_traces(traces)
    cfg = CensusConfig(bootstrap=0, pool=pool, store_budget=budget, index=spec, index_train=40, recall_sample=64)
    setup = prepare(data, cfg)
    plan = setup.parts[0].plan
    ent = build_entries(data)
    seen = []
    original = IndexedKey.topk

    def spy(self, off, n, hi, excluded, k, lo=0):
        idx, score, ok = original(self, off, n, hi, excluded, k, lo)
        seen.append((off, idx))
        return idx, score, ok

    monkeypatch.setattr(IndexedKey, "topk", spy)
    res = census_run(data, cfg)
    assert res.index["trained"]
    if pool == "past":  # the first 40 states answer exactly (warm-up), the trained index the rest
        assert res.index["queries"] > res.index["warmup_queries"] > 0
    else:
        assert res.index["warmup_queries"] == 0
    returned = 0
    for off, idx in seen:
        r = int(ent.request[off])
        pool_r = plan.at(r)
        got = idx[idx >= 0]
        returned += len(got)
        owners = ent.request[got]
        if pool == "past":
            assert (owners < r).all()  # strictly past
            assert (got >= pool_r.lo).all()  # nothing that left the window
        assert all(traces[q].prompt_hash != traces[r].prompt_hash for q in owners)  # no same-prompt trace
        assert ent.valid[got].all()
    assert returned > 0
    ix = res.index
    assert 0 <= ix["knn_recall"] <= 1 and ix["knn_sample"] > 0 and ix["gap_sample"] > 0
    assert ix["bytes_per_state"] < 4 * d and ix["bytes_per_token"] < 2 * d + 20


def test_errors_are_one_useful_line():
    traces = traffic(2, R=6, d=16)
    data = CensusInput.from_traces(traces)
    longest = max(len(t.output) for t in traces)
    cases = [
        (CensusConfig(index="bogus"), "unknown index spec"),
        (CensusConfig(index="pq7"), "pq7 needs M dividing"),
        (CensusConfig(index="pq8"), "needs at least 256 states"),
        (CensusConfig(store_budget=str(longest - 1)), "below one trace"),
        (CensusConfig(store_budget="lots"), "give tokens"),
        (CensusConfig(pool="warm", store_budget="10k"), "past pool"),
        (CensusConfig(index="hnsw8", store_budget="10k"), "cannot evict"),
    ]
    for cfg, message in cases:
        with pytest.raises(OilbirdError, match=message) as e:
            census_positions(data, cfg)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the CLI: census flags and the sweeps

def test_census_cli_index_and_budget_blocks(tmp_path, capsys):
    traces = traffic(3, R=14, d=16, n_max=30)
    write_store(tmp_path, "tiny", traces)
    assert main(["--bench", "tiny", "--model", "no-such-model", "--out", str(tmp_path), "--bootstrap", "0",
                 "--quiet", "--no-embeddings", "--index", "sq8", "--index-train", "32", "--store-budget", "80"]) == 0
    s = json.loads((tmp_path / "tiny" / "no-such-model" / "census" / "summary.json").read_text())
    assert s["config"]["index"] == "sq8" and s["index"]["spec"] == "sq8" and s["index"]["trained"]
    for key in ("knn_recall", "gap_recall_exact", "gap_recall_index", "gap_recall_ratio", "bytes_per_state",
                "bytes_per_token", "warmup_queries"):
        assert key in s["index"]
    assert s["pool_bounds"]["budget_tokens"] == 80 and s["pool_bounds"]["mean_pool_tokens"] <= 80
    assert "recall_check" in s["timing"]["parts_s"]
    capsys.readouterr()
    assert main(["--bench", "tiny", "--model", "no-such-model", "--out", str(tmp_path), "--store-budget", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "below one trace" in err and "\n" not in err


def test_sweeps_write_their_tables(tmp_path, capsys):
    traces = traffic(4, R=14, d=16, n_max=30)
    write_store(tmp_path, "tiny", traces)
    base = ["--bench", "tiny", "--model", "no-such-model", "--out", str(tmp_path), "--quiet"]
    assert main(["sweep-index", *base, "--index", "exact,flat,sq8", "--index-train", "32"]) == 0
    text = capsys.readouterr().out
    assert "sq8" in text and "gap recall" in text
    sweep = json.loads((tmp_path / "tiny" / "no-such-model" / "sweeps" / "index.json").read_text())
    rows = {r["spec"]: r for r in sweep["rows"]}
    assert list(rows) == ["exact", "flat", "sq8"]
    assert set(rows["sq8"]) == {"spec", "bytes_per_state", "gap_recall", "gap_recall_ratio", "sem_hit_rate",
                                "knn_recall", "warmup_share", "trained_gap_positions", "gap_recall_trained",
                                "gap_recall_ratio_trained", "seconds"}
    # the exact row is the census's own recall; flat finds the same neighbours
    df = census_positions(CensusInput.from_traces(traces), CensusConfig(bootstrap=0))
    gap = df["gap"].to_numpy()
    assert sweep["gap_positions"] == int(gap.sum()) and sweep["positions"] == df.height
    assert rows["exact"]["gap_recall"] == pytest.approx(df["sem_hit"].fill_null(False).to_numpy()[gap].mean())
    assert rows["flat"]["gap_recall_ratio"] == pytest.approx(1.0) and rows["flat"]["knn_recall"] == pytest.approx(1.0)
    assert rows["sq8"]["bytes_per_state"] < rows["exact"]["bytes_per_state"]
    assert 0 < rows["sq8"]["warmup_share"] < 1  # 32 states of warm-up, then the trained index
    # the trained-only ratio reads the gap positions after the warm-up; flat needs no training
    assert rows["flat"]["trained_gap_positions"] == sweep["gap_positions"]
    assert 0 < rows["sq8"]["trained_gap_positions"] < sweep["gap_positions"]

    longest = max(len(t.output) for t in traces)
    budgets = [str(longest), str(3 * longest), "all"]
    assert main(["sweep-budget", *base, "--budgets", ",".join(budgets)]) == 0
    assert "budget sweep" in capsys.readouterr().out
    sweep = json.loads((tmp_path / "tiny" / "no-such-model" / "sweeps" / "budget.json").read_text())
    rows = sweep["rows"]
    assert [r["budget"] for r in rows] == budgets and rows[-1]["budget_tokens"] is None
    assert rows[0]["mean_pool_tokens"] < rows[1]["mean_pool_tokens"] < rows[2]["mean_pool_tokens"]
    assert rows[-1]["availability"] == pytest.approx(df["available"].to_numpy().mean())
    assert rows[-1]["gap"] == pytest.approx(gap.mean())
    assert not (tmp_path / "tiny" / "no-such-model" / "census").exists()  # the sweeps leave census/ alone
    assert main(["sweep-budget", *base, "--budgets", f"{longest - 1},all"]) == 2
    assert "below one trace" in capsys.readouterr().err
    assert main(["sweep-index", *base, "--index", "exact,pq7"]) == 2
    assert "pq7" in capsys.readouterr().err


def test_spec_lists_group_multi_part_specs():
    from census.sweep import split_specs

    assert split_specs("exact,sq8,pq64,opq64,pq64,ivf1024,pq64,nprobe=32,hnsw32") == \
        ["exact", "sq8", "pq64", "opq64,pq64", "ivf1024,pq64,nprobe=32", "hnsw32"]
    assert split_specs(["pca128,sq8;hnsw32", "sq4"]) == ["pca128,sq8", "hnsw32", "sq4"]  # --index repeated
    with pytest.raises(OilbirdError, match="names no spec"):
        split_specs([" , ;"])
