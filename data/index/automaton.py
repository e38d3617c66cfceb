"""The suffix automaton over pooled token sequences: one structure for the census and the drafters.

`SuffixAutomaton` is a generalized suffix automaton built online: `start_sequence()` then
`extend(token, group)` per token (or `add_sequence(tokens, group)`), O(1) amortized for the
automaton itself. Each sequence is inserted from the root, so no matched string ever crosses a
sequence boundary. Beside the transitions every state keeps
  - `count`: |endpos|, the number of occurrences of its strings (SuffixDecoding's node count);
  - `pos`: the most recent end position of its strings in `text` (with `positions=True`);
  - `pos2`: the most recent end position whose group differs from `pos`'s group (-1 if none).
`pos2` makes exclusion exact: for any single excluded group, `pos` or `pos2` is the most recent
occurrence outside it.

Which states are counted. A new end position belongs to every state on the suffix-link chain of the
new text. Walking the whole chain costs its length (a few states on natural text, up to the period
count on looping text); the drafters do that (`count_len=None`, exact counts everywhere). The census
only asks counts of strings of at most `count_len` tokens, so with `count_len=K` only the chain from
`tail` (the state of the last min(K, sequence length) tokens) is walked, at most K states per token.
A state whose shortest string is longer than K then keeps a stale count (and stale positions) that
nothing reads: its shortest length only grows, and a clone of it is as long, so it never becomes
readable again.
"""

from __future__ import annotations

from typing import Sequence

SEP = -1  # separates sequences in `SuffixAutomaton.text`; never a transition
NO_GROUP = -2  # an excluded group that matches nothing


