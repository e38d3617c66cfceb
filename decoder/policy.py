"""The decision policy, written once: the arms the decision compares, the verdict's thresholds and the
target rule.

Every command and page that decides or states a decision reads it from here: the verdict
(decoder/verdict.py: enable the semantic source?), the replay's default arms and pairing
(decoder/replay.py), the ablations' `target_met` (decoder/ablations.py) and the reports' decision
block, evidence page and grid (reports/). It imports nothing but the standard library.

The arms:
  ON_ARM / OFF_ARM   oilbird, the merged drafter with the semantic key, and oilbird-no-semantic, the
                     same drafter with the key never queried: the paired comparison the verdict reads
  DECISION_ARMS      what `make census` replays: the key on and off, and the lexical baselines (our
                     SuffixDecoding, the published one in tree mode, our lexical tree)
  LEXICAL_ARMS       the lexical baselines (the ablations' headline); the best lexical arm is the one of
                     these with the highest tau

The verdict's thresholds (the paper's lines, section "Generality"; the rule itself is
decoder/verdict.py): ENABLE_SHARE, OFF_SHARE and SPEED_MARGIN.

The target: tau(oilbird) / tau(best lexical arm) >= TARGET_RATIO (1.25) with the paired 95% interval's
lower end above TARGET_LOWER (1): "met"; below the ratio, or a paired interval whose lower end is not
above 1: "not met"; at or above the ratio without a paired interval: "not established" (a run without
bootstrap draws cannot show the lower end, so `target_met` is false for it).
"""

from __future__ import annotations

import math

ON_ARM = "oilbird"  # the merged drafter, the semantic key on
OFF_ARM = "oilbird-no-semantic"  # ... the key never queried, everything else equal
# suffix-arctic-tree: the published SuffixDecoding cache (ArcticInference) in tree mode, which replays above our
# `suffix` on API-Bank (7.83 against 6.86): the best lexical arm is the stronger of the two
DECISION_ARMS = ("suffix", "suffix-arctic-tree", "lexical", ON_ARM, OFF_ARM)
LEXICAL_ARMS = ("suffix", "suffix-arctic-tree", "suffix-arctic", "sam", "lexical", "recycling", "pld")

ENABLE_SHARE = 0.09  # sole-source share at or above which the semantic source pays (paper, "Generality")
OFF_SHARE = 0.03  # ... below which it does not
SPEED_MARGIN = 1.02  # oilbird slower than oilbird-no-semantic by more than 2%: the key costs more than it saves

TARGET_RATIO = 1.25  # tau(oilbird) over the best lexical arm's that would make the key clearly worth its cost
TARGET_LOWER = 1.0  # ... with the paired interval's lower end above this
TARGET_RULE = (f"tau({ON_ARM}) ≥ {TARGET_RATIO:g}× the best lexical arm's, with the paired 95% interval's "
               f"lower end above {TARGET_LOWER:g}")
TARGET_STATUSES = ("met", "not met", "not established")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def target_interval(iv) -> list | None:
    """The paired interval as the target reads it: two finite numbers, else None (not known)."""
    return iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(map(_finite, iv)) else None


def target_status(ratio, interval) -> str:
    """One of TARGET_STATUSES for oilbird / best lexical = `ratio` with its paired 95% `interval`; a ratio
    that is not a finite number is "not established"."""
    if not _finite(ratio):
        return "not established"
    iv = target_interval(interval)
    if ratio < TARGET_RATIO or (iv is not None and iv[0] <= TARGET_LOWER):
        return "not met"
    return "met" if iv is not None else "not established"
