"""Suffix-automaton drafting (SAM-Decoding style), and the automaton pool the lexical arms share.

The automaton itself (counts, recent positions `pos` / `pos2`, exclusion by group) is
data/index/automaton.py's `SuffixAutomaton`, the one the census counts with; here it is kept with exact
counts and positions. `AutomatonIndex` holds two automata: the pool (finished traces, group = the
trace's prompt hash) and the request (prompt + committed tokens, group = position, so `pos2` is the previous
occurrence). Same-prompt skipping: `begin_request(prompt, prompt_hash)` makes that hash (default
`data.store.schema.prompt_hash(prompt)`, the hash the trace store keeps) the excluded group: its
occurrences are never used as copy positions, and their counts are subtracted
(`excluded_counts`, computed once per request by re-walking those traces), so the excluded
traces neither supply tokens nor rank branches.

`SamDrafter` (arm `sam`): the longest suffix of the context that occurs earlier (in the request)
or anywhere in the pool; the longer one's continuation (up to 32 tokens) is the spine, then the
match state's next most frequent children, each continued from its own most recent occurrence.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from data.index.automaton import NO_GROUP, SuffixAutomaton
from data.store.schema import prompt_hash as hash_prompt
from decoder.draft import Draft, Drafter

REFEED = 256  # tokens re-fed to the pool matcher after the pool changed mid-request


def extends(context: Sequence[int], seen: list[int]) -> bool:
    """Whether `context` starts with `seen` (one C-level list comparison per cycle)."""
    if len(context) < len(seen):
        return False
    prefix = context[: len(seen)]
    if not isinstance(prefix, list):
        prefix = [int(t) for t in prefix]
    return prefix == seen


class AutomatonIndex:
    """The pool automaton (finished traces) beside the request automaton (prompt + committed tokens).

    `sync(context)` indexes the tokens committed since the last call and advances the pool's
    longest-match walk, both O(1) amortized per token; a context that is not an extension of the
    one seen restarts the request side.
    """

    def __init__(self) -> None:
        self.pool = SuffixAutomaton()
        self.request = SuffixAutomaton()
        self._group_of: dict[Hashable, int] = {}  # prompt hash -> pool group
        self._spans: dict[int, list[tuple[int, int]]] = {}  # pool group -> text spans of its traces
        self._n_groups = 0
        self.excluded = NO_GROUP
        self.excluded_counts: dict[int, int] = {}
        self._pool_state = self._pool_matched = 0
        self._pool_stale = False
        self._traces: list[tuple[Hashable | None, int, int]] = []  # per add_trace: prompt hash, text span
        self._excluded_hash: Hashable | None = None
        self.version = 0  # pool changes so far (add_trace, evict_traces): a resumed request re-walks after one

    # pool side
    def add_trace(self, tokens: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        """A finished trace (generated tokens only) enters the pool; None = never excluded."""
        if not len(tokens):
            self._traces.append((prompt_hash, 0, 0))  # counted, so evict_traces counts requests
            return
        if prompt_hash is None:
            group = self._new_group()
        else:
            group = self._group_of.get(prompt_hash)
            if group is None:
                group = self._group_of[prompt_hash] = self._new_group()
        self.pool.start_sequence()
        start = len(self.pool.text)
        for t in tokens:
            self.pool.extend(int(t), group)
        self._spans.setdefault(group, []).append((start, len(self.pool.text)))
        self._traces.append((prompt_hash, start, len(self.pool.text)))
        # a trace of the request being served (its prompt hash may be new to the pool: no group was excluded yet)
        if group == self.excluded or (prompt_hash is not None and prompt_hash == self._excluded_hash):
            self._exclude(group)
        self._pool_stale = True
        self.version += 1

    def evict_traces(self, count: int) -> None:
        """Drop the oldest `count` traces: the pool automaton is rebuilt from the others (an automaton
        cannot forget), which the --store-budget window asks for once per eighth of the budget."""
        count = min(count, len(self._traces))
        if count <= 0:
            return
        text, kept = self.pool.text, self._traces[count:]
        self.pool = SuffixAutomaton()
        self._group_of, self._spans, self._n_groups, self._traces = {}, {}, 0, []
        self.excluded, self.excluded_counts = NO_GROUP, {}
        for h, a, b in kept:
            self.add_trace(text[a:b], h)
        if self._excluded_hash is not None:
            self._exclude(self._group_of.get(self._excluded_hash, NO_GROUP))
        self._pool_stale = True
        self.version += 1

    def _new_group(self) -> int:
        self._n_groups += 1
        return self._n_groups - 1

    def _exclude(self, group: int) -> None:
        self.excluded = group
        self.excluded_counts = self.pool.counts_within(self._spans.get(group, [])) if group >= 0 else {}

    def pool_count(self, state: int) -> int:
        """Occurrences of `state` in the pool outside the excluded traces."""
        return self.pool.count[state] - self.excluded_counts.get(state, 0)

    def pool_occurrence(self, state: int) -> int:
        return self.pool.occurrence(state, self.excluded)

    # request side
    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        """Start indexing a request; pool traces added under its prompt hash are not drafted from."""
        if prompt_hash is None:
            prompt_hash = hash_prompt(prompt)
        self._excluded_hash = prompt_hash
        self._exclude(self._group_of.get(prompt_hash, NO_GROUP))
        self.request = SuffixAutomaton()
        self._pool_state = self._pool_matched = 0
        self._pool_stale = False
        self.sync(prompt)

    REQUEST_FIELDS = ("request", "_pool_state", "_pool_matched", "_pool_stale", "_excluded_hash", "excluded",
                      "excluded_counts")

    def suspend_request(self) -> dict:
        """The request side, to resume later (the pool side is shared by every request)."""
        return {"version": self.version, **{f: getattr(self, f) for f in self.REQUEST_FIELDS}}

    def resume_request(self, saved: dict) -> None:
        """Install a suspended request side; when the pool changed meanwhile, its pool walk is re-fed and
        its excluded group (the pool may hold new traces of its prompt) is recomputed."""
        for f in self.REQUEST_FIELDS:
            setattr(self, f, saved[f])
        if saved["version"] != self.version:
            self._pool_stale = True
            self._exclude(self._group_of.get(self._excluded_hash, NO_GROUP) if self._excluded_hash is not None
                          else NO_GROUP)

    def sync(self, context: Sequence[int]) -> None:
        req = self.request
        seen = len(req.text)
        n = len(context)
        if not extends(context, req.text):
            self.request = req = SuffixAutomaton()
            self._pool_state = self._pool_matched = 0
            seen = 0
        if self._pool_stale:
            self._pool_state, self._pool_matched = self.pool.match(context[max(0, seen - REFEED) : seen])
            self._pool_stale = False
        state, matched = self._pool_state, self._pool_matched
        pool_step = self.pool.step
        for i in range(seen, n):
            t = int(context[i])
            req.extend(t, i)
            state, matched = pool_step(state, matched, t)
        self._pool_state, self._pool_matched = state, matched

    def anchor(self) -> int:
        return self.request.text[-1]

    def pool_match(self) -> tuple[int, int]:
        """(state, length): the longest suffix of the context present in the pool (ignoring exclusion)."""
        return self._pool_state, self._pool_matched

    def request_match(self) -> tuple[int, int]:
        """(state, length): the longest suffix of the context that also occurs earlier in it."""
        req = self.request
        v = req.last
        while v > 0 and req.count[v] < 2:
            v = req.link[v]
        return v, req.length[v]

    def request_occurrence(self, state: int) -> int:
        """The most recent end position of `state` before the context's last token (-1 if none)."""
        p = self.request.pos[state]
        return self.request.pos2[state] if p == len(self.request.text) - 1 else p


