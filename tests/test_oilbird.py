"""Oilbird: exact tests of D(s), the +2 offset, the gate, budget accounting, merge cost, the ring buffer and
self-calibration; a constructed tool-call traffic on which the key must fire and pay; losslessness of every
Oilbird arm on stories260k; the harness's sole-source share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data.errors import OilbirdError
from data.store.schema import prompt_hash
from decoder.draft import ROOT, Draft, VerifyResult
from decoder.drafters import PRESETS, arm_names, make_drafter
from decoder.drafters.keygate import SelfCalibration
from decoder.drafters.lexical import LexicalConfig, build_lexical
from decoder.drafters.oilbird import POOL, SEMANTIC, OilbirdDrafter, merge_candidates
from decoder.drafters.oilbird_config import ARM_PRESETS, OilbirdConfig
from decoder.drafters.pld import NgramIndex
from decoder.drafters.rollouts import RejectedPool, rejected_records
from decoder.drafters.semantic import (
    MIN_CHUNK,
    SemanticPool,
    copy_depth,
    ngram_continuation,
    semantic_chains,
)
from decoder.live.harness import DecodeConfig, run_decode
from decoder.live.results import format_table
from decoder.verify.tree import greedy_accept
from tests.conftest import STORY_PROMPTS, write_jsonl

ARMS = list(ARM_PRESETS)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def unit(v):
    v = np.asarray(v, np.float32)
    return v / np.linalg.norm(v)


def mix(a, b, cos):
    """A unit vector at cosine `cos` from unit `a`, in the plane of a and b (b orthogonal to a)."""
    return unit(cos * a + np.sqrt(1 - cos * cos) * b)


def basis(d, i):
    e = np.zeros(d, np.float32)
    e[i] = 1
    return e


# ------------------------------------------------------------------ D(s), the +2 offset, chains

@pytest.mark.parametrize("s,depth", [(1.0, 48), (0.9, 48), (0.8999, 8), (0.85, 8), (0.82, 8), (0.8199, 0),
                                     (0.8, 0), (-1.0, 0)])
def test_copy_depth(s, depth):
    assert copy_depth(s) == depth


def test_semantic_chains_offset_depth_dedup_and_min_length():
    tokens = np.arange(100, 130, dtype=np.int32)  # two traces: flat [0, 20) and [20, 30)
    depth = lambda s, r: copy_depth(s)  # noqa: E731
    # neighbour at flat 3 (s 0.95: 48 deep, cut at its trace end 20), at 22 (s 0.85: 8 deep, cut at 30)
    assert semantic_chains([0.95, 0.85], [3, 22], [20, 30], tokens, depth) == [
        list(range(105, 120)), list(range(124, 130))]
    assert semantic_chains([0.85], [3], [20], tokens, depth) == [list(range(105, 113))]  # x[i+2 : i+2+8]
    assert semantic_chains([0.81], [3], [20], tokens, depth) == []  # D = 0: skipped
    assert semantic_chains([0.95], [17], [20], tokens, depth) == []  # one token left: too short
    assert semantic_chains([0.95], [16], [20], tokens, depth) == [[118, 119]]
    assert semantic_chains([0.95, 0.91], [3, 3], [20, 20], tokens, depth) == [list(range(105, 120))]  # deduplicated
    ranked = lambda s, r: (4, 2)[r] if r < 2 else 0  # noqa: E731  (--fixed-depth: by rank, not s)
    assert semantic_chains([0.5, 0.5, 0.5], [0, 10, 22], [20, 20, 30], tokens, ranked) == [[102, 103, 104, 105],
                                                                                           [112, 113]]


def test_pool_query_offset_exclusion_and_growth():
    d = 16
    rng = np.random.default_rng(0)
    pool = SemanticPool()
    # trace A: 6 tokens, states e0..e4 and a zero last row (the engine's convention: never fed)
    hidden = np.stack([basis(d, i) * 3 for i in range(5)] + [np.zeros(d)])
    assert pool.add_trace([10, 11, 12, 13, 14, 15], hidden, "A") == 5
    s, rows = pool.query(basis(d, 1), 3)
    assert rows[0] == 1 and s[0] == pytest.approx(1.0) and s[1] == pytest.approx(0.0)
    chains = semantic_chains(s[:1], pool.row_flat[rows[:1]], pool.row_end[rows[:1]], pool.tokens,
                             lambda s, r: copy_depth(s))
    assert chains == [[13, 14, 15]]  # h_1 ~ h_t: x_2 is the anchor, x_3 the first drafted token
    # a same-prompt trace is masked out while its prompt is served
    pool.add_trace([20, 21, 22, 23], np.stack([basis(d, 1)] * 3 + [np.zeros(d)]), "B")
    pool.exclude("A")
    s, rows = pool.query(basis(d, 1), 8)
    assert set(pool.row_flat[rows].tolist()) == {6, 7, 8}  # only B's rows (flat 6, 7, 8)
    pool.exclude("C")
    assert len(pool.query(basis(d, 1), 8)[0]) == 8
    # growth past the first chunk keeps every row, in order, in float16
    big = rng.standard_normal((MIN_CHUNK + 300, d)).astype(np.float32)
    pool.add_trace(list(range(MIN_CHUNK + 300)), big, "big")
    assert pool.n == 8 + MIN_CHUNK + 300 and pool.matrix.shape[0] >= pool.n and pool.matrix.dtype == torch.float16
    s, rows = pool.query(big[700], 1)
    assert rows[0] == 8 + 700 and s[0] == pytest.approx(1.0, abs=2e-3)
    assert pool.nbytes() == pool.n * (2 * d + 16) + 4 * pool.n_tokens


def test_ngram_continuation():
    trace = NgramIndex(4)
    trace.sync([5, 6, 7, 5, 6, 8, 9])
    assert ngram_continuation(trace, [1, 5, 6], 3) == [8, 9]  # the last "5 6" wins
    assert ngram_continuation(trace, [7, 5], 2) == [6, 8]  # "7 5" occurs once
    assert ngram_continuation(trace, [4], 3) == []


# ------------------------------------------------------------------ merge cost and budget accounting

def test_merge_cost_and_root_attached():
    spine = Draft()
    spine.add_chain([1, 2, 3], "spine", 60)
    merged = Draft(list(spine.tokens), list(spine.parents), [set(s) for s in spine.sources], dict(spine._children))
    costs = merge_candidates(merged, [([1, 2, 5, 6], SEMANTIC), ([1, 2, 3], SEMANTIC), ([7, 8], SEMANTIC)], 60)
    assert costs == [2, 0, 2]  # |chain| - longest prefix already on the tree
    assert merged.sources[0] == {"spine", SEMANTIC}  # walked nodes are credited
    rooted = Draft(list(spine.tokens), list(spine.parents), [set(s) for s in spine.sources], dict(spine._children))
    costs = merge_candidates(rooted, [([1, 2, 5, 6], SEMANTIC), ([7, 8], SEMANTIC)], 60, frozenset({SEMANTIC}))
    assert costs == [4, 2] and len(rooted) == 9  # every token bought, duplicates of 1, 2 included
    assert rooted.parents[3] == ROOT and rooted.tokens[3] == 1 and rooted.sources[0] == {"spine"}
    assert merge_candidates(rooted, [([1, 2, 3, 4], "branch")], 60) == [1]  # later merges walk the originals
    assert rooted.parents[-1] == 2 and "branch" in rooted.sources[0] and "branch" not in rooted.sources[3]
    capped = Draft()
    assert merge_candidates(capped, [([1, 2, 3], SEMANTIC), ([4, 5], SEMANTIC), ([1, 2, 9], "branch")], 4) == [3, 1, 0]
    assert capped.sources[:2] == [{SEMANTIC, "branch"}] * 2  # walked (and credited) after the budget is spent


def _frame_drafter(**options) -> tuple[OilbirdDrafter, list[int]]:
    """A drafter whose pool holds one trace with states e0.., an adjacency row at the anchor, h_t = e2."""
    d, vocab = 16, 64
    drafter = OilbirdDrafter(vocab, 60, OilbirdConfig(**options))
    trace = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    drafter.add_trace(trace, "old", np.stack([basis(d, i) for i in range(9)] + [np.zeros(d)]))
    prompt = [1, 2, 30, 31, 32]  # ends with 30 31 32: the automaton matches it in the pool
    drafter.begin_request(prompt)
    if drafter.table is not None:
        drafter.table.update([32], np.array([[40, 41, -1, -1, -1, -1, -1, -1]]))
    drafter.h_t = basis(d, 1)  # the state that predicted the anchor 32 (= x_2 of the trace: neighbour i = 1)
    return drafter, prompt


def test_budget_accounting_lexical_part_and_key_chain():
    drafter, prompt = _frame_drafter()
    draft = drafter.propose(prompt, 60)
    lex = build_lexical(drafter.index, drafter.table, 44, LexicalConfig())
    n = len(lex)
    assert draft.tokens[:n] == lex.tokens and draft.parents[:n] == lex.parents  # the lexical tree comes first
    assert len(draft) <= n + 16 and len(draft) <= 60
    assert drafter.tally["key_queries"] == 1 and drafter.tally["key_fired"] == 1
    # the key's chain x[1+2:] = 33 .. 39 equals the spine: walked and credited, nothing bought
    spine_nodes = draft.path_to(draft.child(draft.child(ROOT, 33), 34))
    assert all(SEMANTIC in draft.sources[i] for i in spine_nodes)
    assert drafter._bought == set()
    # a key chain the lexical tree lacks is bought, within B_ret
    drafter.h_t = mix(basis(16, 4), basis(16, 15), 0.85)  # s = 0.85 at i = 4: x[6 : 6+8] = 36 .. 39 (trace end)
    draft = drafter.propose(prompt, 60)
    node = draft.child(ROOT, 36)
    assert node is not None and draft.chain_tokens(draft.path_to(node)[-1]) == [36]
    assert [draft.tokens[i] for i in sorted(drafter._bought)] == [36, 37, 38, 39]
    assert all(draft.sources[i] == {SEMANTIC} for i in drafter._bought)
    # with a small budget, the reserve is what is left and the total never exceeds the budget
    for budget in range(0, 25):
        assert len(drafter.propose(prompt, budget)) <= budget


def test_no_semantic_never_queries_and_keeps_the_reserve():
    drafter, prompt = _frame_drafter(semantic=False)
    draft = drafter.propose(prompt, 60)
    assert drafter.tally["key_queries"] == 0 and not any(SEMANTIC in s for s in draft.sources)
    lex = build_lexical(drafter.index, drafter.table, 44, LexicalConfig())
    assert draft.tokens[:len(lex)] == lex.tokens


def test_gate():
    d = 16
    # (a) no automaton match, adjacency present: the adjacency-only draft with the whole budget, no key
    drafter, _ = _frame_drafter()
    prompt = [1, 2, 50]
    drafter.begin_request(prompt)
    drafter.h_t = basis(d, 1)
    drafter.table.update([50], np.array([[41, 42, -1, -1, -1, -1, -1, -1]]))
    draft = drafter.propose(prompt, 60)
    assert sorted(draft.tokens) == [41, 42] and all(s == {"adjacency"} for s in draft.sources)
    assert drafter.tally["key_queries"] == 0 and drafter.tally["gated"] == 1
    # (b) a match but no adjacency successors: the lexical chains alone, whole budget
    drafter, prompt = _frame_drafter()
    drafter.table.table[32] = -1
    draft = drafter.propose(prompt, 60)
    assert draft.chain_tokens(len(draft) - 1)[:1] == [33] and drafter.tally["key_queries"] == 0
    assert draft.tokens == build_lexical(drafter.index, drafter.table, 60, LexicalConfig()).tokens
    # (c) neither: nothing drafted (one AR step)
    drafter, _ = _frame_drafter()
    drafter.begin_request([1, 2, 51])
    drafter.h_t = basis(d, 1)
    assert len(drafter.propose([1, 2, 51], 60)) == 0 and drafter.tally["key_queries"] == 0
    # semantic-only has no gate: the key drafts from the root where the lexical sources have nothing
    drafter, _ = _frame_drafter(host="none")
    drafter.begin_request([1, 2, 51])
    drafter.h_t = basis(d, 1)
    draft = drafter.propose([1, 2, 51], 60)
    assert draft.chain_tokens(len(draft) - 1) == [33, 34, 35, 36, 37, 38, 39]
    assert all(s == {SEMANTIC} for s in draft.sources)


def test_root_branching_declares_the_anchors_successors_and_the_null_keeps_it():
    """semantic-only and semantic-null declare root branching: the anchor's adjacency successors (the model's
    top-8 after that token, last time it was verified) as one-token root branches labelled "root", after the
    key chains; @root_branching=0 takes them away (the null control then drafts nothing)."""
    for arm, expect in (("semantic-null", [7, 8, 9]), ("semantic-null@root_branching=0", [])):
        d = make_drafter(arm, vocab_size=20, nodes=60)
        d.begin_request([1, 2, 3])
        d.observe([1, 2, 3], VerifyResult(Draft(), [], 7, [7], np.array([7]), np.array([[7, 8, 9, -1, -1, -1, -1, -1]]),
                                          None))  # the verifier's top-8 after the anchor 3
        draft = d.propose([1, 2, 3, 7, 3], 60)
        assert draft.tokens == expect and draft.parents == [ROOT] * len(expect)
        assert all(src == {"root"} for src in draft.sources)
        assert d.tally["key_queries"] == 0
    with pytest.raises(OilbirdError, match="root_branching needs host none"):
        make_drafter("oilbird@root_branching=8", vocab_size=20, nodes=60)


# ------------------------------------------------------------------ the transplant ladder's +pool rung

def test_pool_arms_are_presets_of_one_drafter():
    assert {"pld+pool", "recycling+pool", "pld+key", "recycling+key"} <= set(arm_names())
    for arm, host in [("pld+pool", "pld"), ("recycling+pool", "recycling")]:
        d = make_drafter(arm, vocab_size=100, nodes=60)
        assert isinstance(d, OilbirdDrafter) and d.name == arm
        c = d.config
        assert (c.host, c.semantic, c.host_pool, c.branch_top, c.rollouts) == (host, False, True, 0, 0)
        assert c.retrieval_budget == 16 and d.host_pool.max_ngram == (3 if host == "pld" else 1)
        # the +key rung replaces the pool's exact key by the semantic one: what fills B_ret differs, and
        # nothing exact over the pool is left to gate the key; +key-added keeps the host's gate
        key = make_drafter(arm.replace("+pool", "+key"), vocab_size=100, nodes=60).config
        assert OilbirdConfig(**{**vars(key), "semantic": False, "host_pool": True, "gate": True}) == c
        assert key.gate is False
        added = make_drafter(arm.replace("+pool", "+key-added"), vocab_size=100, nodes=60).config
        assert OilbirdConfig(**{**vars(added), "semantic": False, "host_pool": True}) == c
    assert make_drafter("pld+key", vocab_size=100).host_pool is None


def test_the_replacing_key_is_asked_where_the_host_has_no_match():
    """pld+key asks the key although prompt lookup matched nothing (the pool's exact key is gone, so nothing
    gates it); pld+key-added, gated by the host's own match, does not."""
    d = 4
    for arm, asked in (("pld+key", 1), ("pld+key-added", 0)):
        drafter = make_drafter(arm, vocab_size=100, nodes=60)
        drafter.add_trace([30, 31, 32, 33, 34], prompt_hash([9]), hidden=np.eye(5, d, dtype=np.float32))
        drafter.begin_request([1, 2, 3])
        drafter.h_t = basis(d, 1)  # the state of trace row 1: the key's chain is 33, 34
        draft = drafter.propose([1, 2, 3], 60)
        assert drafter.tally["key_queries"] == asked
        assert draft.tokens == ([33, 34] if asked else [])
    with pytest.raises(ValueError, match="host_pool"):
        OilbirdDrafter(100, 60, OilbirdConfig(host_pool=True))  # the lexical host already reads the pool


