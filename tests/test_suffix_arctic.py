"""The `suffix-arctic` arms: ArcticInference's SuffixDecodingCache behind the Drafter contract.

`make install` builds ArcticInference 0.3.0, so these tests use the real cache and fail (never skip) where
it is missing, as tests/test_bench_draft.py's; only the missing-package test fakes its absence."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from decoder.draft import ROOT, VerifyResult
from decoder.drafters import make_drafter
from decoder.drafters.suffix_arctic import SuffixArcticConfig, to_draft
from decoder.live.harness import DecodeConfig, run_decode
from decoder.replay.run import ReplayConfig, run_replay
from tests.conftest import STORY_PROMPTS, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TREE = dict(max_spec_factor=4.0, use_tree_spec=True, num_speculative_tokens=0, max_tree_depth=64)


def check_tree(draft, budget, vocab=None):
    assert len(draft) <= budget
    seen = set()
    for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents)):
        assert par == ROOT or 0 <= par < i  # parents before children
        assert (par, tok) not in seen
        seen.add((par, tok))
        assert draft.sources[i]
        if vocab is not None:
            assert 0 <= tok < vocab


def commit(d, context, draft, bonus):
    """Observe a pass that accepted nothing and committed `bonus` (what replay tells a drafter)."""
    topk = np.full((1 + len(draft), 8), -1, np.int32)
    d.observe(context, VerifyResult(draft=draft, accepted_nodes=[], bonus=bonus, committed=[bonus],
                                    argmax=topk[:, 0], topk=topk, hidden=None))
    context.append(bonus)


# ---------------------------------------------------------------- the pure conversion

def test_to_draft_exact_arrays():
    # a tree: 5 -> (6 -> 8, 7); budget 3 keeps the first three nodes, the child of node 1 is left out
    d = to_draft([5, 6, 7, 8], [-1, 0, 0, 1], 3, "x")
    assert (d.tokens, d.parents, d.sources) == ([5, 6, 7], [ROOT, 0, 0], [{"x"}] * 3)
    # a node listed before its parent is left out with its subtree; a repeated (parent, token) is walked
    d = to_draft([5, 9, 6, 5, 7], [-1, 3, 0, -1, 3], 10, "x")
    assert (d.tokens, d.parents) == ([5, 6, 7], [ROOT, 0, 0])
    assert len(to_draft([1, 2], [-1, 0], 0)) == 0


def test_defaults_are_vllms():
    """The arm `suffix-arctic` runs at vLLM's SpeculativeConfig defaults for suffix decoding."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here")
    text = (Path(list(spec.submodule_search_locations)[0]) / "config" / "speculative.py").read_text()
    default = lambda f: re.search(rf"suffix_decoding_{f}: \w+ = ([\d.]+)", text).group(1)  # noqa: E731
    c = make_drafter("suffix-arctic", vocab_size=100).config
    assert c.max_tree_depth == int(default("max_tree_depth")) == 24
    assert c.max_cached_requests == int(default("max_cached_requests"))
    assert c.max_spec_factor == float(default("max_spec_factor"))
    assert c.min_token_prob == float(default("min_token_prob"))
    assert c.num_speculative_tokens == -1 and not c.use_tree_spec and c.max_spec_offset == 0  # -1: unset
    d = make_drafter("suffix-arctic", vocab_size=100)
    assert [d.spec_limit(b) for b in (0, 10, 60)] == [0, 10, 24]  # vLLM: unset = the tree depth
    assert make_drafter("suffix-arctic@max_tree_depth=64", vocab_size=100).spec_limit(60) == 60
    assert make_drafter("suffix-arctic@num_speculative_tokens=8", vocab_size=100).spec_limit(60) == 8
    tree = make_drafter("suffix-arctic-tree", vocab_size=100)
    assert tree.name == "suffix-arctic-tree" and tree.config == SuffixArcticConfig(**{**TREE, "min_token_prob": 0.1})


# ---------------------------------------------------------------- the contract

TRACE = [1, 2, 3, 4, 5, 6, 7, 8]
PROMPT = [9, 1, 2, 3]  # ends with what the trace holds before 4 5 6 ...


def test_same_prompt_traces_are_never_drafted_from():
    d = make_drafter("suffix-arctic", vocab_size=20, **TREE)
    d.add_trace(TRACE, prompt_hash="h")
    d.begin_request(PROMPT, "other")
    assert d.propose(PROMPT, 10).tokens == [4, 5, 6, 7, 8]  # another prompt drafts from the trace
    d.add_trace([], "other")  # the request ends without output
    d.begin_request(PROMPT, "h")
    assert d.propose(PROMPT, 10).tokens == []  # its own prompt's trace is withheld
    assert len(d.cache.cached_requests) == 1  # the running request's live slot only
    context = list(PROMPT)
    commit(d, context, d.propose(context, 10), 4)
    assert d.propose(context, 10).tokens == []  # still withheld while the request runs
    d.add_trace([4], "h")
    d.begin_request(PROMPT, "x")
    assert d.propose(PROMPT, 10).tokens[:5] == [4, 5, 6, 7, 8]  # back in the pool for other prompts
    assert d.counters()["withheld"] == 1 and d.counters()["restored"] == 1


