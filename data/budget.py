"""The bounded pool (--store-budget): which past traces a request may draft from, written once.

A budget is a number of generated tokens ("200k", "1.5M", "50000") or of megabytes ("64MB"; turned
into tokens at a stated number of bytes per pooled token). The pool holds whole traces, in serving
order. Traces join when their request finishes. When a join takes the pool above the budget, the
oldest traces leave until the pool holds at most `low_water` x budget tokens (default 7/8, so a
decoder rebuilds its indexes once per eighth of the budget, not once per request). The pool never
holds more than the budget; a single trace longer than the budget is refused.

`window_starts` gives, for every request r, the first request s(r) of its pool: the pool of r is
the requests s(r) .. r-1 (minus same-prompt and other-tenant traces, which the callers leave out
as before). Census, decoder and replay all read it from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from data.errors import OilbirdError

LOW_WATER = 0.875
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


def parse_budget(text: str | int | None) -> Budget | None:
    """None / '' / 'none' / 'all' / 0: unbounded."""
    if text is None:
        return None
    raw = str(text).strip().lower().replace("_", "").replace(",", "")
    if raw in ("", "none", "all", "0", "inf"):
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
        raise OilbirdError(f"--store-budget {text}: must be positive")
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
