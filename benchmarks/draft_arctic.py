"""`make bench-draft`'s ArcticInference row: the published SuffixDecoding cache behind the Drafter contract.

The wrapper is the replay arm's (decoder/drafters/suffix_arctic.py, arms `suffix-arctic` and
`suffix-arctic-tree`); this row runs it in tree mode at the node budget with an unbounded global cache,
the settings below."""

from __future__ import annotations

from decoder.drafters.suffix_arctic import (  # noqa: F401
    SuffixArcticConfig,
    SuffixArcticDrafter,
    load_arctic,
)

ARCTIC = "arcticinference"  # the row name of ArcticInference's SuffixDecodingCache
ARCTIC_SETTINGS = {"max_tree_depth": 64, "max_spec_factor": 4.0, "min_token_prob": 0.1, "use_tree_spec": True,
                   "num_speculative_tokens": 0, "max_cached_requests": -1}  # 0: max_spec_tokens = the budget


class ArcticDrafter(SuffixArcticDrafter):
    """The row's drafter: `SuffixArcticDrafter` at ARCTIC_SETTINGS on the given cache class."""

    name = ARCTIC

    def __init__(self, cache_class, settings: dict = ARCTIC_SETTINGS, nodes: int = 60) -> None:
        super().__init__(vocab_size=1, nodes=nodes, config=SuffixArcticConfig(**settings), cache_class=cache_class)
