"""Sampled requests (issue 43, item 5, the store's side): the store records how each request's tokens were chosen
(requests.parquet `sampling`, `off_argmax`: data/store/sampling.py), the census, replay and the report say in one
line when a store holds sampled requests, and replay of a one-hot chain against sampled traces estimates vLLM's
expected acceptance under its rejection rule (docs/replay.md, "Sampled traces").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.errors import OilbirdError
from data.store.layout import store_dir
from data.store.reader import open_store
from data.store.sampling import ARGMAX, GREEDY, REFERENCE, SAMPLED, sampled_note, sampled_requests
from data.store.schema import prompt_hash
from data.store.verify import verify_store
from data.store.writer import StoreWriter, TraceRecord, record_checksums
from decoder.draft import ROOT, Draft
from decoder.replay.traces import Trace, TraceVerifier

# ---------------------------------------------------------------- the expectation, on a toy distribution

V, K, PASSES, DRAWS = 6, 4, 3, 20_000  # vocabulary, chain length, passes per draw, draws per estimate
TOLERANCE = 4.0  # standard errors of the difference of two means


def toy_target():
    """A random order-2 Markov target p(x | a, b) over V tokens (fixed seed), and a deterministic drafter's table
    G[a, b] (the next draft token after a, b): the target's argmax after half of the contexts, its second most
    likely token after the others, so that its draft tokens' probabilities range widely."""
    rng = np.random.default_rng(43)
    p = rng.dirichlet(np.full(V, 0.5), size=(V, V))
    order = np.argsort(-p, axis=-1)
    g = np.where(rng.random((V, V)) < 0.5, order[..., 0], order[..., 1])
    return p, g


def draw(p: np.ndarray, u: float) -> int:
    """The token of uniform u under the distribution p (inverse CDF)."""
    return min(int(np.searchsorted(np.cumsum(p), u * float(p.sum()), side="right")), len(p) - 1)


def chain(g: np.ndarray, a: int, b: int) -> list[int]:
    """The deterministic drafter: K tokens, each G of the two before it (the context's last two first)."""
    out = []
    for _ in range(K):
        a, b = b, int(g[a, b])
        out.append(b)
    return out


def vllm_accepted(p, g, rng, biased: bool = False) -> int:
    """Draft tokens accepted over PASSES passes by vLLM's rejection rule for a one-hot draft (q(d) = 1): accept d
    with probability min(1, p(d) / q(d)) = p(d); on a rejection emit a token drawn from the residual
    (p - onehot(d))+ normalised and end the pass; after a fully accepted chain the bonus is drawn from p.
    biased: the wrong rule this test must reject, accepting d exactly when it is p's argmax."""
    a, b, total = 0, 1, 0
    for _ in range(PASSES):
        ctx = (a, b)
        for d in chain(g, a, b):
            q = p[ctx]
            ok = (d == int(np.argmax(q))) if biased else rng.random() < q[d]
            if not ok:
                residual = np.maximum(q - np.eye(V)[d], 0.0)
                ctx = (ctx[1], draw(residual / residual.sum(), rng.random()))
                break
            total += 1
            ctx = (ctx[1], d)
        else:
            ctx = (ctx[1], draw(p[ctx], rng.random()))  # the bonus token
        a, b = ctx
    return total


def replay_accepted(p, g, rng) -> int:
    """Draft tokens accepted over PASSES passes by replay: a trace sampled from p (long enough for every pass),
    verified by replay's own TraceVerifier (decoder/replay/traces.py: truth_argmax, then the engine's greedy_accept)."""
    tokens, a, b = [], 0, 1
    for _ in range(PASSES * (K + 1)):
        a, b = b, draw(p[a, b], rng.random())
        tokens.append(b)
    n = len(tokens)
    trace = Trace(prompt=[0, 1], tokens=tokens, hidden=np.zeros((n, 1), np.float16),
                  topk=np.full((n, 8), -1, np.int32), first_hidden=np.zeros(1, np.float16),
                  first_topk=np.full(8, -1, np.int32))
    verifier = TraceVerifier(trace, V)
    verifier.start(trace.prompt)
    context, total = list(trace.prompt), 0
    for _ in range(PASSES):
        d = chain(g, context[-2], context[-1])
        result = verifier.verify(context, Draft(tokens=d, parents=[ROOT] + list(range(K - 1)),
                                                sources=[{"toy"} for _ in d]))
        total += len(result.accepted_nodes)
        context += result.committed
    return total


