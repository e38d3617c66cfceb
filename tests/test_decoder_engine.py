"""Decoder core: tree mask / positions / acceptance / cache compaction / merge as exact pure-function
tests, tree verify against sequential forwards, and end-to-end losslessness of every arm."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data.capture.models import LayerTap, cache_kwargs, load_model
from data.errors import OilbirdError
from data.store.schema import prompt_hash
from decoder.verify.audit import first_difference
from decoder.draft import ROOT, Draft, Drafter
from decoder.drafters import DRAFTERS, installed
from decoder.verify.engine import (
    StopRule,
    decode_greedy,
    decode_speculative,
    stop_rule,
    verify_tree,
)
from decoder.live.harness import DecodeConfig, run_decode
from decoder.verify.tree import (
    compact_cache,
    greedy_accept,
    tree_attention_mask,
    tree_position_ids,
)
from tests.conftest import STORIES, STORY_PROMPTS, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# A 4-node tree: n0 and n2 hang from the anchor, n1 under n0, n3 under n1.
PARENTS4 = [ROOT, 0, ROOT, 1]


# ------------------------------------------------------------------ pure functions

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_hand_checked(dtype):
    mask = tree_attention_mask(PARENTS4, past_len=2, dtype=dtype)
    assert mask.shape == (1, 1, 5, 7) and mask.dtype == dtype
    allowed = torch.tensor([
        # p0 p1 anchor n0 n1 n2 n3
        [1, 1, 1, 0, 0, 0, 0],  # anchor
        [1, 1, 1, 1, 0, 0, 0],  # n0
        [1, 1, 1, 1, 1, 0, 0],  # n1
        [1, 1, 1, 0, 0, 1, 0],  # n2
        [1, 1, 1, 1, 1, 0, 1],  # n3
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0] == 0, allowed)
    assert torch.all(mask[0, 0][~allowed] == torch.finfo(dtype).min)


def test_mask_and_positions_of_empty_tree_and_chain():
    assert torch.equal(tree_attention_mask([], 3), torch.zeros(1, 1, 1, 4))
    chain = tree_attention_mask([ROOT, 0, 1], 0)[0, 0] == 0
    assert torch.equal(chain, torch.tril(torch.ones(4, 4, dtype=torch.bool)))  # a chain is plain causal
    assert tree_position_ids([], 7).tolist() == [[7]]


def test_positions():
    assert tree_position_ids(PARENTS4, 2).tolist() == [[2, 3, 4, 3, 5]]
    assert tree_position_ids([ROOT, ROOT, 0, 2, 1], 10).tolist() == [[10, 11, 11, 12, 13, 12]]


def test_parents_must_precede_children():
    with pytest.raises(ValueError):
        tree_attention_mask([ROOT, 2, 0], 0)
    with pytest.raises(ValueError):
        tree_position_ids([0], 0)  # a node cannot be its own parent


@pytest.mark.parametrize("argmax,accepted,bonus", [
    ([9, 0, 0, 0, 0], [], 9),  # nothing accepted: the bonus is the anchor's argmax
    ([5, 6, 8, 0, 11], [0, 1, 3], 11),  # the full deepest path
    ([5, 6, 4, 0, 0], [0, 1], 4),  # stops inside the path
    ([7, 6, 8, 3, 0], [2], 3),  # branch choice: n2, not n0
    ([5, 1, 0, 0, 0], [0], 1),  # n0 accepted, its child rejected
])
def test_greedy_accept(argmax, accepted, bonus):
    assert greedy_accept([5, 6, 7, 8], PARENTS4, argmax) == (accepted, bonus)


def test_greedy_accept_empty_and_deep_branch():
    assert greedy_accept([], [], [4]) == ([], 4)
    # two branches share the root token's sibling set; the right one is picked at depth 2
    tokens, parents = [1, 2, 3, 4], [ROOT, 0, 0, 2]
    assert greedy_accept(tokens, parents, [1, 3, 0, 4, 9]) == ([0, 2, 3], 9)


def test_greedy_accept_longest_path_beside_a_root_attached_chain():
    """The issue's case: a spine [5, 9] and, hung from the root beside it, a chain [5, 6, 7, 8]; the
    truth is 5 6 7 8: the chain's four nodes are committed, not the spine's first node alone."""
    from decoder.drafters.oilbird import SEMANTIC, merge_candidates

    draft = Draft()
    draft.add_chain([5, 9], "spine", 60)
    merge_candidates(draft, [([5, 6, 7, 8], SEMANTIC)], 60, frozenset({SEMANTIC}))
    assert draft.tokens == [5, 9, 5, 6, 7, 8] and draft.parents == [ROOT, 0, ROOT, 2, 3, 4]
    # rows: anchor, n0 (5), n1 (9), n2 (5), n3 (6), n4 (7), n5 (8)
    argmax = np.array([5, 6, 0, 6, 7, 8, 3])
    assert greedy_accept(draft.tokens, draft.parents, argmax) == ([2, 3, 4, 5], 3)
    assert greedy_accept(draft.tokens, draft.parents, argmax.tolist()) == ([2, 3, 4, 5], 3)
    # the spine longer than the chain's agreeing part: the spine wins
    assert greedy_accept([5, 9, 5, 6], [ROOT, 0, ROOT, 2], [5, 9, 4, 7, 0]) == ([0, 1], 4)


def test_greedy_accept_ties_no_match_unknown_rows_and_order():
    # two agreeing paths of equal depth: the one ending at the earliest node index
    tokens, parents = [5, 6, 1, 5, 6, 2], [ROOT, 0, 1, ROOT, 3, 4]
    assert greedy_accept(tokens, parents, [5, 6, 1, 7, 6, 2, 8]) == ([0, 1, 2], 7)
    assert greedy_accept([5, 6, 5, 6], [ROOT, 0, ROOT, 2], [5, 6, 7, 6, 9]) == ([0, 1], 7)  # duplicate chains
    assert greedy_accept([5, 5], [ROOT, ROOT], [5, 1, 2]) == ([0], 1)  # duplicate siblings: the first
    assert greedy_accept([5, 5, 6], [ROOT, ROOT, 1], [5, 1, 6, 2]) == ([1, 2], 2)  # ... unless the second goes deeper
    # no match at all: nothing accepted, the bonus is the anchor's argmax
    assert greedy_accept([1, 2, 3], [ROOT, 0, ROOT], [4, 2, 0, 0]) == ([], 4)
    assert greedy_accept([], [], np.array([7])) == ([], 7)
    # -1 (unknown, replay) equals no token; an unknown bonus is returned as -1
    assert greedy_accept([5, 6], [ROOT, 0], [5, -1, -1]) == ([0], -1)
    assert greedy_accept([5, 6], [ROOT, 0], [-1, -1, -1]) == ([], -1)
    assert greedy_accept([], [], [-1]) == ([], -1)
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [ROOT, 1], [1, 2, 3])  # a node cannot be its own parent


def _accept_reference(tokens, parents, argmax):
    """Brute force: every root path; the longest whose every token equals the argmax at its parent's
    row; ties: the path ending at the earliest node."""
    best = ([], int(argmax[0]))
    for end in range(len(tokens)):
        path, node = [], end
        while node != ROOT:
            path.append(node)
            node = parents[node]
        path.reverse()
        rows = [0] + [1 + i for i in path[:-1]]
        if all(argmax[r] >= 0 and tokens[i] == argmax[r] for i, r in zip(path, rows)) and len(path) > len(best[0]):
            best = (path, int(argmax[1 + end]))
    return best


def _first_sibling_walk(tokens, parents, argmax):
    """The acceptance before the fix (first matching sibling): the reference where siblings are distinct."""
    accepted, node = [], ROOT
    while True:
        want = argmax[node + 1]
        nxt = next((c for c, p in enumerate(parents) if p == node and tokens[c] == want), None)
        if nxt is None:
            return accepted, want
        accepted.append(nxt)
        node = nxt


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 2)), max_size=14),
       st.lists(st.integers(-1, 2), min_size=15, max_size=15))
def test_greedy_accept_vs_brute_force(nodes, argmax):
    parents = [r % (i + 1) - 1 for i, (r, _) in enumerate(nodes)]  # -1 (the anchor) .. i - 1
    tokens = [t for _, t in nodes]
    argmax = argmax[: 1 + len(tokens)]
    got = greedy_accept(tokens, parents, np.array(argmax))
    assert got == _accept_reference(tokens, parents, argmax)
    if len(set(zip(parents, tokens))) == len(tokens):  # no duplicate siblings: the old walk, unchanged
        assert got == _first_sibling_walk(tokens, parents, argmax)


def _filled_cache(n_layers=2, length=9, heads=2, dim=3):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(n_layers):
        pos = torch.arange(length, dtype=torch.float32)
        keys = pos[None, None, :, None].expand(1, heads, length, dim) + 100 * layer
        cache.update(keys.clone(), -keys.clone(), layer)
    return cache


@pytest.mark.parametrize("keep", [[0, 2, 4], [0, 1, 2], [0], [0, 3, 5, 6]])
def test_compact_cache(keep):
    past, n = 3, 6  # cache rows 0..2 = prefix, 3 = anchor, 4..9 = nodes 0..5
    cache = _filled_cache(length=past + n + 1)
    compact_cache(cache, past, keep)
    want = torch.tensor(list(range(past)) + [past + k for k in keep], dtype=torch.float32)
    for layer_idx, layer in enumerate(cache.layers):
        assert layer.keys.shape == (1, 2, past + len(keep), 3)
        assert torch.equal(layer.keys[0, 1, :, 2], want + 100 * layer_idx)
        assert torch.equal(layer.values[0, 0, :, 0], -(want + 100 * layer_idx))
    assert cache.get_seq_length() == past + len(keep)


def _root_prefix(draft: Draft, chain) -> int:
    """Brute force: the longest prefix of `chain` that is a root path of `draft`."""
    paths = {tuple(draft.chain_tokens(i)) for i in range(len(draft))}
    return max([k for k in range(1, len(chain) + 1) if tuple(chain[:k]) in paths], default=0)


def test_add_chain_cost_and_budget_random():
    rng = random.Random(0)
    for trial in range(300):
        budget = rng.randrange(0, 25)
        draft = Draft()
        for step in range(rng.randrange(1, 10)):
            chain = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]  # small vocab: many shared prefixes
            shared = _root_prefix(draft, chain)
            before = len(draft)
            added = draft.add_chain(chain, f"s{step}", budget)
            assert len(draft) <= budget
            assert added == len(draft) - before == min(len(chain) - shared, max(0, budget - before))
            walked = draft.path_to(draft.child(ROOT, chain[0])) if chain and draft.child(ROOT, chain[0]) is not None else []
            for node in walked[:shared]:
                assert f"s{step}" in draft.sources[node]  # walked nodes are credited too
        assert all(p < i for i, p in enumerate(draft.parents))


def test_merge_shares_nodes_and_respects_budget():
    a, b = Draft(), Draft()
    a.add_chain([1, 2, 3], "sam", 60)
    b.add_chain([1, 2, 4, 5], "adjacency", 60)
    b.add_chain([7], "adjacency", 60)
    assert a.merge(b, 60) == 3  # 4, 5 under "1 2", and 7: cost = 4 - 2 shared + 1
    assert a.sources[a.child(a.child(ROOT, 1), 2)] == {"sam", "adjacency"}
    c = Draft()
    c.add_chain([1, 2, 3], "sam", 60)
    assert c.merge(b, 4) == 1 and len(c) == 4


# ------------------------------------------------------------------ tree verify == sequential forwards

def _load(kind: str, impl: str, tiny_dirs):
    from transformers import AutoModelForCausalLM

    path = STORIES if kind == "stories" else tiny_dirs[kind]
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


def _random_tree(rng, n, vocab):
    parents = [ROOT]
    for i in range(1, n):
        parents.append(rng.choice([ROOT, *range(i)]))
    return [rng.randrange(vocab) for _ in range(n)], parents


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["stories", "llama", "qwen2"])
@torch.no_grad()
def test_tree_verify_equals_sequential(kind, impl, tiny_dirs):
    from transformers import DynamicCache

    model = _load(kind, impl, tiny_dirs)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    prompt = [rng.randrange(3, vocab) for _ in range(12)]
    tokens, parents = _random_tree(rng, 14, vocab)
    tokens[5] = tokens[3]  # the same token on two branches
    layer = 2
    tap = LayerTap(model, layer)
    cache = DynamicCache()
    model(input_ids=torch.tensor([prompt[:-1]]), **cache_kwargs(model, cache), use_cache=True)
    tap.take()
    past = len(prompt) - 1
    fwd = verify_tree(model, cache, past, prompt[-1], tokens, parents, tap)
    assert cache.get_seq_length() == past + len(tokens) + 1
    draft_paths = [[]] + [Draft(tokens, parents).chain_tokens(i) for i in range(len(tokens))]
    for row, path in enumerate(draft_paths):
        seq = model(input_ids=torch.tensor([prompt + path]))
        states = tap.take()[0, -1]
        torch.testing.assert_close(fwd.logits[row], seq.logits[0, -1], rtol=1e-4, atol=1e-4)
        assert fwd.argmax[row] == int(seq.logits[0, -1].argmax())
        np.testing.assert_allclose(fwd.hidden[row], states.numpy(), rtol=1e-4, atol=1e-4)
    # after compaction to one root path, the next forward continues exactly that sequence
    leaf = max(range(len(tokens)), key=lambda i: len(draft_paths[i + 1]))
    path_nodes = Draft(tokens, parents).path_to(leaf)
    compact_cache(cache, past, [0] + [1 + i for i in path_nodes])
    nxt = 7
    cont = model(input_ids=torch.tensor([[nxt]]), **cache_kwargs(model, cache), use_cache=True,
                 position_ids=torch.tensor([[past + 1 + len(path_nodes)]])).logits[0, -1]
    want = model(input_ids=torch.tensor([prompt + draft_paths[leaf + 1] + [nxt]])).logits[0, -1]
    torch.testing.assert_close(cont, want, rtol=1e-4, atol=1e-4)
    if impl == "eager":  # the pitfall the float mask avoids: eager adds a bool mask as 0/1, masking nothing
        cache.crop(past - cache.get_seq_length())
        bool_mask = tree_attention_mask(parents, past) == 0
        bad = model(input_ids=torch.tensor([[prompt[-1], *tokens]]), attention_mask=bool_mask,
                    position_ids=tree_position_ids(parents, past), **cache_kwargs(model, cache), use_cache=True)
        assert not torch.allclose(bad.logits[0].float(), fwd.logits, atol=1e-3)
    tap.close()


# ------------------------------------------------------------------ test drafters

class OracleDrafter(Drafter):
    """Knows the greedy output of each prompt; proposes it with decoys placed before it, a wrong token at a
    random depth, and a branch that shares the true prefix then diverges (losslessness and compaction)."""

    name = "oracle"

    def __init__(self, truth: dict[tuple, list[int]], vocab: int, seed: int = 0):
        self.truth, self.vocab, self.rng = truth, vocab, random.Random(seed)
        self.pool: list[tuple[str, list[int], np.ndarray | None]] = []  # (prompt hash, output, states)
        self.observed = 0

    def begin_request(self, prompt, prompt_hash=None):
        self.prompt = list(prompt)
        self.answer = self.truth[tuple(prompt)]

    def propose(self, context, budget):
        assert list(context[:len(self.prompt)]) == self.prompt
        done = len(context) - len(self.prompt)
        assert list(context[len(self.prompt):]) == self.answer[:done]  # the context is exactly the greedy prefix
        rng, d = self.rng, Draft()
        for _ in range(rng.randrange(0, 3)):
            d.add_chain([rng.randrange(self.vocab) for _ in range(rng.randrange(1, 4))], "decoy", budget)
        true = self.answer[done:done + rng.randrange(0, 16)]
        wrong = rng.randrange(len(true) + 1)
        chain = true[:wrong] + [rng.randrange(self.vocab)] + true[wrong:]  # usually wrong from `wrong` on
        if rng.random() < 0.5:
            d.add_chain(true[:wrong] + [rng.randrange(self.vocab)], "fork", budget)
        d.add_chain(chain, "oracle", budget)
        if rng.random() < 0.5:
            d.add_chain(true, "oracle", budget)  # the full truth as another branch
        return d

    def observe(self, context, result):
        assert result.committed[-1] == result.bonus or len(result.committed) <= len(result.accepted_nodes)
        assert result.hidden.shape[0] == len(result.draft) + 1 == result.topk.shape[0]
        self.observed += 1

    def add_trace(self, output, prompt_hash=None, hidden=None):
        self.pool.append((prompt_hash, list(output), hidden))


class RandomTreeDrafter(Drafter):
    """Random trees of random tokens (mostly rejected), full budget."""

    name = "randomtree"

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, context, budget):
        d = Draft()
        while len(d) < budget:
            parent = self.rng.choice([ROOT, *range(len(d))])
            d.add_chain([self.rng.randrange(self.vocab)], "random", budget, attach=parent)
        return d


class CopyDrafter(Drafter):
    """Copies the context's continuation after the previous occurrence of the anchor (a tiny PLD)."""

    name = "copy"

    def propose(self, context, budget):
        d = Draft()
        anchor = context[-1]
        for i in range(len(context) - 2, -1, -1):
            if context[i] == anchor:
                d.add_chain(list(context[i + 1:i + 1 + budget]), "copy", budget)
                break
        return d


