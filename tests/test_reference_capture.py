"""Reference (teacher-forced) capture with prefix reuse: the prefix cache, logits only where the
store needs them, the per-request reuse record, and prompt + reference against the context.

Every cached result is compared with one full forward over prompt + reference (`teacher_forced`,
the plain path `--prefix-cache 0` keeps): states to float tolerance, top-8 ids exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data.__main__ import main as data_main
from data.capture.models import LayerTap, encode_prompt, load_model
from data.capture.run import CaptureConfig, capture
from data.capture.teacher import (
    ReferencePrefixCache,
    reference_tokens,
    teacher_forced,
    teacher_forced_cached,
)
from data.errors import OilbirdError
from data.store.reader import open_store
from data.store.verify import verify_store
from tests.conftest import crash_on_call

SYS_A = ("You are the librarian of a small town. You know every book on the shelves and you answer in "
         "short, kind sentences. Never invent a title.")
SYS_B = ("Zebra keepers at the city zoo write their daily notes here: feeding times, the weather, "
         "and which animal looked tired or hungry today.")
TURNS_A = [("Do you have a book about cats?", "Yes, we have three books about cats on the second shelf."),
           ("Which one is the shortest?", "The shortest one is called Little Cat and it has ten pages."),
           ("Can I take it home today?", "Yes, you can keep it for two weeks.")]
TURNS_B = [("What did the zebras eat this morning?", "They ate hay and some fresh apples at eight."),
           ("Was anyone tired?", "The old zebra slept in the sun after lunch."),
           ("And the weather?", "It was warm and dry all day.")]


def _lm(kind, stories, tiny_dirs):
    return stories if kind == "stories" else load_model(tiny_dirs[kind])


def _conversation(lm, system, turns):
    """Token-level replay of one conversation turn by turn: request k's prompt is request k-1's
    prompt + reference + the next user turn (how a served agent's requests repeat the history)."""
    tok = lambda text: lm.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [sorted(lm.eos_ids)[0]]
    bos = [lm.tokenizer.bos_token_id] if lm.tokenizer.bos_token_id is not None else []
    out, history = [], bos + tok(system)
    for user, answer in turns:
        prompt = history + tok(" User: " + user + " Assistant:")
        ref = tok(answer) + eos
        out.append((prompt, ref))
        history = prompt + ref
    return out


def _assert_equal_to_full_forward(got, want, atol=1e-4):
    assert got.tokens == want.tokens and got.stop_reason == want.stop_reason == "reference"
    assert got.hidden.shape == want.hidden.shape and got.hidden_valid.all()
    np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-4, atol=atol)
    np.testing.assert_allclose(got.prompt_last_hidden, want.prompt_last_hidden, rtol=1e-4, atol=atol)
    np.testing.assert_array_equal(got.topk, want.topk)
    np.testing.assert_array_equal(got.prompt_last_topk, want.prompt_last_topk)


