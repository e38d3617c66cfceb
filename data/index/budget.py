"""The bounded pool (--store-budget): which past traces a request may draft from, written once.

A budget is a number of generated tokens ("200k", "1.5M", "50000") or of megabytes ("64MB"; turned
into tokens at `bytes_per_token`, below). The pool holds whole traces, in serving
order. Traces join when their request finishes. When a join takes the pool above the budget, the
oldest traces leave until the pool holds at most `low_water` x budget tokens (default 7/8, so a
decoder rebuilds its indexes once per eighth of the budget, not once per request). The pool never
holds more than the budget; a single trace longer than the budget is refused.

`window_starts` gives, for every request r, the first request s(r) of its pool: the pool of r is
the requests s(r) .. r-1 (minus same-prompt and other-tenant traces, which the callers leave out
as before). Census, decoder and replay all read it from here.

Bytes per token, the one definition (census, decoder, replay): what one pooled generated token
costs in the drafter's pool, `state_bytes(spec, d) + ROW_POINTER_BYTES + TOKEN_BYTES`:
  - its state in the semantic key's index: float16 (2 d bytes) for `exact`; for `auto` that row plus
    the pruner's projected row, id and group (data/index/pruner.py: 128 + 12 bytes at d >= 256), counted
    whole although a small pool has no pruner yet; else the faiss code
    the spec stores per state, read off faiss itself (sa_code_size; an ivf adds its int64 id, an
    hnsw its level-0 int32 links); codebooks and projections are a fixed cost, not per token;
  - two int64 row pointers (the state's flat token index and its trace's end);
  - the token id (int32).
The exact float16 pool then costs 2 d + 20 bytes a token, what the decoder's
`store_bytes_per_token` measures when every token has a state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from data.errors import OilbirdError
from data.index.stateindex import IndexSpec

LOW_WATER = 0.875
ROW_POINTER_BYTES = 16  # per state: its flat token index and its trace end (int64 each)
TOKEN_BYTES = 4  # per pooled token (int32)
_UNITS = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


@dataclass(frozen=True)
class Budget:
    """A parsed --store-budget: tokens, or megabytes (then `tokens` is filled by `in_tokens`)."""

    text: str
    tokens: int | None = None
    megabytes: float | None = None

    def in_tokens(self, bytes_per_token: float | None = None) -> int:
        if self.tokens is not None:
            return self.tokens
        if not bytes_per_token or bytes_per_token <= 0:
            raise OilbirdError(f"--store-budget {self.text}: a budget in MB needs the bytes per token of the store")
        return int(self.megabytes * 2 ** 20 / bytes_per_token)


def state_bytes(spec: IndexSpec, d: int) -> float:
    """Bytes one state costs in the index (its code; codebooks and projections are fixed costs)."""
    if spec.exact:
        return 2.0 * d  # float16
    if spec.auto:  # the float16 row and, once the pool is large, its projected row and id in the pruner
        from data.index.pruner import PrunerConfig

        return 2.0 * d + PrunerConfig().bytes_per_state(d)
    try:
        import faiss
    except ImportError:
        raise OilbirdError(f"--index {spec.text} needs faiss: pip install -e '.[faiss]' "
                           "(or use --index exact)") from None

    index = faiss.index_factory(d, spec.factory, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        return float(ivf.code_size + 8)  # an inverted list keeps a code and an int64 id per state
    try:
        return float(index.sa_code_size())
    except RuntimeError:  # hnsw: its storage's code plus the level-0 links (int32)
        inner = index
        while not hasattr(inner, "hnsw") and hasattr(inner, "index"):
            inner = faiss.downcast_index(inner.index)
        return float(faiss.downcast_index(inner.storage).sa_code_size() + 4 * inner.hnsw.nb_neighbors(0))


def bytes_per_token(spec: IndexSpec, d: int) -> float:
    """What one pooled token costs: its state, its two row pointers, the token (module docstring)."""
    return state_bytes(spec, d) + ROW_POINTER_BYTES + TOKEN_BYTES


def parse_budget(text: str | int | None) -> Budget | None:
    """None / '' / 'none' / 'all' / 'inf': unbounded. 0 is refused like any budget below 1 token: it
    once meant unbounded without saying so, the opposite of what it reads as (an empty pool)."""
    if text is None:
        return None
    raw = str(text).strip().lower().replace("_", "").replace(",", "")
    if raw in ("", "none", "all", "inf"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(mb|mib)", raw)
    if m:
        mb = float(m.group(1))
        if mb <= 0:
            raise OilbirdError(f"--store-budget {text}: must be positive")
        return Budget(str(text), megabytes=mb)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:tok|tokens)?", raw)
    if not m:
        raise OilbirdError(f"--store-budget '{text}': give tokens (200k, 1.5M, 50000) or megabytes (64MB)")
    tokens = int(round(float(m.group(1)) * _UNITS[m.group(2)]))
    if tokens <= 0:
        raise OilbirdError(f"--store-budget {text}: must be positive (leave it out, or give 'all', for an "
                           "unbounded pool)")
    return Budget(str(text), tokens=tokens)


def check_budget(budget_tokens: int | None, lengths) -> None:
    """A budget must hold the longest trace."""
    if budget_tokens is None or len(lengths) == 0:
        return
    longest = int(np.max(lengths))
    if budget_tokens < longest:
        raise OilbirdError(f"--store-budget of {budget_tokens} tokens is below one trace (the longest holds {longest} tokens)")


def window_starts(lengths, budget_tokens: int | None, low_water: float = LOW_WATER) -> np.ndarray:
    """s(r) for every request: its pool is requests s(r)..r-1 (all of 0..r-1 when unbounded).

    lengths[q] = tokens request q adds to the pool (its generated tokens, 0 if it adds none).
    """
    lengths = np.asarray(lengths, np.int64)
    R = len(lengths)
    starts = np.zeros(R, np.int64)
    if budget_tokens is None:
        return starts
    check_budget(budget_tokens, lengths)
    low = low_water * budget_tokens
    s, held = 0, 0
    for r in range(R):
        starts[r] = s
        held += int(lengths[r])  # r joins after it is served
        if held > budget_tokens:
            while held > low and s <= r:
                held -= int(lengths[s])
                s += 1
    return starts


def pool_tokens(lengths, starts: np.ndarray) -> np.ndarray:
    """Tokens in request r's pool (for tests and reports)."""
    c = np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))])
    r = np.arange(len(starts))
    return c[r] - c[starts]
