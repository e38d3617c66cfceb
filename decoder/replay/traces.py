"""Replay's verifier: the captured trace store stands in for the model (decoder/loop.py `Verifier`).

Greedy decoding is deterministic, and the trace store holds every committed token x_t, the state and
the top-8 computed with x_t as input (data/store/schema.py). A draft node's fate depends only on the true
continuation: it is accepted iff its root path spells the trace's next tokens. `TraceVerifier` runs
each pass of the one speculative loop (`speculate`) without the model - SuffixDecoding's offline
simulator, for every arm, the semantic source included:

  per pass (m tokens committed)   argmax = truth_argmax(draft, x[m:]): the next token at the anchor and
                                    at every node on the true path, -1 elsewhere
                                  accepted, bonus = greedy_accept(...)          (the engine's kernel)
                                  commit accepted + bonus, cut at the trace's end (stop: trace_end)
                                  the drafter observes the store's top-8 and states at the anchor and
                                    the nodes on the true path

Exact arms. A drafter whose proposals depend only on committed tokens and their states (pld, suffix,
sam, the semantic key) makes the same passes as live decoding (tests/test_replay.py compares them
pass by pass). The store lacks the model's outputs at REJECTED nodes: the adjacency table of Token
Recycling (recycling, lexical, the lexical host of oilbird) learns the top-8 at every verified node,
the rejected-branch ring buffer (oilbird's rollouts) the argmax at rejected nodes. Replay passes -1
there: the table skips those rows and the ring buffer records nothing. `exactness(drafter)` says which
arms that touches, and summary.json records it with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from decoder.draft import ROOT, Draft, Drafter, VerifyResult
from decoder.loop import Cycle, speculate
from decoder.verify.tree import greedy_accept

TRACE_END = "trace_end"  # replay's stop reason: the trace ends where greedy decoding stopped


@dataclass
class Trace:
    """One request of the store: prompt, generated tokens, and per token the state and top-8 computed
    with it as input (`known[t]` False where the store has none: the last token, never fed)."""

    prompt: list[int]
    tokens: list[int]
    hidden: np.ndarray  # [n, d] float16
    topk: np.ndarray  # [n, 8] int32, -1 rows where unknown
    first_hidden: np.ndarray  # [d] the state that predicted tokens[0] (at the prompt's last token)
    first_topk: np.ndarray  # [8]
    tenant: str = ""  # whose traffic; "" = the default tenant (stores without the column)

    def pool_states(self) -> np.ndarray:
        """float32 states for the drafter's pool: zeros where unknown (the live engine's convention)."""
        return self.hidden.astype(np.float32)


def load_traces(store, limit: int | None, max_new_tokens: int | None) -> list[Trace]:
    """The store's requests in serving order, each cut at max_new_tokens (greedy with a lower cap)."""
    n_req = store.n_requests if limit is None else min(limit, store.n_requests)
    flat_tokens = store.positions["token"].to_numpy()
    # stores written before tenants lack the column: one tenant
    tenants = store.requests["tenant"].to_list() if "tenant" in store.requests.columns else [""] * n_req
    traces = []
    for r in range(n_req):
        lo, hi = int(store.offsets[r]), int(store.offsets[r + 1])
        if max_new_tokens is not None:
            hi = min(hi, lo + max_new_tokens)
        known = store.hidden_valid[lo:hi].copy()
        if len(known):
            known[-1] = False  # the cut trace's last token is never fed back
        hidden = store.hidden[lo:hi].copy()
        hidden[~known] = 0
        topk = store.topk[lo:hi].copy()
        topk[~known] = -1
        traces.append(Trace(prompt=store.prompt(r), tokens=flat_tokens[lo:hi].astype(int).tolist(),
                            hidden=hidden, topk=topk, first_hidden=store.prompt_last_hidden[r],
                            first_topk=store.prompt_last_topk[r], tenant=tenants[r] or ""))
    return traces