@pytest.mark.parametrize("kind", ["stories", "llama", "qwen2"])
def test_interleaved_conversations_hit_and_equal_a_full_forward(kind, stories, tiny_dirs, one_thread):
    """A1 B1 A2 B2 A3 B3, then B3 again: A2 shares its prefix with A1, two requests back, and each
    later turn with its conversation's previous turn; the repeat reuses all but its last prompt token."""
    lm = _lm(kind, stories, tiny_dirs)
    conv_a, conv_b = _conversation(lm, SYS_A, TURNS_A), _conversation(lm, SYS_B, TURNS_B)
    traffic = [conv_a[0], conv_b[0], conv_a[1], conv_b[1], conv_a[2], conv_b[2], conv_b[2]]
    seq_len = [len(p) + len(o) for p, o in traffic]
    assert ReferencePrefixCache().min_reuse > 1  # A and B share their BOS only: below the reuse threshold
    with LayerTap(lm.model, lm.layer) as tap:
        full = [teacher_forced(lm, tap, p, o) for p, o in traffic]
        cache = ReferencePrefixCache(entries=4)
        cached = [teacher_forced_cached(lm, tap, p, o, cache) for p, o in traffic]
        logits_only = [teacher_forced_cached(lm, tap, p, o, None) for p, o in traffic]
        previous_only = ReferencePrefixCache(entries=1)
        reuse_prev = [teacher_forced_cached(lm, tap, p, o, previous_only).prompt_tokens_reused for p, o in traffic]
    reused = [g.prompt_tokens_reused for g in cached]
    # request k of a conversation reuses all of request k-1's prompt + reference (stored two requests back)
    assert reused == [0, 0, seq_len[0], seq_len[1], seq_len[2], seq_len[3], len(traffic[6][0]) - 1], reused
    assert cache.hits == 5 and cache.reused_tokens == sum(reused)
    assert reuse_prev[2] == 0 and reuse_prev[6] > 0  # a cache of the previous request alone misses A2
    for got, want in zip(cached, full):
        _assert_equal_to_full_forward(got, want)
    for got, want in zip(logits_only, full):
        assert got.prompt_tokens_reused == 0
        _assert_equal_to_full_forward(got, want)


def test_shared_with_two_back_not_a_conversation_chain(stories, one_thread):
    """A request whose prompt shares a long start with the request two back (and nothing with the
    previous one), and whose reference differs: the reuse stops at the shared prefix."""
    lm = stories
    tok = lambda text: lm.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [sorted(lm.eos_ids)[0]]
    bos = [lm.tokenizer.bos_token_id]
    head = bos + tok(SYS_A)
    traffic = [(head + tok(" User: Tell me a story about a dog."), tok("A dog ran to the park.") + eos),
               (bos + tok(SYS_B), tok("The zebras are fine.") + eos),
               (head + tok(" User: Tell me a story about a frog."), tok("A frog sat on a log.") + eos)]
    shared = next(i for i, (a, b) in enumerate(zip(traffic[0][0], traffic[2][0])) if a != b)
    assert shared >= 16
    with LayerTap(lm.model, lm.layer) as tap:
        full = [teacher_forced(lm, tap, p, o) for p, o in traffic]
        cache = ReferencePrefixCache(entries=3)
        cached = [teacher_forced_cached(lm, tap, p, o, cache) for p, o in traffic]
    assert [g.prompt_tokens_reused for g in cached] == [0, 0, shared]
    for got, want in zip(cached, full):
        _assert_equal_to_full_forward(got, want)


def test_prefix_cache_bounds_and_entries_never_change(stories, one_thread):
    lm = stories
    conv_a, conv_b = _conversation(lm, SYS_A, TURNS_A), _conversation(lm, SYS_B, TURNS_B)
    with LayerTap(lm.model, lm.layer) as tap:
        cache = ReferencePrefixCache(entries=2)
        teacher_forced_cached(lm, tap, *conv_a[0], cache)
        assert len(cache) == 1
        teacher_forced_cached(lm, tap, *conv_a[1], cache)  # A1's tokens are a prefix of A2's: A1 is dropped
        assert len(cache) == 1 and len(cache._entries[0].tokens) == sum(map(len, conv_a[1]))
        teacher_forced_cached(lm, tap, *conv_b[0], cache)
        assert len(cache) == 2
        a2 = cache._entries[0]
        assert len(a2.tokens) == sum(map(len, conv_a[1]))
        snapshot = [(k.clone(), v.clone()) for k, v in a2.kv]
        got = teacher_forced_cached(lm, tap, *conv_a[2], cache)  # reuses A2's entry
        assert got.prompt_tokens_reused == sum(map(len, conv_a[1]))
        for (k, v), (k0, v0) in zip(a2.kv, snapshot):  # the entry was read, never written
            assert torch.equal(k, k0) and torch.equal(v, v0)
        # A3's entry starts with a copy of A2's, which it replaces (A2's tokens are a prefix of A3's)
        assert all(e is not a2 for e in cache._entries)
        for (k, v), (k0, v0) in zip(cache._entries[-1].kv, snapshot):
            assert torch.equal(k[:, :, :k0.shape[2]], k0) and torch.equal(v[:, :, :v0.shape[2]], v0)
        assert len(cache) == 2 and cache.nbytes == sum(e.nbytes for e in cache._entries) <= cache.peak_bytes
        # LRU: a third conversation evicts the least recently used entry (B1)
        conv_c = _conversation(lm, "Rain fell on the quiet village all night long, and the river rose.",
                               TURNS_A[:1])
        teacher_forced_cached(lm, tap, *conv_c[0], cache)
        held = [len(e.tokens) for e in cache._entries]
        assert held == [sum(map(len, conv_a[2])), sum(map(len, conv_c[0]))]
        assert teacher_forced_cached(lm, tap, *conv_b[1], cache).prompt_tokens_reused == 0  # B1 was evicted
        # the memory bound: an entry larger than the budget is not kept
        tiny = ReferencePrefixCache(entries=4, max_mb=1e-6)
        teacher_forced_cached(lm, tap, *conv_a[0], tiny)
        assert len(tiny) == 0 and tiny.peak_bytes == 0
    with pytest.raises(ValueError):
        ReferencePrefixCache(entries=0)


