"""Which request each vLLM batch row holds, read from the tokens alone (decoder/vllm/proposer.py,
data/capture/vllm_capture.py).

vLLM calls a custom proposer with, per batch row, the row's tokens (`token_ids_cpu[i, :num_tokens_no_spec[i]]`:
prompt and everything committed, this step's tokens included) and the tokens this step committed
(`sampled_token_ids[i]`: the accepted drafts and the bonus token; empty while a prompt is still being
prefilled in chunks). It passes no request id, reuses a finished request's row for the next request, and
moves rows when it compacts the batch. So a row's request is recognised by its text:
  - continuing: a request seen at the last step whose tokens are this row's first tokens, and exactly
    this step's sampled tokens were appended (the row's previous holder first, then the others: a moved
    row). A new request whose prompt extends a finished one (a later chat turn) appends more than that,
    so it is never taken for its predecessor;
  - new: any other row with sampled tokens: its prompt is the row's tokens minus the sampled ones;
  - finished: a request seen at the last step that no row holds now (vLLM drops a finished request's row
    before the next step). A request vLLM preempts and later resumes is, by this rule, finished and
    then new again: its text still enters the pool once, as two traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RowRequest:
    """One request as the proposer follows it."""

    serial: int  # order of first sight
    prompt_len: int
    tokens: np.ndarray  # prompt + committed tokens at the last step (int32)
    sampled: int = 0  # tokens this step appended
    decoding: bool = False  # True once its prefill step has been seen (its later rows verify a draft)
    pending: list[int] | None = None  # the draft tokens proposed for it at the last step (verified at this one)
    draft: Any = None  # a drafting proposer's own record of that draft (decoder/vllm/proposer.py: the Draft)
    saved: Any = None  # a drafting proposer's suspended request state (Drafter.suspend_request)
    first: tuple | None = None  # (state, top-8) at the prompt's last token, from the prefill step
    states: list = field(default_factory=list)  # per output token: its state (row i: output[i] as input)
    topk: list = field(default_factory=list)  # per output token: its top-8
    off_argmax: int = 0  # committed tokens seen that were not the model's top-1 there (a sampled request)

    @property
    def output(self) -> np.ndarray:
        return self.tokens[self.prompt_len:]


class RowTracker:
    """`step(...)` once per engine step: the request of every row (None for a row with nothing sampled)
    and the requests that finished since the last step."""

    def __init__(self) -> None:
        self.rows: list[RowRequest | None] = []  # last step's holder of each row
        self.serials = 0

    def step(self, sampled: Sequence[Sequence[int]], num_tokens: Sequence[int],
             token_rows: np.ndarray) -> tuple[list[RowRequest | None], list[RowRequest]]:
        active = [r for r in self.rows if r is not None]
        unmatched = {id(r): r for r in active}
        now: list[RowRequest | None] = []
        for i, new_tokens in enumerate(sampled):
            m = len(new_tokens)
            n = int(num_tokens[i])
            text = token_rows[i, :n]
            if m == 0:  # a chunk of a prompt still prefilling, or a row vLLM discarded
                held = self.rows[i] if i < len(self.rows) else None
                if held is not None and id(held) in unmatched and _continues(held, text, 0):
                    del unmatched[id(held)]
                    held.sampled = 0
                    now.append(held)
                else:
                    now.append(None)
                continue
            held = self.rows[i] if i < len(self.rows) else None
            order = ([held] if held is not None and id(held) in unmatched else []) + \
                [r for r in unmatched.values() if r is not held]
            match = next((r for r in order if _continues(r, text, m)), None)
            if match is None:
                self.serials += 1
                match = RowRequest(self.serials, n - m, np.array(text, np.int32))
            else:
                del unmatched[id(match)]
                match.tokens = np.array(text, np.int32)
            match.sampled = m
            now.append(match)
        self.rows = now
        return now, list(unmatched.values())


def _continues(req: RowRequest, text: np.ndarray, appended: int) -> bool:
    """Whether `text` is `req`'s tokens followed by exactly `appended` more."""
    n = len(req.tokens)
    return len(text) == n + appended and np.array_equal(text[:n], req.tokens)
