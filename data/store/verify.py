"""`python -m data verify`: everything open_store checks, then every stored value."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data.store.reader import _damaged, _hashes_checked, open_store, position_parts

# "unknown": a store written by serving (data/capture/served_store.py), whose proposer never sees a request's own
# max_tokens or stop strings
STOP_REASONS = ("eos", "stop_string", "length", "reference", "unknown")


def _check_sampling(p: Path, req) -> None:
    """`sampling` is one of SAMPLINGS (or null: unknown), `off_argmax` a count, and the two agree where both are
    known: "sampled" has some token off the top-1, "argmax" none (data/store/sampling.py; "greedy" is what capture
    asked for, and a tie at the top may still count one)."""
    from data.store.sampling import ARGMAX, SAMPLED, SAMPLINGS

    bad = set(req["sampling"].drop_nulls().to_list()) - set(SAMPLINGS)
    if bad:
        raise _damaged(p, f"unknown sampling {sorted(bad)[0]!r}")
    off = req["off_argmax"]
    if off.drop_nulls().len() and int(off.drop_nulls().min()) < 0:
        raise _damaged(p, "a request's off_argmax is negative")
    for value, ok, says in ((SAMPLED, lambda n: n > 0, "none"), (ARGMAX, lambda n: n == 0, "some")):
        known = [n for s, n in zip(req["sampling"].to_list(), off.to_list()) if s == value and n is not None]
        if any(not ok(n) for n in known):
            raise _damaged(p, f"a request's sampling is {value!r} but its off_argmax counts {says} of its tokens "
                              "off the model's top-1")


def verify_store(path: str | Path) -> str:
    """The full check behind `python -m data verify`: everything open_store checks (checksums,
    schema, row counts, prompt hashes), then the values: states finite, token and top-k ids inside
    the vocabulary, stop reasons known, ids unique, the sampling columns consistent. Returns the OK line (which
    says whether meta.json is sealed: data/store/meta.py); raises on the first problem."""
    st = open_store(path)
    p = st.path
    meta = st.meta
    vocab = int(meta.get("vocab_size") or 0)
    req = st.requests
    if meta.get("n_requests") is not None and int(meta["n_requests"]) != st.n_requests:
        raise _damaged(p, f"meta.json says {meta['n_requests']} requests, requests.parquet holds {st.n_requests}")
    if not np.isfinite(st.hidden[st.hidden_valid].astype(np.float32)).all():
        raise _damaged(p, "a stored hidden state is not finite")
    if not np.isfinite(st.prompt_last_hidden.astype(np.float32)).all():
        raise _damaged(p, "a stored prompt_last_hidden is not finite")
    if vocab:
        checks = {"generated token": st.positions["token"].to_numpy(), "top-k id": st.topk[st.hidden_valid],
                  "prompt token": req["prompt_tokens"].explode().drop_nulls().to_numpy(),
                  "prompt top-k id": st.prompt_last_topk}
        for what, ids in checks.items():
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
                raise _damaged(p, f"a {what} lies outside the vocabulary of {vocab}")
    bad = set(req["stop_reason"].to_list()) - set(STOP_REASONS)
    if bad:
        raise _damaged(p, f"unknown stop reason {sorted(bad)[0]!r}")
    if req["id"].n_unique() != st.n_requests:
        raise _damaged(p, "request ids repeat")
    _check_sampling(p, req)
    reused = meta.get("prompt_tokens_reused")  # per request; absent in stores captured before it was recorded
    if reused is not None:
        if not isinstance(reused, list) or len(reused) != st.n_requests:
            raise _damaged(p, f"meta.json prompt_tokens_reused does not hold one entry per request "
                              f"({len(reused) if isinstance(reused, list) else type(reused).__name__} for {st.n_requests})")
        lens = req["prompt_tokens"].list.len().to_list()
        for r, (v, n) in enumerate(zip(reused, lens)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < max(1, n)):
                raise _damaged(p, f"meta.json prompt_tokens_reused[{r}] = {v!r} is not a count below the prompt's "
                                  f"{n} tokens")
    if meta.get("mode") == "generate" and meta.get("max_new_tokens"):
        longest = int(req["output_tokens"].list.len().max())
        if longest > int(meta["max_new_tokens"]):
            raise _damaged(p, f"a request holds {longest} generated tokens, over max_new_tokens "
                              f"{meta['max_new_tokens']}")
    files = 1 + len(position_parts(p))
    line = f"OK: {p}: {st.n_requests} requests, {st.positions.height} generated tokens"
    # open_store refused an edited sealed meta.json; an unsealed one (older code's) is said so
    sealed = ("meta.json sealed" if st.meta_sealed else
              f"meta.json unsealed (written before meta.json was sealed; `python -m data migrate {p}` seals it)")
    if not st.verified:
        return line + f"; unverified: no checksums recorded (written before checksums), contents checked; {sealed}"
    hashes = "prompt hashes, " if _hashes_checked(meta) else ""
    return line + f"; {files} files match their checksums; {sealed}; {hashes}states, ids and counts checked"

