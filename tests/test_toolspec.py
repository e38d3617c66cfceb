"""ToolSpec (decoder/drafters/toolspec.py): the schema, the FSM's candidates, the n-gram phase, the memory,
the host's interface, the arms' contract, and losslessness live."""

from __future__ import annotations

import numpy as np
import pytest

from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from decoder.draft import ROOT, VerifyResult
from decoder.drafters import make_drafter
from decoder.drafters.toolspec import (
    INIT_PREFIXES,
    ToolSpecConfig,
    ToolSpecHost,
    ToolSpecMemory,
    extract_schema,
    first_param_candidates,
    init_candidates,
    ngram_candidates,
    param_candidates,
    schema_tokens,
    verified_tool,
)
from decoder.live.harness import DecodeConfig, run_decode
from decoder.replay.run import ReplayConfig, run_replay
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Chars:
    """A tokenizer with one token per character (ids = code points < 128): candidate strings are readable."""

    def __len__(self):
        return 128

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def enc(text):
    return [ord(c) for c in text]


def text_of(ids):
    return "".join(chr(i) for i in ids)


def check_tree(draft, budget):
    assert len(draft) <= budget
    seen = set()
    for i, (tok, par) in enumerate(zip(draft.tokens, draft.parents)):
        assert par == ROOT or 0 <= par < i
        assert (par, tok) not in seen
        seen.add((par, tok))


def leaves(draft) -> set[str]:
    parents = set(draft.parents)
    return {text_of(draft.chain_tokens(i)) for i in range(len(draft)) if i not in parents}


def host_for(prompt_text: str, **options) -> ToolSpecHost:
    h = ToolSpecHost(128, ToolSpecConfig(**options))
    h._tokenizer, h._tokenizer_name = Chars(), "chars"
    h.begin_request(enc(prompt_text))
    return h


APIBANK = ('Tools.\n\n1. Name: Foo\nDescription: Does foo.\nParameters: {"a": {"type": "str"}, "bb": {"type": "int"}}'
           '\n\n2. Name: Fob\nDescription: Does fob.\nParameters: {}\n\n**Output Format**\n')


# ---------------------------------------------------------------- the schema

def test_extract_schema_formats():
    assert extract_schema(APIBANK) == {"Foo": ["a", "bb"], "Fob": []}
    alpaca = ("The current year is 2023.\n\n**Available Tools**\n\n1. getX: Get x.\nParameters: {\"q\": \"Required. "
              "string.\"}\nOutput: ok\n\n2. getDetails: Ask.\nParameters: {\"Question\": \"string.\"}")
    assert extract_schema(alpaca) == {"getX": ["q"], "getDetails": ["Question"]}  # the year's line is no tool
    tau = ('policy\n{"name": "calc", "description": "d", "parameters": {"type": "object", "properties": '
           '{"expression": {"type": "string"}}, "required": ["expression"]}}\n{"name": "think", "parameters": {}}')
    assert extract_schema(tau) == {"calc": ["expression"], "think": []}
    python_literal = "1. Name: T\nDescription: x\nParameters: {'k': {'type': 'str'}, 'v': None}"
    assert extract_schema(python_literal) == {"T": ["k", "v"]}
    assert extract_schema("Once upon a time, there was a dog.") == {}


# ---------------------------------------------------------------- the FSM's candidates (token ids)

INIT = [(0, [1, 2, 3, 4]), (1, [1, 2, 5]), (0, [7, 1, 2, 3, 4])]