def test_pld_pool_drafts_the_pool_chain_where_the_context_has_none():
    trace = [40, 41, 42, 43, 44, 45]
    prompt = [1, 2, 3, 40, 41]  # no repeated n-gram: prompt lookup alone is blind here
    pld = make_drafter("pld", vocab_size=100)
    pld.begin_request(prompt)
    assert len(pld.propose(prompt, 60)) == 0
    d = make_drafter("pld+pool", vocab_size=100, nodes=60)
    d.add_trace(trace, prompt_hash([9, 9]))  # a finished request of another prompt
    d.begin_request(prompt)
    draft = d.propose(prompt, 60)
    assert draft.tokens == [42, 43, 44, 45] and draft.parents == [ROOT, 0, 1, 2]  # "40 41" -> what followed
    assert all(src == {POOL} for src in draft.sources)
    assert d.tally["gated"] == 0 and d.tally["host_pool_chains"] == 1 and d.tally["key_queries"] == 0
    # with prompt lookup matching too: its chain first, the pool's merged into B_ret (the longest n-gram wins)
    context = [7, 41, 8, 9, 40, 41]
    d.begin_request(context)
    draft = d.propose(context, 60)
    assert draft.tokens == [8, 9, 40, 41, 42, 43, 44, 45] and draft.parents == [ROOT, 0, 1, 2, ROOT, 4, 5, 6]
    assert draft.sources == [{"pld"}] * 4 + [{POOL}] * 4
    # a pool chain that starts like the prompt-lookup chain walks it (credited) and buys only the rest
    d.add_trace([5, 7, 8, 9, 1, 7, 50], "other")
    context = [7, 8, 9, 1, 7, 8, 9]  # prompt lookup: "7 8 9" -> 1 7 8 9; the pool: "7 8 9" -> 1 7 50
    d.begin_request(context)
    draft = d.propose(context, 60)
    assert draft.tokens == [1, 7, 8, 9, 50] and draft.parents == [ROOT, 0, 1, 2, 1]
    assert draft.sources == [{"pld", POOL}] * 2 + [{"pld"}] * 2 + [{POOL}]