class SuffixAutomaton:
    """Generalized suffix automaton over token sequences, with occurrence counts and, optionally,
    recent end positions (module docstring).

    count_len: counts are kept exact for strings of at most this many tokens (None: all strings).
    positions: keep `text`, `group`, `pos` and `pos2` (the drafters copy continuations from them;
    the census only counts).
    """

    def __init__(self, count_len: int | None = None, positions: bool = True) -> None:
        self.count_len = None if count_len is None else int(count_len)
        self.positions = positions
        self.length: list[int] = [0]  # longest string of the state
        self.link: list[int] = [-1]  # suffix link
        self.next: list[dict[int, int]] = [{}]  # transitions
        self.count: list[int] = [0]  # |endpos| (the root's is not kept)
        self.pos: list[int] = [-1]  # most recent end position in `text`
        self.pos2: list[int] = [-1]  # most recent end position with a group other than pos's
        self.text: list[int] = []  # every token extended, SEP between sequences (positions only)
        self.group: list[int] = []  # group id of each text position (SEP positions: -1)
        self.last = 0  # state of the current sequence so far
        self.tail = 0  # state of the current sequence's last tail_len tokens (the counted chain's head)
        self.tail_len = 0  # min(count_len, current sequence length)
        self.n_sequences = 0  # sequences started (empty ones included)

    def __len__(self) -> int:
        return len(self.length)

    def start_sequence(self) -> None:
        if self.positions and self.text and self.text[-1] != SEP:
            self.text.append(SEP)
            self.group.append(-1)
        self.last = self.tail = self.tail_len = 0
        self.n_sequences += 1

    def add_sequence(self, tokens: Sequence[int], group: int = 0) -> None:
        self.start_sequence()
        for t in tokens:
            self.extend(int(t), group)

    def _clone(self, p: int, q: int, token: int) -> int:
        c = len(self.length)
        self.length.append(self.length[p] + 1)
        self.link.append(self.link[q])
        self.next.append(dict(self.next[q]))
        self.count.append(self.count[q])  # before the split, the shorter strings shared q's endpos
        self.pos.append(self.pos[q])
        self.pos2.append(self.pos2[q])
        nxt = self.next
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = c
            p = self.link[p]
        self.link[q] = c
        if self.tail == q and self.tail_len <= self.length[c]:
            self.tail = c  # the counted suffix moved into the clone
        return c

    def extend(self, token: int, group: int = 0) -> None:
        """Append `token` to the current sequence (group: who this occurrence belongs to)."""
        length, link, nxt = self.length, self.link, self.next
        p = self.last
        q = nxt[p].get(token)
        if q is not None:  # the sequence so far already occurs (only near a sequence start)
            cur = q if length[q] == length[p] + 1 else self._clone(p, q, token)
        else:
            cur = len(length)
            length.append(length[p] + 1)
            link.append(0)
            nxt.append({})
            self.count.append(0)
            self.pos.append(-1)
            self.pos2.append(-1)
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][token]
                link[cur] = q if length[q] == length[p] + 1 else self._clone(p, q, token)
        self.last = cur
        K = self.count_len
        if K is None:
            tail = cur
        else:  # the state of the last min(K, n) tokens: one transition, then at most one link down
            tail = nxt[self.tail][token]
            self.tail_len += 1
            if self.tail_len > K:
                self.tail_len = K
                if length[link[tail]] >= K:
                    tail = link[tail]
        self.tail = tail
        count = self.count
        v = tail
        if not self.positions:
            while v > 0:  # every counted state holding a suffix of the new text gains an end position
                count[v] += 1
                v = link[v]
            return
        i = len(self.text)
        self.text.append(token)
        self.group.append(group)
        pos, pos2, grp = self.pos, self.pos2, self.group
        while v > 0:
            count[v] += 1
            pv = pos[v]
            if pv >= 0 and grp[pv] != group:
                pos2[v] = pv
            pos[v] = i
            v = link[v]

    # -------------------------------------------------------------- reading

    def state_of(self, tokens: Sequence[int]) -> int:
        """The state holding exactly `tokens` (0 for the empty string), or -1 if it never occurs."""
        state = 0
        nxt = self.next
        for t in tokens:
            state = nxt[state].get(int(t), -1)
            if state < 0:
                return -1
        return state

    def occurrences(self, tokens: Sequence[int]) -> int:
        """Occurrences of `tokens` in the sequences (0 for the empty string)."""
        if self.count_len is not None and len(tokens) > self.count_len:
            raise ValueError(f"counts are kept for strings of at most {self.count_len} tokens")
        state = self.state_of(tokens)
        return self.count[state] if state > 0 else 0

    def step(self, state: int, matched: int, token: int, cap: int | None = None) -> tuple[int, int]:
        """One matching-statistics step: from `state` matching a suffix of length `matched`, the
        (state, length) of the longest suffix of (matched text + token) present, the length capped
        at `cap` (then the state is the one holding the length-cap suffix)."""
        nxt, link = self.next, self.link
        while state and token not in nxt[state]:
            state = link[state]
            matched = self.length[state]
        q = nxt[state].get(token)
        if q is None:
            return 0, 0
        matched += 1
        if cap is not None and matched > cap:
            matched = cap
            if self.length[link[q]] >= cap:
                q = link[q]
        return q, matched

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `tokens` present."""
        state = matched = 0
        for t in tokens:
            state, matched = self.step(state, matched, int(t))
        return state, matched

    def shorten(self, state: int, matched: int, cap: int) -> tuple[int, int]:
        """The state of the length-`cap` suffix of a match longer than `cap`."""
        if matched <= cap:
            return state, matched
        while self.length[self.link[state]] >= cap:
            state = self.link[state]
        return state, cap

    def continuation(self, pos: int, k: int) -> list[int]:
        """Up to k tokens after text position `pos`, stopping at the end of its sequence."""
        seg = self.text[pos + 1 : pos + 1 + k]
        if SEP in seg:
            seg = seg[: seg.index(SEP)]
        return seg

    def occurrence(self, state: int, excluded: int = NO_GROUP) -> int:
        """The most recent end position of `state` outside group `excluded` (-1 if none)."""
        p = self.pos[state]
        if p >= 0 and self.group[p] == excluded:
            p = self.pos2[state]
        return p

    def counts_within(self, spans: Sequence[tuple[int, int]]) -> dict[int, int]:
        """Per state, how many of its occurrences end inside text[start:end] for the given sequences."""
        out: dict[int, int] = {}
        for start, end in spans:
            state = 0
            for i in range(start, end):
                state = self.next[state][self.text[i]]
                v = state
                while v > 0:
                    out[v] = out.get(v, 0) + 1
                    v = self.link[v]
        return out