def _truth(lm, prompts, stop):
    return {tuple(p): decode_greedy(lm, p, stop).tokens for p in prompts}


def _story_prompts(lm, texts=STORY_PROMPTS):
    from data.capture.models import encode_prompt

    return [encode_prompt(lm, [{"role": "user", "content": t}]) for t in texts]


# ------------------------------------------------------------------ engine: stops, states, ar

def test_ar_equals_capture_greedy(stories):
    from data.capture.greedy import greedy_batch

    stop = stop_rule(stories, (), 40)
    with LayerTap(stories.model, stories.layer) as tap:
        for p in _story_prompts(stories)[:3]:
            assert decode_greedy(stories, p, stop).tokens == greedy_batch(stories, tap, [p], 40)[0].tokens


def test_states_and_topk_equal_teacher_forced(stories):
    from data.capture.teacher import teacher_forced

    stop = stop_rule(stories, (), 60)
    prompts = _story_prompts(stories)[:2]
    truth = _truth(stories, prompts, stop)
    with LayerTap(stories.model, stories.layer) as tap:
        for p in prompts:
            g = decode_speculative(stories, tap, p, OracleDrafter(truth, stories.vocab_size), stop)
            tf = teacher_forced(stories, tap, p, g.tokens)
            n = len(g.tokens)
            assert g.tokens == truth[tuple(p)] and g.hidden.shape == (n, stories.d_model)
            assert g.hidden_valid.tolist() == [True] * (n - 1) + [False] and not g.hidden[-1].any()
            np.testing.assert_allclose(g.hidden[:-1], tf.hidden[:-1], rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(g.topk[:-1], tf.topk[:-1])
            np.testing.assert_allclose(g.prompt_last_hidden, tf.prompt_last_hidden, rtol=1e-4, atol=1e-4)
            assert len(g.cycles) < n  # the oracle made passes commit several tokens


@pytest.mark.parametrize("kind", ["eos", "stop_string", "length"])
def test_stops_cut_mid_pass_like_ar(stories, kind):
    prompts = _story_prompts(stories)[:3]
    free = _truth(stories, prompts, stop_rule(stories, (), 80))
    lm, strings, cap = stories, (), 80
    long_out = max(free.values(), key=len)
    if kind == "eos":  # a token seen mid-output becomes an extra EOS id
        lm = dataclasses.replace(stories, eos_ids=stories.eos_ids | {long_out[20]})
    elif kind == "stop_string":  # a word from the middle of an output becomes a stop string
        text = stories.tokenizer.decode(long_out[15:40])
        strings = (max(text.split(), key=len),)
    else:
        cap = 23
    stop = StopRule(lm.tokenizer, lm.eos_ids, strings, cap)
    truth = _truth(lm, prompts, stop)
    assert any(len(t) < len(free[k]) for k, t in truth.items())  # the rule did stop something early
    cut_mid_pass = 0
    with LayerTap(lm.model, lm.layer) as tap:
        for p in prompts:
            ar = decode_greedy(lm, p, stop)
            for seed in range(3):
                g = decode_speculative(lm, tap, p, OracleDrafter(truth, lm.vocab_size, seed), stop)
                assert g.tokens == ar.tokens and g.stop_reason == ar.stop_reason
                last = g.cycles[-1]
                cut_mid_pass += last.committed < last.accepted + 1
    assert cut_mid_pass > 0  # some pass had accepted tokens past the stop, and they were cut


def test_bad_drafts_are_refused(stories):
    class Over(RandomTreeDrafter):
        def propose(self, context, budget):
            d = Draft()
            d.add_chain(list(range(budget + 1)), "x", budget + 1)
            return d

    stop = stop_rule(stories, (), 5)
    with LayerTap(stories.model, stories.layer) as tap, pytest.raises(ValueError, match="budget"):
        decode_speculative(stories, tap, _story_prompts(stories)[0], Over(stories.vocab_size), stop, nodes=4)
    with pytest.raises(OilbirdError):
        stop_rule(stories, (), 0)


# ------------------------------------------------------------------ harness end to end

LIBRARY = [name for name in DRAFTERS if name != "ar" and installed(name)]  # test_suffix_arctic.py fails if not


def _test_arms(lm, prompts, max_new):
    truth = _truth(lm, prompts, stop_rule(lm, (), max_new))
    return {
        "oracle": lambda lm_, cfg: OracleDrafter(truth, lm_.vocab_size, seed=1),
        "randomtree": lambda lm_, cfg: RandomTreeDrafter(lm_.vocab_size, seed=2),
        "copy": lambda lm_, cfg: CopyDrafter(),
    }


def _repetitive_bench(tmp_path):
    prompts = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1], STORY_PROMPTS[4]]
    return write_jsonl(tmp_path / "bench.jsonl", prompts)