def test_pool_arms_never_draft_from_a_same_prompt_trace():
    prompt = [1, 2, 3, 40, 41]
    for arm in ("pld+pool", "recycling+pool"):
        d = make_drafter(arm, vocab_size=100, nodes=60)
        d.add_trace([40, 41, 42, 43], prompt_hash(prompt))  # this prompt's own earlier trace (warm or served)
        d.begin_request(prompt)
        assert len(d.propose(prompt, 60)) == 0 and d.tally["gated"] == 1, arm  # nothing else: one AR step
        d.add_trace([41, 60, 61], prompt_hash([7, 7]))  # another prompt's trace is used
        draft = d.propose(prompt, 60)
        assert draft.tokens == [60, 61] and draft.sources == [{POOL}] * 2, arm
        d.begin_request([5, 6, 40, 41])  # another prompt: the first trace is no longer excluded
        # pld's key: "40 41" (only in the first trace) beats "41"; recycling's: the anchor 41, most recent
        want = [42, 43] if arm == "pld+pool" else [60, 61]
        assert d.propose([5, 6, 40, 41], 60).tokens == want, arm


def test_recycling_pool_adds_the_anchor_continuation_to_the_adjacency_tree():
    d = make_drafter("recycling+pool", vocab_size=100, nodes=60)
    d.add_trace([40, 41, 42, 43], "old")
    prompt = [1, 2, 40]
    d.begin_request(prompt)
    draft = d.propose(prompt, 60)  # no adjacency yet: the pool's chain alone (the pool is the host's key)
    assert draft.tokens == [41, 42, 43] and draft.sources == [{POOL}] * 3
    d.table.update([40], np.array([[50, 41, -1, -1, -1, -1, -1, -1]]))
    rec = make_drafter("recycling", vocab_size=100)
    rec.table.table[:] = d.table.table
    assert rec.propose(prompt, 60).tokens == [50, 41]  # recycling alone: nothing after 41
    draft = d.propose(prompt, 60)
    assert draft.tokens == [50, 41, 42, 43] and draft.parents == [ROOT, ROOT, 1, 2]
    assert draft.sources == [{"recycling"}, {"recycling", POOL}, {POOL}, {POOL}]  # 41 walked and credited


