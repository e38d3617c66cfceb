"""Capture and the trace store: greedy equality, stored states and top-k, resume, bad input."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data.__main__ import main as data_main
from data.capture.greedy import PrefixCache, greedy_batch
from data.capture.models import (
    LayerTap,
    default_capture_layer,
    encode_prompt,
    load_model,
)
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.reader import open_store
from tests.conftest import STORY_PROMPTS, crash_on_call, write_jsonl


def _cfg(bench, out, **kw):
    return CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=kw.pop("max_new_tokens", 40),
                         progress=False, **kw)


def _fresh_forward(lm, prompt, output):
    with LayerTap(lm.model, lm.layer) as tap, torch.no_grad():
        logits = lm.model(torch.tensor([prompt + output])).logits[0]
        states = tap.take()[0]
    return states.numpy(), logits.topk(8).indices.numpy()


def test_capture_layer_default():
    assert [default_capture_layer(n) for n in (1, 5, 30, 32, 36)] == [1, 4, 26, 27, 31]


def test_stored_tokens_states_topk_match_generate(stories, tmp_path):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:4])
    path = capture(_cfg(bench, tmp_path / "runs"), lm=stories)
    st = open_store(path, model_fingerprint=stories.fingerprint, d_model=stories.d_model)
    assert st.n_requests == 4 and st.meta["complete"] and st.meta["layer"] == 4
    for r in range(st.n_requests):
        prompt, out = st.prompt(r), st.tokens(r).tolist()
        assert prompt == encode_prompt(stories, [{"role": "user", "content": STORY_PROMPTS[r]}])
        ref = stories.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                                     eos_token_id=sorted(stories.eos_ids), pad_token_id=0)[0, len(prompt):].tolist()
        assert out == ref
        states, topk = _fresh_forward(stories, prompt, out)
        rows = slice(st.offsets[r], st.offsets[r + 1])
        valid = st.hidden_valid[rows]
        assert valid.sum() == len(out) - 1 and not valid[-1]  # the last token is never fed back
        p = len(prompt)
        want = states[p:p + len(out)][valid].astype(np.float16)
        np.testing.assert_allclose(st.hidden[rows][valid].astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(st.topk[rows][valid], topk[p:p + len(out)][valid])
        np.testing.assert_allclose(st.prompt_last_hidden[r].astype(np.float32), states[p - 1], rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(st.prompt_last_topk[r], topk[p - 1])
        assert st.prompt_last_topk[r][0] == out[0]  # the prompt's top-1 is the first generated token


@pytest.mark.parametrize("kind", ["stories", "llama", "qwen2"])
def test_batched_equals_batch1(kind, stories, tiny_dirs):
    lm = stories if kind == "stories" else load_model(tiny_dirs[kind])
    prompts = [lm.tokenizer(t)["input_ids"] for t in STORY_PROMPTS]
    with LayerTap(lm.model, lm.layer) as tap:
        free = [greedy_batch(lm, tap, [p], 30)[0] for p in prompts]
        # an extra stop token seen mid-output makes rows finish at different steps, so new rows join mid-batch
        early = dataclasses.replace(lm, eos_ids=lm.eos_ids | {free[1].tokens[5]})
        for model in (lm, early):
            single = [greedy_batch(model, tap, [p], 30)[0] for p in prompts]
            for width in (3, len(prompts)):
                _assert_same(single, greedy_batch(model, tap, prompts, 30, batch_size=width))
    assert len({len(g.tokens) for g in single}) > 1


def test_continuous_batching_reuses_and_grows_rows(stories, monkeypatch):
    """Both ways a request joins the batch: written into a finished request's row, and, when its
    prompt is longer than the batch, by left-padding the others; tokens still equal batch 1."""
    import data.capture.greedy as greedy

    kinds, real = [], greedy._admit

    def spy(cache, mask, row_cache, row_len, slot):
        if cache is not None:
            kinds.append("into free row" if slot is not None and row_len <= mask.shape[1] else "left-pad")
        return real(cache, mask, row_cache, row_len, slot)

    monkeypatch.setattr(greedy, "_admit", spy)
    text = [stories.tokenizer(t)["input_ids"] for t in STORY_PROMPTS]
    prompts = [text[0][:3], text[1][:4], text[2] + text[3] + text[4], text[3][:5], text[4][:3], text[0] + text[1] + text[2]]
    with LayerTap(stories.model, stories.layer) as tap:
        free = [greedy_batch(stories, tap, [p], 24)[0] for p in prompts]
        early = dataclasses.replace(stories, eos_ids=stories.eos_ids | {free[0].tokens[4], free[3].tokens[9]})
        single = [greedy_batch(early, tap, [p], 24)[0] for p in prompts]
        kinds.clear()
        _assert_same(single, greedy_batch(early, tap, prompts, 24, batch_size=2))
    assert len({len(g.tokens) for g in single}) > 2
    assert {"into free row", "left-pad"} <= set(kinds), kinds


def _assert_same(single, batch):
    for s, b in zip(single, batch):
        assert s.tokens == b.tokens and s.stop_reason == b.stop_reason
        np.testing.assert_array_equal(s.topk, b.topk)
        np.testing.assert_allclose(s.hidden, b.hidden, atol=1e-4)


def test_capture_batched_store_equals_batch1_store(stories, tmp_path):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS)
    b = open_store(capture(_cfg(bench, tmp_path / "b", batch_size=4, max_new_tokens=60), lm=stories))
    a = open_store(capture(_cfg(bench, tmp_path / "a2", max_new_tokens=60, prefix_reuse=False), lm=stories))
    assert a.positions.equals(b.positions)
    assert a.requests["output_tokens"].to_list() == b.requests["output_tokens"].to_list()
    np.testing.assert_array_equal(a.topk, b.topk)


def test_prefix_reuse_equals_fresh_prefill(stories, tmp_path):
    prompts = STORY_PROMPTS[:3] + [STORY_PROMPTS[0] + " She had a cat.", STORY_PROMPTS[0] + " She had a dog named Max."]
    bench = write_jsonl(tmp_path / "b.jsonl", prompts)
    with LayerTap(stories.model, stories.layer) as tap:
        prefix = PrefixCache()
        encoded = [stories.tokenizer(p)["input_ids"] for p in prompts]
        reused_direct = greedy_batch(stories, tap, encoded, 40, (), prefix, batch_size=1)
        assert prefix.reused_tokens >= 2 * len(encoded[0]) - 2  # requests 2, 3 and 4 reuse request 0's start
        assert [g.tokens for g in reused_direct] == [g.tokens for g in greedy_batch(stories, tap, encoded, 40, batch_size=1)]
    fresh = open_store(capture(_cfg(bench, tmp_path / "a", prefix_reuse=False), lm=stories))
    reused = open_store(capture(_cfg(bench, tmp_path / "b", prefix_reuse=True), lm=stories))
    assert fresh.positions.equals(reused.positions)
    np.testing.assert_array_equal(fresh.topk, reused.topk)
    np.testing.assert_allclose(fresh.hidden.astype(np.float32), reused.hidden.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(fresh.prompt_last_hidden.astype(np.float32),
                               reused.prompt_last_hidden.astype(np.float32), atol=2e-3)


def test_generate_records_prompt_tokens_reused(stories, tmp_path, capsys):
    prompts = [STORY_PROMPTS[0], STORY_PROMPTS[0] + " She had a cat named Tom and a big brown dog.", STORY_PROMPTS[1]]
    bench = write_jsonl(tmp_path / "b.jsonl", prompts)
    st = open_store(capture(_cfg(bench, tmp_path / "a", flush_every=1), lm=stories))
    reused = st.meta["prompt_tokens_reused"]
    assert len(reused) == 3 and reused[0] == 0 and reused[2] == 0
    assert 16 <= reused[1] < len(st.prompt(1))
    assert st.prompt(1)[:reused[1]] == st.prompt(0)[:reused[1]]
    off = open_store(capture(_cfg(bench, tmp_path / "b", prefix_cache=0), lm=stories))
    assert off.meta["prompt_tokens_reused"] == [0, 0, 0]
    assert off.positions.equals(st.positions)
    capsys.readouterr()
    assert data_main(["show", str(st.path)]) == 0
    assert f"prompt tokens reused: {reused[1]} of {sum(len(st.prompt(r)) for r in range(3))}" in capsys.readouterr().out


def test_stop_string_cuts_generation(stories, tmp_path):
    with LayerTap(stories.model, stories.layer) as tap:
        prompt = stories.tokenizer(STORY_PROMPTS[0])["input_ids"]
        free = greedy_batch(stories, tap, [prompt], 60)[0]
        text = stories.tokenizer.decode(free.tokens)
        stop = text.split()[3]  # a word the model will produce
        cut = greedy_batch(stories, tap, [prompt], 60, (stop,))[0]
    assert cut.stop_reason == "stop_string"
    assert cut.tokens == free.tokens[:len(cut.tokens)]
    assert stop in stories.tokenizer.decode(cut.tokens) and stop not in stories.tokenizer.decode(cut.tokens[:-1])


def test_resume_after_crash(stories, tmp_path, monkeypatch):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS)
    whole = open_store(capture(_cfg(bench, tmp_path / "whole"), lm=stories))

    import data.capture.greedy as greedy

    real = crash_on_call(monkeypatch, greedy, "_prefill", 4)
    with pytest.raises(KeyboardInterrupt):
        capture(_cfg(bench, tmp_path / "crash", flush_every=2), lm=stories)
    path = next((tmp_path / "crash").rglob("traces"))
    with pytest.raises(OilbirdError, match="incomplete"):
        open_store(path)
    partial = open_store(path, allow_incomplete=True)
    assert partial.n_requests == 2  # two committed, the third lost with the crash

    # A crash between the positions part and the requests.parquet commit leaves an orphan part.
    import data.store.writer as writer_mod

    real_write, state = writer_mod.atomic_write_table, {"n": 0}

    def failing_write(p, table):
        if p.name == "requests.parquet":
            state["n"] += 1
            if state["n"] == 1:
                raise KeyboardInterrupt
        return real_write(p, table)

    monkeypatch.setattr(greedy, "_prefill", real)
    monkeypatch.setattr(writer_mod, "atomic_write_table", failing_write)
    with pytest.raises(KeyboardInterrupt):
        capture(_cfg(bench, tmp_path / "crash", flush_every=2), lm=stories)
    assert len(list(path.glob("positions-*.parquet"))) == 2  # the orphan is on disk
    capture(_cfg(bench, tmp_path / "crash", flush_every=2), lm=stories)
    done = open_store(path)
    assert done.positions.equals(whole.positions)
    assert done.requests["output_tokens"].to_list() == whole.requests["output_tokens"].to_list()
    assert done.requests["request"].to_list() == list(range(len(STORY_PROMPTS)))
    np.testing.assert_array_equal(done.hidden, whole.hidden)


def test_reference_mode_matches_generate(stories, tmp_path):
    bench = write_jsonl(tmp_path / "g.jsonl", STORY_PROMPTS[:3])
    gen = open_store(capture(_cfg(bench, tmp_path / "gen"), lm=stories))
    refs = [stories.tokenizer.decode(gen.tokens(r).tolist(), skip_special_tokens=True) for r in range(3)]
    bench_ref = write_jsonl(tmp_path / "r.jsonl", STORY_PROMPTS[:3], refs)
    ref = open_store(capture(_cfg(bench_ref, tmp_path / "ref", mode="reference"), lm=stories))
    assert ref.meta["mode"] == "reference"
    for r in range(3):
        g, t = gen.tokens(r).tolist(), ref.tokens(r).tolist()
        body = [x for x in g if x not in stories.eos_ids]
        if t[:len(body)] != body:  # decode/encode round trip can differ in rare tokenizations
            continue
        k = len(body) - 1
        rows_g, rows_t = slice(gen.offsets[r], gen.offsets[r] + k), slice(ref.offsets[r], ref.offsets[r] + k)
        np.testing.assert_allclose(gen.hidden[rows_g].astype(np.float32), ref.hidden[rows_t].astype(np.float32), atol=5e-3)
        np.testing.assert_array_equal(gen.topk[rows_g], ref.topk[rows_t])
        assert ref.hidden_valid[ref.offsets[r]:ref.offsets[r + 1]].all()


# ------------------------------------------------------------------ bad input: one line, no traceback

def _cli(argv, capsys):
    code = data_main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def test_unknown_benchmark_one_line(capsys):
    code, err = _cli(["capture", "--bench", "nope", "--model", "stories260k"], capsys)
    assert code == 2 and err.startswith("error: unknown benchmark") and "\n" not in err


def test_empty_benchmark_one_line(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = _cli(["capture", "--bench", f"jsonl:{tmp_path / 'empty.jsonl'}", "--model", "stories260k",
                      "--out", str(tmp_path)], capsys)
    assert code == 2 and "no requests" in err and "\n" not in err
    assert not list(tmp_path.rglob("meta.json"))  # nothing that looks like a store


def test_unknown_model_one_line(tmp_path, capsys):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:1])
    code, err = _cli(["capture", "--bench", bench, "--model", "no-such-model", "--out", str(tmp_path)], capsys)
    assert code == 2 and "no-such-model" in err and "\n" not in err


def test_corrupt_part_and_wrong_model(stories, tiny_dirs, tmp_path, capsys):
    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS[:3])
    path = capture(_cfg(bench, tmp_path / "runs"), lm=stories)
    with pytest.raises(OilbirdError, match="wrong model"):
        open_store(path, model_fingerprint="0" * 16)
    with pytest.raises(OilbirdError, match="wrong model"):
        open_store(path, d_model=576)
    # capturing into the same store with another model refuses (one line) instead of mixing
    other = load_model(tiny_dirs["llama"])
    with pytest.raises(OilbirdError, match="other settings"):
        capture(_cfg(bench, tmp_path / "runs"), lm=type(other)(**{**other.__dict__, "name": "stories260k"}))
    part = next(iter(sorted((tmp_path / "runs").rglob("positions-*.parquet"))))
    part.write_bytes(part.read_bytes()[:100])
    with pytest.raises(OilbirdError, match="corrupt Parquet") as e:
        open_store(path)
    assert "\n" not in str(e.value)
    code, err = _cli(["show", str(path)], capsys)
    assert code == 2 and "corrupt Parquet" in err and "\n" not in err
    # a mismatched schema (wrong d_model column width) is refused too
    table = pq.read_table(next(iter(sorted((tmp_path / "runs").rglob("requests.parquet")))))
    meta_path = next((tmp_path / "runs").rglob("meta.json"))
    meta = json.loads(meta_path.read_text())
    meta["d_model"] = 65
    meta.pop("meta_sha256")  # as in a store written before meta.json was sealed (a sealed one: the seal says so)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="does not match the trace schema"):
        open_store(path)
    assert table.num_rows == 3


def test_missing_store_one_line(tmp_path):
    with pytest.raises(OilbirdError, match="no trace store"):
        open_store(tmp_path / "nothing")
