"""Drafters against brute-force references on small random token streams (hypothesis, small vocab)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.errors import OilbirdError
from data.index.automaton import SuffixAutomaton
from data.store.schema import prompt_hash
from decoder.draft import ROOT, Draft, VerifyResult
from decoder.drafters import DRAFTERS, installed, make_drafter
from decoder.drafters.lexical import (
    ADJACENCY,
    BRANCH,
    SPINE,
    LexicalConfig,
    build_lexical,
)
from decoder.drafters.pld import NgramIndex, PoolNgramIndex
from decoder.drafters.recycling import RANK_PRIOR, AdjacencyTable, default_template
from decoder.drafters.sam import AutomatonIndex, automaton_chains, automaton_match
from decoder.drafters.suffix import SuffixConfig, SuffixDrafter

FAST = settings(max_examples=60, deadline=None)

tokens3 = st.lists(st.integers(0, 2), min_size=1, max_size=14)
hashes = st.sampled_from(["a", "b", "c", None])


# ---------- naive references ----------

def occurrences(seqs, s):
    """[(trace index, end position)] of s in each sequence, in pool order (never across sequences)."""
    m = len(s)
    return [(k, i + m - 1) for k, seq in enumerate(seqs) for i in range(len(seq) - m + 1) if seq[i:i + m] == s]


def flat_offsets(seqs):
    offs, o = [], 0
    for seq in seqs:
        offs.append(o)
        o += len(seq) + 1  # one separator between sequences
    return offs


def root_paths(draft: Draft) -> set[tuple[int, ...]]:
    return {tuple(draft.chain_tokens(i)) for i in range(len(draft))}


def check_tree(draft: Draft, budget: int, vocab: int | None = None) -> None:
    """Budget respected, parents before children, no two siblings with one token, sources present."""
    assert len(draft) <= budget
    assert len(draft.parents) == len(draft.tokens) == len(draft.sources)
    seen = set()
    for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents)):
        assert par == ROOT or 0 <= par < i
        assert (par, tok) not in seen
        seen.add((par, tok))
        assert draft.sources[i]
        if vocab is not None:
            assert 0 <= tok < vocab


# ---------- suffix automaton core ----------

@FAST
@given(st.lists(st.tuples(tokens3, st.integers(0, 2)), min_size=1, max_size=4),
       st.lists(st.integers(0, 2), max_size=10))
def test_sam_counts_positions_and_match_vs_naive_scan(traces, pattern):
    seqs = [list(s) for s, _ in traces]
    groups = [g for _, g in traces]
    sam = SuffixAutomaton()
    for s, g in zip(seqs, groups):
        sam.start_sequence()
        for i, t in enumerate(s):
            sam.extend(t, g)
            assert sam.state_of(s[: i + 1]) == sam.last  # online: `last` holds the sequence so far
    assert len(sam) <= 2 * sum(len(s) for s in seqs) + 1
    offs = flat_offsets(seqs)
    candidates = {tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i + 1, len(s) + 1)}
    candidates |= {c for n in range(1, 5) for c in itertools.product(range(3), repeat=n)}
    for cand in candidates:
        s = list(cand)
        occ = occurrences(seqs, s)
        state = sam.state_of(s)
        if not occ:
            assert state == -1
            continue
        assert sam.length[sam.link[state]] < len(s) <= sam.length[state]
        assert sam.count[state] == len(occ)
        ends = [(offs[k] + e, groups[k]) for k, e in occ]
        last_pos, last_group = max(ends)
        assert sam.pos[state] == last_pos
        other = [p for p, g in ends if g != last_group]
        assert sam.pos2[state] == (max(other) if other else -1)
        for excluded in range(3):  # the most recent occurrence outside any one group
            outside = [p for p, g in ends if g != excluded]
            assert sam.occurrence(state, excluded) == (max(outside) if outside else -1)
    # longest suffix of the pattern present, never across sequences
    state, matched = sam.match(pattern)
    naive = max([n for n in range(1, len(pattern) + 1) if occurrences(seqs, pattern[-n:])], default=0)
    assert matched == naive
    if naive:
        assert state == sam.state_of(pattern[-naive:])
    # occurrence counts restricted to one group's sequences
    spans = [(offs[k], offs[k] + len(s)) for k, s in enumerate(seqs) if groups[k] == 1]
    within = sam.counts_within(spans)
    inside = [s for k, s in enumerate(seqs) if groups[k] == 1]
    for cand in candidates:
        state = sam.state_of(list(cand))
        if state > 0:
            assert within.get(state, 0) == len(occurrences(inside, list(cand)))


def test_sam_small_exact():
    sam = SuffixAutomaton()
    sam.add_sequence([1, 2, 1, 2, 3], group=0)
    sam.add_sequence([2, 3, 4], group=1)
    s12 = sam.state_of([1, 2])
    assert sam.count[s12] == 2 and sam.pos[s12] == 3 and sam.pos2[s12] == -1
    s23 = sam.state_of([2, 3])
    assert sam.count[s23] == 2 and sam.pos[s23] == 7 and sam.pos2[s23] == 4  # text: 1 2 1 2 3 | 2 3 4
    assert sam.state_of([3, 2]) == -1  # never across the separator
    assert sam.match([9, 1, 2, 1]) == (sam.state_of([1, 2, 1]), 3)
    assert sam.continuation(sam.pos[sam.state_of([1])], 10) == [2, 3]  # stops at the sequence end


def test_sam_extension_is_amortized_constant():
    """The automaton has at most 2n states and its transition walk stays linear on a long stream."""
    rng = random.Random(0)
    sam = SuffixAutomaton()
    sam.add_sequence([rng.randrange(50) for _ in range(20000)])
    assert len(sam) <= 40001
    assert sum(len(d) for d in sam.next) <= 3 * 20000


# ---------- the automaton's spine and branches (arms sam / lexical) ----------

def naive_spine_and_branches(pool, req_hash, context, spine_max, top, branch_max, with_length=False):
    excluded = {k for k, (_, h) in enumerate(pool) if req_hash is not None and h == req_hash}
    seqs = [t for t, _ in pool]
    n = len(context)
    # request: longest suffix that also ends before the last position, its most recent such occurrence
    r_len, r_cont = 0, []
    for L in range(n - 1, 0, -1):
        ends = [e for k, e in occurrences([context], context[-L:]) if e < n - 1]
        if ends:
            r_len, r_cont = L, context[max(ends) + 1 : max(ends) + 1 + spine_max]
            break
    # pool: longest suffix whose most recent occurrence outside the excluded traces has a continuation
    p_len, p_cont = 0, []
    for L in range(n, 0, -1):
        occ = [(k, e) for k, e in occurrences(seqs, context[-L:]) if k not in excluded]
        if occ:
            k, e = max(occ)
            if e < len(seqs[k]) - 1:
                p_len, p_cont = L, seqs[k][e + 1 : e + 1 + spine_max]
                break
    if not r_cont and not p_cont:
        return (0, [], []) if with_length else ([], [])
    use_request = bool(r_cont) and r_len >= p_len
    spine = r_cont if use_request else p_cont
    s = context[-(r_len if use_request else p_len):]
    ranked = []
    for c in range(3):
        if c == spine[0]:
            continue
        if use_request:
            ends = [e for _, e in occurrences([context], s + [c])]
            if not ends:
                continue
            before = [e for e in ends if e < n - 1]
            occ_key = max(before) if before else -1
            cont = context[occ_key + 1 : occ_key + branch_max] if before else []
            ranked.append(((len(ends), (0, occ_key), c), [c] + cont))
        else:
            occ = [(k, e) for k, e in occurrences(seqs, s + [c]) if k not in excluded]
            if not occ:
                continue
            k, e = max(occ)
            ranked.append(((len(occ), (k, e), c), [c] + seqs[k][e + 1 : e + branch_max]))
    ranked.sort(reverse=True)
    branches = [chain for _, chain in ranked[:top]]
    return (r_len if use_request else p_len, spine, branches) if with_length else (spine, branches)


pools = st.lists(st.tuples(tokens3, hashes), max_size=4)


@FAST
@given(pools, tokens3, st.lists(st.integers(0, 2), max_size=8), hashes,
       st.integers(1, 6), st.integers(0, 3), st.integers(1, 6))
def test_automaton_chains_vs_naive(pool, prompt, generated, req_hash, spine_max, top, branch_max):
    index = AutomatonIndex()
    for trace, h in pool:
        index.add_trace(trace, h)
    index.begin_request(prompt, req_hash)
    context = prompt + generated
    for i in range(len(prompt), len(context) + 1):  # committed tokens arrive a few at a time
        index.sync(context[:i])
    got = automaton_chains(index, spine_max, top, branch_max)
    assert got == naive_spine_and_branches(pool, req_hash, context, spine_max, top, branch_max)
    # the match length SAM-Decoding's rule reads (oilbird-one-source): the suffix the spine continues
    assert automaton_match(index, spine_max, top, branch_max) == naive_spine_and_branches(
        pool, req_hash, context, spine_max, top, branch_max, with_length=True)


def test_same_prompt_traces_are_never_drafted_from():
    trace = [5, 6, 7, 8, 9, 10, 11]
    for name in ("sam", "suffix", "lexical"):
        d = make_drafter(name, vocab_size=16)
        d.add_trace(trace, prompt_hash="h")
        d.begin_request([1, 2], prompt_hash="h")
        assert len(d.propose([1, 2, 5, 6], 60)) == 0, name
        d.add_trace([5, 6, 12], prompt_hash="other")
        assert d.propose([1, 2, 5, 6], 60).tokens[0] == 12, name  # only the other trace is used
        d.begin_request([1, 2], prompt_hash="g")
        assert d.propose([1, 2, 5, 6], 60).tokens[:1] in ([7], [12]), name


@pytest.mark.parametrize("name", ["sam", "suffix", "lexical"])
def test_finished_request_enters_pool_under_its_prompt_hash(name):
    d = make_drafter(name, vocab_size=16)
    d.add_trace([3, 4, 5], prompt_hash([7, 7]))  # a warm trace, fed as the harness does
    d.begin_request([1, 2])
    d.propose([1, 2, 3, 4, 5], 10)
    d.add_trace([3, 4, 6], prompt_hash([1, 2]))
    d.begin_request([1, 2])  # the same prompt again: its own trace is skipped, the warm one is not
    assert root_paths(d.propose([1, 2, 3], 10)) == {(4,), (4, 5)}
    d.begin_request([7, 7])
    assert root_paths(d.propose([7, 7, 3], 10)) == {(4,), (4, 6)}
    d.begin_request([1, 2], prompt_hash=prompt_hash([7, 7]))  # an explicit hash wins
    assert root_paths(d.propose([1, 2, 3], 10)) == {(4,), (4, 6)}


# ---------- SuffixDecoding ----------

def naive_suffix_tree(seqs, counts_from, s, max_depth, min_prob):
    """{path: probability} of every node under s with path probability >= min_prob, depth <= max_depth."""
    def count(x):
        return len(occurrences(counts_from, x))

    out, frontier = {}, [((), 1.0)]
    while frontier:
        path, prob = frontier.pop()
        if len(path) >= max_depth:
            continue
        total = count(s + list(path))
        for c in range(3):
            p = count(s + list(path) + [c]) * (prob / total) if total else 0.0  # as the drafter rounds
            if p >= min_prob:
                out[path + (c,)] = p
                frontier.append((path + (c,), p))
    return out


def naive_suffix_side(context, seqs, counts_from, max_match, max_depth, min_prob, local):
    """The node set of one side: longest usable match, then every node above min_prob."""
    n = len(context)
    for L in range(min(max_match, n), 0, -1):
        s = context[-L:]
        if local:
            usable = any(e < n - 1 for _, e in occurrences([context], s))
        else:
            usable = any(occurrences(counts_from, s + [c]) for c in range(3))
        if usable:
            return naive_suffix_tree(seqs, counts_from, s, max_depth - L, min_prob)
    return None


@FAST
@given(pools, tokens3, st.lists(st.integers(0, 2), max_size=6), hashes,
       st.integers(1, 5), st.integers(2, 8), st.integers(1, 40))
def test_suffix_tree_vs_naive_counting(pool, prompt, generated, req_hash, max_match, max_depth, budget):
    cfg = SuffixConfig(max_depth=max_depth, max_match=max_match, min_token_prob=0.1)
    d = SuffixDrafter(vocab_size=3, config=cfg)
    for trace, h in pool:
        d.add_trace(trace, h)
    d.begin_request(prompt, req_hash)
    context = prompt + generated
    d.index.sync(context)
    seqs = [t for t, _ in pool]
    kept = [t for t, h in pool if req_hash is None or h != req_hash]
    sides = [naive_suffix_side(context, [context], [context], max_match, max_depth, 0.1, True),
             naive_suffix_side(context, seqs, kept, max_match, max_depth, 0.1, False)]
    sides = [s for s in sides if s is not None]
    got = d.candidates(budget)
    assert len(got) == len(sides)
    for (draft, score), nodes in zip(got, sides):
        check_tree(draft, budget)
        probs = sorted(nodes.values(), reverse=True)
        assert len(draft) == min(budget, len(nodes))
        assert root_paths(draft) <= set(nodes)
        assert score == pytest.approx(sum(probs[:budget]))  # best-first: the budget's most probable nodes
    d.index.sync(context)
    best = d.propose(context, budget)
    if got:
        assert root_paths(best) == root_paths(max(got, key=lambda c: c[1])[0])


def test_suffix_small_exact():
    d = SuffixDrafter(vocab_size=10)
    d.add_trace([1, 2, 3, 4])
    d.add_trace([1, 2, 3, 5])
    d.add_trace([1, 2, 6, 7])
    d.begin_request([9, 1, 2])
    draft = d.propose([9, 1, 2], 60)
    assert root_paths(draft) == {(3,), (6,), (3, 4), (3, 5), (6, 7)}  # 2/3, 1/3, 1/3, 1/3, 1/3
    assert draft.tokens[0] == 3  # the most probable node first
    d = SuffixDrafter(vocab_size=10)
    for tail in [3] * 9 + [4]:
        d.add_trace([1, 2, tail])
    d.begin_request([1, 2])
    assert root_paths(d.propose([1, 2], 60)) == {(3,), (4,)}  # 4 sits exactly at min_token_prob = 0.1
    d = SuffixDrafter(vocab_size=10)
    for tail in [3] * 10 + [4]:
        d.add_trace([1, 2, tail])
    d.begin_request([1, 2])
    assert root_paths(d.propose([1, 2], 60)) == {(3,)}  # 1/11 < 0.1


# ---------- prompt lookup ----------

def naive_pld(context, max_ngram, max_copy):
    n = len(context)
    for k in range(min(max_ngram, n), 0, -1):
        for j in range(n - 2, k - 2, -1):  # most recent earlier occurrence first
            if context[j - k + 1 : j + 1] == context[n - k :]:
                return context[j + 1 : j + 1 + max_copy]
    return []


@FAST
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 12),
       st.lists(st.integers(1, 4), max_size=10))
def test_pld_vs_naive_scan(stream, max_ngram, max_copy, steps):
    index = NgramIndex(max_ngram)
    cut = max(1, len(stream) // 3)
    for step in [0, *steps]:  # the context grows by a few committed tokens per cycle
        cut = min(len(stream), cut + step)
        index.sync(stream[:cut])
        assert index.lookup(max_copy) == naive_pld(stream[:cut], max_ngram, max_copy)
    index.sync([2, 2, 1])  # not an extension: the index restarts
    assert index.lookup(5) == naive_pld([2, 2, 1], max_ngram, 5)


def test_pld_drafter_chain():
    d = make_drafter("pld", vocab_size=10)
    d.begin_request([1, 2, 3, 4, 5, 2, 3])
    draft = d.propose([1, 2, 3, 4, 5, 2, 3], 60)
    assert draft.tokens == [4, 5, 2, 3] and draft.parents == [-1, 0, 1, 2]
    assert d.propose([1, 2, 3, 4, 5, 2, 3], 2).tokens == [4, 5]


# ---------- the pool under an exact key (the +pool rungs) ----------

def test_pool_ngram_index_small_exact():
    pool = PoolNgramIndex(3)
    pool.add_trace([1, 2, 3, 4, 5], "a")  # flat 0..4, separator at 5
    pool.add_trace([2, 3, 9, 9], "b")  # flat 6..9
    pool.add_trace([7, 1, 2, 3], None)  # flat 11..14: its "1 2 3" and "2 3" end the trace (nothing to copy)
    assert pool.n_traces == 3 and pool.n_tokens == 13
    assert pool.lookup([0, 2, 3], 3, 10) == [9, 9]  # "2 3": the most recent occurrence with a next token (b)
    assert pool.lookup([0, 2, 3], 3, 10, excluded_group="b") == [4, 5]
    assert pool.lookup([0, 2, 3], 3, 10, excluded_group="a") == [9, 9]
    assert pool.lookup([1, 2, 3], 3, 10) == [4, 5]  # the longest n wins over recency
    assert pool.lookup([1, 2, 3], 3, 1) == [4]
    assert pool.lookup([1, 2, 3], 3, 10, excluded_group="a") == [9, 9]  # only in the excluded group: back off
    assert pool.lookup([1, 2, 3], 1, 10) == [9, 9]  # max_n = 1: the anchor token alone
    assert pool.lookup([5], 3, 10) == []  # 5 ends trace a: nothing after it in that trace
    assert pool.lookup([4, 5, 2], 3, 10) == [3]  # "5 2" would cross a boundary; "2" last occurs in the third
    assert pool.lookup([9, 9], 3, 10) == [9]  # "9 9" ends the trace; "9" at flat 8 has one 9 after it
    assert pool.lookup([8], 3, 10) == [] and pool.lookup([], 3, 10) == [] and pool.lookup([2], 3, 0) == []
    assert pool.lookup([3], 3, 10, excluded_group="zzz") == [9, 9]  # an unknown group excludes nothing
    pool.add_trace([2, 3, 6], "a")  # a second trace of group a: now the most recent "2 3"
    assert pool.lookup([2, 3], 3, 10) == [6]
    assert pool.lookup([2, 3], 3, 10, excluded_group="a") == [9, 9]  # pos2: the most recent outside a
    assert pool.lookup([2, 3], 3, 10, excluded_group="b") == [6]


def naive_pool_lookup(pool, context, max_n, max_copy, excluded):
    seqs = [t for t, _ in pool]
    skip = {k for k, (_, h) in enumerate(pool) if excluded is not None and h == excluded}
    for k in range(min(max_n, len(context)), 0, -1):
        occ = [(j, e) for j, e in occurrences(seqs, list(context[-k:])) if j not in skip and e < len(seqs[j]) - 1]
        if occ:
            j, e = max(occ)
            return seqs[j][e + 1 : e + 1 + max_copy]
    return []


@FAST
@given(pools, st.lists(st.integers(0, 2), max_size=6), hashes, st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 6))
def test_pool_ngram_index_vs_naive(pool, context, excluded, max_ngram, max_n, max_copy):
    index = PoolNgramIndex(max_ngram)
    for trace, h in pool:
        index.add_trace(trace, h)
    got = index.lookup(context, max_n, max_copy, excluded)
    assert got == naive_pool_lookup(pool, context, min(max_n, max_ngram), max_copy, excluded)


# ---------- token recycling ----------

def test_default_template_is_the_most_probable_paths():
    for n in (1, 8, 20, 60, 80):
        parents, ranks = default_template(n)
        assert len(parents) == n
        paths, depth = [], []
        for t, (p, r) in enumerate(zip(parents, ranks)):
            assert p == ROOT or p < t
            paths.append((paths[p] if p != ROOT else ()) + (r,))
            depth.append(len(paths[-1]))
        assert depth == sorted(depth)  # breadth-first
        assert len(set(paths)) == n

        def value(path):
            return float(np.prod([RANK_PRIOR[r] for r in path]))

        inside = min(value(p) for p in paths)
        boundary = [p + (r,) for p in [(), *paths] for r in range(8) if p + (r,) not in set(paths) and len(p) < 8]
        assert all(value(b) <= inside + 1e-15 for b in boundary)
    per_depth = lambda n: np.bincount([len(p) for p in _paths(n)])[1:].tolist()  # noqa: E731
    assert per_depth(60) == [8, 18, 17, 9, 6, 1, 1]
    assert per_depth(80) == [8, 23, 28, 13, 6, 1, 1]


def _paths(n):
    parents, ranks = default_template(n)
    paths = []
    for p, r in zip(parents, ranks):
        paths.append((paths[p] if p != ROOT else ()) + (r,))
    return paths


def random_topk(rng, vocab, n):
    return np.stack([rng.permutation(vocab)[:8] for _ in range(n)]).astype(np.int64)


@FAST
@given(st.integers(0, 10**6), st.integers(1, 6), st.integers(0, 60))
def test_recycling_table_and_expansion_vs_reference(seed, cycles, budget):
    rng = np.random.default_rng(seed)
    vocab = 12
    d = make_drafter("recycling", vocab_size=vocab)
    ref: dict[int, list[int]] = {}
    for _ in range(cycles):
        anchor = int(rng.integers(vocab))
        draft = d.propose([anchor], int(rng.integers(0, 20)))
        tokens = draft.tokens if len(draft) else rng.integers(0, vocab, size=int(rng.integers(0, 6))).tolist()
        draft = Draft(tokens=list(tokens), parents=[-1] * len(tokens), sources=[{"x"}] * len(tokens))
        topk = random_topk(rng, vocab, 1 + len(tokens))
        d.observe([anchor], VerifyResult(draft=draft, accepted_nodes=[], bonus=0, committed=[0],
                                         argmax=topk[:, 0], topk=topk, hidden=None))
        for tok, row in zip([anchor, *tokens], topk):  # every node, accepted or not; the last one wins
            ref[int(tok)] = row.tolist()
    for tok in range(vocab):
        assert d.table.table[tok].tolist() == ref.get(tok, [-1] * 8)
    anchor = int(rng.integers(vocab))
    draft = d.propose([5, anchor], budget)
    check_tree(draft, budget, vocab)
    expected = set()  # every template path whose rows along the way are filled
    for path in _paths(budget):
        tok, toks = anchor, []
        for r in path:
            row = ref.get(tok)
            if row is None:
                break
            tok = row[r]
            toks.append(tok)
        else:
            expected.add(tuple(toks))
    assert root_paths(draft) == expected
    assert all(s == {"recycling"} for s in draft.sources)


def test_recycling_repeated_token_last_wins():
    table = AdjacencyTable(5)
    table.update([1, 2, 1], np.array([[0] * 8, [1] * 8, [2] * 8]))
    assert table.table[1].tolist() == [2] * 8 and table.table[2].tolist() == [1] * 8
    assert table.table[0].tolist() == [-1] * 8
    # known: verified at least once (a row of -1, an unknown output, is skipped); ids outside the vocabulary never
    table.update([3], np.array([[-1] * 8]))
    assert [table.knows(t) for t in (-1, 0, 1, 2, 3, 4, 5)] == [False, False, True, True, False, False, False]


# ---------- lexical ----------

@FAST
@given(pools, tokens3, st.lists(st.integers(0, 2), max_size=6), hashes, st.integers(0, 80),
       st.integers(0, 12), st.integers(0, 10**6))
def test_lexical_budget_spine_and_sources(pool, prompt, generated, req_hash, budget, reserve, seed):
    vocab = 3
    index = AutomatonIndex()
    for trace, h in pool:
        index.add_trace(trace, h)
    index.begin_request(prompt, req_hash)
    context = prompt + generated
    index.sync(context)
    rng = np.random.default_rng(seed)
    table = AdjacencyTable(vocab)
    for tok in range(vocab):
        if rng.random() < 0.8:
            table.table[tok] = np.r_[rng.permutation(vocab), [-1] * 5]
    cfg = LexicalConfig(spine_max=5, branch_top=2, branch_max=4, adjacency_reserve=reserve)
    draft = build_lexical(index, table, budget, cfg)
    check_tree(draft, budget, vocab)
    spine, branches = automaton_chains(index, cfg.spine_max, cfg.branch_top, cfg.branch_max)
    auto_budget = max(0, budget - reserve)
    paths = root_paths(draft)
    on_spine = {tuple(spine[:i]) for i in range(1, min(len(spine), auto_budget) + 1)}
    assert on_spine <= paths  # the spine is a root path (as far as the automaton budget allows)
    on_branch = {tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
    parents, ranks = default_template(budget)
    adjacency = root_paths(table.expand(context[-1], parents, ranks, budget))
    for i in range(len(draft)):
        path = tuple(draft.chain_tokens(i))
        assert (SPINE in draft.sources[i]) == (path in on_spine)
        assert (BRANCH in draft.sources[i]) <= (path in on_branch)
        assert (ADJACENCY in draft.sources[i]) == (path in adjacency)
        assert draft.sources[i] <= {SPINE, BRANCH, ADJACENCY}
    assert len(draft) == budget or adjacency <= paths  # adjacency fills whatever is left


# ---------- every arm ----------

@pytest.mark.parametrize("name", sorted(n for n in DRAFTERS if installed(n)))  # test_suffix_arctic.py: it is
def test_drafter_protocol_invariants(name):
    """Random requests through the whole protocol: trees stay valid and within budget."""
    rng = np.random.default_rng(1)
    vocab = 10
    d = make_drafter(name, vocab_size=vocab, nodes=20)
    d.add_trace(rng.integers(0, vocab, 50).tolist(), prompt_hash="warm")
    for r in range(4):
        prompt = rng.integers(0, vocab, 8).tolist()
        d.begin_request(prompt, prompt_hash="warm" if r == 1 else f"p{r}")
        context = list(prompt)
        for _ in range(15):
            budget = int(rng.integers(0, 21))
            draft = d.propose(context, budget)
            check_tree(draft, budget, vocab)
            topk = random_topk(rng, vocab, 1 + len(draft))
            accepted = [0] if len(draft) and draft.parents[0] == ROOT else []
            committed = [draft.tokens[i] for i in accepted] + [int(topk[0, 0])]
            d.observe(context, VerifyResult(draft=draft, accepted_nodes=accepted, bonus=committed[-1],
                                            committed=committed, argmax=topk[:, 0], topk=topk, hidden=None))
            context.extend(committed)
        d.add_trace(context[len(prompt):], prompt_hash(prompt))


def test_make_drafter_errors():
    with pytest.raises(OilbirdError, match="unknown drafter"):
        make_drafter("nope", vocab_size=10)
    with pytest.raises(OilbirdError, match="no option"):
        make_drafter("sam", vocab_size=10, bogus=1)
    assert make_drafter("lexical", vocab_size=10, adjacency_reserve=8).config.adjacency_reserve == 8


# ---------- one source per step (oilbird-one-source, SAM-Decoding's rule) ----------

def _basis(d, i):
    e = np.zeros(d, np.float32)
    e[i] = 1
    return e


def _one_source_frame(arm, prompt, h_t=None):
    """An Oilbird arm whose pool holds one trace 30 .. 39 with states e0 .. e8, an adjacency row 40, 41 at the
    prompt's anchor, and h_t (default e1: the key's neighbour is the trace's position 1)."""
    d = make_drafter(arm, vocab_size=64, nodes=60)
    d.add_trace(list(range(30, 40)), "old", np.stack([_basis(16, i) for i in range(9)] + [np.zeros(16)]))
    d.begin_request(prompt)
    if d.table is not None:  # semantic-only has none
        d.table.update([prompt[-1]], np.array([[40, 41, -1, -1, -1, -1, -1, -1]]))
    d.h_t = _basis(16, 1) if h_t is None else h_t
    return d


