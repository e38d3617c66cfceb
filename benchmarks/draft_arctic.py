"""`make bench-draft`'s ArcticInference row: the published SuffixDecoding cache behind the Drafter contract."""

from __future__ import annotations

from typing import Hashable, Sequence

from decoder.draft import ROOT, Draft, Drafter

ARCTIC = "arcticinference"  # the row name of ArcticInference's SuffixDecodingCache
ARCTIC_SETTINGS = {"max_tree_depth": 64, "max_spec_factor": 4.0, "min_token_prob": 0.1, "use_tree_spec": True}


def load_arctic():
    """(ArcticInference's SuffixDecodingCache class, None) when it imports, else (None, why not)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except Exception as e:  # not installed, or a build that fails to load
        return None, (f"arctic_inference is not installed here ({type(e).__name__}: {e}); "
                      "`pip install arctic-inference` to time its SuffixDecodingCache.speculate on the same contexts")
    return SuffixDecodingCache, None


class ArcticDrafter(Drafter):
    """ArcticInference's SuffixDecodingCache behind the Drafter contract, so the one loop runs it: the request's
    prompt in its local tree, each committed token added to the active response (ArcticInference's own
    serving use), a warm trace cached as a finished response. It has no same-prompt exclusion."""

    name = ARCTIC

    def __init__(self, cache_class, settings: dict = ARCTIC_SETTINGS) -> None:
        self.settings = dict(settings)
        self.cache = cache_class(max_tree_depth=self.settings["max_tree_depth"])
        self.serial = 0
        self.active = None

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        self.serial += 1
        self.active = ("served", self.serial)
        self.cache.start_request(self.active, [int(t) for t in prompt])

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        s = self.settings
        if budget <= 0:
            return Draft()
        pattern = [int(t) for t in context[-s["max_tree_depth"]:]]
        out = self.cache.speculate(self.active, pattern, max_spec_tokens=budget, max_spec_factor=s["max_spec_factor"],
                                   min_token_prob=s["min_token_prob"], use_tree_spec=s["use_tree_spec"])
        draft, node_of = Draft(), {ROOT: ROOT}
        for i, (tok, parent) in enumerate(zip(out.token_ids, out.parents)):
            base = node_of.get(int(parent))
            if base is None or len(draft) >= budget:
                continue
            node = draft.child(base, int(tok))
            node_of[i] = draft.add_node(base, int(tok), ARCTIC) if node is None else node
        return draft

    def observe(self, context: Sequence[int], result) -> None:
        self.cache.add_active_response(self.active, [int(t) for t in result.committed])

    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None, hidden=None) -> None:
        if self.active is not None:  # the request just served: its response is cached already
            self.cache.stop_request(self.active)
            self.active = None
            return
        self.serial += 1
        rid = ("warm", self.serial)
        self.cache.start_request(rid, [])
        self.cache.add_active_response(rid, [int(t) for t in output])
        self.cache.stop_request(rid)