def _check_run(summaries, out, bench, slug):
    from data.store.layout import store_dir

    folder = store_dir(out, bench, slug).parent / "decode"
    for arm, s in summaries.items():
        audit = s["lossless"]
        assert audit["lossless"] and audit["matched"] == audit["requests"], (arm, audit["mismatches"])
        cycles = pq.read_table(folder / arm / "cycles.parquet").to_pydict()
        reqs = pq.read_table(folder / arm / "requests.parquet").to_pydict()
        assert len(cycles["pass"]) == s["passes"] and sum(cycles["committed"]) == s["generated_tokens"]
        assert all(n <= s["nodes"] for n in cycles["nodes"])
        assert [len(x) for x in cycles["sources"]] == cycles["accepted"]
        assert json.loads((folder / arm / "summary.json").read_text())["tau"] == pytest.approx(s["tau"])
        assert reqs["output_tokens"] == pq.read_table(folder / "ar" / "requests.parquet")["output_tokens"].to_pylist()
    assert summaries["ar"]["tau"] == 1.0 and summaries["ar"]["speedup"] == 1.0
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_harness_lossless_stories(stories, tmp_path):
    bench = _repetitive_bench(tmp_path)
    prompts = _story_prompts(stories, [json.loads(x)["prompt"] for x in open(bench[6:])])
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("oracle", "randomtree", "copy"),
                       max_new_tokens=48, out=str(tmp_path / "runs"), nodes=20, progress=False)
    summaries = run_decode(cfg, lm=stories, extra_arms=_test_arms(stories, prompts, 48))
    assert list(summaries) == ["ar", "oracle", "randomtree", "copy"]  # ar added first
    assert summaries["oracle"]["ar_added"]
    _check_run(summaries, tmp_path / "runs", bench, "stories260k")
    assert summaries["oracle"]["tau"] > 2.0 and summaries["oracle"]["accepted_by_source"]["oracle"] > 0
    assert summaries["randomtree"]["mean_nodes"] == 20
    assert summaries["copy"]["tau"] > 1.0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_harness_lossless_tiny_random(kind, tiny_dirs, tmp_path):
    lm = load_model(tiny_dirs[kind])
    bench = write_jsonl(tmp_path / "bench.jsonl", STORY_PROMPTS[:4])
    prompts = _story_prompts(lm, STORY_PROMPTS[:4])
    arms = ("ar", "oracle", "randomtree", "copy", *LIBRARY)
    cfg = DecodeConfig(bench=bench, model=tiny_dirs[kind], arms=arms, max_new_tokens=40,
                       out=str(tmp_path / "runs"), progress=False)
    summaries = run_decode(cfg, lm=lm, extra_arms=_test_arms(lm, prompts, 40))
    _check_run(summaries, tmp_path / "runs", bench, lm.slug)