# ------------------------------------------------------------------ capture end to end

def _write_conversations(path, conversations, order):
    """jsonl with the messages of each conversation's turns, replayed in `order` ((conv, turn) pairs)."""
    with open(path, "w") as f:
        for c, t in order:
            system, turns = conversations[c]
            msgs = [{"role": "system", "content": system}]
            for user, answer in turns[:t]:
                msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            msgs.append({"role": "user", "content": turns[t][0]})
            f.write(json.dumps({"id": f"{c}{t}", "group": c, "messages": msgs, "reference": turns[t][1]}) + "\n")
    return f"jsonl:{path}"


INTERLEAVED = [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]


def _cfg(bench, out, **kw):
    return CaptureConfig(bench=bench, model="stories260k", out=str(out), mode="reference", progress=False, **kw)


@pytest.fixture
def conv_bench(tmp_path):
    return _write_conversations(tmp_path / "conv.jsonl", {"A": (SYS_A, TURNS_A), "B": (SYS_B, TURNS_B)}, INTERLEAVED)


def test_capture_reference_with_prefix_cache_equals_plain_path(stories, conv_bench, tmp_path, capsys, one_thread):
    plain = open_store(capture(_cfg(conv_bench, tmp_path / "plain", prefix_cache=0), lm=stories))
    cached = open_store(capture(_cfg(conv_bench, tmp_path / "cached", flush_every=2), lm=stories))
    assert cached.positions.equals(plain.positions)
    timing = ["seconds", "finished_at"]  # wall times: when each request ran and was committed
    assert cached.requests.drop(timing).equals(plain.requests.drop(timing))
    np.testing.assert_array_equal(cached.topk, plain.topk)
    np.testing.assert_array_equal(cached.prompt_last_topk, plain.prompt_last_topk)
    np.testing.assert_allclose(cached.hidden.astype(np.float32), plain.hidden.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(cached.prompt_last_hidden.astype(np.float32),
                               plain.prompt_last_hidden.astype(np.float32), atol=2e-3)
    # the per-request record: the plain path reuses nothing; the cache serves every later turn
    assert plain.meta["prompt_tokens_reused"] == [0] * 6
    reused = cached.meta["prompt_tokens_reused"]
    lens = [len(cached.prompt(r)) for r in range(6)]
    assert len(reused) == 6 and reused[:2] == [0, 0]
    assert all(lens[r] // 2 < reused[r] < lens[r] for r in range(2, 6)), (reused, lens)
    assert [r["prefix_cache"] for r in cached.meta["runs"]] == [4] and plain.meta["runs"][0]["prefix_cache"] == 0
    assert verify_store(cached.path).startswith("OK")
    capsys.readouterr()
    assert data_main(["show", str(cached.path)]) == 0
    shown = capsys.readouterr().out
    pct = 100.0 * sum(reused) / sum(lens)
    assert f"prompt tokens reused: {sum(reused)} of {sum(lens)} ({pct:.1f}%" in shown
    assert "4 of 6 requests reused an earlier prefix" in shown


def test_reference_resume_keeps_the_reuse_record_aligned(stories, conv_bench, tmp_path, monkeypatch, one_thread):
    whole = open_store(capture(_cfg(conv_bench, tmp_path / "whole"), lm=stories))
    import data.capture.run as cap

    real = crash_on_call(monkeypatch, cap, "teacher_forced_cached", 4)
    with pytest.raises(KeyboardInterrupt):
        capture(_cfg(conv_bench, tmp_path / "crash", flush_every=2), lm=stories)
    path = next((tmp_path / "crash").rglob("traces"))
    partial = open_store(path, allow_incomplete=True)
    assert partial.n_requests == 2 and partial.meta["prompt_tokens_reused"] == [0, 0]
    monkeypatch.setattr(cap, "teacher_forced_cached", real)
    done = open_store(capture(_cfg(conv_bench, tmp_path / "crash", flush_every=2), lm=stories))
    assert done.positions.equals(whole.positions)
    np.testing.assert_array_equal(done.topk, whole.topk)
    np.testing.assert_allclose(done.hidden.astype(np.float32), whole.hidden.astype(np.float32), atol=2e-3)
    reused = done.meta["prompt_tokens_reused"]
    # the resumed run starts with an empty cache: requests 2 and 3 (second turns) find nothing to reuse,
    # the third turns reuse the second turns' entries as in the uninterrupted run
    assert len(reused) == 6 and reused[:4] == [0, 0, 0, 0] and reused[4:] == whole.meta["prompt_tokens_reused"][4:]
    assert all(r > 0 for r in whole.meta["prompt_tokens_reused"][2:])
    assert [(r["requests_from"], r["requests_to"]) for r in done.meta["runs"]] == [(0, 2), (2, 6)]
    assert verify_store(done.path).startswith("OK")


def test_store_without_the_reuse_record_stays_readable_and_extends(stories, conv_bench, tmp_path, capsys, one_thread):
    path = capture(_cfg(conv_bench, tmp_path / "old", limit=3), lm=stories)
    meta_path = next((tmp_path / "old").rglob("meta.json"))
    meta = json.loads(meta_path.read_text())
    del meta["prompt_tokens_reused"]  # as a store captured before the record existed
    meta_path.write_text(json.dumps(meta))
    assert open_store(path).n_requests == 3 and verify_store(path).startswith("OK")
    capsys.readouterr()
    assert data_main(["show", str(path)]) == 0
    assert "prompt tokens reused: not recorded" in capsys.readouterr().out
    done = open_store(capture(_cfg(conv_bench, tmp_path / "old"), lm=stories))  # a larger limit extends it
    reused = done.meta["prompt_tokens_reused"]
    assert len(reused) == 6 and reused[:3] == [None] * 3 and all(isinstance(r, int) for r in reused[3:])
    assert verify_store(done.path).startswith("OK")
    assert data_main(["show", str(done.path)]) == 0
    assert "3 request(s) captured before the record" in capsys.readouterr().out
    # a record that does not match the rows is damage
    meta = json.loads(meta_path.read_text())
    meta["prompt_tokens_reused"] = reused[:5]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(OilbirdError, match="prompt_tokens_reused"):
        verify_store(done.path)


def test_prompt_plus_reference_longer_than_the_context(stories, tmp_path, capsys, one_thread):
    def prompt_len(text):
        return len(encode_prompt(stories, [{"role": "user", "content": text}]))

    reps = 1
    while prompt_len("the cat sat on the mat. " * (reps + 1)) <= 470:
        reps += 1
    prompt_text, ref_text = "the cat sat on the mat. " * reps, "the dog ran to the park and back. " * 8
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": prompt_text, "reference": ref_text}) + "\n"
                    + json.dumps({"id": "short", "prompt": "Once upon a time", "reference": "there was a cat."}) + "\n")
    bench = f"jsonl:{path}"
    p = encode_prompt(stories, [{"role": "user", "content": prompt_text}])
    ref = stories.tokenizer(ref_text, add_special_tokens=False)["input_ids"]
    assert len(p) < stories.context < len(p) + len(ref) + 1  # the prompt alone fits; with its reference not
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, tmp_path / "runs"), lm=stories)
    msg = str(e.value)
    assert msg.startswith("request long: the prompt is") and "context of 512 positions" in msg
    assert "reference" in msg and "--truncate left" in msg and "\n" not in msg
    assert not list((tmp_path / "runs").rglob("meta.json"))  # refused before anything is written
    st = open_store(capture(_cfg(bench, tmp_path / "runs", truncate="left"), lm=stories))
    assert "truncated 1 prompt(s)" in capsys.readouterr().err
    n_ref = len(ref) + 1  # with EOS
    assert st.meta["truncated"] == {"long": len(p)}
    assert len(st.prompt(0)) + n_ref == 512 and st.prompt(0)[0] == stories.tokenizer.bos_token_id
    assert st.tokens(0).tolist() == ref + [sorted(stories.eos_ids)[0]]
    # a reference that alone fills the context leaves no room: refused with one line
    path.write_text(json.dumps({"id": "huge", "prompt": "Hi", "reference": ref_text * 12}) + "\n")
    with pytest.raises(OilbirdError, match="huge's reference is .* no room"):
        capture(_cfg(bench, tmp_path / "runs2", truncate="left"), lm=stories)


