"""The decision policy, written once: the arms the decision compares, the verdict's thresholds and the
target rule.

Every command and page that decides or states a decision reads it from here: the verdict
(decoder/verdict.py: enable the semantic source?), the replay's default arms and pairing
(decoder/replay/run.py), the ablations' `target_met` (decoder/replay/ablations.py) and the reports' decision
block, evidence page and grid (reports/). It imports nothing but the standard library.

The arms:
  ON_ARM / OFF_ARM   oilbird, the merged drafter with the semantic key, and oilbird-no-semantic, the
                     same drafter with the key never queried: the paired comparison the verdict reads
  DECISION_ARMS      what `make census` replays for the harness (a tree engine): the key on and off, sized
                     by the engine's cost and at the fixed budget, and the lexical baselines (our
                     SuffixDecoding, the published one in tree mode, our lexical tree)

The form the engine verifies (`ENGINE_FORMS`): the harness verifies trees, vLLM one chain per request. The
decision compares the key on and off in that form (`FORM_PAIRS`) and names the fastest arm the engine can
run among `decision_arms(engine, batch sizes)`: for vLLM the Oilbird chains (sized per batch size the
profile measured, `@batch=B`), vLLM's own `suffix` method (suffix-arctic: ArcticInference with vLLM's
settings) and prompt lookup (`pld`, the `ngram` method's rule); for the harness the trees above.
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
DECISION_ARMS = ("suffix", "suffix-arctic-tree", "lexical", ON_ARM, OFF_ARM, "oilbird-fixed", "oilbird-no-semantic-fixed")
ENGINE_FORMS = {"harness": "tree", "vllm": "chain"}  # engine -> the form of draft it verifies
FORM_PAIRS = {"tree": (ON_ARM, OFF_ARM), "chain": ("oilbird-chain", "oilbird-no-semantic-chain")}
FORM_ARMS = {"tree": DECISION_ARMS, "chain": ("suffix-arctic", "pld", *FORM_PAIRS["chain"])}
# an Oilbird arm -> the arm its paired gain is measured against (variants pair with the same variant)
PAIRS = {ON_ARM: OFF_ARM, "oilbird-chain": "oilbird-no-semantic-chain", "oilbird-fixed": "oilbird-no-semantic-fixed"}
LEXICAL_ARMS = ("suffix", "suffix-arctic-tree", "suffix-arctic", "sam", "lexical", "recycling", "pld")

ENABLE_SHARE = 0.09  # sole-source share at or above which the semantic source pays (paper, "Generality")
OFF_SHARE = 0.03  # ... below which it does not
SPEED_MARGIN = 1.02  # oilbird slower than oilbird-no-semantic by more than 2%: the key costs more than it saves

TARGET_RATIO = 1.25  # tau(oilbird) over the best lexical arm's that would make the key clearly worth its cost
TARGET_LOWER = 1.0  # ... with the paired interval's lower end above this
TARGET_RULE = (f"tau({ON_ARM}) ≥ {TARGET_RATIO:g}× the best lexical arm's, with the paired 95% interval's "
               f"lower end above {TARGET_LOWER:g}")
TARGET_STATUSES = ("met", "not met", "not established")


def engine_form(engine: str | None) -> str:
    """The form of draft an engine verifies: tree (the harness, and an unknown engine) or chain (vLLM)."""
    return ENGINE_FORMS.get(engine or "harness", "tree")


def decision_arms(engine: str | None, batch_sizes=(1,)) -> tuple[str, ...]:
    """What `make census` replays for `engine`: the form's arms, and the key on and off sized for every
    other batch size the profile measured (`arm@batch=B`)."""
    form = engine_form(engine)
    on, off = FORM_PAIRS[form]
    extra = [f"{a}@batch={b}" for b in batch_sizes if b > 1 for a in (on, off)]
    return (*FORM_ARMS[form], *extra)


def paired_arm(arm: str) -> str | None:
    """The arm `arm`'s paired gain is measured against: PAIRS, a variant with the same variant (None: none)."""
    base, at, tail = arm.partition("@")
    other = PAIRS.get(base)
    return None if other is None else other + at + tail


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