@pytest.mark.parametrize("arm", ["pld+pool", "recycling+pool"])
def test_pool_arms_stay_within_the_budget_and_b_ret(arm):
    rng = np.random.default_rng(5)
    vocab = 200
    d = make_drafter(arm, vocab_size=vocab, nodes=60)
    long_trace = list(range(100, 160))  # 60 distinct tokens: the pool could copy far more than B_ret
    d.add_trace(long_trace, "old")
    if d.table is not None:
        for tok in range(vocab):
            d.table.table[tok] = rng.integers(0, vocab, 8)
    prompt = [1, 2, 100, 101]
    d.begin_request(prompt)
    draft = d.propose(prompt, 60)
    pooled = [i for i, src in enumerate(draft.sources) if POOL in src]
    bought = [i for i, src in enumerate(draft.sources) if src == {POOL}]
    assert len(draft) <= 60 and len(bought) <= 16
    assert draft.chain_tokens(pooled[-1]) == long_trace[2:18]  # B_ret = 16 tokens copied
    for budget in range(0, 40):
        draft = d.propose(prompt, budget)
        assert len(draft) <= budget
        assert sum(src == {POOL} for src in draft.sources) <= min(budget, 16)


# ------------------------------------------------------------------ ring buffer

def _verify_result(d=4):
    # n0 (5) and n2 (7) under the anchor, n1 (6) and n3 (9) under n0, n4 (4) under n2
    draft = Draft()
    for parent, tok in [(ROOT, 5), (0, 6), (ROOT, 7), (0, 9), (2, 4)]:
        draft.add_node(parent, tok, "x")
    argmax = np.array([5, 6, 8, 4, 12, 11])  # rows: anchor, n0..n4
    accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
    assert (accepted, bonus) == ([0, 1], 8)
    hidden = np.eye(6, d, dtype=np.float32) if d >= 6 else np.random.default_rng(0).standard_normal((6, d))
    return VerifyResult(draft, accepted, bonus, [5, 6, 8], argmax, np.zeros((6, 8), np.int64), hidden)