@pytest.mark.parametrize("arm", LIBRARY)
def test_library_drafters_lossless_stories(arm, stories, tmp_path):
    bench = _repetitive_bench(tmp_path)
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("ar", arm), max_new_tokens=64,
                       out=str(tmp_path / "runs"), progress=False)
    summaries = run_decode(cfg, lm=stories)
    _check_run(summaries, tmp_path / "runs", bench, "stories260k")


def test_warm_from_excludes_own_trace(stories, tmp_path):
    """A one-request benchmark warmed from a store holding only that request's own trace must draft exactly
    as with an empty pool: the trace shares the prompt, so no drafter may use it."""
    from data.capture.run import CaptureConfig, capture

    bench = write_jsonl(tmp_path / "one.jsonl", [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1]])
    store = capture(CaptureConfig(bench=bench, model="stories260k", out=str(tmp_path / "cap"), max_new_tokens=48,
                                  progress=False), lm=stories)
    kw = dict(bench=bench, model="stories260k", arms=("ar", *LIBRARY), max_new_tokens=48, progress=False)
    cold = run_decode(DecodeConfig(out=str(tmp_path / "cold"), **kw), lm=stories)
    warm = run_decode(DecodeConfig(out=str(tmp_path / "warm"), warm_from=store, **kw), lm=stories)
    for arm in LIBRARY:
        assert warm[arm]["warm_requests"] == 1
        assert warm[arm]["drafted_by_source"] == cold[arm]["drafted_by_source"], arm
        assert warm[arm]["passes"] == cold[arm]["passes"], arm


