"""The lossless audit per dtype (decoder/verify/audit.py): exact-array tests of the classifier, float32 exact
on stories260k, bfloat16 with every mismatch numeric, and a planted acceptance bug classified
algorithmic."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import decoder.verify.engine as engine
from data.capture.models import load_model
from decoder.verify.audit import ALGORITHMIC, NUMERIC, NUMERIC_MARGIN, classify, lossless_audit
from decoder.live.harness import DecodeConfig, run_decode
from decoder.loop import Generation
from tests.conftest import STORIES, STORY_PROMPTS, write_jsonl

IDS = np.array([5, 7, 1, 2, 3, 4, 6, 8])


def _row(*logits):
    return np.array(logits + (0.0,) * (8 - len(logits)), dtype=np.float32)


def test_classify_near_tie_is_numeric():
    # the reference prefers 5 over 7 by 0.1; the arm's row prefers 7 over 5 by 0.05 and committed 7
    out = classify(5, IDS, _row(10.0, 9.9), 7, np.array([7, 5, 1, 2, 3, 4, 6, 8]), _row(10.0, 9.95), 0.5)
    assert out["kind"] == NUMERIC and out["arm_chose_own_argmax"]
    assert out["margin"] == pytest.approx(0.1, abs=1e-5) and out["ref_margin"] == pytest.approx(0.1, abs=1e-5)
    assert out["arm_margin"] == pytest.approx(0.05, abs=1e-5)


def test_classify_large_gap_is_algorithmic():
    # the same swap, but the reference preferred 5 by 3.0: beyond bfloat16 rounding
    out = classify(5, IDS, _row(12.9, 9.9), 7, np.array([7, 5, 1, 2, 3, 4, 6, 8]), _row(10.0, 9.95), 0.5)
    assert out["kind"] == ALGORITHMIC and out["margin"] == pytest.approx(3.0, abs=1e-5)


def test_classify_token_not_the_arms_argmax_is_algorithmic():
    # the arm committed 7 while its own row ranks 5 first: an acceptance bug, however small the gap
    out = classify(5, IDS, _row(10.0, 9.99), 7, IDS, _row(10.0, 9.99), 0.5)
    assert out["kind"] == ALGORITHMIC and not out["arm_chose_own_argmax"]


def test_classify_token_outside_top8_is_algorithmic():
    out = classify(5, IDS, _row(10.0, 9.9), 99, np.array([99, 5, 1, 2, 3, 4, 6, 8]), _row(10.0, 9.9), 0.5)
    assert out["kind"] == ALGORITHMIC and out["margin"] is None


def _gen(tokens, ids=None, logits=None):
    n = len(tokens)
    return Generation(tokens=list(tokens), stop_reason="length", seconds=0.0, prefill_s=0.0, cycles=[],
                      chosen_ids=np.tile(IDS, (n, 1)) if ids is None else ids,
                      chosen_logits=np.tile(_row(10.0, 9.9), (n, 1)) if logits is None else logits)


def test_audit_counts_and_prefix_stop():
    ref = [_gen([5, 5, 5]), _gen([5, 5, 5]), _gen([5, 5, 5])]
    near = _gen([5, 7, 1], ids=np.tile(np.array([7, 5, 1, 2, 3, 4, 6, 8]), (3, 1)),
                logits=np.tile(_row(10.0, 9.95), (3, 1)))
    shorter = _gen([5, 5])  # equal tokens, an earlier stop: never numerics
    audit = lossless_audit([_gen([5, 5, 5]), near, shorter], ref, ["a", "b", "c"], "bfloat16")
    assert (audit["matched"], audit["numeric"], audit["algorithmic"]) == (1, 1, 1)
    assert not audit["lossless"] and audit["numeric_threshold"] == NUMERIC_MARGIN["bfloat16"]
    kinds = {m["id"]: (m["kind"], m["first_diff"]) for m in audit["mismatches"]}
    assert kinds == {"b": (NUMERIC, 1), "c": (ALGORITHMIC, 2)}
    # the same near tie in float32 is beyond its rounding
    assert lossless_audit([near], ref[:1], ["b"], "float32")["algorithmic"] == 1


# ------------------------------------------------------------------ end to end on stories260k

ARMS = ("ar", "lexical", "oilbird")


def _serve(tmp_path, lm, arms=ARMS, n=6, max_new=48):
    bench = write_jsonl(tmp_path / "bench.jsonl", (STORY_PROMPTS * 2)[:n])
    cfg = DecodeConfig(bench=bench, model="stories260k", arms=arms, max_new_tokens=max_new,
                       out=str(tmp_path / "runs"), nodes=20, progress=False)
    return run_decode(cfg, lm=lm)


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_float32_exact(stories, tmp_path, one_thread):
    with warnings.catch_warnings():  # the KV cache goes by the keyword this transformers takes (cache_kwargs)
        warnings.filterwarnings("error", message=".*past_key_values.*")
        summaries = _serve(tmp_path, stories)
    for arm, s in summaries.items():
        audit = s["lossless"]
        assert audit["dtype"] == "float32" and audit["lossless"], (arm, audit["mismatches"])
        assert (audit["numeric"], audit["algorithmic"]) == (0, 0)


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_bfloat16_mismatches_are_numeric(tmp_path, one_thread):
    lm = load_model("stories260k", dtype="bfloat16")
    summaries = _serve(tmp_path, lm)
    mismatches = 0
    for arm, s in summaries.items():
        audit = s["lossless"]
        assert audit["dtype"] == "bfloat16" and audit["algorithmic"] == 0, (arm, audit["mismatches"])
        assert audit["numeric"] == audit["requests"] - audit["matched"]
        for m in audit["mismatches"]:
            assert m["kind"] == NUMERIC and m["arm_chose_own_argmax"]
            assert 0 <= m["margin"] <= audit["numeric_threshold"]
        mismatches += audit["numeric"]
    assert mismatches > 0  # these prompts do flip in bfloat16: the classifier is exercised, not skipped


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_planted_acceptance_bug_is_algorithmic(stories, tmp_path, one_thread, monkeypatch):
    true_accept = engine.greedy_accept

    def accept_one_more(tokens, parents, argmax):
        """The bug: also accept the first child of the last accepted node (or of the root), agreeing or not."""
        accepted, bonus = true_accept(tokens, parents, argmax)
        last = accepted[-1] if accepted else -1
        child = next((i for i, p in enumerate(parents) if p == last), None)
        if child is None:
            return accepted, bonus
        return accepted + [child], int(argmax[child + 1])

    monkeypatch.setattr(engine, "greedy_accept", accept_one_more)
    summaries = _serve(tmp_path, stories, arms=("ar", "lexical"))
    audit = summaries["lexical"]["lossless"]
    assert audit["algorithmic"] > 0 and audit["numeric"] == 0, audit["mismatches"]
    assert all(not m["arm_chose_own_argmax"] for m in audit["mismatches"] if m["margin"] is not None)


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_bench_numerics_rescores_the_greedy_tokens(stories, one_thread):
    """make bench-numerics' tree re-scoring (chains of 2, 8, 32, 60 nodes) gives, row for row, the logits
    of one plain forward over prompt + tokens: it measures numerics, not a shifted context."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_numerics import rescore

    prompt = stories.tokenizer.encode(STORY_PROMPTS[0])
    tokens = [int(t) for t in torch.randint(3, stories.vocab_size, (110,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        full = stories.model(input_ids=torch.tensor([prompt + tokens])).logits[0].float().numpy()
    rows = rescore(stories, prompt, tokens)
    assert rows.shape == (len(tokens), stories.vocab_size)
    np.testing.assert_allclose(rows, full[len(prompt) - 1:-1], atol=1e-4)