def _same_tree(a: Draft, b: Draft) -> bool:
    return (a.tokens, a.parents, a.sources) == (b.tokens, b.parents, b.sources)


SHORT = [1, 2, 30, 31, 32]  # the automaton's match: "30 31 32" in the pool, 3 tokens
LONG = [1, 2, 30, 31, 32, 33, 34]  # 5 tokens
NEAR = 0.85 * _basis(16, 4) + np.sqrt(1 - 0.85 ** 2) * _basis(16, 15)  # s = 0.85 at position 4: x[6 : 14]


def test_one_source_picks_semantic_below_the_match_threshold():
    """Match 3 < 5: the semantic draft alone, at the whole budget: exactly what semantic-only proposes without
    its root branching (the lexical draft's adjacency is the one-source arm's)."""
    d = _one_source_frame("oilbird-one-source", SHORT, NEAR)
    assert automaton_match(d.index, 32, 3, 32)[0] == 3
    draft = d.propose(SHORT, 60)
    assert draft.tokens == [36, 37, 38, 39] and draft.parents == [ROOT, 0, 1, 2]
    assert draft.sources == [{"semantic"}] * 4
    ref = _one_source_frame("semantic-only@root_branching=0", SHORT, NEAR)
    assert _same_tree(draft, ref.propose(SHORT, 60))
    assert (d.tally["chose_semantic"], d.tally["chose_lexical"], d.tally["key_queries"]) == (1, 0, 1)
    assert sorted(d._bought) == [0, 1, 2, 3]  # self-calibration judges the key on the nodes it proposed
    # merged (oilbird), the same step holds both sources in one tree
    merged = _one_source_frame("oilbird", SHORT, NEAR).propose(SHORT, 60)
    assert {"spine", "semantic"} <= set().union(*merged.sources)


