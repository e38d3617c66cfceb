"""Drafting beside the verify (decoder/loop.py): the previous pass's deferred bookkeeping (`Drafter.observe_split`)
runs after the next launch and before its collect, while an overlapping verifier works; the passes do not depend
on where it ran."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import STORY_PROMPTS, write_jsonl
from decoder.draft import Draft, Drafter, VerifyResult
from decoder.loop import speculate
from decoder.verify.tree import greedy_accept


class Truth:
    """A verifier over a fixed greedy continuation (as replay's TraceVerifier), logging each verify and running the
    loop's beside work before it."""

    timed, vocab_size, overlaps = True, 100, False

    def __init__(self, truth: list[int], log: list[str]) -> None:
        self.truth, self.log, self.m = truth, log, 0

    @property
    def stop_reason(self):
        return "length" if self.m >= len(self.truth) else None

    def start(self, prompt):
        self.m = 0

    def verify(self, context, draft: Draft, beside=None) -> VerifyResult:
        if beside is not None:
            beside()
        return self.verify_pass(context, draft)

    def verify_pass(self, context, draft: Draft) -> VerifyResult:
        self.log.append(f"verify{len(context)}")
        truth = self.truth[self.m:]
        argmax = np.zeros(len(draft) + 1, np.int64)  # row 0: the anchor's next token; a node's: its child's
        depth = draft.depths() if len(draft) else []
        argmax[0] = truth[0]
        for i in range(len(draft)):
            argmax[1 + i] = truth[depth[i]] if depth[i] < len(truth) else 0
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
        committed = truth[:len(accepted) + 1]
        self.m += len(committed)
        return VerifyResult(draft, accepted, bonus, committed, argmax, np.zeros((len(draft) + 1, 8), np.int64), None)

    def advance(self, result):
        pass


class ThreadTruth(Truth):
    """Runs the beside work on a thread of its own and verifies only once that work has run: a verifier that ran
    it after its verify would wait here (the wait times out, and the test fails)."""

    overlaps = True

    def __init__(self, truth, log, ran: threading.Event) -> None:
        super().__init__(truth, log)
        self.ran, self.threads = ran, []

    def verify(self, context, draft, beside=None):
        helper = threading.Thread(target=lambda: (self.threads.append(threading.current_thread().name), beside()))
        helper.start()
        if self.m:  # from the second pass on, the beside work holds the previous pass's bookkeeping
            assert self.ran.wait(10), "the previous pass's bookkeeping did not run beside the verify"
        self.ran.clear()
        try:
            return self.verify_pass(context, draft)
        finally:
            helper.join(10)


class Learner(Drafter):
    """Proposes the last token + 1, twice, and a chain it learnt: `learnt` grows only in the deferred part."""

    def __init__(self, log: list[str], beside: threading.Event | None = None) -> None:
        self.log, self.learnt, self.beside = log, [], beside

    def propose(self, context, budget):
        self.log.append(f"propose(learnt={len(self.learnt)})")
        d = Draft()
        d.add_chain([context[-1] + 1, context[-1] + 2], "x", budget)
        if self.learnt:
            d.add_chain(self.learnt[-1][:2], "y", budget)
        return d

    def observe_split(self, context, result):
        self.log.append("now")
        committed = list(result.committed)

        def later():
            self.log.append("later")
            self.learnt.append(committed)
            if self.beside is not None:
                self.beside.set()

        return later


TRUTH = [11, 12, 5, 6, 7, 1, 2]  # from the prompt [10]: passes commit 11 12 5 | 6 7 1 | 2


def test_the_loop_runs_the_previous_pass_bookkeeping_beside_the_next_verify():
    log: list[str] = []
    run = speculate(Learner(log), Truth(TRUTH, log), [10], 4)
    # pass 1 proposes 11, 12 (accepted, bonus 5); pass 2 proposes before pass 1's bookkeeping ran (learnt=0)
    assert log[:8] == ["propose(learnt=0)", "verify1", "now",
                       "propose(learnt=0)", "later", "verify4", "now", "propose(learnt=1)"]
    assert log[-1] == "later" and log.count("later") == log.count("now") == len(run.cycles)
    assert [c.committed for c in run.cycles] == [3, 3, 1]
    # what pass 1 taught (deferred) reaches pass 3's draft, not pass 2's
    assert [c.node_sources for c in run.cycles] == [{"x": 2}, {"x": 2}, {"x": 2, "y": 2}]
    # serial: verify_s leaves the beside work out; it is counted apart
    assert all(c.beside_s >= 0 and c.verify_s >= 0 for c in run.cycles)


def test_an_overlapping_verifier_gives_the_same_passes_with_the_bookkeeping_beside_it():
    serial_log: list[str] = []
    serial = speculate(Learner(serial_log), Truth(TRUTH, serial_log), [10], 4)
    ran = threading.Event()
    log: list[str] = []
    verifier = ThreadTruth(TRUTH, log, ran)
    overlapped = speculate(Learner(log, ran), verifier, [10], 4)
    assert log == serial_log  # the verify waits for the beside work: the same order on the host
    assert all(name != threading.current_thread().name for name in verifier.threads)
    key = [(c.nodes, c.accepted, c.committed, c.sources) for c in serial.cycles]
    assert [(c.nodes, c.accepted, c.committed, c.sources) for c in overlapped.cycles] == key


def test_the_model_verifier_runs_the_beside_work_on_its_helper_thread(stories):
    from data.capture.models import LayerTap
    from decoder.verify.engine import ModelVerifier, stop_rule

    stop = stop_rule(stories, (), 12)
    prompt = stories.tokenizer.encode("Once upon a time")
    tap = LayerTap(stories.model, stories.layer)
    try:
        results = {}
        for overlap in (False, True):
            v = ModelVerifier(stories, tap, stop, overlap)
            threads = []
            verify_pass = v.verify_pass
            v.verify_pass = lambda c, d: (threads.append(threading.current_thread().name), verify_pass(c, d))[1]
            v.start(prompt)
            draft = Draft([5, 6, 7], [-1, 0, -1], [{"x"}] * 3)
            results[overlap] = v.verify(list(prompt), draft, lambda: threads.append(threading.current_thread().name))
            v.close()
            # the forward on the calling thread; the beside work before it, or on the helper thread
            if overlap:
                assert threads[0] != "MainThread" or threads[1] != "MainThread"
                assert sorted(t.split("_")[0] for t in threads) == ["MainThread", "oilbird-beside"]
            else:
                assert threads == ["MainThread", "MainThread"]
        a, b = results[False], results[True]
        assert a.accepted_nodes == b.accepted_nodes and a.committed == b.committed
        assert (a.argmax == b.argmax).all() and np.allclose(a.hidden, b.hidden)
    finally:
        tap.close()


def test_oilbird_defers_only_what_the_next_propose_may_lack(stories, tmp_path):
    """Live oilbird with the bookkeeping beside the verify and before it (arm+serial), eager: lossless, the same
    passes, and the deferred work counted (beside_s) where it ran."""
    from decoder.live.harness import DecodeConfig, run_decode

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    out = run_decode(DecodeConfig(bench=bench, model="stories260k", arms=("ar", "oilbird", "oilbird+serial"),
                                  max_new_tokens=40, out=str(tmp_path / "runs"), progress=False, verifier="eager",
                                  overlap="on"),
                     lm=stories)
    on, off = out["oilbird"], out["oilbird+serial"]
    for s in (on, off):
        assert s["lossless"]["lossless"] and s["lossless"]["matched"] == 3
    assert on["verifier"] == {"kind": "eager", "overlap": True}
    assert off["verifier"] == {"kind": "eager", "overlap": False}
    assert on["passes"] == off["passes"] and on["tau"] == off["tau"]
    assert on["accepted_by_source"] == off["accepted_by_source"]
    assert on["time"]["beside_s"] > 0 and off["time"]["beside_s"] > 0
    import pyarrow.parquet as pq

    cycles = pq.read_table(f"{on['decode_dir']}/oilbird/cycles.parquet")
    assert "beside_s" in cycles.column_names and sum(cycles["beside_s"].to_pylist()) == pytest.approx(on["time"]["beside_s"])


def test_serial_suffix_is_refused_for_the_references(tmp_path, capsys):
    from decoder.__main__ import main

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:1])
    assert main(["--bench", bench, "--model", "stories260k", "--arms", "ar,ar+serial", "--quiet",
                 "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: arm 'ar+serial': ar verifies no draft") and "\n" not in err
    with pytest.raises(SystemExit) as e:  # argparse's choices: its usage and one error line
        main(["--bench", bench, "--model", "stories260k", "--overlap", "sideways", "--quiet"])
    assert e.value.code == 2 and "argument --overlap: invalid choice: 'sideways'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_overlap_resolves_by_device():
    from data.errors import OilbirdError
    from decoder.verify.graph import resolve_overlap

    assert resolve_overlap("auto", "cpu") is False and resolve_overlap("auto", "cuda") is True
    assert resolve_overlap("on", "cpu") is True and resolve_overlap("off", "cuda") is False
    with pytest.raises(OilbirdError, match="--overlap must be on, off or auto"):
        resolve_overlap("yes", "cpu")