def truth_argmax(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> tuple[np.ndarray, dict[int, int]]:
    """The model's next token at the anchor (row 0) and after every draft node (row 1 + i), as far as
    the truth tells it: known for nodes whose root path spells truth[:depth], -1 elsewhere.

    Returns (argmax [1 + N] int64, {node: depth} for the nodes on the true path)."""
    n_truth = len(truth)
    argmax = np.full(1 + len(tokens), -1, np.int64)
    argmax[0] = truth[0] if n_truth else -1
    on_path: dict[int, int] = {}
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        depth = 1 if p == ROOT else on_path.get(p, -1) + 1
        if depth >= 1 and depth <= n_truth and tok == truth[depth - 1]:
            on_path[i] = depth
            if depth < n_truth:
                argmax[1 + i] = truth[depth]
    return argmax, on_path


class StoreRows:
    """`VerifyResult.hidden` in replay: row 0 = the anchor, 1 + i = node i, read from the store.

    Only rows of the anchor and of nodes on the true path exist; any other row raises, so a drafter
    that would need a state the store lacks fails loudly instead of reading a made-up one."""

    def __init__(self, trace: Trace, m: int, on_path: dict[int, int]) -> None:
        self.trace, self.m, self.on_path = trace, m, on_path

    def __getitem__(self, row: int) -> np.ndarray:
        row = int(row)
        if row == 0:
            return self.trace.first_hidden if self.m == 0 else self.trace.hidden[self.m - 1]
        depth = self.on_path.get(row - 1)
        if depth is None:
            raise LookupError(f"replay: the state at rejected draft node {row - 1} is not in the trace store")
        return self.trace.hidden[self.m + depth - 1]


def store_topk(trace: Trace, m: int, n_nodes: int, on_path: dict[int, int]) -> np.ndarray:
    """[1 + N, 8]: the store's top-8 at the anchor and at nodes on the true path, -1 rows elsewhere."""
    topk = np.full((1 + n_nodes, trace.topk.shape[1]), -1, np.int32)
    topk[0] = trace.first_topk if m == 0 else trace.topk[m - 1]
    for i, depth in on_path.items():
        topk[1 + i] = trace.topk[m + depth - 1]
    return topk


class TraceVerifier:
    """The stored greedy trace as the verifier (module docstring); verify time comes from a profile. Nothing
    runs beside its verify, but the loop defers the drafters' bookkeeping as it does live: the same passes."""

    timed = False
    overlaps = False

    def __init__(self, trace: Trace, vocab_size: int) -> None:
        self.trace, self.vocab_size = trace, vocab_size
        self.m = 0  # tokens committed so far

    def start(self, prompt: Sequence[int]) -> None:
        self.m = 0

    @property
    def stop_reason(self) -> str | None:
        return TRACE_END if self.m >= len(self.trace.tokens) else None

    def verify(self, context: Sequence[int], draft: Draft, beside=None) -> VerifyResult:
        if beside is not None:
            beside()
        m, truth = self.m, self.trace.tokens[self.m:]
        argmax, on_path = truth_argmax(draft.tokens, draft.parents, truth)
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
        committed = truth[:len(accepted) + 1]  # the trace ends where greedy decoding stopped
        self.m += len(committed)
        return VerifyResult(draft=draft, accepted_nodes=accepted, bonus=bonus, committed=committed,
                            argmax=argmax, topk=store_topk(self.trace, m, len(draft), on_path),
                            hidden=StoreRows(self.trace, m, on_path))

    def advance(self, result: VerifyResult) -> None:
        pass  # no cache to keep


def replay_request(drafter: Drafter, trace: Trace, nodes: int, vocab_size: int) -> list[Cycle]:
    """One request's passes: the one loop (begin_request included) with the store as the verifier."""
    return speculate(drafter, TraceVerifier(trace, vocab_size), trace.prompt, nodes).cycles


ADJACENCY_REASON = ("the adjacency table learns the model's top-8 at every verified node; the store holds it "
                    "at the anchor and the accepted nodes only, so rows of rejected nodes are skipped")
RING_REASON = ("the rejected-branch ring buffer needs the model's argmax at rejected nodes, which the store "
               "lacks: it stays empty in replay")


def exactness(drafter) -> tuple[bool, str]:
    """Whether replay makes the same passes as live decoding for this drafter, and why not."""
    reasons = []
    if getattr(drafter, "table", None) is not None:
        reasons.append(ADJACENCY_REASON)
    ring = getattr(drafter, "ring", None)
    if ring is not None and ring.capacity > 0 and getattr(drafter.config, "rollouts", 0) > 0:
        reasons.append(RING_REASON)
    if reasons:
        return False, "; ".join(reasons)
    return True, "proposals depend only on committed tokens and their states, all in the store"


def uses_states(drafter) -> bool:
    """Whether the drafter queries the semantic key (and so needs the store's states in its pool)."""
    config = getattr(drafter, "config", None)
    return (getattr(drafter, "pool", None) is not None and bool(getattr(config, "semantic", False))
            and getattr(config, "key_level", "position") != "null")
