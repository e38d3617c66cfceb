"""Decoder at scale (issue 13): the semantic key's faiss index (--index), the bounded pool (--store-budget)
and tenants, in the decoder and in replay. Brute-force checks on synthetic traces: an evicted pool equals a
fresh pool of the retained traces, the budget window is data/index/budget.py's, no request drafts from an evicted
or another tenant's trace; knn_recall recomputed by hand; the CLI's one-line errors; stories260k end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data.index.budget import window_starts
from data.index.stateindex import unit
from data.store.layout import replay_dir
from data.store.schema import prompt_hash
from decoder.__main__ import main as decoder_main
from decoder.draft import Drafter
from decoder.drafters import make_drafter
from decoder.drafters.pld import PoolNgramIndex
from decoder.drafters.sam import AutomatonIndex, automaton_chains
from decoder.drafters.semantic import SemanticPool
from decoder.live.harness import DecodeConfig, run_decode
from decoder.pools import PoolSettings, TenantPools, merge_stats
from decoder.replay.run import ReplayConfig, replay_arm, run_replay
from decoder.replay.traces import Trace, replay_request
from tests.conftest import STORY_PROMPTS, capture_story_store, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 3000
LEXICAL_ARMS = ("suffix", "sam", "lexical", "pld+pool")  # cross-request pools without states
KEY_ARMS = ("oilbird", "semantic-only")  # the semantic pool (the +key hosts gate it shut on this traffic)


# ------------------------------------------------------------------ synthetic traffic

def token_states(d: int = 32, seed: int = 7) -> np.ndarray:
    """One random state per token id: a trace's state at a position is its token's (so the same
    token, wherever it occurs, looks alike to the key)."""
    return np.random.default_rng(seed).standard_normal((VOCAB, d)).astype(np.float32)


def make_trace(prompt, tokens, table, tenant="", rng=None) -> Trace:
    """A store trace: states from `table` (+ a little noise), the last row unknown, top-8 unknown everywhere
    (so the adjacency table learns nothing and the ring buffer records nothing: only pools can draft)."""
    n, d = len(tokens), table.shape[1]
    hidden = table[np.asarray(tokens)].copy()
    if rng is not None:
        hidden += 0.01 * rng.standard_normal(hidden.shape).astype(np.float32)
    hidden = hidden.astype(np.float16)
    hidden[-1] = 0
    return Trace(prompt=list(prompt), tokens=list(tokens), hidden=hidden, topk=np.full((n, 8), -1, np.int32),
                 first_hidden=np.zeros(d, np.float16), first_topk=np.full(8, -1, np.int32), tenant=tenant)


def phrase_traffic(n_requests=14, seed=0, table=None, tenants=None) -> list[Trace]:
    """Requests stitched from a few shared phrases with request-specific tokens between them, so pools pay."""
    rng = np.random.default_rng(seed)
    phrases = [list(range(100 + 20 * k, 112 + 20 * k)) for k in range(4)]  # 4 phrases of 12 distinct tokens
    table = token_states() if table is None else table
    traces = []
    for r in range(n_requests):
        out = []
        for _ in range(int(rng.integers(2, 4))):
            out += phrases[int(rng.integers(0, 4))] + rng.integers(1000, 2900, int(rng.integers(1, 4))).tolist()
        prompt = [5, 6, 2900 + r]
        traces.append(make_trace(prompt, out, table, tenants[r] if tenants else "", rng))
    return traces


def _passes(cycles) -> list[tuple]:
    return [(c.nodes, c.accepted, c.committed, tuple(c.sources)) for c in cycles]


class Recorder:
    """make_drafter wrapped: every drafter made, and per request (its prompt's last token) every proposal."""

    def __init__(self, monkeypatch):
        import decoder.drafters as drafters

        self.made, self.proposed = [], {}
        real = make_drafter  # the module's own, not an earlier Recorder's

        def make(*args, **kwargs):
            d = real(*args, **kwargs)
            self.made.append(d)
            propose = d.propose

            def logged(context, budget):
                draft = propose(context, budget)
                self.proposed.setdefault(int(context[2]), []).append(list(draft.tokens))
                return draft

            d.propose = logged
            return d

        monkeypatch.setattr(drafters, "make_drafter", make)


# ------------------------------------------------------------------ the window is data/index/budget.py's

@pytest.mark.parametrize("seed", range(4))
def test_tenant_pools_window_is_window_starts(seed):
    rng = np.random.default_rng(seed)
    R = 60
    lengths = rng.integers(0, 40, R).tolist()
    tenants = [str(t) for t in rng.integers(0, 3, R)]
    budget = int(rng.integers(max(lengths), 3 * max(lengths)))

    class Held(Drafter):  # a drafter that only remembers which requests it holds
        def __init__(self):
            self.held = []

        def evict_traces(self, n):
            assert n <= len(self.held)
            del self.held[:n]

    pools = TenantPools(Held, budget)
    starts = window_starts(lengths, budget)
    for r in range(R):
        d = pools.begin(r, tenants[r])
        assert pools.start == starts[r]
        for t, other in pools.drafters.items():  # brute force: each tenant holds its requests in [s(r), r)
            assert other.held == [q for q in range(starts[r], r) if tenants[q] == t]
        assert pools.held == sum(lengths[starts[r]:r]) <= budget
        d.held.append(r)
        pools.end(r, tenants[r], lengths[r])
    assert pools.max_pool_tokens == max(sum(lengths[starts[r]:r]) for r in range(R))
    assert pools.evicted == starts[-1]
    unbounded = TenantPools(Held, None)
    for r in range(R):
        unbounded.begin(r, "").held.append(r)
        unbounded.end(r, "", lengths[r])
    assert unbounded.drafters[""].held == list(range(R)) and unbounded.evictions == 0


# ------------------------------------------------------------------ eviction equals a fresh pool of the rest

def _pool_traces(seed=1, d=24, n=9):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(n):
        k = int(rng.integers(0, 40))
        hidden = rng.standard_normal((k, d)).astype(np.float32)
        if k:
            hidden[-1] = 0  # the never-fed last token
        h = f"p{t % 4}" if t % 3 else None  # repeated prompts, and anonymous traces
        out.append((rng.integers(0, 500, k).tolist(), hidden if t != 4 else None, h))
    return out


@pytest.mark.parametrize("spec", ["exact", "flat"])
def test_semantic_pool_eviction_equals_fresh_pool(spec):
    traces = _pool_traces()
    queries = np.random.default_rng(2).standard_normal((12, 24)).astype(np.float32)
    for cut in (0, 3, 5, 9):
        for later in (0, 2):  # traces added after the eviction too
            pool = SemanticPool(spec)
            for tokens, hidden, h in traces[: len(traces) - later]:
                pool.add_trace(tokens, hidden, h)
            pool.evict_traces(cut)
            for tokens, hidden, h in traces[len(traces) - later:]:
                pool.add_trace(tokens, hidden, h)
            fresh = SemanticPool(spec)
            for tokens, hidden, h in traces[min(cut, len(traces) - later):]:
                fresh.add_trace(tokens, hidden, h)
            assert pool.n == fresh.n and pool.n_tokens == fresh.n_tokens
            assert pool.tokens[: pool.n_tokens].tolist() == fresh.tokens[: fresh.n_tokens].tolist()
            if spec == "exact":
                assert pool.nbytes() == fresh.nbytes()
                assert pool.matrix is None or pool.matrix.shape[0] < 2 * max(pool.n, 1024)  # compacted
            for excluded in (None, "p1", "p2"):
                pool.exclude(excluded)
                fresh.exclude(excluded)
                for q in queries:
                    s1, r1 = pool.query(q, 8)
                    s2, r2 = fresh.query(q, 8)
                    assert r1.tolist() == r2.tolist(), (cut, later, excluded)
                    np.testing.assert_allclose(s1, s2, rtol=0, atol=1e-6)
                    assert pool.row_flat[r1].tolist() == fresh.row_flat[r2].tolist()
                    assert pool.row_end[r1].tolist() == fresh.row_end[r2].tolist()
                    assert pool.nearest_traces(q, 3) == fresh.nearest_traces(q, 3)
            assert [pool.trace_tokens(t) for t in range(len(pool.trace_span))] == \
                   [fresh.trace_tokens(t) for t in range(len(fresh.trace_span))]


def test_lexical_pools_eviction_equals_fresh():
    rng = np.random.default_rng(3)
    traces = [(rng.integers(0, 12, int(rng.integers(0, 30))).tolist(), f"h{t % 3}" if t % 4 else None)
              for t in range(10)]
    contexts = [rng.integers(0, 12, 8).tolist() for _ in range(20)]
    for cut in (1, 4, 10):
        auto, ngram = AutomatonIndex(), PoolNgramIndex(3)
        for tokens, h in traces:
            auto.add_trace(tokens, h)
            ngram.add_trace(tokens, h)
        auto.evict_traces(cut)
        ngram.evict_traces(cut)
        auto2, ngram2 = AutomatonIndex(), PoolNgramIndex(3)
        for tokens, h in traces[cut:]:
            auto2.add_trace(tokens, h)
            ngram2.add_trace(tokens, h)
        assert auto.pool.text == auto2.pool.text and ngram.tokens == ngram2.tokens
        for excluded in ("h1", "h2", "none"):
            for ctx in contexts:
                for a in (auto, auto2):
                    a.begin_request(ctx[:3], excluded)
                    a.sync(ctx)
                assert automaton_chains(auto) == automaton_chains(auto2)
                assert ngram.lookup(ctx, 3, 10, excluded) == ngram2.lookup(ctx, 3, 10, excluded)


@pytest.mark.parametrize("arm", ["suffix", "sam", "pld+pool"])
def test_budget_replay_equals_fresh_drafter_per_request(arm):
    """With a budget, request r's passes equal those of a fresh drafter holding exactly requests
    window_starts[r] .. r-1; the unbounded run differs (the budget matters here)."""
    traces = phrase_traffic()
    lengths = [len(t.tokens) for t in traces]
    budget = 2 * max(lengths)
    starts = window_starts(lengths, budget)
    assert starts[-1] > 0
    run = replay_arm(arm, traces, 60, "past", VOCAB, settings=PoolSettings(budget_tokens=budget))
    for r, tr in enumerate(traces):
        d = make_drafter(arm, vocab_size=VOCAB, nodes=60)
        for q in range(starts[r], r):
            d.add_trace(traces[q].tokens, prompt_hash(traces[q].prompt))
        assert _passes(replay_request(d, tr, 60, VOCAB)) == _passes(run.cycles[r]), (arm, r)
    assert run.pools["store_budget_tokens"] == budget and run.pools["evicted_traces"] == starts[-1]
    assert run.pools["max_pool_tokens"] == max(sum(lengths[starts[r]:r]) for r in range(len(traces))) <= budget
    free = replay_arm(arm, traces, 60, "past", VOCAB)
    assert [_passes(c) for c in free.cycles] != [_passes(c) for c in run.cycles]
    roomy = replay_arm(arm, traces, 60, "past", VOCAB, settings=PoolSettings(budget_tokens=sum(lengths)))
    assert [_passes(c) for c in roomy.cycles] == [_passes(c) for c in free.cycles]  # never evicts: unchanged
    assert roomy.pools["pool_evictions"] == 0


# ------------------------------------------------------------------ no request drafts from an evicted trace

@pytest.mark.parametrize("arm", LEXICAL_ARMS + KEY_ARMS)
def test_budget_never_drafts_from_an_evicted_trace(arm, monkeypatch):
    table = token_states()
    unique = list(range(400, 430))  # 30 tokens that only request 0 and the last request contain
    rng = np.random.default_rng(4)
    traces = [make_trace([5, 6, 2900], unique, table, rng=rng)]
    for r in range(1, 6):
        traces.append(make_trace([5, 6, 2900 + r], list(range(1000 + 30 * r, 1030 + 30 * r)), table, rng=rng))
    traces.append(make_trace([5, 6, 2999], unique, table, rng=rng))
    lengths = [len(t.tokens) for t in traces]
    budget = 80
    assert window_starts(lengths, budget)[-1] > 0  # request 0 has left the window of the last request
    results = {}
    for label, settings in (("unbounded", None), ("budget", PoolSettings(budget_tokens=budget))):
        rec = Recorder(monkeypatch)
        run = replay_arm(arm, traces, 60, "past", VOCAB, settings=settings)
        results[label] = (run, rec)
    run, rec = results["unbounded"]
    assert sum(c.accepted for c in run.cycles[-1]) > 0, arm  # the pool pays when request 0 is in it
    run, rec = results["budget"]
    assert sum(c.accepted for c in run.cycles[-1]) == 0, arm
    assert not any(set(t) & set(unique) for t in rec.proposed[2999]), arm  # nothing of request 0 proposed
    # what the pools hold after the last request joined: its own trace, not request 0's
    drafter = rec.made[-1]  # the tenant's drafter (the first one made is replay_arm's probe)
    pools = []
    if isinstance(getattr(drafter, "index", None), AutomatonIndex):
        pools.append(list(drafter.index.pool.text))
    if getattr(drafter, "host_pool", None) is not None:
        pools.append(list(drafter.host_pool.tokens))
    if getattr(drafter, "pool", None) is not None:
        pools.append(drafter.pool.tokens[: drafter.pool.n_tokens].tolist())
        assert drafter.pool.n_tokens == sum(lengths[window_starts(lengths, budget)[-1]:])  # s(last) .. last
    assert pools and all(p.count(unique[0]) == 1 for p in pools), arm
    unbounded = results["unbounded"][1].made[-1]
    assert unbounded.index.pool.text.count(unique[0]) == 2 if arm in ("suffix", "sam", "lexical") else True


# ------------------------------------------------------------------ tenants

@pytest.mark.parametrize("arm", LEXICAL_ARMS + KEY_ARMS)
def test_tenants_never_share_traces(arm, monkeypatch):
    """Two tenants with identical traffic: the second tenant's first request drafts as the first tenant's
    first request did (from nothing); served as one tenant, it drafts from the first tenant's other trace."""
    table = token_states()
    shared = list(range(500, 530))  # in both outputs of each tenant
    rng = np.random.default_rng(6)
    outs = [shared + [600, 601], shared + [700, 701]]
    prompts = [[5, 6, 2900], [5, 6, 2901]]
    for tenants in (["a", "a", "b", "b"], ["", "", "", ""]):
        traces = [make_trace(prompts[r % 2], outs[r % 2], table, tenants[r], rng) for r in range(4)]
        rec = Recorder(monkeypatch)
        run = replay_arm(arm, traces, 60, "past", VOCAB)
        if tenants[0]:
            assert run.pools["tenants"] == 2 and len(rec.made) == 3  # the probe and one drafter per tenant
            assert _passes(run.cycles[2]) == _passes(run.cycles[0]), arm  # an empty pool, as request 0 had
            assert sum(c.accepted for c in run.cycles[2]) == 0, arm
            assert sum(c.accepted for c in run.cycles[3]) > 0, arm  # tenant b's own earlier trace pays
        else:
            assert run.pools["tenants"] == 1
            # request 2 (prompt 0 again: its own earlier trace is excluded) drafts from request 1's trace
            assert sum(c.accepted for c in run.cycles[2]) > 0, arm


def test_merge_stats_adds_tenants():
    a = {"passes": 3, "semantic_key": True, "pool_tokens": 10, "store_bytes": 100, "store_bytes_per_token": 10.0,
         "pool_states": 4, "bytes_per_state": 8.0, "index": "sq8", "knn_recall_every": 8, "knn_recall_k": 8,
         "index_trained": True}
    b = {"passes": 2, "semantic_key": False, "pool_tokens": 30, "store_bytes": 200, "store_bytes_per_token": 6.7,
         "pool_states": 12, "bytes_per_state": 4.0, "index": "sq8", "knn_recall_every": 8, "knn_recall_k": 8,
         "index_trained": False}
    m = merge_stats([a, b])
    assert m["passes"] == 5 and m["semantic_key"] and m["pool_tokens"] == 40 and m["index"] == "sq8"
    assert m["store_bytes_per_token"] == 300 / 40 and m["bytes_per_state"] == (8 * 4 + 4 * 12) / 16
    assert m["knn_recall_every"] == 8 and m["knn_recall_k"] == 8 and m["index_trained"] is False
    assert merge_stats([a]) is a and merge_stats([]) is None


# ------------------------------------------------------------------ the faiss index and knn_recall

def test_faiss_pool_recall_by_brute_force():
    rng = np.random.default_rng(8)
    d, n = 32, 700
    states = rng.standard_normal((n, d)).astype(np.float32)
    states[-1] = 0
    pool = SemanticPool("pq8", recall_every=8, train_size=300)
    exact = SemanticPool("exact")
    for lo, hi, h in ((0, 200, "a"), (200, 450, "b"), (450, n, "c")):
        pool.add_trace(list(range(lo, hi)), states[lo:hi], h)
        exact.add_trace(list(range(lo, hi)), states[lo:hi], h)
    assert pool.index.trained and pool.matrix is not None  # trained; the shadow kept for the recall sample
    pool.exclude("b")
    exact.exclude("b")
    queries = rng.standard_normal((40, d)).astype(np.float32)
    hits = total = 0
    unit16 = unit(states[:n - 1]).astype(np.float16).astype(np.float64)
    for j, q in enumerate(queries):
        s, rows = pool.query(q, 8)
        assert len(rows) == 8 and not ((rows >= 200) & (rows < 450)).any()  # the excluded group's range
        truth = exact.query(q, 8)[1]  # the reference: today's float16 exact pool over the same rows
        sims = unit16 @ unit(q).astype(np.float16).astype(np.float64)
        sims[200:450] = -np.inf
        assert np.sort(sims)[-8:].min() >= np.sort(sims[truth]).min() - 2e-3  # ... which is the top 8
        if j % 8 == 0:  # the sampled queries
            hits += len(set(truth.tolist()) & set(rows.tolist()))
            total += 8
    assert pool.recall_queries == 5 and (pool.recall_hits, pool.recall_total) == (hits, total)
    assert 0 < hits < total  # pq8 on 32 dims: approximate
    info = pool.index_info()
    assert info["index"] == "pq8" and info["bytes_per_state"] == pytest.approx(8, abs=0.5)
    assert info["knn_recall_k"] == 8 and info["warmup_queries"] == 0
    assert pool.shadow_s > 0 and pool.bytes_per_state() < 2 * d
    flat = SemanticPool("flat", recall_every=1)  # exact up to float32: the nearest of a near-copy is found
    flat.add_trace(list(range(n)), states, "a")
    for q in states[:40] + 0.01 * rng.standard_normal((40, d)).astype(np.float32):
        flat.query(q, 1)
    assert flat.recall_queries == 40 and flat.recall_hits == flat.recall_total == 40


def test_faiss_pool_warm_up_and_budget_eviction():
    rng = np.random.default_rng(9)
    d = 16
    pool = SemanticPool("sq8", recall_every=4, train_size=50)
    pool.add_trace(list(range(30)), rng.standard_normal((30, d)), "a")
    pool.query(rng.standard_normal(d), 4)
    assert not pool.index.trained and pool.index.warmup_queries == 1 and pool.recall_queries == 0
    pool.add_trace(list(range(40)), rng.standard_normal((40, d)), "b")
    assert pool.index.trained
    pool.evict_traces(1)  # the first trace leaves the faiss index too
    assert pool.row_base == 30 and pool.n == 40 and pool.index.ntotal == 40
    for _ in range(8):
        s, rows = pool.query(rng.standard_normal(d), 8)
        assert rows.min() >= 0 and rows.max() < 40
    assert pool.recall_queries == 2


# ------------------------------------------------------------------ stories260k: replay and serve end to end

@pytest.fixture(scope="module")
def story_store(tmp_path_factory, stories):
    prompts = STORY_PROMPTS + [STORY_PROMPTS[4] + " Tom"]
    return capture_story_store(tmp_path_factory, stories, "scale_store", prompts, 32)


def test_replay_index_and_budget_summary(story_store, tmp_path):
    bench, out = story_store
    cfg = dict(bench=bench, model="stories260k", out=out, bootstrap=0, jobs=1, progress=False)
    arms = ("oilbird", "semantic-only", "suffix")
    base = run_replay(ReplayConfig(arms=arms, **cfg))
    again = run_replay(ReplayConfig(arms=arms, store_budget="1M", **cfg))  # a budget that never evicts
    for arm in arms:
        b, a = base[(arm, 60)], again[(arm, 60)]
        assert a["passes"] == b["passes"] and a["accepted_by_source"] == b["accepted_by_source"], arm
        assert b["index"] == "auto" and b["store_budget"] is None and b["tenants"] == 1
        assert a["store_budget_tokens"] == 1_000_000 and a["pool_evictions"] == 0
        assert 0 < b["max_pool_tokens"] < b["generated_tokens"]  # all but the last trace
    assert base[("oilbird", 60)]["bytes_per_state"] == 2 * 64 and base[("oilbird", 60)]["knn_recall"] is None
    assert base[("suffix", 60)]["bytes_per_state"] is None
    sq = run_replay(ReplayConfig(arms=("semantic-only", "suffix"), index="sq8", index_train_size=64,
                                 store_budget="120", **cfg))
    s = sq[("semantic-only", 60)]
    written = json.loads((replay_dir(out, bench, "stories260k") / "semantic-only" / "summary.json").read_text())
    assert written["index"] == s["index"] == "sq8" and written["store_budget"]["tokens"] == 120
    assert s["store_budget_tokens"] == 120 and 0 < s["max_pool_tokens"] <= 120 and s["evicted_traces"] > 0
    assert s["warmup_queries"] > 0 and s["bytes_per_state"] == pytest.approx(64, abs=1)
    rec = s["knn_recall"]
    assert rec is not None and rec["queries"] > 0 and 0 <= rec["value"] <= 1 and rec["total"] > 0
    assert sq[("suffix", 60)]["knn_recall"] is None and sq[("suffix", 60)]["index"] == "sq8"
    mb = run_replay(ReplayConfig(arms=("suffix",), store_budget="0.01MB", index="exact", **cfg))[("suffix", 60)]
    per_token = 2 * 64 + 20  # exact float16 state, two row pointers, the token
    assert mb["store_budget"]["bytes_per_token"] == per_token
    assert mb["store_budget_tokens"] == int(0.01 * 2 ** 20 / per_token)
    mb = run_replay(ReplayConfig(arms=("suffix",), store_budget="0.01MB", **cfg))[("suffix", 60)]
    per_token = 2 * 64 + 64 + 12 + 20  # auto: the float16 state, the pruner's 8-bit row (d < 256: unprojected), id, group
    assert mb["store_budget"]["bytes_per_token"] == per_token


def _cli(argv, capsys):
    code = decoder_main(["replay", *argv, "--quiet", "--bootstrap", "0", "--jobs", "1"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_replay_bad_pool_settings_one_line(story_store, capsys):
    bench, out = story_store
    base = ["--bench", bench, "--model", "stories260k", "--out", out, "--arms", "oilbird"]
    for bad, words in ((["--store-budget", "5"], "below one trace"),
                       (["--store-budget", "1000", "--pool", "warm"], "warm"),
                       (["--store-budget", "lots"], "store-budget"),
                       (["--index", "bogus"], "unknown index"),
                       (["--index", "pq7"], "dividing"),
                       (["--index", "hnsw32", "--store-budget", "1000"], "cannot evict"),
                       (["--index", "ivf1024,pq8"], "needs at least 1024 states")):
        code, err = _cli(base + bad, capsys)
        assert code == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0], (bad, err)


def test_serve_tenants_and_budget(stories, tmp_path):
    path = tmp_path / "tenants.jsonl"
    prompts = STORY_PROMPTS[:3]
    with open(path, "w") as f:
        for t in ("a", "b"):
            for i, p in enumerate(prompts):
                f.write(json.dumps({"id": f"{t}{i}", "prompt": p, "tenant": t}) + "\n")
    out = str(tmp_path / "runs")
    arms = ("ar", "suffix", "pld+key")
    s = run_decode(DecodeConfig(bench=f"jsonl:{path}", model="stories260k", arms=arms, max_new_tokens=24, out=out,
                                progress=False, store_budget="60"), lm=stories)
    import pyarrow.parquet as pq

    for arm in arms[1:]:
        assert s[arm]["lossless"]["lossless"], arm
        assert s[arm]["tenants"] == 2 and s[arm]["store_budget_tokens"] == 60 and s[arm]["max_pool_tokens"] <= 60
        t = pq.read_table(Path(s[arm]["decode_dir"]) / arm / "cycles.parquet").to_pydict()
        per = {}
        for r, n, a, c in zip(t["request"], t["nodes"], t["accepted"], t["committed"]):
            per.setdefault(r, []).append((n, a, c))
        if arm == "suffix":  # tenant b's first request starts from an empty pool, as tenant a's did
            assert per[3] == per[0]
    assert s["ar"]["tenants"] is None and s["suffix"]["index"] == "auto"
    code = decoder_main(["--bench", f"jsonl:{path}", "--model", "stories260k", "--arms", "suffix", "--out", out,
                         "--max-new-tokens", "24", "--store-budget", "3", "--quiet"])
    assert code == 2  # below one trace: refused after ar, before any drafter arm


def test_serve_with_a_faiss_index(stories, tmp_path):
    bench = write_jsonl(tmp_path / "bench.jsonl", STORY_PROMPTS)
    s = run_decode(DecodeConfig(bench=bench, model="stories260k", arms=("ar", "semantic-only", "suffix"),
                                max_new_tokens=24, out=str(tmp_path / "runs"), progress=False, index="flat"),
                   lm=stories)
    key = s["semantic-only"]
    assert key["lossless"]["lossless"] and key["index"] == "flat" and key["index_trained"]
    assert key["bytes_per_state"] == pytest.approx(4 * 64, abs=1)  # float32 rows
    assert key["warmup_queries"] == 0 and key["knn_recall"]["queries"] > 0 and 0 <= key["knn_recall"]["value"] <= 1
    assert key["drafter_stats"]["knn_shadow_s"] > 0 and key["accepted_by_source"].get("semantic", 0) > 0
    assert s["suffix"]["knn_recall"] is None and s["suffix"]["bytes_per_state"] is None