def test_init_candidates_exact():
    assert init_candidates([9, 9], 2, INIT, 2) == [[1, 2, 3, 4], [1, 2, 5], [7, 1, 2, 3, 4]]  # empty response
    assert init_candidates([9, 9, 8, 1, 2], 2, INIT, 2) == [[3, 4], [5]]  # the longest match, every candidate
    assert init_candidates([9, 9, 7, 1, 2, 3], 2, INIT, 2) == [[4]]  # 4 tokens of the third beat 3 of the first
    assert init_candidates([9, 9, 8, 1], 2, INIT, 2) == []  # one token is below init_min_match
    assert init_candidates([9, 9, 8, 1], 2, INIT, 1) == [[2, 3, 4], [2, 5]]
    assert init_candidates([1, 2, 8], 2, INIT, 2) == []  # the match must lie in the response
    assert init_candidates([9, 1, 2, 3, 4], 1, INIT, 2) == []  # a whole candidate is matched, nothing left


def test_verified_tool_and_first_param_exact():
    keys = [[50, 51, 60], [50, 51, 61, 62]]
    ctx = [50, 51, 61, 62, 0, 50, 51, 60, 40, 41]  # the prompt holds tool 1; the response, tool 0 then 40 41
    assert verified_tool(ctx, 4, keys) == (0, 8)
    assert verified_tool(ctx, 6, keys) == (-1, -1)  # no key inside the response
    seqs = [[40, 41, 42, 43], [40, 44], [40, 41]]
    assert first_param_candidates(ctx, 8, seqs) == [[42, 43]]  # [40, 41] is matched whole: nothing left
    assert first_param_candidates(ctx[:8], 8, seqs) == [[40, 41, 42, 43], [40, 44], [40, 41]]
    assert first_param_candidates(ctx + [99], 8, seqs) == [] and first_param_candidates(ctx, -1, seqs) == []


def test_param_candidates_exact():
    sep, seqs = 7, [[20, 21, 22], [20, 23], [24]]
    assert param_candidates([1, 2, 3, 7], sep, seqs) == [[20, 21, 22], [20, 23], [24]]
    assert param_candidates([1, 7, 20, 21], sep, seqs) == [[22]]
    assert param_candidates([7, 1, 20, 23, 5], sep, seqs) == []  # no separator in the last 4 tokens
    assert param_candidates([7, 20, 23, 5], sep, seqs, window=4) == []  # what follows extends no parameter
    assert param_candidates([7, 20, 23, 7, 20], sep, seqs) == [[21, 22], [23]]  # the last separator counts


