"""benchmarks/bench_draft.py (`make bench-draft`) on a tiny synthetic store: the tie-aware recall definition
(data/index/knnrecall.py) against a brute-force reference, the warm pool's tiling plan, and the bench end to end
(the JSON's schema, recall 1.0 with the exact index, ArcticInference's row absent or run through a stand-in).
Nothing here checks a timing target: the bench prints those."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from data.index.knnrecall import (
    TIE_TOLERANCE,
    kth_largest,
    recall_hits,
    tie_aware_recall,
)
from data.store.layout import bench_dir, store_dir
from data.store.schema import prompt_hash
from data.store.writer import StoreWriter, TraceRecord

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
V, D = 400, 24


@pytest.fixture
def bd(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_draft

    monkeypatch.setattr(bench_draft, "load_arctic", lambda: (None, "arctic_inference is not installed here (test)"))
    return bench_draft


# ---------------------------------------------------------------- the recall definition

def reference_recall(scores: np.ndarray, returned, k: int, tol: float) -> tuple[int, int]:
    """Brute force, another formulation: a returned candidate row is a hit when fewer than k' candidates score
    more than tol above it (it could stand in the exact top-k' up to the tolerance)."""
    cand = [i for i, s in enumerate(scores) if np.isfinite(s)]
    wanted = min(k, len(cand))
    hits = 0
    for r in set(int(x) for x in returned):
        if 0 <= r < len(scores) and np.isfinite(scores[r]):
            above = sum(1 for i in cand if scores[i] > scores[r] + tol)
            hits += above < wanted
    return min(hits, wanted), wanted


def test_tie_aware_recall_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(1, 30))
        scores = rng.integers(-3, 4, n) / 4.0 + rng.choice([0.0, 4e-4, 2e-3], n)  # ties, near-ties, far ones
        scores[rng.random(n) < 0.2] = -np.inf  # rows that are not candidates (excluded)
        k = int(rng.integers(1, 9))
        returned = rng.integers(-2, n + 2, int(rng.integers(0, k + 3)))  # out-of-range rows and duplicates too
        assert tie_aware_recall(scores, returned, k) == reference_recall(scores, returned, k, TIE_TOLERANCE)
    # the exact answer has recall 1, any of several tied rows counts, a row below the k-th does not
    s = np.array([0.9, 0.8, 0.8, 0.8, 0.1])
    assert tie_aware_recall(s, [0, 1], 2) == (2, 2)
    assert tie_aware_recall(s, [0, 3], 2) == (2, 2)
    assert tie_aware_recall(s, [0, 4], 2) == (1, 2)
    assert tie_aware_recall(s, [0, 0], 2) == (1, 2)  # a duplicate counts once
    assert tie_aware_recall(np.array([0.5, -np.inf]), [0], 8) == (1, 1)  # k' = min(k, candidates)
    assert tie_aware_recall(np.array([-np.inf]), [0], 8) == (0, 0)
    assert kth_largest(np.array([3.0, 1.0, 2.0, -np.inf]), 2) == (2.0, 2)
    assert recall_hits(np.array([0.8 - 0.0009, 0.8 - 0.0011, np.nan]), 0.8, 3) == 1


# ---------------------------------------------------------------- a tiny store

