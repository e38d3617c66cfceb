"""The training-free drafters, one per arm, each a `decoder.draft.Drafter` (the one contract).

Every drafter is a thin class around pure functions in its module; on the contract's methods:
  - `begin_request(prompt, prompt_hash=None)`: pool traces added under the same prompt hash
    (default: `data.store.schema.prompt_hash(prompt)`) are never drafted from during this request; the
    automaton arms exclude them at match time (see `sam.AutomatonIndex`), the +pool arms
    likewise (`pld.PoolNgramIndex`);
  - `add_trace(output, prompt_hash=None, hidden=None)`: put a finished trace in the pool (None: never
    excluded); the request runner (decoder/loop.py) keys served and `--warm-from` traces alike by
    their prompt's hash;
  - `evict_traces(count)`: forget the oldest `count` pooled traces (one per add_trace, empty ones
    included), the --store-budget window (decoder/pools.py); state that is not a trace pool (the
    adjacency table, bounded by the vocabulary; the ring buffer, by its capacity) stays.

    make_drafter("lexical", vocab_size=lm.vocab_size, nodes=60, adjacency_reserve=16)

The Oilbird arms (`oilbird` and its ablations, see decoder/drafters/oilbird.py) are one drafter
class under named presets: `ARM_PRESETS` maps an arm name to OilbirdConfig options, and
`make_drafter` accepts those names too (`arm_names()` lists every arm). sizing.py sizes a draft by the
engine's cost: the tree (or chain) that maximises expected tokens per second.

May import: data and the top-level decoder modules (draft, calibration). Imported by verify, cost, replay, vllm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from data.errors import OilbirdError
from decoder.draft import Draft, Drafter
from decoder.drafters.lexical import LexicalDrafter
from decoder.drafters.oilbird import OilbirdDrafter
from decoder.drafters.oilbird_config import ARM_PRESETS
from decoder.drafters.pld import PldDrafter
from decoder.drafters.recycling import RecyclingDrafter
from decoder.drafters.sam import SamDrafter
from decoder.drafters.suffix import SuffixDrafter
from decoder.drafters.suffix_arctic import ARCTIC_PRESETS, SuffixArcticDrafter
from decoder.drafters.toolspec import TOOLSPEC_PRESETS, ToolSpecDrafter


@dataclasses.dataclass
class NoConfig:
    pass


class NullDrafter(Drafter):
    """Arm `ar`: drafts nothing, so every pass commits exactly the model's own next token."""

    name = "ar"
    Config = NoConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: NoConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft()


DRAFTERS = {
    "ar": NullDrafter,
    "pld": PldDrafter,
    "suffix": SuffixDrafter,
    "sam": SamDrafter,
    "recycling": RecyclingDrafter,
    "lexical": LexicalDrafter,
    "oilbird": OilbirdDrafter,
    "suffix-arctic": SuffixArcticDrafter,
    "toolspec": ToolSpecDrafter,
}

# drafter -> the optional package it needs (the `arctic` extra, built by `make install`); every other drafter
# needs only the core dependencies
NEEDS = {"suffix-arctic": "arctic_inference"}


def installed(drafter: str) -> bool:
    """Whether a drafter of DRAFTERS can be built here (its optional package imports); tests at the dependency
    floors (make test-floor) run the drafters that can, and tests/test_suffix_arctic.py fails where it cannot."""
    import importlib.util

    need = NEEDS.get(drafter)
    return need is None or importlib.util.find_spec(need) is not None


# arm name -> (drafter in DRAFTERS, Config options): the Oilbird ablations, then the other drafters' presets
PRESETS = {name: ("oilbird", options) for name, options in ARM_PRESETS.items() if name not in DRAFTERS}
PRESETS.update({name: ("suffix-arctic", options) for name, options in ARCTIC_PRESETS.items()})
PRESETS.update({name: ("toolspec", options) for name, options in TOOLSPEC_PRESETS.items()})


def arm_names() -> list[str]:
    """Every arm make_drafter knows: the drafters, then the presets."""
    return [*DRAFTERS, *PRESETS]


def parse_variant(name: str) -> tuple[str, dict[str, str]]:
    """An arm variant `arm@field=value:field=value` (e.g. `oilbird@theta=0.7:k=4`): the arm and the
    Config fields it overrides, values as written (`variant_options` converts them)."""
    arm, _, tail = name.partition("@")
    opts: dict[str, str] = {}
    for part in [p for p in tail.split(":") if p] if tail else []:
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise OilbirdError(f"arm variant {name!r}: write arm@field=value[:field=value...], e.g. oilbird@theta=0.7")
        opts[key] = value
    if "@" in name and not opts:
        raise OilbirdError(f"arm variant {name!r} sets no field; e.g. oilbird@theta=0.7")
    return arm, opts


