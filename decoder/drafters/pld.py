"""Prompt lookup decoding (Saxena 2023): copy what followed the context's last n-gram earlier in it.

The index maps every n-gram (n <= max_ngram) of the context to the end position of its most
recent occurrence, excluding the context's final position (whose n-grams are the query). It is
extended by the tokens committed since the last call, O(max_ngram) per token, so a cycle never
rescans the context. The longest n wins; within it, the most recent occurrence.

`PoolNgramIndex` is the same key over a pool of finished traces (the `pld+pool` and
`recycling+pool` transplant rungs, see decoder/drafters/oilbird.py): n-gram -> its most recent
occurrence and the most recent occurrence of another group (sam.py's `pos` / `pos2`), so that
skipping one excluded group (the request's own prompt hash) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from decoder.draft import Draft, Drafter
from decoder.drafters.sam import extends


@dataclass
class PldConfig:
    max_ngram: int = 3  # longest n-gram matched (then n-1, ..., 1)
    max_copy: int = 10  # tokens copied after the match


class NgramIndex:
    """n-gram -> end position of its most recent occurrence, over context positions before the last."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # end positions 0..indexed-1 are in `last`

    def sync(self, context: Sequence[int]) -> None:
        seen = len(self.tokens)
        if not extends(context, self.tokens):
            self.tokens, self.last, self.indexed, seen = [], {}, 0, 0
        self.tokens.extend(int(t) for t in context[seen:])
        toks, last = self.tokens, self.last
        for j in range(self.indexed, len(toks) - 1):
            for k in range(1, min(self.max_ngram, j + 1) + 1):
                last[tuple(toks[j - k + 1 : j + 1])] = j
        self.indexed = max(self.indexed, len(toks) - 1)

    def lookup(self, max_copy: int) -> list[int]:
        """What followed the most recent earlier occurrence of the longest matching suffix n-gram."""
        toks = self.tokens
        for k in range(min(self.max_ngram, len(toks)), 0, -1):
            j = self.last.get(tuple(toks[len(toks) - k :]))
            if j is not None:
                return toks[j + 1 : j + 1 + max_copy]
        return []


SEP = -1  # separates traces in `PoolNgramIndex.tokens`
NO_GROUP = -2  # an excluded group that matches nothing


class PoolNgramIndex:
    """n-gram (n <= max_ngram) -> its most recent end position in a pool of traces, outside one excluded group.

    Traces enter with `add_trace(tokens, group)` (group: a prompt hash; None = a group of its own, never
    excluded), flattened with a separator between them, so no n-gram and no copied continuation ever
    crosses a trace boundary. Only end positions followed by a token of the same trace are indexed
    (an occurrence with nothing after it has nothing to copy). Per n-gram, `pos` is the most recent
    end position and `pos2` the most recent one whose group differs from `pos`'s (-1 if none): for
    any single excluded group, one of the two is the most recent occurrence outside it.
    O(max_ngram) per added token; a lookup is O(max_ngram).
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.tokens: list[int] = []  # every trace, SEP between traces
        self.group: list[int] = []  # group id of each position (SEP positions: -1)
        self.occ: dict[tuple[int, ...], list[int]] = {}  # n-gram -> [pos, pos2]
        self._group_of: dict[Hashable, int] = {}
        self._n_groups = 0
        self.n_traces = 0
        self.n_tokens = 0  # trace tokens (separators not counted)
        self._traces: list[tuple[Hashable | None, int, int]] = []  # per add_trace: group, span in `tokens`

    def group_id(self, group: Hashable | None, create: bool = False) -> int:
        """The internal id of `group` (NO_GROUP if unknown and not created; None always gets a fresh id)."""
        if group is None and create:
            self._n_groups += 1
            return self._n_groups - 1
        gid = self._group_of.get(group, NO_GROUP)
        if gid == NO_GROUP and create:
            gid = self._group_of[group] = self._n_groups
            self._n_groups += 1
        return gid

    def add_trace(self, tokens: Sequence[int], group: Hashable | None = None) -> None:
        if not len(tokens):
            self._traces.append((group, 0, 0))  # counted, so evict_traces counts requests
            return
        gid = self.group_id(group, create=True)
        if self.tokens:
            self.tokens.append(SEP)
            self.group.append(-1)
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        self._traces.append((group, start, len(self.tokens)))
        self.group.extend([gid] * len(tokens))
        self.n_traces += 1
        self.n_tokens += len(tokens)
        toks, grp, occ = self.tokens, self.group, self.occ
        for j in range(start, len(toks) - 1):  # end positions with a next token in this trace
            for k in range(1, min(self.max_ngram, j - start + 1) + 1):
                key = tuple(toks[j - k + 1 : j + 1])
                entry = occ.get(key)
                if entry is None:
                    occ[key] = [j, -1]
                    continue
                if grp[entry[0]] != gid:
                    entry[1] = entry[0]
                entry[0] = j

    def evict_traces(self, count: int) -> None:
        """Drop the oldest `count` traces (--store-budget): the index is rebuilt from the others."""
        count = min(count, len(self._traces))
        if count <= 0:
            return
        tokens, kept = self.tokens, self._traces[count:]
        self.__init__(self.max_ngram)
        for group, a, b in kept:
            self.add_trace(tokens[a:b], group)

    def occurrence(self, ngram: Sequence[int], excluded: int = NO_GROUP) -> int:
        """The most recent end position of `ngram` outside internal group `excluded` (-1 if none)."""
        entry = self.occ.get(tuple(int(t) for t in ngram))
        if entry is None:
            return -1
        p = entry[0]
        return entry[1] if self.group[p] == excluded else p

    def continuation(self, pos: int, max_copy: int) -> list[int]:
        """Up to max_copy tokens after position `pos`, stopping at the end of its trace."""
        seg = self.tokens[pos + 1 : pos + 1 + max(0, max_copy)]
        if SEP in seg:
            seg = seg[: seg.index(SEP)]
        return seg

    def lookup(self, context: Sequence[int], max_n: int, max_copy: int,
               excluded_group: Hashable | None = None, min_n: int = 1) -> list[int]:
        """What followed, in the pool, the longest suffix n-gram (min_n <= n <= min(max_n, max_ngram)) of
        `context`: its most recent occurrence outside `excluded_group` (a prompt hash; None excludes nothing),
        up to `max_copy` tokens. A longer n-gram found only in the excluded group backs off to shorter n."""
        if max_copy <= 0 or not self.occ:
            return []
        excluded = NO_GROUP if excluded_group is None else self.group_id(excluded_group)
        n_ctx = len(context)
        for k in range(min(max_n, self.max_ngram, n_ctx), max(1, min_n) - 1, -1):
            p = self.occurrence(context[n_ctx - k :], excluded)
            if p >= 0:
                return self.continuation(p, max_copy)
        return []


class PldDrafter(Drafter):
    """Arm `pld`: one chain copied from the current request's own context (no cross-request pool: the
    contract's defaults add, evict and observe nothing)."""

    name = "pld"
    Config = PldConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: PldConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or PldConfig()
        self.index = NgramIndex(self.config.max_ngram)

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        self.index = NgramIndex(self.config.max_ngram)
        self.index.sync(prompt)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.index.sync(context)
        draft = Draft()
        draft.add_chain(self.index.lookup(min(self.config.max_copy, budget)), self.name, budget)
        return draft