# Drafting from the index: pure functions over an AutomatonIndex.

Chain = list[int]


def pool_spine(index: AutomatonIndex, max_tokens: int) -> tuple[int, int, Chain]:
    """The pool's longest match with a usable continuation: (state, length, continuation)."""
    pool = index.pool
    state, matched = index.pool_match()
    while state > 0:
        if index.pool_count(state) > 0:
            p = index.pool_occurrence(state)
            if p >= 0:
                cont = pool.continuation(p, max_tokens)
                if cont:
                    return state, matched, cont
        state = pool.link[state]
        matched = pool.length[state]
    return 0, 0, []


def request_spine(index: AutomatonIndex, max_tokens: int) -> tuple[int, int, Chain]:
    """The request's longest earlier match: (state, length, continuation after its last occurrence)."""
    state, matched = index.request_match()
    if state <= 0:
        return 0, 0, []
    p = index.request_occurrence(state)
    return state, matched, index.request.continuation(p, max_tokens)


def frequent_branches(sam: SuffixAutomaton, state: int, count: Callable[[int], int],
                      occurrence: Callable[[int], int], top: int, max_tokens: int,
                      skip: int | None = None) -> list[Chain]:
    """The `top` most frequent next tokens after `state` (except `skip`), each continued from its
    child's most recent occurrence: [token] + what followed it, up to `max_tokens` in all."""
    if top <= 0 or max_tokens <= 0:
        return []
    ranked = heapq.nlargest(  # by count, then by recency of the occurrence that would be copied
        top, ((count(child), occurrence(child), tok) for tok, child in sam.next[state].items() if tok != skip)
    )
    chains = []
    for n, p, tok in ranked:
        if n > 0:
            chains.append([tok] + (sam.continuation(p, max_tokens - 1) if p >= 0 else []))
    return chains