def test_rejected_records():
    result = _verify_result()
    # rejected and judged: n2 (under the anchor: state row 0) and n3 (under n0: row 1); n4 was never judged
    assert rejected_records(result, 6) == [(0, 7, [4, 11]), (1, 9, [12])]  # n2's argmax 4 is its child n4: followed
    assert rejected_records(result, 1) == [(0, 7, [4]), (1, 9, [12])]
    assert rejected_records(result, 0) == []


def test_ring_buffer_lookup_overwrite_and_owner():
    d = 8
    ring = RejectedPool(capacity=3)
    ring.add(basis(d, 0), 7, [1, 2], owner=("p", 1))
    ring.add(mix(basis(d, 0), basis(d, 1), 0.85), 7, [3], owner=("p", 1))
    ring.add(mix(basis(d, 0), basis(d, 1), 0.5), 7, [4], owner=("q", 2))
    assert ring.lookup(basis(d, 0), 7, 0.8, 4) == [[1, 2], [3]]  # cos 1 then 0.85; 0.5 is below theta
    assert ring.lookup(basis(d, 0), 8, 0.8, 4) == []  # the anchor token must be equal
    assert ring.lookup(basis(d, 0), 7, 0.8, 1) == [[1, 2]]  # at most `top`
    assert ring.lookup(basis(d, 0), 7, 0.8, 4, skip=lambda o: o == ("p", 1)) == []
    ring.add(basis(d, 0), 7, [9], owner=("q", 2))  # overwrites the oldest slot ([1, 2])
    assert ring.size == 3 and ring.lookup(basis(d, 0), 7, 0.8, 4) == [[9], [3]]
    ring.add(basis(d, 2), 5, [1, 2])  # overwrites [3]: token 7 loses that slot
    assert ring.lookup(basis(d, 0), 7, 0.8, 4) == [[9]] and ring.lookup(basis(d, 2), 5) == [[1, 2]]
    ring.add(basis(d, 0), 7, [1, 1, 1])
    ring.add(basis(d, 0), 7, [1, 1, 1])
    assert ring.lookup(basis(d, 0), 7, 0.8, 4) == [[1, 1, 1]]  # deduplicated


def test_rollouts_reach_the_draft_from_the_ring():
    drafter, prompt = _frame_drafter(semantic=False, branch_top=0)
    drafter.ring.add(basis(16, 1), 32, [70, 71, 72])  # same anchor token, same state
    draft = drafter.propose(prompt, 60)
    node = draft.child(draft.child(draft.child(ROOT, 70), 71), 72)
    assert node is not None and draft.sources[node] == {"rollout"}
    assert drafter.tally["rollout_chains"] == 1


# ------------------------------------------------------------------ self-calibration

def test_self_calibration_window_threshold_recovery():
    cal = SelfCalibration(window=4, min_hit_rate=0.5, cooldown=3)
    for hit in [True, False, False]:
        assert cal.allow()
        cal.record(hit)
    assert cal.allow()
    cal.record(True)  # window full: 2 hits of 4 = 0.5, not below the threshold
    assert cal.allow() and cal.mutes == 0
    cal.record(False)  # window now F F T F: 1 of 4 < 0.5: muted
    assert cal.mutes == 1 and [cal.allow() for _ in range(4)] == [False, False, False, True]
    assert cal.skipped == 3 and len(cal.outcomes) == 0  # back on probation with an empty window
    for _ in range(3):
        cal.record(False)
    assert cal.allow() and cal.mutes == 1  # three misses: the window is not full yet
    cal.record(False)
    assert not cal.allow() and cal.mutes == 2
    off = SelfCalibration(window=0)
    for _ in range(10):
        off.record(False)
    assert off.allow() and off.mutes == 0


def test_drafter_feeds_self_calibration():
    drafter, prompt = _frame_drafter(calib_window=2, calib_min_hit_rate=0.5, calib_cooldown=5,
                                     key_floor=0.0)  # its answers (cosine 0.85) stay below the default floor
    for _ in range(2):
        drafter.h_t = mix(basis(16, 4), basis(16, 15), 0.85)
        draft = drafter.propose(prompt, 60)
        assert drafter._bought
        topk = np.zeros((1 + len(draft), 8), np.int64)
        drafter.observe(prompt, VerifyResult(draft, [], 99, [99], topk[:, 0], topk, None))  # nothing accepted
    assert drafter.calibration.mutes == 1
    drafter.h_t = basis(16, 1)
    drafter.propose(prompt, 60)
    assert drafter.tally["key_queries"] == 2 and drafter.calibration.skipped == 1


def test_a_far_answer_quiets_the_key_for_a_few_passes():
    drafter, prompt = _frame_drafter(key_floor=0.88, key_floor_skip=3)
    queries = []
    for h in [mix(basis(16, 4), basis(16, 15), 0.85)] + [basis(16, 1)] * 4:  # cosine 0.85, then 1.0
        drafter.h_t = h
        drafter.propose(prompt, 60)
        queries.append(drafter.tally["key_queries"])
    assert queries == [1, 1, 1, 1, 2]  # the far answer skips the next three passes
    assert drafter.counters()["floor_skipped"] == 3