def test_ngram_candidates_exact():
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 8, 1, 2, 3]
    # n = 3: occurrences ending at 2 and 6 (the self-match at the end is excluded), earliest first
    assert ngram_candidates(ctx, (), 3, 3, (4, 4)) == [[9, 1, 2, 3], [8, 8, 1, 2]]
    assert ngram_candidates(ctx, (), 3, 3, (2,)) == [[9, 1]]
    # a retrieved segment is searched first; its continuation stops at its end
    assert ngram_candidates(ctx, ([5, 1, 2, 3, 6],), 3, 3, (4, 4, 4)) == [[6], [9, 1, 2, 3], [8, 8, 1, 2]]
    assert ngram_candidates(ctx, ([5, 1, 2, 3, 6],), 3, 3, (4, 4, 4), search_context=False) == [[6]]
    # a continuation that is a prefix of one taken (or extends one) is skipped; shorter n are tried next
    ctx = [4, 2, 3, 5, 6, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert ngram_candidates(ctx, (), 3, 2, (3, 3, 3)) == [[5, 6, 7], [5, 6, 1]]  # n = 3, then n = 2 (5 6 7: skipped)
    assert ngram_candidates(ctx, (), 3, 2, (3, 2)) == [[5, 6, 7]]  # 5 6 is a prefix of 5 6 7: skipped
    assert ngram_candidates([1, 2], (), 3, 3) == []


# ---------------------------------------------------------------- the host, one pass at a time

def test_host_schema_states_and_budget():
    h = host_for(APIBANK)
    assert h.schema.tools == ["Foo", "Fob"]
    prompt = enc(APIBANK)
    draft, matched = h.draft(prompt, 500)
    assert matched and h.last_stage == "schema"
    assert leaves(draft) == {p + t for p in INIT_PREFIXES for t in ("Foo", "Fob")}  # the code's pass 1
    for budget in range(0, 40):
        d, m = h.draft(prompt, budget)
        check_tree(d, budget)
        assert m  # matched does not depend on the budget
    # the call opens mid-response: the frame's tail is matched, the rest drafted
    ctx = prompt + enc('ok <tool_call>\n{"na')
    h.draft(ctx, 500)
    assert h.candidates(ctx)[1] == [enc('me": "Foo'), enc('me": "Fob')]
    # after the tool name (and the bonus `"`): first_param, that tool's parameters only
    ctx = prompt + enc('<tool_call>\n{"name": "Foo"')
    assert h.candidates(ctx) == ("schema", [enc(', "parameters": {"a": "'), enc(', "parameters": {"bb": "')])
    ctx = prompt + enc('<tool_call>\n{"name": "Fob", "param')
    assert h.candidates(ctx) == ("schema", [enc('eters": {"')])  # no parameters: the prefix alone (the code's)


def test_host_falls_through_ngram_then_recycling():
    h = host_for(APIBANK)
    prompt = enc(APIBANK)
    ctx = prompt + enc("Does foo.")  # no schema state; the context's last 7 tokens occurred in the prompt
    stage, cands = h.candidates(ctx)
    assert stage == "ngram" and cands[0] == enc("\nParameters: {\"a\": {\"type\": \"str\"}, \"bb\": {\"")[:32]
    ctx = prompt + enc("zq")  # nothing matches: recycling, and only with adjacency rows at the anchor
    draft, matched = h.draft(ctx, 10)
    assert (len(draft), matched, h.last_stage) == (0, False, "")
    topk = np.full((1, 8), -1, np.int32)
    topk[0, :2] = [65, 66]
    h.observe(ctx, VerifyResult(draft=draft, accepted_nodes=[], bonus=65, committed=[65], argmax=topk[:, 0],
                                topk=topk, hidden=None))
    draft, matched = h.draft(ctx, 10)
    assert matched and h.last_stage == "recycling" and sorted(draft.tokens) == [65, 66]


def test_host_without_tokenizer_or_schema():
    h = ToolSpecHost(10)  # auto: no project tokenizer has 10 entries
    h.begin_request([1, 2, 3, 1, 2, 3, 4, 5, 1, 2, 3])
    assert h.schema is None and h.counters()["schema_off"] == 1 and "10 entries" in h.counters()["tokenizer_note"]
    assert h.draft([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5], 10)[1]  # the n-gram phase still drafts
    assert host_for("Once upon a time.").schema is None  # a prompt without tools


def test_explicit_tokenizer_errors_are_one_line():
    for spec, needle in (("/nonexistent/tokenizer", "cannot load"), ("stories260k", "more than the model's")):
        h = ToolSpecHost(100, ToolSpecConfig(tokenizer=spec))
        with pytest.raises(OilbirdError) as e:
            h.begin_request([1, 2, 3])
        assert "\n" not in str(e.value) and needle in str(e.value)


def test_schema_tokens_are_encoded_in_context():
    s = schema_tokens(Chars(), {"Foo": ["a"]}, INIT_PREFIXES[:1])
    assert s.init == [(0, enc('{"name": "Foo'))] and s.name_keys == [enc('name": "Foo')]
    assert s.first == [[enc('", "parameters": {"a": "')]] and s.remaining == [[enc(' "a": "')]]
    assert s.separator == ord('"')


# ---------------------------------------------------------------- the memory and the arms' contract

def test_memory_retrieves_by_cosine_skipping_the_prompt():
    m = ToolSpecMemory()
    e = np.eye(4, dtype=np.float32)
    m.add_trace([1], "a", e[0])
    m.add_trace([2], "b", 0.6 * e[0] + 0.8 * e[1])
    m.add_trace([3], "c", e[1])
    m.add_trace([4], "d", None)  # no key: never retrieved
    m.add_trace([], "e", e[0])  # empty: never retrieved
    assert m.retrieve(e[0], 10) == [[1], [2], [3]]
    assert m.retrieve(e[0], 2, excluded="a") == [[2], [3]]
    assert m.retrieve(e[1], 1) == [[3]] and m.retrieve(None, 3) == []
    m.evict_traces(2)
    assert m.retrieve(e[0], 10) == [[3]]


def _observe_first(d, context, draft, state):
    hidden = np.stack([state] * (1 + len(draft)))
    topk = np.full((1 + len(draft), 8), -1, np.int32)
    d.observe(context, VerifyResult(draft=draft, accepted_nodes=[], bonus=0, committed=[0], argmax=topk[:, 0],
                                    topk=topk, hidden=hidden))


@pytest.mark.parametrize("same", [True, False])
def test_memory_arm_never_retrieves_its_own_prompt(same):
    d = make_drafter("toolspec-memory", vocab_size=10, nodes=20)
    assert d.config.memory and make_drafter("toolspec", vocab_size=10).memory is None
    e = np.eye(4, dtype=np.float32)
    d.add_trace([5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6], "h", hidden=np.stack([e[0]] * 11))  # a warm trace
    prompt = [1, 2, 3, 4, 5]
    d.begin_request(prompt, "h" if same else "x")
    draft = d.propose(prompt, 20)
    _observe_first(d, prompt, draft, e[0])
    d.propose(prompt + [0], 20)  # the second pass retrieves
    assert d._segments == ([] if same else [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]])
    d.add_trace([0, 1], "h" if same else "x")
    assert len(d.memory.entries) == 2 and np.allclose(d.memory.entries[1][1], e[0])  # keyed by its first state
    d.evict_traces(1)
    assert [t for _, _, t in d.memory.entries] == [[0, 1]]


