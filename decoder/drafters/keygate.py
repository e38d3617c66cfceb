"""When the semantic key is asked: two gates over its per-pass outcomes (decoder/drafters/oilbird.py).

`SelfCalibration` mutes the key where its drafts are rarely accepted:
  - outcome: one per pass in which the key bought at least one node (added a node no other source
    had placed); a hit when any node it bought was accepted;
  - window: the last `window` (32) outcomes;
  - threshold: once the window is full and its hit rate is below `min_hit_rate` (1/32: not one hit
    in 32 buying passes), the key is muted. Deliberately lenient: a hit is worth several tokens
    while a miss costs only reserved nodes, and on stories260k traffic (names minted into a
    repeated frame; 12% of buying passes hit) a 2-in-16 rule muted a key that paid (tau 4.03 vs
    4.16 unmuted), 1-in-32 gave 4.14;
  - recovery: a muted key skips the next `cooldown` (64) passes that would have queried it, then
    returns on probation with an empty window (it needs another full window to be muted again).
The state is global across requests (a traffic's regime is a property of the traffic).

`RequestPatience` goes quiet inside a request that has stopped paying, and for a few passes after an answer
too far to pay (its docstring has the rules and the measurements behind them).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class SelfCalibration:
    """Mutes the key when, over its last `window` buying passes, fewer than `min_hit_rate` had a bought
    node accepted; a muted key skips `cooldown` passes, then returns with an empty window."""

    window: int = 32
    min_hit_rate: float = 1 / 32
    cooldown: int = 64
    outcomes: collections.deque = field(init=False)  # the last `window` outcomes
    muted_for: int = 0  # passes left to skip
    mutes: int = 0  # times muted so far
    skipped: int = 0  # passes skipped so far

    def __post_init__(self) -> None:
        self.outcomes = collections.deque(maxlen=max(0, self.window))

    def allow(self) -> bool:
        """Called once per pass that would query the key: False while muted (and counts the skip)."""
        if self.window <= 0:
            return True
        if self.muted_for > 0:
            self.muted_for -= 1
            self.skipped += 1
            return False
        return True

    def record(self, hit: bool) -> None:
        """The outcome of a pass in which the key bought nodes."""
        if self.window <= 0:
            return
        self.outcomes.append(bool(hit))
        if len(self.outcomes) == self.window and sum(self.outcomes) < self.min_hit_rate * self.window:
            self.muted_for = self.cooldown
            self.mutes += 1
            self.outcomes.clear()


@dataclass
class RequestPatience:
    """Query the key only where it can pay, judged inside the request, by two rules (a new request starts
    fresh; `patience` 0 = always query, both rules off):
      - patience: after `patience` passes in a row without a hit (a pass hits when a node the key bought is
        accepted; a pass that did not query misses), the key is queried only on every `probe_every`-th pass
        until it hits again. Measured on the whole API-Bank store (docs/decoder.md, "Query only where it can
        pay"): passes 12 or more since the request's last hit held 17% of the key's queries and 1.4% of the
        tokens it alone placed on the accepted path;
      - floor: a query whose nearest neighbour is below cosine `floor` makes the key skip the next `floor_skip`
        passes. Measured there (the key asked on every pass): queries that followed such an answer held 14%
        of the queries and 2% of the key's sole tokens; the key's tokens come from near-duplicate states
        (84% from queries whose best cosine was >= 0.98)."""

    patience: int = 8
    probe_every: int = 4
    floor: float = 0.0
    floor_skip: int = 0
    since_hit: int = 0  # passes since this request's last hit (or its start)
    quiet_for: int = 0  # quiet passes in a row
    low_for: int = 0  # passes still to skip after an answer below the floor
    skipped: int = 0  # queries skipped so far (every request; the floor's skips included)
    floor_skipped: int = 0  # of which after an answer below the floor
    probes: int = 0  # queries made while quiet
    _held: bool = False  # this pass was held back by the floor

    def begin(self) -> None:
        self.since_hit, self.quiet_for, self.low_for = 0, 0, 0

    def allow(self) -> bool:
        """Called once per pass that would query the key."""
        if self.patience <= 0:
            return True
        if self.low_for > 0:
            self.low_for -= 1
            self.skipped += 1
            self.floor_skipped += 1
            self._held = True
            return False
        if self.since_hit < self.patience:
            self.quiet_for = 0
            return True
        self.quiet_for += 1
        if (self.quiet_for - 1) % max(1, self.probe_every) == 0:
            self.probes += 1
            return True
        self.skipped += 1
        return False

    def answered(self, best: float) -> None:
        """A query's best cosine (called when it found a neighbour)."""
        if self.patience > 0 and best < self.floor:
            self.low_for = self.floor_skip

    def record(self, hit: bool) -> None:
        """Every pass's outcome (a pass the floor held back is not a miss: the two rules do not compound)."""
        if hit:
            self.since_hit = 0
        elif not self._held:
            self.since_hit += 1
        self._held = False

    def suspend(self) -> tuple[int, int, int]:
        return self.since_hit, self.quiet_for, self.low_for

    def resume(self, saved: tuple[int, int, int]) -> None:
        self.since_hit, self.quiet_for, self.low_for = saved