# ------------------------------------------------------------------ every arm through the protocol

@pytest.mark.parametrize("arm", ARMS)
def test_protocol_invariants_with_states(arm):
    """Random requests with random states: trees valid, within budget, sources labelled."""
    rng = np.random.default_rng(3)
    vocab, d = 12, 8
    drafter = make_drafter(arm, vocab_size=vocab, nodes=24, calib_window=4, ring_size=16)
    labels = {"spine", "branch", "adjacency", "pld", "recycling", "toolspec", SEMANTIC, "rollout", POOL, "root"}
    served = 0
    for r in range(5):
        prompt = rng.integers(0, vocab, 10).tolist()
        drafter.begin_request(prompt)
        context, states = list(prompt), []
        for _ in range(12):
            budget = int(rng.integers(0, 25))
            draft = drafter.propose(context, budget)
            assert len(draft) <= budget and all(p < i for i, p in enumerate(draft.parents))
            assert all(0 <= t < vocab for t in draft.tokens) and all(s and s <= labels for s in draft.sources)
            n = len(draft)
            argmax = rng.integers(0, vocab, 1 + n)
            topk = np.concatenate([argmax[:, None], rng.integers(0, vocab, (1 + n, 7))], axis=1)
            accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
            hidden = rng.standard_normal((1 + n, d)).astype(np.float32)
            committed = [draft.tokens[i] for i in accepted] + [bonus]
            drafter.observe(context, VerifyResult(draft, accepted, bonus, committed, argmax, topk, hidden))
            context += committed
            states += [hidden[0]] + [hidden[1 + i] for i in accepted]
        output = context[len(prompt):]
        drafter.add_trace(output, prompt_hash(prompt), np.stack(states[: len(output)]))
        served += len(output)
    assert drafter.counters()["pool_tokens"] == served
    assert PRESETS.get(arm, ("oilbird",))[0] == "oilbird" and drafter.name == arm


# ------------------------------------------------------------------ constructed traffic: tool calls with minted names

KEYS = [60, 61, 62, 63, 64]  # five keys, each after a comma: a 1-token lexical match cannot tell them apart
CALLS_PER_REQUEST = 3
VOCAB = 2200


def _tool_traffic(n_requests=10, d=32, seed=0):
    """Requests of repeated tool-call frames `CALL ( name = N1 N2 , k1 = V1 , ... , k5 = V5 ) END`, the
    name and the values minted per call (never seen before); a state per position = its frame slot's
    vector + noise, so the same slot looks alike across requests whatever was minted into it. After a
    minted token the automaton matches at most the comma, which precedes all five keys; the state
    that predicted the comma knows which key comes next."""
    rng = np.random.default_rng(seed)
    CALL, LP, NAME, EQ, COMMA, RP, END = 1, 2, 3, 4, 5, 6, 7
    minted = iter(range(100, 2000))
    truths = []
    for _ in range(n_requests):
        out = []
        for _ in range(CALLS_PER_REQUEST):
            out += [CALL, LP, NAME, EQ, next(minted), next(minted)]
            for k in KEYS:
                out += [COMMA, k, EQ, next(minted)]  # minted values too
            out += [RP, END]
        truths.append(out)
    frame = len(truths[0]) // CALLS_PER_REQUEST
    slots = rng.standard_normal((frame, d)).astype(np.float32)

    def state(index):  # the state with truth[index] as input
        return slots[index % frame] + 0.05 * rng.standard_normal(d).astype(np.float32)

    prompts = [[8, 9, 2100 + r] for r in range(n_requests)]
    return truths, prompts, state, d


def _serve(drafter, truths, prompts, state, d, nodes=60):
    """The engine's loop with a simulated verifier that argmaxes the truth (states per `state`).
    Returns tau and the accepted tokens only the semantic source proposed."""
    rng = np.random.default_rng(1)
    prompt_state = rng.standard_normal(d).astype(np.float32)  # the prompts are alike (request-level key)
    passes = tokens = sole = 0
    for prompt, truth in zip(prompts, truths):
        drafter.begin_request(prompt)
        context, out, rows = list(prompt), [], []
        while len(out) < len(truth):
            draft = drafter.propose(context, nodes)
            pos = len(out)  # truth index of the next token
            n = len(draft)
            on: dict[int, int] = {}  # node -> truth index of its token, for nodes on the true path
            argmax = np.zeros(1 + n, np.int64)
            hidden = np.zeros((1 + n, d), np.float32)
            argmax[0] = truth[pos]
            hidden[0] = state(pos - 1) if pos else prompt_state + 0.1 * rng.standard_normal(d)
            for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents)):
                idx = pos if par == ROOT else (on[par] + 1 if par in on else None)
                if idx is not None and idx < len(truth) and truth[idx] == tok:
                    on[i] = idx
                    argmax[1 + i] = truth[idx + 1] if idx + 1 < len(truth) else 0
                    hidden[1 + i] = state(idx)
                else:
                    argmax[1 + i] = 2050 + i % 40
                    hidden[1 + i] = rng.standard_normal(d)
            topk = np.full((1 + n, 8), -1, np.int64)
            topk[:, 0] = argmax
            accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
            sole += sum(draft.sources[i] == {SEMANTIC} for i in accepted)
            committed = ([draft.tokens[i] for i in accepted] + [bonus])[: len(truth) - pos]
            result = VerifyResult(draft, accepted, bonus, committed, argmax, topk, hidden)
            drafter.observe(context, result)
            rows += ([hidden[0]] if pos else []) + [hidden[1 + i] for i in accepted]
            context += committed
            out += committed
            passes += 1
        hid = np.zeros((len(out), d), np.float32)
        hid[: len(out) - 1] = np.stack(rows[: len(out) - 1])
        drafter.add_trace(out, prompt_hash(prompt), hid)
        tokens += len(out)
    return tokens / passes, sole