def test_warm_from_feeds_the_pool(stories, tmp_path):
    from data.capture.run import CaptureConfig, capture
    from data.store.reader import open_store

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    store = capture(CaptureConfig(bench=bench, model="stories260k", out=str(tmp_path / "cap"), max_new_tokens=30,
                                  progress=False), lm=stories)
    seen: list[OracleDrafter] = []
    prompts = _story_prompts(stories, STORY_PROMPTS[:3])

    def factory(lm, cfg):
        d = OracleDrafter(_truth(lm, prompts, stop_rule(lm, (), 30)), lm.vocab_size)
        seen.append(d)
        return d

    cfg = DecodeConfig(bench=bench, model="stories260k", arms=("oracle",), max_new_tokens=30,
                       out=str(tmp_path / "runs"), warm_from=store, progress=False)
    summaries = run_decode(cfg, lm=stories, extra_arms={"oracle": factory})
    st = open_store(store)
    pool = seen[0].pool
    assert len(pool) == 6 and summaries["oracle"]["warm_requests"] == 3  # 3 warm traces, then 3 served
    for r in range(3):
        warm_key, warm_out, warm_hidden = pool[r]
        served_key, served_out, served_hidden = pool[3 + r]
        assert warm_key == served_key == prompt_hash(st.prompt(r)) and warm_out == served_out == st.tokens(r).tolist()
        # served states follow the store's convention and agree with the captured ones (float16 there)
        np.testing.assert_allclose(served_hidden, warm_hidden, rtol=5e-3, atol=5e-3)
    with pytest.raises(OilbirdError, match="no trace store"):
        run_decode(dataclasses.replace(cfg, warm_from=str(tmp_path / "nowhere")), lm=stories,
                   extra_arms={"oracle": factory})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_cli_errors(tmp_path, capsys):
    from decoder.__main__ import main

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:1])
    base = ["--bench", bench, "--model", "stories260k", "--out", str(tmp_path / "runs"), "--quiet"]
    for argv, msg in [(["--arms", "ar,nosuch"], "unknown arm 'nosuch'"),
                      (["--arms", "ar,ar"], "twice"),
                      (["--arms", "ar", "--max-new-tokens", "0"], "max-new-tokens"),
                      (["--arms", "ar", "--warm-from", str(tmp_path / "none")], "no trace store")]:
        assert main(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err
    assert main(["--bench", "nosuch", "--arms", "ar"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing written on bad input


def test_cli_writes_outputs(tmp_path, capsys):
    from decoder.__main__ import main

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:2])
    assert main(["--bench", bench, "--model", "stories260k", "--arms", "ar", "--max-new-tokens", "12",
                 "--out", str(tmp_path / "runs"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tau" in out and "2/2" in out
    folder = next((tmp_path / "runs").rglob("decode"))
    assert sorted(p.name for p in (folder / "ar").iterdir()) == ["cycles.parquet", "requests.parquet", "summary.json"]


# ------------------------------------------------------------------ SmolLM2 (slow)

@pytest.mark.slow
def test_smollm2_apibank_lossless(tmp_path):
    lm = load_model("smollm2-135m")
    arms = ("ar", "copy", *LIBRARY)
    cfg = DecodeConfig(bench="apibank", model="smollm2-135m", arms=arms, limit=3, out=str(tmp_path / "runs"),
                       progress=False)
    summaries = run_decode(cfg, lm=lm, extra_arms={"copy": lambda lm_, c: CopyDrafter()})
    _check_run(summaries, tmp_path / "runs", "apibank", lm.slug)
    assert set(summaries["ar"]["stop_reasons"]) <= {"stop_string", "eos", "length"}