def expected_accepted(p, g) -> float:
    """The exact expectation of vllm_accepted's statistic: one pass from each context gives its expected accepted
    count and the law of the context it leaves (the chain is fixed by the context), propagated over PASSES."""
    law, total = np.zeros((V, V)), 0.0
    law[0, 1] = 1.0
    for _ in range(PASSES):
        after = np.zeros((V, V))
        for a, b in zip(*np.nonzero(law)):
            w, ctx = law[a, b], (int(a), int(b))
            for d in chain(g, a, b):
                q = p[ctx]
                for y in range(V):  # rejected: y != d emitted with probability p(y)
                    if y != d:
                        after[ctx[1], y] += w * q[y]
                w *= q[d]
                total += w
                ctx = (ctx[1], d)
            after[ctx[1]] += w * p[ctx]  # every draft token accepted: the bonus
        law = after
    return total


def _z(x: np.ndarray, y: np.ndarray) -> float:
    """The difference of the two means in standard errors."""
    se = math.sqrt(x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))
    return float((x.mean() - y.mean()) / se)


def test_replay_of_sampled_traces_estimates_vllm_acceptance():
    """Replay of a deterministic chain drafter over traces sampled from p has vLLM's expected acceptance.

    Toy: an order-2 Markov target over V = 6 tokens (Dirichlet(0.5) rows, seed 43), a drafter proposing a chain of
    K = 4 tokens from the context's last two, PASSES = 3 passes per draw from the context (0, 1). Statistic: the
    draft tokens accepted over the 3 passes. DRAWS = 20,000 draws each of (a) vLLM's rejection rule simulated for
    a one-hot draft and (b) traces sampled from p replayed by replay's TraceVerifier; the means must agree within
    TOLERANCE = 4 standard errors of their difference (a false alarm about once in 16,000; seeds fixed, so the
    outcome is deterministic). The same comparison must reject (c) a biased rule that accepts a draft token exactly
    when it is p's argmax, by more than 4 standard errors: the test can fail. Each mean is also held to the exact
    expectation (enumerated over the contexts, `expected_accepted`) within 4 of its standard errors; the biased
    one must miss it.
    """
    p, g = toy_target()
    vllm = np.array([vllm_accepted(p, g, np.random.default_rng([1, i])) for i in range(DRAWS)], float)
    replay = np.array([replay_accepted(p, g, np.random.default_rng([2, i])) for i in range(DRAWS)], float)
    biased = np.array([vllm_accepted(p, g, np.random.default_rng([3, i]), biased=True) for i in range(DRAWS)], float)
    assert 0.5 < replay.mean() < PASSES * K - 0.5  # neither never nor always accepted: a real test of the rule
    assert abs(_z(replay, vllm)) < TOLERANCE, (replay.mean(), vllm.mean())
    assert abs(_z(replay, biased)) > TOLERANCE, (replay.mean(), biased.mean())
    # and each against the exact expectation, within TOLERANCE of its own standard error
    exact = expected_accepted(p, g)
    for x in (vllm, replay):
        assert abs(x.mean() - exact) < TOLERANCE * x.std(ddof=1) / math.sqrt(DRAWS), (x.mean(), exact)
    assert abs(biased.mean() - exact) > TOLERANCE * biased.std(ddof=1) / math.sqrt(DRAWS)


# ---------------------------------------------------------------- stores with and without sampled requests

D = 8
META = dict(model="no-such-model", model_fingerprint="x", layer=1, n_layers=1, d_model=D, vocab_size=64,
            dtype="float32", tokenizer_hash="t", chat_template_hash="c", data_fingerprint="f", mode="generate",
            max_new_tokens=64, versions={}, created="now")