def test_constructed_tool_traffic_key_fires_and_pays():
    truths, prompts, state, d = _tool_traffic()
    taus, sole, drafters = {}, {}, {}
    for arm in ["oilbird", "oilbird-no-semantic", "lexical", "oilbird-request-key", "semantic-only",
                "semantic-null", "pld", "pld+key", "recycling", "recycling+key"]:
        drafters[arm] = make_drafter(arm, vocab_size=VOCAB, nodes=60)
        truths_, prompts_, state_, _ = _tool_traffic()  # the same traffic, the same noise, per arm
        taus[arm], sole[arm] = _serve(drafters[arm], truths_, prompts_, state_, d)
    stats = drafters["oilbird"].counters()
    assert stats["key_fired"] > 0 and stats["key_nodes"] > 0 and sole["oilbird"] > 0
    assert taus["oilbird"] > 1.2 * taus["oilbird-no-semantic"], taus  # measured 1.93 vs 1.45
    assert taus["oilbird-no-semantic"] >= taus["lexical"] - 0.05, taus
    assert drafters["oilbird-no-semantic"].counters()["key_queries"] == 0 and sole["oilbird-no-semantic"] == 0
    # one similarity per trace cannot tell the five commas apart; one per position can
    assert drafters["oilbird-request-key"].counters()["key_fired"] > 0
    assert taus["oilbird"] > 1.2 * taus["oilbird-request-key"], taus
    assert taus["semantic-only"] > 1.5 * taus["semantic-null"], taus  # the key is what the null control lacks
    assert taus["pld+key"] > 1.2 * taus["pld"] and taus["recycling+key"] > 1.2 * taus["recycling"], taus


def test_the_key_on_the_worker_drafts_what_it_drafts_inline():
    """key_overlap: the query on the kernel's worker thread, started before the lexical tree is built, gives
    every pass the draft the inline query gives (a pool pruned early, so that the kernel answers)."""
    from data.index import keyscan
    from data.index.pruner import PrunerConfig

    assert keyscan.library() is not None
    drafts, counters = {}, {}
    for overlap in ("on", "off"):
        drafter = make_drafter("oilbird", vocab_size=VOCAB, nodes=60, key_overlap=overlap)
        drafter.pool.pruner_config = PrunerConfig(prune_from=128, min_lists=8, nprobe_min=2, train_per_list=16)
        seen, propose = [], drafter.propose
        drafter.propose = lambda context, budget: seen.append(propose(context, budget)) or seen[-1]
        truths, prompts, state, d = _tool_traffic()
        _serve(drafter, truths, prompts, state, d)
        drafts[overlap] = [(x.tokens, x.parents, x.sources) for x in seen]
        counters[overlap] = drafter.counters()
    assert drafts["on"] == drafts["off"]
    on, off = counters["on"], counters["off"]
    assert on["key_queries"] == off["key_queries"] > 0 and on["key_fired"] == off["key_fired"] > 0
    assert on["overlapped_queries"] > 0.5 * on["key_queries"] and off["overlapped_queries"] == 0
    assert on["pruned_queries"] == off["pruned_queries"]
    with pytest.raises(OilbirdError, match="key_overlap must be auto, on or off"):
        make_drafter("oilbird@key_overlap=sometimes", vocab_size=VOCAB, nodes=60)


def test_constructed_tool_traffic_transplant_ladder():
    """base < +pool < +key for both published hosts: the key is measured against the host handed the pool
    under its own exact key, not against the host alone (measured: pld 1.27 < 1.52 < 1.69, recycling
    1.19 < 1.47 < 1.85)."""
    taus, drafters = {}, {}
    for arm in ["pld", "pld+pool", "pld+key", "recycling", "recycling+pool", "recycling+key"]:
        drafters[arm] = make_drafter(arm, vocab_size=VOCAB, nodes=60)
        truths, prompts, state, d = _tool_traffic()
        taus[arm], sole = _serve(drafters[arm], truths, prompts, state, d)
        assert sole == 0 or arm.endswith("+key"), arm
    for host in ("pld", "recycling"):
        assert taus[f"{host}+pool"] > 1.1 * taus[host], taus
        assert taus[f"{host}+key"] > taus[f"{host}+pool"], taus
        pool = drafters[f"{host}+pool"].counters()
        assert pool["host_pool_chains"] > 0 and pool["key_queries"] == 0 and pool["rollout_chains"] == 0


# ------------------------------------------------------------------ stories260k: every arm lossless, summary fields