def test_no_reference_is_refused_before_the_store(stories, tmp_path):
    path = tmp_path / "noref.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n")
    with pytest.raises(OilbirdError, match="no reference output"):
        capture(_cfg(f"jsonl:{path}", tmp_path / "runs"), lm=stories)
    assert not list((tmp_path / "runs").rglob("meta.json"))


def test_cli_prefix_cache_flags(stories, conv_bench, tmp_path, capsys, monkeypatch):
    import data.capture.run as cap

    seen = {}
    real = cap.capture

    def spy(cfg, lm=None):
        seen["cfg"] = cfg
        return real(cfg, lm=stories)

    monkeypatch.setattr(cap, "capture", spy)
    out = tmp_path / "runs"
    assert data_main(["capture", "--bench", conv_bench, "--model", "stories260k", "--mode", "reference",
                      "--out", str(out), "--quiet", "--prefix-cache", "0"]) == 0
    assert seen["cfg"].prefix_cache == 0 and not seen["cfg"].prefix_reuse
    assert data_main(["capture", "--bench", conv_bench, "--model", "stories260k", "--mode", "reference",
                      "--out", str(tmp_path / "b"), "--quiet", "--prefix-cache", "2", "--prefix-cache-mb", "64"]) == 0
    assert seen["cfg"].prefix_cache == 2 and seen["cfg"].prefix_cache_mb == 64 and seen["cfg"].prefix_reuse
    capsys.readouterr()
    code = data_main(["capture", "--bench", conv_bench, "--model", "stories260k", "--mode", "reference",
                      "--out", str(tmp_path / "c"), "--quiet", "--prefix-cache", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--prefix-cache" in err and "\n" not in err


def test_reference_tokens_end_with_eos(stories):
    from data.benchmarks.request import Request

    req = Request(id="x", group="x", messages=({"role": "user", "content": "Hi"},), reference="A cat.")
    toks = reference_tokens(stories, req)
    assert toks[-1] in stories.eos_ids and toks[:-1] == stories.tokenizer("A cat.", add_special_tokens=False)["input_ids"]
