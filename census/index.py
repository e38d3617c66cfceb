"""The lexical pool's answers: a pool view over data/index/automaton.py's suffix automata.

The pool's traces are held in `SuffixAutomaton(count_len, positions=False)`: one sequence per
pooled trace's generated tokens (no match crosses a request boundary), grown trace by trace as
requests join the pool, never rescanning what it already holds (amortised O(1) per added token),
with counts exact for strings of at most `count_len` tokens (all the census asks).

Exclusion. A pool is "every pooled trace except some" (earlier traces with the same prompt_hash;
in warm mode the request's own hash group; with a store budget, the traces that left the window).
`PoolView` answers over `main` minus a list of subtracted automata, each holding only excluded
traces (disjoint sets of traces that `main` holds): count_pool(v) = count_main(v) - sum of
count_sub(v), exact because each counts the same occurrences of v in its own traces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.index.automaton import SuffixAutomaton


@dataclass
class LexicalRow:
    """Lexical answers for one request: arrays over its generated positions."""

    available: np.ndarray  # bool
    producible: np.ndarray  # bool
    oracle_suffix_len: np.ndarray  # int32
    longest_match_len: np.ndarray  # int32


def shorten(states: list[int], matched: list[int], links: list, lens: list, L: int) -> list[int]:
    """Each subtracted automaton's state moved down its suffix links to the one holding the
    length-L suffix (updated in `states`), or 0 where its match is shorter than L (nothing to subtract)."""
    out = []
    for i, g in enumerate(states):
        if L <= matched[i]:
            li, ni = links[i], lens[i]
            while ni[li[g]] >= L:
                g = li[g]
            states[i] = g
            out.append(g)
        else:
            out.append(0)
    return out


class PoolView:
    """The pool as `main` minus the `subtracted` automata (disjoint sets of main's traces)."""

    def __init__(self, main: SuffixAutomaton,
                 subtracted: SuffixAutomaton | list[SuffixAutomaton] | None = None):
        if subtracted is None:
            subtracted = []
        elif isinstance(subtracted, SuffixAutomaton):
            subtracted = [subtracted]
        self.main = main
        self.subtracted = [e for e in subtracted if e.n_sequences]  # an empty one subtracts nothing

    def count(self, seq) -> int:
        n = self.main.occurrences(seq)
        if n:
            for e in self.subtracted:
                n -= e.occurrences(seq)
        return n

    def prefix_len(self, seq, cap: int) -> int:
        """Longest prefix of seq (at most cap tokens) occurring in the pool."""
        m, subs = self.main, self.subtracted
        s, L = 0, 0
        gs = [0] * len(subs)  # state in each subtracted automaton, -1 once the prefix left it
        for a in seq[:cap]:
            a = int(a)
            s = m.next[s].get(a, -1)
            if s < 0:
                break
            n = m.count[s]
            for i, e in enumerate(subs):
                g = gs[i]
                if g >= 0:
                    g = gs[i] = e.next[g].get(a, -1)
                    if g > 0:
                        n -= e.count[g]
            if n <= 0:
                break
            L += 1
        return L

    def lexical_pass(self, prompt, output, *, horizon: int, min_suffix: int, max_suffix: int,
                     candidates: int) -> LexicalRow:
        """available / producible / oracle_suffix_len / longest_match_len at every generated position.

        One left-to-right walk over prompt + output keeps, in each automaton, the state of the
        longest context suffix (capped at max_suffix) that occurs there (matching statistics);
        the oracle's back-off reads the shorter suffixes off the suffix links. Follower lists are
        memoised per tuple of states (main, then each subtracted automaton; 0 where the suffix
        does not occur there): every string of one tuple has the same followers with the same
        counts, so a back-off step that stays in the tuple adds nothing.

        One function, not several: the four answers share the walk's state (every automaton's
        matched suffix), and this is the census's innermost loop, kept on local names.
        """
        m, subs = self.main, self.subtracted
        nxt, link, length, cnt = m.next, m.link, m.length, m.count
        S = len(subs)
        snxt = [e.next for e in subs]
        slink = [e.link for e in subs]
        slen = [e.length for e in subs]
        scnt = [e.count for e in subs]
        M = max_suffix
        out = [int(x) for x in output]
        ctx = [int(x) for x in prompt] + out
        P, n = len(prompt), len(out)
        available = np.zeros(n, bool)
        producible = np.zeros(n, bool)
        oracle_len = np.zeros(n, np.int32)
        longest = np.zeros(n, np.int32)
        memo: dict[tuple, list[int]] = {}

        def followers(key: tuple) -> list[int]:
            sm = key[0]
            items = []
            for a, t in nxt[sm].items():
                if a < 0:
                    continue
                c = cnt[t]
                for i in range(S):
                    sg = key[i + 1]
                    if sg > 0:
                        tg = snxt[i][sg].get(a)
                        if tg is not None:
                            c -= scnt[i][tg]
                if c > 0:
                    items.append((-c, a))  # most frequent first, ties to the smaller token id
            items.sort()
            return [a for _, a in items]

        s = l = 0  # main: state and length of the longest matched context suffix
        g = [0] * S  # each subtracted automaton: the same
        lg = [0] * S
        for j in range(P + n):
            if j >= P:
                t = j - P
                x = out[t]
                # available: the h-token future (shorter at the end) occurs in the pool
                fut = out[t:t + horizon]
                sm = m.state_of(fut)
                if sm > 0:
                    c = cnt[sm]
                    for e in subs:
                        sg = e.state_of(fut)
                        if sg > 0:
                            c -= e.count[sg]
                    available[t] = c > 0
                # longest context suffix occurring in the pool (<= max_suffix)
                if not S:
                    longest[t] = l
                else:
                    L, sL, gL = l, s, list(g)
                    while L > 0:
                        while length[link[sL]] >= L:
                            sL = link[sL]
                        c = cnt[sL]
                        for i, gi in enumerate(shorten(gL, lg, slink, slen, L)):
                            if gi:
                                c -= scnt[i][gi]
                        if c > 0:
                            break
                        L -= 1
                    longest[t] = L
                # the exact-match oracle, longest suffix first, backing off while < candidates
                cands: list[int] = []
                found = used = 0
                prev = None
                sL, gL = s, list(g)
                for L in range(l, min_suffix - 1, -1):
                    while length[link[sL]] >= L:
                        sL = link[sL]
                    key = (sL, *shorten(gL, lg, slink, slen, L))
                    if key == prev:
                        continue
                    prev = key
                    fol = memo.get(key)
                    if fol is None:
                        fol = memo[key] = followers(key)
                    if not fol:
                        continue
                    if not used:
                        used = L
                    for a in fol:
                        if a not in cands:
                            cands.append(a)
                            if a == x:
                                found = L
                            if len(cands) >= candidates:
                                break
                    if len(cands) >= candidates:
                        break
                producible[t] = found > 0
                oracle_len[t] = found if found else used
            if j == P + n - 1:
                break
            # extend the matched suffix by the next context token (matching statistics)
            c = ctx[j]
            s, l = m.step(s, l, c, M)
            for i, e in enumerate(subs):
                g[i], lg[i] = e.step(g[i], lg[i], c, M)
        return LexicalRow(available, producible, oracle_len, longest)
