"""The training-free drafters, one per arm, behind the `Drafter` protocol of `decoder.draft`.

Every drafter is a thin class around pure functions in its module and offers, beyond the protocol:
  - `begin_request(prompt, prompt_hash=None)`: pool traces added under the same prompt hash
    (default: `data.capture.prompt_hash(prompt)`) are never drafted from during this request; the
    automaton arms exclude them at match time (see `sam.AutomatonIndex`), the +pool arms
    likewise (`pld.PoolNgramIndex`);
  - `add_trace(output_tokens, prompt_hash=None)`: put a finished trace in the pool (None: never
    excluded). `end_request(prompt, output, hidden)` is add_trace(output, prompt_hash(prompt)),
    so a `--warm-from` store fed through end_request is keyed like served requests;
  - `evict_traces(count)`: forget the oldest `count` pooled traces (one per end_request / add_trace,
    empty ones included), the --store-budget window (decoder/pools.py); state that is not a trace
    pool (the adjacency table, bounded by the vocabulary; the ring buffer, by its capacity) stays.

    make_drafter("lexical", vocab_size=lm.vocab_size, nodes=60, adjacency_reserve=16)

The Oilbird arms (`oilbird` and its ablations, see decoder/drafters/oilbird.py) are one drafter
class under named presets: `ARM_PRESETS` maps an arm name to OilbirdConfig options, and
`make_drafter` accepts those names too (`arm_names()` lists every arm).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import numpy as np

from data.errors import OilbirdError
from decoder.draft import Draft
from decoder.drafters.lexical import LexicalDrafter
from decoder.drafters.oilbird import ARM_PRESETS, OilbirdDrafter
from decoder.drafters.pld import PldDrafter
from decoder.drafters.recycling import RecyclingDrafter
from decoder.drafters.sam import SamDrafter
from decoder.drafters.suffix import SuffixDrafter


@dataclasses.dataclass
class NoConfig:
    pass


class NullDrafter:
    """Arm `ar`: drafts nothing, so every pass commits exactly the model's own next token."""

    name = "ar"
    Config = NoConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: NoConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes

    def add_trace(self, output_tokens: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        pass

    def evict_traces(self, count: int) -> None:
        pass

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        pass

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft()

    def observe(self, context: Sequence[int], result) -> None:
        pass

    def end_request(self, prompt: Sequence[int], output: Sequence[int], hidden: np.ndarray | None) -> None:
        pass


DRAFTERS = {
    "ar": NullDrafter,
    "pld": PldDrafter,
    "suffix": SuffixDrafter,
    "sam": SamDrafter,
    "recycling": RecyclingDrafter,
    "lexical": LexicalDrafter,
    "oilbird": OilbirdDrafter,
}

# arm name -> (drafter in DRAFTERS, Config options): the Oilbird ablations
PRESETS = {name: ("oilbird", options) for name, options in ARM_PRESETS.items() if name not in DRAFTERS}


def arm_names() -> list[str]:
    """Every arm make_drafter knows: the drafters, then the presets."""
    return [*DRAFTERS, *PRESETS]


def make_drafter(name: str, *, vocab_size: int, nodes: int = 60, shared: dict | None = None, **options):
    """A fresh drafter for arm `name`; `options` set fields of that drafter's Config dataclass.

    `shared` sets the same fields on every arm whose Config has them and is ignored by the others:
    how a run's `--index` spec reaches every arm with a semantic pool (the Oilbird presets)."""
    base, preset = PRESETS.get(name, (name, {}))
    cls = DRAFTERS.get(base)
    if cls is None:
        raise OilbirdError(f"unknown drafter {name!r}; choose from {', '.join(arm_names())}")
    if vocab_size <= 0 or nodes < 0:
        raise OilbirdError(f"drafter {name!r} needs vocab_size > 0 and nodes >= 0 (got {vocab_size}, {nodes})")
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    options = {**{k: v for k, v in (shared or {}).items() if k in fields}, **options}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise OilbirdError(f"drafter {name!r} has no option {', '.join(unknown)}; "
                           f"options: {', '.join(sorted(fields)) or 'none'}")
    drafter = cls(vocab_size=vocab_size, nodes=nodes, config=cls.Config(**{**preset, **options}))
    if base != name:
        drafter.name = name
    return drafter
