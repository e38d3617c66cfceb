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

`RequestPatience` goes quiet inside a request that has stopped paying (its docstring has the rule and
the measurement behind it).
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
    """Query the key only where it can pay, judged inside the request: after `patience` passes in a row
    without a hit (a pass hits when a node the key bought is accepted; a pass that did not query
    misses), the key is queried only on every `probe_every`-th pass until it hits again; a new request
    starts fresh. Measured on the whole API-Bank store (docs/decoder.md, "Query only where it can
    pay"): passes 12 or more since the request's last hit held 17% of the key's queries and 1.4% of the
    tokens it alone placed on the accepted path. `patience` 0 = always query."""

    patience: int = 8
    probe_every: int = 4
    since_hit: int = 0  # passes since this request's last hit (or its start)
    quiet_for: int = 0  # quiet passes in a row
    skipped: int = 0  # queries skipped so far (every request)
    probes: int = 0  # queries made while quiet

    def begin(self) -> None:
        self.since_hit, self.quiet_for = 0, 0

    def allow(self) -> bool:
        """Called once per pass that would query the key."""
        if self.patience <= 0 or self.since_hit < self.patience:
            self.quiet_for = 0
            return True
        self.quiet_for += 1
        if (self.quiet_for - 1) % max(1, self.probe_every) == 0:
            self.probes += 1
            return True
        self.skipped += 1
        return False

    def record(self, hit: bool) -> None:
        """Every pass's outcome."""
        self.since_hit = 0 if hit else self.since_hit + 1