def test_every_oilbird_arm_lossless_stories(stories, tmp_path):
    prompts = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1]]
    bench = write_jsonl(tmp_path / "bench.jsonl", prompts)
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("ar", *ARMS), max_new_tokens=40,
                       out=str(tmp_path / "runs"), progress=False)
    summaries = run_decode(cfg, lm=stories)
    lexical = {"spine", "branch", "adjacency"}
    for arm in ARMS:
        s = summaries[arm]
        assert s["lossless"]["lossless"], (arm, s["lossless"]["mismatches"])
        assert s["generated_tokens"] == summaries["ar"]["generated_tokens"]
        drafted = set(s["drafted_by_source"])
        stats = s["drafter_stats"]
        assert stats["pool_tokens"] == s["generated_tokens"]  # every finished request entered the pool
        share = s["sole_source_share"]
        cycles = pq.read_table(Path(s["decode_dir"]) / arm / "cycles.parquet").to_pydict()
        if stats["semantic_key"]:
            labels = [label for per_pass in cycles["sources"] for label in per_pass]
            draft_share = s["sole_source_share_of_draft"]
            # the paper's share: over all committed tokens (bonus included); beside it, over accepted draft tokens
            assert share["tokens"] == sum(cycles["committed"]) == s["generated_tokens"]
            assert draft_share["accepted"] == sum(cycles["accepted"]) == len(labels)
            assert share["sole"] == draft_share["sole"] == labels.count(SEMANTIC)
            assert share["value"] == pytest.approx(share["sole"] / share["tokens"])
            assert draft_share["value"] == pytest.approx(draft_share["sole"] / max(1, draft_share["accepted"]))
            assert 0 <= share["sole"] <= s["accepted_by_source"].get(SEMANTIC, 0) <= draft_share["accepted"]
            assert s["semantic_time_s"] >= 0 and 0 <= s["retrieval_fraction"] < 1
            assert s["store_bytes_per_token"] > 0
        else:
            assert share is None and s["sole_source_share_of_draft"] is None and SEMANTIC not in drafted
    # the sources each arm may use, read from the per-node counters
    assert summaries["oilbird"]["drafter_stats"]["key_queries"] > 0
    for arm in ("oilbird", "semantic-only", "oilbird-root-attached", "oilbird-fixed-depth", "pld+key", "recycling+key"):
        assert summaries[arm]["drafted_by_source"].get(SEMANTIC, 0) > 0, arm  # lossless with the key drafting
    assert SEMANTIC not in summaries["oilbird-no-semantic"]["drafted_by_source"]
    assert not (set(summaries["semantic-only"]["drafted_by_source"]) & lexical)
    # the null control drafts: root branching (the anchor's adjacency successors) seeds the rejected-branch pool
    assert summaries["semantic-null"]["drafted_by_source"].get("root", 0) > 0
    assert not set(summaries["semantic-null"]["drafted_by_source"]) - {"rollout", "root"}
    assert not set(summaries["semantic-only"]["drafted_by_source"]) - {SEMANTIC, "rollout", "root"}
    assert set(summaries["pld+key"]["drafted_by_source"]) <= {"pld", SEMANTIC}
    assert set(summaries["recycling+key"]["drafted_by_source"]) <= {"recycling", SEMANTIC}
    table = format_table(summaries)
    assert "sole" in table.splitlines()[0] and "oilbird-root-attached" in table
    written = json.loads((Path(summaries["oilbird"]["decode_dir"]) / "oilbird" / "summary.json").read_text())
    assert set(written["sole_source_share"]) == {"value", "interval", "sole", "tokens", "definition"}
    assert set(written["sole_source_share_of_draft"]) == {"value", "interval", "sole", "accepted", "definition"}


def test_pool_arms_lossless_stories(stories, tmp_path):
    """The +pool rungs decode live on stories260k: lossless, with the pool's chains drafted and accepted."""
    prompts = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1]]
    bench = write_jsonl(tmp_path / "bench.jsonl", prompts)
    arms = ("pld", "pld+pool", "recycling", "recycling+pool")
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("ar", *arms), max_new_tokens=40,
                       out=str(tmp_path / "runs"), progress=False)
    summaries = run_decode(cfg, lm=stories)
    for arm in arms:
        s = summaries[arm]
        assert s["lossless"]["lossless"], (arm, s["lossless"]["mismatches"])
        assert s["generated_tokens"] == summaries["ar"]["generated_tokens"]
    for arm, host in (("pld+pool", "pld"), ("recycling+pool", "recycling")):
        s = summaries[arm]
        assert set(s["drafted_by_source"]) <= {host, POOL}, arm
        assert s["drafted_by_source"].get(POOL, 0) > 0 and s["accepted_by_source"].get(POOL, 0) > 0, arm
        assert s["sole_source_share"] is None  # no semantic key
        stats = s["drafter_stats"]
        assert stats["host_pool_tokens"] == s["generated_tokens"]  # every finished request entered the pool
        assert stats["key_queries"] == 0 and stats["host_pool_chains"] > 0
        cycles = pq.read_table(Path(s["decode_dir"]) / arm / "cycles.parquet").to_pydict()
        assert all(n <= 60 for n in cycles["nodes"])
    assert POOL not in summaries["pld"]["drafted_by_source"]


def test_warm_pool_same_prompt_is_never_a_neighbour():
    drafter = OilbirdDrafter(64, 60)
    prompt = [1, 2, 3]
    hidden = np.stack([basis(8, i) for i in range(4)] + [np.zeros(8)])
    drafter.add_trace([10, 11, 12, 13, 14], prompt_hash(prompt), hidden)  # a warm trace of this very prompt
    drafter.begin_request(prompt)
    assert drafter.pool.query(basis(8, 1), 8)[0].size == 0
    drafter.begin_request([1, 2, 4])
    assert drafter.pool.query(basis(8, 1), 8)[1].tolist()[0] == 1
    assert prompt_hash(prompt) in drafter.pool._group_of