def test_served_response_joins_completed_and_evict_counts_every_trace():
    d = make_drafter("suffix-arctic", vocab_size=40, **TREE)
    d.begin_request([30, 31], "a")
    context = [30, 31]
    for tok in (10, 11):  # the passes commit 10, 11; the cache has seen 10 (a propose appends what came before)
        commit(d, context, d.propose(context, 5), tok)
    d.add_trace([10, 11, 12], "a")  # 11 and the trace's last token 12 complete the cached response
    assert len(d.cache.cached_requests) == 1 and not d.cache.active_requests
    d.add_trace([], "b")  # an empty trace counts for evict_traces
    d.add_trace([20, 21, 22], "c")
    d.begin_request([5, 10], "z")
    assert d.propose([5, 10], 5).tokens == [11, 12]  # the served trace is cached whole, the last token too
    d.add_trace([], "z")
    d.evict_traces(2)  # the served trace and the empty one leave
    d.begin_request([5, 10], "y")
    assert d.propose([5, 10], 5).tokens == []
    assert d.propose([5, 20], 5).tokens == [21, 22]
    assert d.counters()["pooled_traces"] == 2  # "c" and "z"


def test_a_request_without_add_trace_leaves_no_response_behind():
    """Replay's warm pool adds no served trace: the next request evicts the live response of the last."""
    d = make_drafter("suffix-arctic", vocab_size=40, **TREE)
    d.begin_request([30, 31], "a")
    context = [30, 31]
    for tok in (10, 11, 12):
        commit(d, context, d.propose(context, 5), tok)
    d.begin_request([5, 10], "b")
    assert d.propose([5, 10], 5).tokens == [] and d.counters()["live_evicted"] == 1


@pytest.mark.parametrize("arm", ["suffix-arctic", "suffix-arctic-tree"])
def test_budget_and_tree_shape_on_random_requests(arm):
    rng = np.random.default_rng(0)
    vocab = 6
    d = make_drafter(arm, vocab_size=vocab, nodes=20, min_token_prob=0.0)
    for r in range(6):
        d.add_trace(rng.integers(0, vocab, 60).tolist(), prompt_hash=f"w{r % 3}")
    sizes = []
    for r in range(4):
        prompt = rng.integers(0, vocab, 12).tolist()
        d.begin_request(prompt, f"w{r % 3}")
        context = list(prompt)
        for _ in range(12):
            budget = int(rng.integers(0, 21))
            draft = d.propose(context, budget)
            check_tree(draft, d.spec_limit(budget), vocab)
            assert d.spec_limit(budget) <= budget
            sizes.append(len(draft))
            commit(d, context, draft, int(rng.integers(0, vocab)))
        d.add_trace(context[len(prompt):], f"w{r % 3}")
    assert max(sizes) > 3  # it drafts: the budget is what bounds it


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)  # import fails as if absent
    with pytest.raises(OilbirdError) as e:
        make_drafter("suffix-arctic-tree", vocab_size=10)
    msg = str(e.value)
    assert "\n" not in msg and "arctic_inference" in msg and "make install" in msg and "arctic-inference==0.3.0" in msg


# ---------------------------------------------------------------- lossless, and replay equals live

def _passes(folder: Path) -> list[tuple]:
    t = pq.read_table(folder / "cycles.parquet").to_pydict()
    return list(zip(t["request"], t["pass"], t["nodes"], t["accepted"], t["committed"]))


def test_live_is_lossless_and_replay_equals_live(stories, tmp_path):
    traffic = STORY_PROMPTS + [STORY_PROMPTS[1] + " " + STORY_PROMPTS[1]]
    bench = write_jsonl(tmp_path / "bench.jsonl", traffic)
    out = str(tmp_path / "runs")
    arms = ("suffix-arctic", "suffix-arctic-tree")
    capture(CaptureConfig(bench=bench, model=stories.name, max_new_tokens=32, out=out, progress=False), lm=stories)
    live = run_decode(DecodeConfig(bench=bench, model=stories.name, arms=("ar", *arms), max_new_tokens=32, out=out,
                                   progress=False), lm=stories)
    replay = run_replay(ReplayConfig(bench=bench, model=stories.name, arms=arms, max_new_tokens=32, out=out,
                                     bootstrap=0, jobs=1, progress=False))
    for arm in arms:
        audit = live[arm]["lossless"]
        assert audit["lossless"] and audit["matched"] == audit["requests"] == len(traffic), arm
        s = replay[(arm, 60)]
        assert s["exact"] and s["generated_tokens"] == live[arm]["generated_tokens"] == live["ar"]["generated_tokens"]
        folder = Path(s["store"]).parent
        assert _passes(folder / "replay" / arm) == _passes(Path(live[arm]["decode_dir"]) / arm), arm
        assert live[arm]["tau"] > 1.0, arm  # it drafted tokens the model accepted


def test_arctic_inference_is_installed_where_the_suite_runs():
    """make install builds arctic-inference: the main suite fails, never skips, without it (the floor env's
    all-drafter tests leave suffix-arctic out, decoder.drafters.installed)."""
    from decoder.drafters import installed

    assert installed("suffix-arctic")