def toy_traces(n: int = 4, length: int = 24):
    """Repetitive requests (two prompts, the same text again and again) so that suffix drafts get accepted."""
    from data.capture.vllm_capture import Trace as ServedTrace

    rng = np.random.default_rng(7)
    text = rng.integers(3, 60, 12)
    out = []
    for i in range(n):
        output = np.resize(text, length).astype(np.int32)
        hidden = rng.standard_normal((length, D)).astype(np.float32)
        topk = np.column_stack([np.append(output[1:], 5), rng.integers(3, 60, (length, 7))])  # top-1: the next token
        out.append(ServedTrace(prompt=np.array([1, 2, 3 + i % 2], np.int32), output=output, hidden=hidden,
                               hidden_valid=np.ones(length, bool), topk=topk.astype(np.int64),
                               prompt_last_hidden=rng.standard_normal(D).astype(np.float32),
                               prompt_last_topk=np.concatenate([output[:1], rng.integers(3, 60, 7)])))
    return out


def served_store(runs: Path, bench: str, off: list[int]) -> Path:
    """A served store (data/capture/served_store.py) of toy requests, request i with off[i] tokens off the top-1."""
    from data.capture.served_store import ServedStore

    path = store_dir(runs, bench, "no-such-model")
    store = ServedStore(path, dict(META, bench=bench, engine="vllm-serving"), eos_ids=frozenset({0}), flush_every=2)
    for trace, n in zip(toy_traces(len(off)), off):
        trace.off_argmax = n
        store.add(trace)
    store.close()
    return path


def records_store(runs: Path, bench: str, sampling, off) -> Path:
    """A store written by StoreWriter from records with the given sampling columns (None: not recorded)."""
    path = store_dir(runs, bench, "no-such-model")
    w = StoreWriter(path, dict(META, bench=bench))
    w.append([TraceRecord(request=i, id=f"r{i}", group="", prompt_hash=prompt_hash(t.prompt.tolist()),
                          prompt_tokens=t.prompt.tolist(), output_tokens=t.output.tolist(), stop_reason="length",
                          seconds=0.0, hidden=t.hidden, hidden_valid=np.arange(len(t.output)) < len(t.output) - 1,
                          topk=t.topk, prompt_last_hidden=t.prompt_last_hidden, prompt_last_topk=t.prompt_last_topk,
                          sampling=s, off_argmax=o)
              for i, (t, s, o) in enumerate(zip(toy_traces(len(sampling)), sampling, off))])
    w.finish()
    return path


def census_and_replay(runs: Path, bench: str, capsys, model: str = "no-such-model",
                      store: Path | None = None) -> tuple[dict, dict, str]:
    """The census's and a suffix replay's summary.json of runs/<bench>/<model> (or `store`), and what both said on
    stderr."""
    from census.definitions import CensusConfig
    from census.output import run_census
    from decoder.replay.run import ReplayConfig, run_replay

    capsys.readouterr()
    target, _ = run_census(bench, model, CensusConfig(bootstrap=0), runs, embeddings=None, progress=False,
                           store=store)
    (summary,) = run_replay(ReplayConfig(bench=bench, model=model, arms=("suffix",), out=str(runs), bootstrap=0,
                                         progress=False, store=None if store is None else str(store))).values()
    census = json.loads((target / "summary.json").read_text())
    return census, summary, capsys.readouterr().err


def page(runs: Path) -> str:
    from reports.benchmark_page import result_page
    from reports.case_viewer import id_text
    from reports.results import find_results

    (result,) = find_results(runs)
    return result_page(result, token_text=id_text("ids"))


def test_served_store_records_sampling(tmp_path, capsys):
    from data.__main__ import main as data_main

    path = served_store(tmp_path, "served", [0, 3, 0, 1])
    st = open_store(path)
    assert st.requests["sampling"].to_list() == [ARGMAX, SAMPLED, ARGMAX, SAMPLED]
    assert st.requests["off_argmax"].to_list() == [0, 3, 0, 1]
    assert sampled_requests(st.requests) == {"count": 2, "of": 4, "unknown": 0}
    assert verify_store(path).startswith("OK: ")
    capsys.readouterr()
    assert data_main(["show", str(path)]) == 0
    assert "sampling: argmax 2, sampled 2" in capsys.readouterr().out.splitlines()