def test_one_source_picks_lexical_at_the_match_threshold():
    """Match 5 >= 5: the lexical host's tree at the whole budget (spine, branches, adjacency), the key not queried."""
    d = _one_source_frame("oilbird-one-source", LONG, _basis(16, 3))
    assert automaton_match(d.index, 32, 3, 32)[0] == 5
    draft = d.propose(LONG, 60)
    assert _same_tree(draft, build_lexical(d.index, d.table, 60, LexicalConfig()))
    assert draft.tokens == [35, 36, 37, 38, 39, 40, 41]
    assert draft.sources == [{SPINE}] * 5 + [{ADJACENCY}] * 2
    assert (d.tally["chose_lexical"], d.tally["chose_semantic"], d.tally["key_queries"]) == (1, 0, 0)


@pytest.mark.parametrize("threshold, source", [(0, "lexical"), (3, "lexical"), (4, "semantic"), (5, "semantic")])
def test_one_source_threshold_is_a_variant_field(threshold, source):
    d = _one_source_frame(f"oilbird-one-source@one_source_min_match={threshold}", SHORT, NEAR)
    assert d.config.one_source and d.config.one_source_min_match == threshold
    draft = d.propose(SHORT, 60)
    want = {"lexical": [33, 34, 35, 36, 37, 38, 39, 40, 41], "semantic": [36, 37, 38, 39]}
    assert draft.tokens == want[source] and d.tally[f"chose_{source}"] == 1