# ---------------------------------------------------------------- lossless, live

SCHEMA = ('1. Name: Ball\nDescription: A red ball.\nParameters: {"color": {"type": "str"}, "size": {"type": "int"}}'
          '\n\n2. Name: Park\nDescription: A park.\nParameters: {"name": {"type": "str"}}\n\n')
TRAFFIC = [SCHEMA + "Once upon a time, there was a little girl named Lily.",
           SCHEMA + "Tom had a red ball. He liked to play with it every day.",
           SCHEMA + "Once upon a time, there was a little girl named Lily.",
           "One day, a big dog came to the park."]


def test_live_is_lossless_and_the_schema_drafts(stories, tmp_path):
    bench = write_jsonl(tmp_path / "bench.jsonl", TRAFFIC)
    out = str(tmp_path / "runs")
    arms = ("toolspec@tokenizer=stories260k", "toolspec-memory@tokenizer=stories260k")
    live = run_decode(DecodeConfig(bench=bench, model=stories.name, arms=("ar", *arms), max_new_tokens=32, out=out,
                                   progress=False), lm=stories)
    for arm in arms:
        audit = live[arm]["lossless"]
        assert audit["lossless"] and audit["matched"] == audit["requests"] == len(TRAFFIC), arm
        stats = live[arm]["drafter_stats"]
        assert stats["schema_requests"] == 3 and stats["schema_off"] == 1 and stats["schema_passes"] >= 3, arm
        assert live[arm]["tau"] > 1.0, arm
    capture(CaptureConfig(bench=bench, model=stories.name, max_new_tokens=32, out=out, progress=False), lm=stories)
    replay = run_replay(ReplayConfig(bench=bench, model=stories.name, arms=arms, max_new_tokens=32, out=out,
                                     bootstrap=0, jobs=1, progress=False))
    for arm in arms:
        s = replay[(arm, 60)]
        assert s["generated_tokens"] == live["ar"]["generated_tokens"] and not s["exact"]  # the adjacency table
        assert s["drafter_stats"]["schema_passes"] >= 3