# The values an arm variant's numeric field may take (`arm@field=value`): a NaN or a value outside these
# was taken silently and changed results (oilbird@theta=nan: sole-source share 8.1% -> 0.6%, issue 35).
# Every numeric Config field of every drafter is named here (tests/test_trust_exits.py checks it);
# None: no bound on that side. Cosines are in [-1, 1], probabilities and rates in [0, 1]; counts are
# 0 or more, and 1 or more where a count divides or sizes a container (k neighbours, a ring, a batch).
COSINES = ("theta", "rollout_theta", "key_floor")
RATES = ("min_token_prob", "calib_min_hit_rate")
AT_LEAST_ONE = ("k", "batch", "ring_size", "key_probe_every", "memory_k")
COUNTS = ("max_ngram", "max_copy", "max_depth", "max_match", "spine_max", "branch_top", "branch_max",
          "template_nodes", "adjacency_reserve", "retrieval_budget", "offset", "min_chain", "pld_max_ngram",
          "pld_max_copy", "rollouts", "root_branching", "rollout_depth", "request_traces", "request_ngram",
          "calib_window", "calib_cooldown", "key_patience", "key_floor_skip", "index_train_size",
          "knn_recall_every", "one_source_min_match", "chain", "max_tree_depth", "max_cached_requests",
          "init_min_match", "separator_window", "min_ngram")
OPTION_RANGES: dict[str, tuple[float | None, float | None]] = {
    **{k: (-1.0, 1.0) for k in COSINES}, **{k: (0.0, 1.0) for k in RATES},
    **{k: (1, None) for k in AT_LEAST_ONE}, **{k: (0, None) for k in COUNTS},
    "max_spec_factor": (0.0, None), "max_spec_offset": (None, None),
    "num_speculative_tokens": (-1, None),  # -1: vLLM's default (suffix_arctic.py)
}


def _check_range(name: str, key: str, value) -> None:
    """A converted variant value: finite and inside OPTION_RANGES, else one line naming arm and field."""
    lo, hi = OPTION_RANGES.get(key, (None, None))
    if key == "depth_schedule":  # (cosine threshold, depth) steps
        bad = [v for t, d in value for v in (t, d) if not math.isfinite(v)]
        bad += [t for t, _ in value if not -1 <= t <= 1] + [d for _, d in value if d < 0]
        if bad:
            raise OilbirdError(f"arm variant {name!r}: depth_schedule={bad[0]!r} is out of range "
                               "(thresholds are cosines in -1..1, depths 0 or more)")
        return
    if key == "rank_depths":  # depths by neighbour rank
        lo = 0
    for v in value if isinstance(value, tuple) else (value,):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            span = (f"{lo:g}..{hi:g}" if lo is not None and hi is not None else f"{lo:g} or more"
                    if lo is not None else f"at most {hi:g}" if hi is not None else "a finite number")
            raise OilbirdError(f"arm variant {name!r}: {key}={v!r} is out of range ({key} takes {span})")


def _convert(name: str, key: str, text: str, default):
    """A variant's value in the type of the field's default: bool (on/off), int, float, str, a depth
    schedule `0.9x48_0.82x8` (threshold x depth, '_' between steps) or a list of ints `16_8_4`."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("on", "off", "true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("on", "true", "1")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, str):
            return text
        if key == "depth_schedule":
            return tuple((float(t), int(d)) for t, d in (step.split("x") for step in text.split("_")))
        if key == "rank_depths":
            return tuple(int(v) for v in text.split("_"))
    except ValueError:
        pass
    raise OilbirdError(f"arm variant {name!r}: cannot read {key}={text!r} (as {type(default).__name__}"
                       + ("; depth schedule as 0.9x48_0.82x8" if key == "depth_schedule" else "") + ")")


def make_drafter(name: str, *, vocab_size: int, nodes: int = 60, shared: dict | None = None, **options):
    """A fresh drafter for arm `name`; `options` set fields of that drafter's Config dataclass.

    `shared` sets the same fields on every arm whose Config has them and is ignored by the others:
    how a run's `--index` spec reaches every arm with a semantic pool (the Oilbird presets).
    `name` may be a variant, `arm@field=value:...` (parse_variant): the arm with those fields set."""
    arm, written = parse_variant(name)
    base, preset = PRESETS.get(arm, (arm, {}))
    cls = DRAFTERS.get(base)
    if cls is None:
        raise OilbirdError(f"unknown drafter {name!r}; choose from {', '.join(arm_names())}")
    if vocab_size <= 0 or nodes < 0:
        raise OilbirdError(f"drafter {name!r} needs vocab_size > 0 and nodes >= 0 (got {vocab_size}, {nodes})")
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    if written:
        defaults = cls.Config(**preset)
        bad = sorted(set(written) - fields)
        if bad:
            raise OilbirdError(f"arm variant {name!r}: {arm} has no field {', '.join(bad)}; "
                               f"fields: {', '.join(sorted(fields)) or 'none'}")
        converted = {k: _convert(name, k, v, getattr(defaults, k)) for k, v in written.items()}
        for k, v in converted.items():
            _check_range(name, k, v)
        options = {**converted, **options}
    options = {**{k: v for k, v in (shared or {}).items() if k in fields}, **options}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise OilbirdError(f"drafter {name!r} has no option {', '.join(unknown)}; "
                           f"options: {', '.join(sorted(fields)) or 'none'}")
    try:
        drafter = cls(vocab_size=vocab_size, nodes=nodes, config=cls.Config(**{**preset, **options}))
    except (ValueError, RuntimeError) as e:  # a setting the drafter (or torch, e.g. key_device) refuses: one line
        raise OilbirdError(f"drafter {name!r}: {e}") from None
    if base != name:
        drafter.name = name
    return drafter
