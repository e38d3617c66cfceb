"""The rejected-branch ring buffer (paper (i b)): a record per node verification
rejected, keyed by (the state before the node, its token), valued by the continuation the model
endorses from there (`rejected_records`), retrieved where the anchor token is the record's token
and cos(h_t, key state) >= 0.8.
"""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np

from data.index.stateindex import unit
from decoder.draft import ROOT, VerifyResult

Chain = list[int]


def rejected_records(result: VerifyResult, max_depth: int = 6) -> list[tuple[int, int, Chain]]:
    """(row of the state before the node, the node's token, the endorsed continuation) per rejected node.

    Rejected nodes: the children of the anchor and of the accepted nodes that were not accepted
    (the nodes verification judged and refused). Rows index result.hidden (0 = anchor, 1 + i = node i).
    The continuation starts with the model's argmax at the node and follows the child carrying that
    argmax while one exists, up to `max_depth` tokens. An argmax of -1 is unknown (replay: the trace
    store holds the model's outputs on the true path only): the continuation stops there, and a node
    with no known continuation gives no record.
    """
    draft = result.draft
    if not len(draft) or max_depth <= 0:
        return []
    argmax = result.argmax
    accepted = set(result.accepted_nodes)
    judged = {ROOT, *result.accepted_nodes}
    out = []
    for i, p in enumerate(draft.parents):
        if p not in judged or i in accepted:
            continue
        cont, node = [], i
        while len(cont) < max_depth:
            tok = int(argmax[1 + node])
            if tok < 0:
                break
            cont.append(tok)
            nxt = draft.child(node, tok)
            if nxt is None:
                break
            node = nxt
        if cont:
            out.append((0 if p == ROOT else 1 + p, int(draft.tokens[i]), cont))
    return out


class RejectedPool:
    """Ring buffer of rejected nodes: (state before, token) -> continuation; oldest overwritten first."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self.states: np.ndarray | None = None  # [capacity, d] float32, normalised (small: numpy beats torch here)
        self.tokens = np.full(capacity, -1, np.int64)
        self.conts: list[Chain | None] = [None] * capacity
        self.owner: list[tuple[Hashable, int] | None] = [None] * capacity  # (prompt hash, request serial)
        self.by_token: dict[int, set[int]] = {}
        self.next = 0  # the slot written next
        self.size = 0

    def add(self, state: np.ndarray, token: int, cont: Chain, owner: tuple[Hashable, int] | None = None) -> None:
        if self.capacity <= 0 or not cont:
            return
        state = unit(state).reshape(-1)
        if self.states is None:
            self.states = np.zeros((self.capacity, state.shape[0]), np.float32)
        slot = self.next
        old = int(self.tokens[slot])
        if old >= 0:
            self.by_token[old].discard(slot)
        self.states[slot] = state
        self.tokens[slot] = token
        self.conts[slot] = list(cont)
        self.owner[slot] = owner
        self.by_token.setdefault(int(token), set()).add(slot)
        self.next = (slot + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def lookup(self, state: np.ndarray, token: int, theta: float = 0.8, top: int = 4,
               skip: Callable[[tuple[Hashable, int] | None], bool] | None = None) -> list[Chain]:
        """Up to `top` distinct continuations of records with this token and cos >= theta, most similar first."""
        slots = [s for s in self.by_token.get(int(token), ()) if skip is None or not skip(self.owner[s])]
        if not slots or top <= 0:
            return []
        slots.sort()
        sims = self.states[slots] @ unit(state).reshape(-1)
        order = np.argsort(-sims, kind="stable")
        chains, seen = [], set()
        for j in order:
            if sims[j] < theta or len(chains) >= top:
                break
            cont = self.conts[slots[j]]
            if tuple(cont) not in seen:
                seen.add(tuple(cont))
                chains.append(list(cont))
        return chains

    def nbytes(self) -> int:
        d = self.states.shape[1] if self.states is not None else 0
        return self.size * (4 * d + 8) + sum(4 * len(c) for c in self.conts if c)