def test_sampled_store_is_said_by_census_replay_and_report(tmp_path, capsys):
    runs = tmp_path / "runs"
    served_store(runs, "served", [0, 5, 0, 0])
    census, replay, err = census_and_replay(runs, "served", capsys)
    want = {"count": 1, "of": 4, "unknown": 0}
    assert census["sampled_requests"] == want and replay["sampled_requests"] == want
    assert replay["accepted_draft_tokens"] > 0  # the toy's repetitions are drafted: a replay that did something
    said = [line for line in err.splitlines() if "were sampled" in line]
    assert said == [f"note: {sampled_note(want)}"] * 2  # one line from each, the same line
    assert said[0].startswith("note: 1 of 4 requests were sampled") and "docs/replay.md" in said[0]
    html = page(runs)
    assert html.count('id="sampled"') == 1 and "1 of 4 requests were sampled" in html
    assert html.index('id="sampled"') < html.index('id="decision"')  # beside the verdict, above it


def test_greedy_capture_records_greedy_and_says_nothing(tmp_path, capsys, stories):
    from data.capture.run import CaptureConfig, capture
    from tests.conftest import STORY_PROMPTS, write_jsonl

    prompts = STORY_PROMPTS[:3] + STORY_PROMPTS[:1]  # the last one again: the same prompt, another request
    runs = tmp_path / "runs"
    path = capture(CaptureConfig(bench=write_jsonl(tmp_path / "b.jsonl", prompts), model="stories260k",
                                 out=str(runs), max_new_tokens=24, progress=False), lm=stories)
    st = open_store(path)
    assert st.requests["sampling"].to_list() == [GREEDY] * 4 and st.requests["off_argmax"].to_list() == [0] * 4
    # the harness's greedy tokens are the top-1 of the store's own top-8 wherever a next token follows
    tokens, top1, request = st.positions["token"].to_numpy(), st.topk[:, 0], st.positions["request"].to_numpy()
    follows = st.hidden_valid[:-1] & (request[1:] == request[:-1])
    assert follows.any() and np.array_equal(tokens[1:][follows], top1[:-1][follows])
    census, replay, err = census_and_replay(runs, st.meta["bench"], capsys, "stories260k", path)
    assert census["sampled_requests"] == replay["sampled_requests"] == {"count": 0, "of": 4, "unknown": 0}
    assert "sampled" not in err and 'id="sampled"' not in page(runs)

    ref = capture(CaptureConfig(bench=write_jsonl(tmp_path / "r.jsonl", STORY_PROMPTS[:2], STORY_PROMPTS[2:4]),
                                model="stories260k", out=str(tmp_path / "ref"), mode="reference", progress=False),
                  lm=stories)
    ref_req = open_store(ref).requests
    assert ref_req["sampling"].to_list() == [REFERENCE] * 2 and ref_req["off_argmax"].null_count() == 2


def test_store_without_the_columns_reads_and_says_nothing(tmp_path, capsys):
    """A store written before the columns (OPTIONAL_COLUMNS): both read as null, verify passes, nothing is said."""
    from data.__main__ import main as data_main

    runs = tmp_path / "runs"
    path = records_store(runs, "old", [SAMPLED, ARGMAX, SAMPLED, ARGMAX], [2, 0, 1, 0])
    table = pq.read_table(path / "requests.parquet").drop_columns(["sampling", "off_argmax"])
    pq.write_table(table, path / "requests.parquet")
    record_checksums(path)  # the bytes older code would have written
    st = open_store(path)
    assert st.requests["sampling"].null_count() == 4 and st.requests["off_argmax"].null_count() == 4
    assert verify_store(path).startswith("OK: ")
    capsys.readouterr()
    assert data_main(["show", str(path)]) == 0
    assert "sampling: not recorded 4" in capsys.readouterr().out.splitlines()
    census, replay, err = census_and_replay(runs, "old", capsys)
    assert census["sampled_requests"] == replay["sampled_requests"] == {"count": 0, "of": 4, "unknown": 4}
    assert "sampled" not in err and 'id="sampled"' not in page(runs)


@pytest.mark.parametrize("sampling, off, why", [
    ([SAMPLED], [0], "sampling is 'sampled' but its off_argmax counts none"),
    ([ARGMAX], [2], "sampling is 'argmax' but its off_argmax counts some"),
    (["hot"], [None], "unknown sampling 'hot'"),
    ([SAMPLED], [-1], "off_argmax is negative"),
])
def test_verify_refuses_inconsistent_sampling(tmp_path, sampling, off, why):
    path = records_store(tmp_path, "bad", sampling, off)
    with pytest.raises(OilbirdError, match=why):
        verify_store(path)