def automaton_match(index: AutomatonIndex, spine_max: int = 32, branch_top: int = 3,
                    branch_max: int = 32) -> tuple[int, Chain, list[Chain]]:
    """(match length, spine, branches): the spine is the longer of the request's and the pool's match
    continuations (ties go to the request), the branches are the most frequent next tokens at that
    match's state, and the length is that match's (the suffix of the context the spine continues;
    0 when there is no spine). SAM-Decoding's rule reads the length (oilbird's one_source)."""
    return automaton_match_support(index, spine_max, branch_top, branch_max)[:3]


def automaton_match_support(index: AutomatonIndex, spine_max: int = 32, branch_top: int = 3,
                            branch_max: int = 32) -> tuple[int, Chain, list[Chain], list[list[tuple[int, int]]]]:
    """`automaton_match` and the support of every token of its chains (`chain_support`: the spine's, then each
    branch's): the evidence of their node probabilities (decoder/drafters/features.py)."""
    r_state, r_len, r_cont = request_spine(index, spine_max)
    p_state, p_len, p_cont = pool_spine(index, spine_max)
    if not r_cont and not p_cont:
        return 0, [], [], []
    if r_cont and r_len >= p_len:
        sam, state, count, occurrence, length, spine = (index.request, r_state, index.request.count.__getitem__,
                                                         index.request_occurrence, r_len, r_cont)
    else:
        sam, state, count, occurrence, length, spine = index.pool, p_state, index.pool_count, index.pool_occurrence, \
            p_len, p_cont
    branches = frequent_branches(sam, state, count, occurrence, branch_top, branch_max, skip=spine[0])
    return length, spine, branches, [chain_support(sam, state, count, c) for c in [spine, *branches]]


def chain_support(sam: SuffixAutomaton, state: int, count: Callable[[int], int], chain: Chain) -> list[tuple[int, int]]:
    """Per token of `chain` copied after the match `state`: (occurrences of the match extended through that token,
    occurrences of the match extended through the tokens before it), walking the automaton: the counts a suffix
    tree gives SuffixDecoding, whose ratio estimates each token's probability. Past the first token the
    automaton has not seen, (0, 0)."""
    out = []
    cur, n_cur = state, count(state)
    for tok in chain:
        nxt = sam.next[cur].get(tok) if cur >= 0 else None
        if nxt is None:
            out.append((0, n_cur))
            cur, n_cur = -1, 0
            continue
        n_next = count(nxt)
        out.append((n_next, n_cur))
        cur, n_cur = nxt, n_next
    return out


def automaton_chains(index: AutomatonIndex, spine_max: int = 32, branch_top: int = 3,
                     branch_max: int = 32) -> tuple[Chain, list[Chain]]:
    """The spine and the frequency branches of `automaton_match`, without the match length."""
    return automaton_match(index, spine_max, branch_top, branch_max)[1:]


class AutomatonPoolDrafter(Drafter):
    """The pool side shared by the automaton drafters (sam, suffix, lexical): `self.index` holds the
    pool and the request; finished traces enter keyed by their prompt hash (states unused)."""

    index: AutomatonIndex

    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None,
                  hidden: np.ndarray | None = None) -> None:
        self.index.add_trace(output, prompt_hash)

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        self.index.begin_request(prompt, prompt_hash)

    def evict_traces(self, count: int) -> None:
        """--store-budget: forget the oldest `count` pooled traces."""
        self.index.evict_traces(count)


@dataclass
class SamConfig:
    spine_max: int = 32  # tokens copied after the longest match
    branch_top: int = 3  # next most frequent branches at the match state
    branch_max: int = 32  # tokens per branch


class SamDrafter(AutomatonPoolDrafter):
    """Arm `sam`: the automaton's longest-match continuation, then its frequency branches."""

    name = "sam"
    Config = SamConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: SamConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or SamConfig()
        self.index = AutomatonIndex()

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.index.sync(context)
        c = self.config
        spine, branches = automaton_chains(self.index, c.spine_max, c.branch_top, c.branch_max)
        draft = Draft()
        for chain in [spine, *branches]:
            if len(draft) >= budget:
                break
            draft.add_chain(chain, self.name, budget)
        return draft

    def observe(self, context: Sequence[int], result) -> None:
        pass  # the automaton learns from the committed context at the next propose