def test_one_source_exact_at_every_budget_and_fallbacks():
    for budget in range(0, 14):
        d = _one_source_frame("oilbird-one-source", SHORT, NEAR)
        ref = _one_source_frame("semantic-only@root_branching=0", SHORT, NEAR)
        assert _same_tree(d.propose(SHORT, budget), ref.propose(SHORT, budget)), budget
        d = _one_source_frame("oilbird-one-source", LONG, _basis(16, 3))
        assert _same_tree(d.propose(LONG, budget), build_lexical(d.index, d.table, budget, LexicalConfig())), budget
    # the key silent (no state yet: the request's first pass): an empty semantic draft gives way to the lexical one
    d = _one_source_frame("oilbird-one-source", SHORT)
    d.h_t = None
    draft = d.propose(SHORT, 60)
    assert _same_tree(draft, build_lexical(d.index, d.table, 60, LexicalConfig())) and d.tally["chose_lexical"] == 1
    # the gate as in oilbird: no automaton match, adjacency only (Token Recycling's draft), the key never asked
    d = _one_source_frame("oilbird-one-source", [1, 2, 50])
    draft = d.propose([1, 2, 50], 60)
    assert draft.tokens == [40, 41] and d.tally["gated"] == 1 and d.tally["key_queries"] == 0


def test_one_source_bad_settings_are_one_line():
    with pytest.raises(OilbirdError, match="one_source needs host lexical"):
        make_drafter("semantic-only@one_source=on", vocab_size=10)
    with pytest.raises(OilbirdError, match="one_source_min_match.* 0 or more"):  # the variant range check says it first
        make_drafter("oilbird-one-source@one_source_min_match=-1", vocab_size=10)