def write_store(root: Path, bench: str = "tiny", n_requests: int = 24, seed: int = 0) -> Path:
    """Requests stitched from shared phrases (so pools pay), each state its token's own vector plus noise."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V, D)).astype(np.float32)
    phrases = [list(range(20 + 16 * k, 32 + 16 * k)) for k in range(5)]
    meta = dict(model="m", model_fingerprint="x", layer=1, n_layers=1, d_model=D, dtype="float32", tokenizer_hash="t",
                chat_template_hash="c", bench=bench, data_fingerprint="f", mode="generate", max_new_tokens=64,
                versions={}, created="now")
    w = StoreWriter(store_dir(root, bench, "m"), meta)
    records = []
    for r in range(n_requests):
        out = []
        for _ in range(int(rng.integers(2, 4))):
            out += phrases[int(rng.integers(0, 5))] + rng.integers(200, 390, int(rng.integers(1, 3))).tolist()
        n = len(out)
        hidden = (table[out] + 0.02 * rng.standard_normal((n, D))).astype(np.float16)
        topk = (np.asarray(out)[:, None] + np.arange(8)[None, :]) % V
        topk[:-1, 0] = out[1:]
        prompt = [1, 2, 390 + r % 10, r]
        records.append(TraceRecord(request=r, id=f"r{r}", group="", prompt_hash=prompt_hash(prompt), prompt_tokens=prompt,
                                   output_tokens=out, stop_reason="length", seconds=0.0, hidden=hidden,
                                   hidden_valid=np.arange(n) < n - 1, topk=topk,
                                   prompt_last_hidden=table[prompt[-1] % V].astype(np.float16),
                                   prompt_last_topk=np.arange(8) + out[0] % (V - 8)))
    w.append(records)
    w.finish()
    return store_dir(root, bench, "m")


def test_warm_plan_tiles_to_the_size(bd):
    counts = [5, 0, 7, 3]  # 15 states a copy, an empty trace among them
    for target in (1, 5, 6, 12, 15, 16, 30, 31, 44):
        plan, tiles = bd.warm_plan(counts, target)
        kept = sum(counts[r] if cut is None else cut for _, r, cut in plan)
        assert kept == target and tiles == -(-target // 15)
        assert len(set((k, r) for k, r, _ in plan)) == len(plan)
        if tiles > 1:  # whole copies before the last, interleaved in serving order
            assert [(k, r) for k, r, _ in plan[:tiles]] == [(k, 0) for k in range(tiles)]
            for k in range(tiles - 1):
                assert [r for kk, r, cut in plan if kk == k and cut is None] == list(range(4))


def test_served_requests_never_warm(bd, tmp_path):
    path = write_store(tmp_path)
    w, _ = bd.load_workload(path, None, 4, 0.02, 0)
    served = {prompt_hash(tr.prompt) for tr in w.served}
    plan, tiles = bd.warm_plan(w.counts, 3 * sum(w.counts) + 7)
    assert tiles == 4
    for k, r, cut in plan:
        prompt, tokens, hidden, _ = w.warm_trace(k, r, cut, True)
        assert prompt_hash(prompt) not in served
        assert len(hidden) == len(tokens) and (k > 0) == (prompt != w.warm[r].prompt)
    again = w.warm_trace(2, 1, None, True)[2]  # a copy is the same whatever the size
    assert np.array_equal(again, w.warm_trace(2, 1, None, True)[2])


# ---------------------------------------------------------------- the bench end to end

def test_bench_draft_smoke(bd, tmp_path, capsys):
    write_store(tmp_path)
    sizes = "256,1500"  # a prefix of one copy, and copies (about 700 states each)
    assert bd.main(["--bench", "tiny", "--model", "m", "--out", str(tmp_path), "--serve", "3", "--pool-sizes", sizes,
                    "--index", "exact", "--whole-rounds", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    data = json.loads((bench_dir(tmp_path, "tiny", "m") / "draft.json").read_text())
    assert data["complete"] and data["device"]["type"] == "cpu" and data["store_fingerprint"]
    assert data["served"]["requests"] == 3 and data["served"]["ids"] == ["r21", "r22", "r23"]
    rows = [r for r in data["rows"] if not r.get("absent")]
    assert [(r["arm"], r["pool_states"]) for r in rows] == [
        (a, s) for s in (256, 1500) for a in ("suffix", "lexical", "oilbird", "oilbird-no-semantic")]
    for r in rows:
        assert set(r["draft_ms_per_pass"]) >= {"median", "p99", "mean"} and r["passes"] > 0 and r["tau"] >= 1
        assert r["draft_ms_per_pass"]["median"] > 0
        if r["arm"] == "oilbird":
            assert r["index"] == "exact" and r["pool_states_warm"] == r["pool_states"]
            assert r["query_ms"]["count"] > 0 and set(r["query_ms"]) >= {"median", "p99"}
            assert r["recall_vs_exact"] == 1.0 and r["recall"]["queries"] > 0
        else:
            assert "query_ms" not in r and "recall_vs_exact" not in r
    assert rows[0]["tiles"] == 1 and rows[4]["tiles"] == -(-1500 // data["warm"]["states_per_copy"]) > 1
    arctic = [r for r in data["rows"] if r["arm"] == "arcticinference"]
    assert len(arctic) == 1 and arctic[0]["absent"] and "not installed" in arctic[0]["note"]
    names = [t["name"] for t in data["targets"]]
    assert any("65,536" in n for n in names) and set(data["draft_ratio_by_size"]) == {"256", "1500"}
    assert all(t["holds"] is None for t in data["targets"] if "key query" in t["name"])  # those sizes did not run
    # the whole store, in rounds: the key on, off, as it was (exact, every pass) and inline; replay is deterministic
    whole = data["whole_store"]
    assert whole["rounds"] == 2 and whole["requests"] == 24
    assert set(whole["arms"]) == {"oilbird", "oilbird-no-semantic", "oilbird@index=exact:key_patience=0",
                                  "oilbird@key_overlap=off"}
    assert whole["arms"]["oilbird-no-semantic"]["key_queries"] == 0
    # the worker changes where the query runs, not what it answers
    inline = whole["arms"]["oilbird@key_overlap=off"]
    served = whole["arms"]["oilbird"]
    assert (inline["tau"], inline["key_queries"]) == (served["tau"], served["key_queries"])
    assert whole["torch_threads"] == 1 and isinstance(whole["key_overlap"], bool)
    assert whole["arms"]["oilbird@index=exact:key_patience=0"]["key_queries"] >= whole["arms"]["oilbird"]["key_queries"]
    ratio = whole["draft_ratio"]["mean"]
    assert ratio["min"] <= ratio["median"] <= ratio["max"] and whole["tau_vs_before"] > 0
    by_name = {t["name"]: t for t in data["targets"]}
    assert by_name["drafting over the whole store"]["holds"] is not None
    assert by_name["tau over the whole store"]["measured"]["tau_ratio"] == whole["tau_vs_before"]
    assert "oilbird-no-semantic" in out and "recall" in out and "n/a" in out
    assert ("PASS" in out) or ("FAIL" in out)


class FakeCache:
    """A stand-in for ArcticInference's SuffixDecodingCache: proposes what followed the pattern's last token
    in the most recent cached response (a chain, parents -1, 0, 1, ...)."""

    def __init__(self, max_tree_depth=64, max_cached_requests=-1):
        self.responses, self.active = {}, set()

    def start_request(self, rid, prompt):
        self.active.add(rid)
        self.responses[rid] = []

    def add_active_response(self, rid, tokens):
        self.responses[rid].extend(tokens)

    def stop_request(self, rid):
        self.active.remove(rid)

    def speculate(self, rid, pattern, max_spec_tokens=None, max_spec_factor=1.0, min_token_prob=0.1,
                  use_tree_spec=False):
        assert rid in self.active
        last, chain = pattern[-1], []
        for other, toks in reversed(self.responses.items()):
            if other != rid and last in toks:
                i = len(toks) - 1 - toks[::-1].index(last)
                chain = toks[i + 1:i + 1 + max_spec_tokens]
                break
        return types.SimpleNamespace(token_ids=chain, parents=list(range(-1, len(chain) - 1)), probs=[], score=0.0,
                                     match_len=1)


def test_bench_draft_arctic_row_runs_the_same_loop(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    pkg, sub = types.ModuleType("arctic_inference"), types.ModuleType("arctic_inference.suffix_decoding")
    sub.SuffixDecodingCache = FakeCache
    pkg.suffix_decoding = sub
    monkeypatch.setitem(sys.modules, "arctic_inference", pkg)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", sub)
    import bench_draft

    write_store(tmp_path)
    assert bench_draft.main(["--bench", "tiny", "--model", "m", "--out", str(tmp_path), "--serve", "2",
                             "--pool-sizes", "300", "--arms", "oilbird", "--quiet"]) == 0  # the default index
    data = json.loads((bench_dir(tmp_path, "tiny", "m") / "draft.json").read_text())
    key = next(r for r in data["rows"] if r["arm"] == "oilbird")
    assert key["index"] and 0 <= key["recall_vs_exact"] <= 1 and key["query_ms"]["count"] > 0
    row = next(r for r in data["rows"] if r["arm"] == "arcticinference")
    assert not row.get("absent") and row["pool_states"] == 300 and row["passes"] > 0 and row["tau"] > 1
    assert row["settings"]["use_tree_spec"] is True and data["settings"]["arctic"] is not None
    assert "arcticinference" in capsys.readouterr().out


def test_bench_draft_errors_are_one_line(bd, tmp_path, capsys):
    write_store(tmp_path)
    common = ["--bench", "tiny", "--model", "m", "--out", str(tmp_path), "--quiet"]
    for extra, needle in ((["--serve", "24"], "no request"), (["--pool-sizes", "0"], "pool-sizes"),
                          (["--arms", "nope"], "nope"), (["--bench", "missing"], "no trace store")):
        assert bd.main(common + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error:") and needle in err


def test_bench_draft_runs_the_published_suffixdecoding(monkeypatch, tmp_path):
    """`make install` builds ArcticInference 0.3.0: its SuffixDecodingCache runs through the same loop, its own
    tree and scores, and the served requests' tokens decide what it accepts (replay), at every pool size."""
    import arctic_inference.suffix_decoding  # noqa: F401  (installed by `make install`; a missing build fails here)

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_draft

    write_store(tmp_path)
    assert bench_draft.main(["--bench", "tiny", "--model", "m", "--out", str(tmp_path), "--serve", "3",
                             "--pool-sizes", "256,1500", "--arms", "suffix", "--whole-rounds", "0", "--quiet"]) == 0
    data = json.loads((bench_dir(tmp_path, "tiny", "m") / "draft.json").read_text())
    arctic = [r for r in data["rows"] if r["arm"] == "arcticinference"]
    assert [r["pool_states"] for r in arctic] == [256, 1500] and not any(r.get("absent") for r in arctic)
    assert all(r["tau"] >= 1 and r["passes"] > 0 and r["draft_ms_per_pass"]["median"] > 0 for r in arctic)
    assert data["settings"]["arctic"]["use_tree_spec"] is True
