"""The graph verifier (decoder/verify/graph.py): fixed shapes, compiled with torch.compile on the CPU, lossless.

Each model is compiled once per module (the compile is the slow part: inductor builds C++ kernels), then serves
every check: tokens equal `ar` token for token, the same passes as the eager verifier, states and top-8 equal,
bucket overflow, cache growth, a stop mid-pass, and no recompile across 100+ passes (from the counters)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.capture.models import LayerTap, load_model
from decoder.draft import Draft, Drafter
from decoder.verify.engine import ModelVerifier, decode_greedy, stop_rule
from decoder.loop import speculate
from decoder.verify.tree import tree_ancestors
from decoder.verify.graph import GraphVerifier, ancestor_block, buckets_for, capacity_for

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "Tom had a red ball. He liked to play with it.",
           "One day, a big dog came to the park."]


def test_ancestor_block_equals_the_tree_rule():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 70))
        parents = [int(rng.integers(-1, i)) for i in range(n)]
        if rng.random() < 0.3:
            parents = list(range(-1, n - 1))  # a chain: the deepest tree
        rows = n + 1 + int(rng.integers(0, 6))
        got, want = ancestor_block(parents, rows), tree_ancestors(parents)
        assert (got[:n + 1, :n + 1] == want).all()
        assert not got[:n + 1, n + 1:].any() and (got[n + 1:] == np.eye(rows, dtype=bool)[n + 1:]).all()
    with pytest.raises(ValueError):
        ancestor_block([0], 2)


def test_buckets_and_capacity():
    assert buckets_for(60) == (1, 16, 32, 64)
    assert buckets_for(12) == (1, 16)
    assert buckets_for(0) == (1,)
    assert buckets_for(100) == (1, 16, 32, 64, 128)
    assert buckets_for(20, (1, 8)) == (1, 8, 16, 32)
    assert capacity_for(1) == 256 and capacity_for(257) == 512


class Oracle(Drafter):
    """Trees holding the greedy continuation (sometimes with a wrong token) beside random branches: every pass
    accepts something and refuses something."""

    name = "oracle"

    def __init__(self, refs: dict, seed: int = 0, longest: int = 8) -> None:
        self.refs, self.rng, self.longest = refs, np.random.default_rng(seed), longest

    def begin_request(self, prompt, key=None):
        self.ref, self.plen = self.refs[tuple(prompt)], len(prompt)

    def propose(self, context, nodes):
        d = Draft()
        done = len(context) - self.plen
        for _ in range(int(self.rng.integers(0, 4))):
            d.add_chain(self.rng.integers(3, 500, int(self.rng.integers(1, 5))).tolist(), "noise", nodes)
        chain = list(self.ref[done:done + int(self.rng.integers(0, self.longest + 1))])
        if chain and self.rng.random() < 0.3:
            chain[int(self.rng.integers(0, len(chain)))] = int(self.rng.integers(3, 500))
        d.add_chain(chain, "oracle", nodes)
        for _ in range(int(self.rng.integers(0, 3))):
            d.add_chain(self.rng.integers(3, 500, int(self.rng.integers(1, 8))).tolist(), "noise", nodes)
        return d

    def observe(self, context, result):
        pass


def _setup(model: str, max_new: int = 48):
    lm = load_model(model)
    stop = stop_rule(lm, (), max_new)
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    refs = {tuple(p): decode_greedy(lm, p, stop).tokens for p in prompts}
    return lm, stop, prompts, refs


def _eager(lm, stop, prompt, drafter, nodes):
    tap = LayerTap(lm.model, lm.layer)
    try:
        v = ModelVerifier(lm, tap, stop)
        run = speculate(drafter, v, prompt, nodes)
        return run, v.generation(run)
    finally:
        tap.close()


def _same_generation(a, b):
    assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
    n = len(a.tokens) - 1
    x, y = a.hidden[:n].astype(np.float64), b.hidden[:n].astype(np.float64)
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    assert cos.min() >= 0.9999
    assert (a.topk[:n] == b.topk[:n]).mean() >= 0.99  # (a tie among the 8th ids may order differently)
    assert (a.chosen_ids[:, 0] == b.chosen_ids[:, 0]).all()


@pytest.fixture(scope="module", params=["stories260k", "llama", "qwen2"])
def compiled(request, tiny_dirs):
    """One compiled graph verifier per model (nodes 12: buckets 1 and 16, rows symbolic), warmed up."""
    torch.set_num_threads(1)
    model = request.param if request.param == "stories260k" else tiny_dirs[request.param]
    lm, stop, prompts, refs = _setup(model)
    gv = GraphVerifier(lm, stop, nodes=12, capacity=capacity_for(200))
    gv.warm_up()
    yield lm, stop, prompts, refs, gv
    gv.close()


def test_graph_verifier_is_lossless_and_equals_eager_pass_for_pass(compiled):
    lm, stop, prompts, refs, gv = compiled
    passes = 0
    for seed in range(3):
        for p in prompts:
            run_e, gen_e = _eager(lm, stop, p, Oracle(refs, seed), 12)
            run_g = speculate(Oracle(refs, seed), gv, p, 12)
            gen_g = gv.generation(run_g)
            assert gen_g.tokens == refs[tuple(p)]  # ar's tokens, token for token
            assert [(c.nodes, c.accepted, c.committed) for c in run_g.cycles] == \
                   [(c.nodes, c.accepted, c.committed) for c in run_e.cycles]
            _same_generation(gen_g, gen_e)
            passes += len(run_g.cycles)
    d = gv.describe()
    assert passes >= 100 and d["passes"] >= passes
    assert d["kind"] == "graph" and d["buckets"] == [1, 16]
    assert d["compiles"] >= 1 and d["recompiles_after_warmup"] == 0, d  # no recompile while decoding


def test_empty_drafts_take_the_one_row_graph(compiled):
    lm, stop, prompts, refs, gv = compiled

    class Empty(Drafter):
        def propose(self, context, nodes):
            return Draft()

    run = speculate(Empty(), gv, prompts[0], 12)
    assert gv.generation(run).tokens == refs[tuple(prompts[0])]
    assert all(c.nodes == 0 for c in run.cycles) and gv.describe()["recompiles_after_warmup"] == 0


def test_a_stop_mid_pass_cuts_as_ar_does(compiled):
    lm, _, prompts, _, gv = compiled
    for cap in (5, 17):
        stop = stop_rule(lm, (), cap)
        refs = {tuple(p): decode_greedy(lm, p, stop).tokens for p in prompts}
        gv.stop = stop
        run = speculate(Oracle(refs, 7, longest=12), gv, prompts[1], 12)
        g = gv.generation(run)
        assert g.tokens == refs[tuple(prompts[1])] and len(g.tokens) == cap and g.stop_reason == "length"
    gv.stop = stop_rule(lm, (), 48)


def test_bucket_overflow_cuts_the_draft_to_the_largest_bucket(stories):
    torch.set_num_threads(1)
    lm = stories
    stop = stop_rule(lm, (), 40)
    p = lm.tokenizer.encode(PROMPTS[0])
    refs = {tuple(p): decode_greedy(lm, p, stop).tokens}
    gv = GraphVerifier(lm, stop, nodes=7, buckets=(1, 8), capacity=256, compile=False)  # built for 7 nodes
    try:
        run = speculate(Oracle(refs, 3, longest=20), gv, p, 30)  # drafts of up to 30 nodes
        assert gv.generation(run).tokens == refs[tuple(p)]
        assert gv.stats.overflow_passes > 0 and max(c.nodes for c in run.cycles) > 7
    finally:
        gv.close()


def test_the_cache_grows_instead_of_overflowing(stories, capsys):
    torch.set_num_threads(1)
    lm = stories
    stop = stop_rule(lm, (), 300)
    p = lm.tokenizer.encode(PROMPTS[2])
    refs = {tuple(p): decode_greedy(lm, p, stop).tokens}
    gv = GraphVerifier(lm, stop, nodes=7, buckets=(1, 8), capacity=256, compile=False)
    try:
        run = speculate(Oracle(refs, 5), gv, p, 7)
        assert gv.generation(run).tokens == refs[tuple(p)]
        assert gv.stats.cache_growths >= 1 and gv.capacity > 256
        assert "the cache grows from 256" in capsys.readouterr().err
    finally:
        gv.close()
