"""Drafter.suspend_request / resume_request: one drafter serving interleaved requests (the vLLM proposer's
rows) drafts for a resumed request exactly what it would have drafted had no other request run meanwhile,
with the pool as it is at resume (traces added meanwhile, same-prompt exclusion recomputed)."""

from __future__ import annotations

import numpy as np
import pytest

from data.store.schema import prompt_hash
from decoder.draft import VerifyResult
from decoder.drafters import make_drafter
from decoder.drafters.sam import AutomatonIndex
from decoder.verify.tree import greedy_accept

VOCAB, D = 12, 8


def _run(drafter, prompt, passes, rng, context=None):
    """`passes` propose/observe rounds with random verification outcomes; the context afterwards."""
    context = list(prompt) if context is None else context
    for _ in range(passes):
        draft = drafter.propose(context, 16)
        n = len(draft)
        argmax = rng.integers(0, VOCAB, 1 + n)
        topk = np.concatenate([argmax[:, None], rng.integers(0, VOCAB, (1 + n, 7))], axis=1)
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
        hidden = rng.standard_normal((1 + n, D)).astype(np.float32)
        committed = [draft.tokens[i] for i in accepted] + [bonus]
        drafter.observe(context, VerifyResult(draft, accepted, bonus, committed, argmax, topk, hidden))
        context += committed
    return context


def _pool_with_traces(drafter, rng, n=6):
    for _ in range(n):
        out = rng.integers(0, VOCAB, 40).tolist()
        drafter.add_trace(out, ("other", len(out), int(out[0])), rng.standard_normal((40, D)).astype(np.float32))


def _history(arm):
    """A drafter with a pool, four passes into request A (the same every call: the twin is a replay)."""
    rng = np.random.default_rng(7)
    drafter = make_drafter(arm, vocab_size=VOCAB, nodes=16)
    _pool_with_traces(drafter, rng)
    a = rng.integers(0, VOCAB, 12).tolist()
    drafter.begin_request(a)
    return drafter, a, _run(drafter, a, 4, rng), rng


@pytest.mark.parametrize("arm", ["oilbird", "oilbird-no-semantic", "oilbird@host=pld", "oilbird@k=4:theta=0.0"])
def test_a_resumed_request_drafts_as_if_alone(arm):
    drafter, a, ctx_a, rng = _history(arm)
    alone = _history(arm)[0]  # A's twin: no other request runs on it

    saved = drafter.suspend_request()
    b = rng.integers(0, VOCAB, 9).tolist()
    drafter.begin_request(b)
    ctx_b = list(b)
    for _ in range(3):  # B proposes (no observe: the shared adjacency table stays as A's twin has it)
        ctx_b += drafter.propose(ctx_b, 16).tokens[:2] or [1]
    # a trace of A's own prompt and one of another prompt enter the pool meanwhile, on both
    same = rng.integers(0, VOCAB, 30).tolist()
    states = rng.standard_normal((30, D)).astype(np.float32)
    for d in (drafter, alone):
        d.add_trace(same, prompt_hash(a), states)
        d.add_trace(ctx_a[len(a):], ("other", "b"), rng.standard_normal((len(ctx_a) - len(a), D)).astype(np.float32))
    drafter.resume_request(saved)

    for _ in range(3):
        mine, twin = drafter.propose(ctx_a, 16), alone.propose(ctx_a, 16)
        assert (mine.tokens, mine.parents) == (twin.tokens, twin.parents)
        step = mine.tokens[:1] or [3]
        ctx_a = ctx_a + step


def test_a_resumed_automaton_rewalks_a_pool_that_changed():
    """The request side comes back; the pool walk is re-fed when traces arrived while it was away, so the
    longest pool match is the one a fresh walk finds, and the request's prompt stays excluded."""
    index = AutomatonIndex()
    index.add_trace([1, 2, 3, 4, 5], "p")
    index.begin_request([9, 1, 2], "q")
    saved = index.suspend_request()
    index.begin_request([7, 7], "r")
    index.add_trace([8, 1, 2, 6, 6, 6], "q")  # A's own prompt: excluded from A's drafting
    index.add_trace([9, 1, 2, 3, 4], "s")
    index.resume_request(saved)
    index.sync([9, 1, 2])
    fresh = AutomatonIndex()
    for toks, h in (([1, 2, 3, 4, 5], "p"), ([8, 1, 2, 6, 6, 6], "q"), ([9, 1, 2, 3, 4], "s")):
        fresh.add_trace(toks, h)
    fresh.begin_request([9, 1, 2], "q")
    assert index.pool_match() == fresh.pool_match() and index.pool_match()[1] == 3
    assert index.excluded == fresh.excluded >= 0 and index.excluded_counts == fresh.excluded_counts
    assert index.request.text == [9, 1, 2]


def test_a_drafter_without_request_state_says_so():
    assert make_drafter("ar", vocab_size=VOCAB).suspend_request() is None
