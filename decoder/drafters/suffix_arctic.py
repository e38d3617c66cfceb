"""ArcticInference's published SuffixDecoding cache (`arctic_inference.suffix_decoding.SuffixDecodingCache`,
the implementation vLLM's `method: suffix` runs) behind the Drafter contract: arms `suffix-arctic`
(vLLM's defaults) and `suffix-arctic-tree` (tree mode), beside our own `suffix` (decoder/drafters/suffix.py).

How the cache is driven is vLLM's proposer (vllm/v1/spec_decode/suffix_decoding.py, vLLM 0.32):
  - `begin_request`: `start_request(id, prompt)` builds the request's local (prompt) tree and allocates
    the request's slot in the global tree (max_cached_requests != 0);
  - `propose`: the tokens committed since the last call are appended with `add_active_response` (to the
    local tree and to the request's live response in the global tree, as vLLM appends each step's
    sampled tokens), then `speculate(id, the context's last max_tree_depth tokens, max_spec_tokens,
    max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)`: the better-scoring of the local
    and the global tree's drafts; max_spec_tokens = min(num_speculative_tokens, budget);
  - `add_trace` of the request just served: its response is completed to `output` and the request
    stopped (its response stays cached); a trace without a served request (a warm trace) enters as a
    request of its own with an empty prompt;
  - the draft (token ids + parents, -1 = child of the anchor) becomes our Draft, parents first, every
    node labelled `suffix-arctic`, never more than `budget` nodes.

Settings (`SuffixArcticConfig`), the arm `suffix-arctic` = vLLM 0.32's SpeculativeConfig defaults
(vllm/config/speculative.py): suffix_decoding_max_tree_depth 24, suffix_decoding_max_cached_requests
10000, suffix_decoding_max_spec_factor 1.0, suffix_decoding_min_token_prob 0.1; num_speculative_tokens
unset (-1), which vLLM defaults to the tree depth (24); vLLM passes no max_spec_offset (0.0) and no
use_tree_spec (a chain). `suffix-arctic-tree` = the cache's tree mode at the node budget: use_tree_spec
on, max_spec_factor 4.0, max_tree_depth 64 (our `suffix` arm's depth and the cache's own default),
max_spec_tokens = the budget (num_speculative_tokens 0).

Where this wrapper departs from vLLM, for the contract:
  - same-prompt exclusion: the cache knows requests only by id, so the wrapper keeps every pooled
    trace's id and prompt hash; at `begin_request` the cached responses of pooled traces with the
    request's prompt hash are evicted from the global tree (`evict_cached_response`) and put back (each
    as a new request id, the same tokens) before another prompt's request begins, so no request ever
    drafts from a pooled trace of its own prompt. Putting a response back makes it the newest for the
    cache's FIFO eviction, which only acts past max_cached_requests traces;
  - the served request's own response is in the global tree while it is served (vLLM's behaviour; the
    local tree holds it too); a request that ends without `add_trace` (a pool that does not join, e.g.
    replay's warm pool) has that live response evicted when the next request begins;
  - `evict_traces(count)` (--store-budget) evicts the oldest `count` pooled traces' responses, one per
    add_trace, empty ones included;
  - no `suspend_request`: one request at a time (replay, the live decoder), so the vLLM proposer refuses
    the arm (vLLM runs this cache itself as `method: suffix`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from data.errors import OilbirdError
from data.store.schema import prompt_hash as hash_prompt
from decoder.draft import ROOT, Draft, Drafter

NAME = "suffix-arctic"
INSTALL = ("`make install` builds arctic-inference==0.3.0 from its sdist (docs/install.md: cmake, ninja, "
           "nanobind==2.9.2, then pip install --no-build-isolation --no-deps arctic-inference==0.3.0)")


def load_arctic():
    """(ArcticInference's SuffixDecodingCache class, None) when it imports, else (None, one line why not)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except Exception as e:  # not installed, or a build that fails to load (its C++ extension)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"arctic_inference is not importable here ({type(e).__name__}: {first}); {INSTALL}"
    return SuffixDecodingCache, None


@dataclass
class SuffixArcticConfig:
    max_tree_depth: int = 24  # vLLM suffix_decoding_max_tree_depth: match length + draft depth, both trees
    max_cached_requests: int = 10000  # vLLM suffix_decoding_max_cached_requests (FIFO; 0: no global tree;
    #                                   -1: unbounded)
    max_spec_factor: float = 1.0  # vLLM suffix_decoding_max_spec_factor: draft <= factor * match length + offset
    max_spec_offset: float = 0.0  # ArcticInference's default (vLLM passes none)
    min_token_prob: float = 0.1  # vLLM suffix_decoding_min_token_prob
    num_speculative_tokens: int = -1  # -1: vLLM's default when unset (= max_tree_depth); 0: the node budget
    use_tree_spec: bool = False  # vLLM drafts one chain; True: the cache's tree mode


# arm name -> SuffixArcticConfig options (registered in decoder/drafters/__init__.py PRESETS)
ARCTIC_PRESETS: dict[str, dict] = {
    "suffix-arctic-tree": {"max_tree_depth": 64, "max_spec_factor": 4.0, "use_tree_spec": True,
                           "num_speculative_tokens": 0},
}


def to_draft(token_ids: Sequence[int], parents: Sequence[int], budget: int, source: str = NAME) -> Draft:
    """The cache's draft (parents[i] indexes token_ids, -1 = child of the anchor) as a Draft of at most
    `budget` nodes: a node whose parent was left out (over the budget, or listed after it) is left out
    with its subtree; a repeated (parent, token) is walked, not added."""
    draft, node_of = Draft(), {ROOT: ROOT}
    for i, (tok, parent) in enumerate(zip(token_ids, parents)):
        base = node_of.get(int(parent))
        if base is None:
            continue
        node = draft.child(base, int(tok))
        if node is None:
            if len(draft) >= budget:
                continue
            node = draft.add_node(base, int(tok), source)
        node_of[i] = node
    return draft


class SuffixArcticDrafter(Drafter):
    """Arms `suffix-arctic`, `suffix-arctic-tree`: ArcticInference's SuffixDecodingCache (module docstring)."""

    name = NAME
    Config = SuffixArcticConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: SuffixArcticConfig | None = None,
                 cache_class=None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        c = self.config = config or SuffixArcticConfig()
        if c.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be at least 1 (got {c.max_tree_depth})")
        if c.num_speculative_tokens < -1 or c.max_spec_factor < 0 or not 0 <= c.min_token_prob <= 1:
            raise ValueError("num_speculative_tokens must be -1 (vLLM's default), 0 (the budget) or a cap; "
                             "max_spec_factor >= 0; min_token_prob in [0, 1]")
        if cache_class is None:
            cache_class, why = load_arctic()
            if cache_class is None:
                raise OilbirdError(f"arm {self.name}: {why}")
        self.cache = cache_class(max_tree_depth=c.max_tree_depth, max_cached_requests=c.max_cached_requests)
        self._serial = 0
        self.traces: list[tuple[Hashable | None, list[int], object]] = []  # per add_trace: hash, tokens, cache id
        self.withheld: list[int] = []  # indices into traces evicted for the running request's prompt
        self.active: tuple | None = None  # the running request's cache id
        self._active_hash: Hashable | None = None
        self._prompt_len = 0
        self._response: list[int] = []  # the running request's response as the cache holds it
        self.tally = dict(passes=0, drafted=0, withheld=0, restored=0, live_evicted=0)

    # ------------------------------------------------------------ the pool
    def _new_id(self, kind: str) -> tuple:
        self._serial += 1
        return (kind, self._serial)

    def _cache_response(self, tokens: Sequence[int]) -> tuple:
        """A finished response entered as a request of its own (empty prompt): its cache id."""
        rid = self._new_id("trace")
        self.cache.start_request(rid, [])
        if len(tokens):
            self.cache.add_active_response(rid, [int(t) for t in tokens])
        self.cache.stop_request(rid)
        return rid

    def _cached(self, rid) -> bool:
        """Whether the global tree holds `rid`'s response (a cache without `cached_requests`, a test double,
        holds none the wrapper could evict)."""
        return rid is not None and rid in getattr(self.cache, "cached_requests", ())

    def _evict(self, rid) -> None:
        if self._cached(rid):
            self.cache.evict_cached_response(rid)

    def _restore(self) -> None:
        """The traces withheld for the last request's prompt go back into the global tree."""
        for i in self.withheld:
            h, tokens, _ = self.traces[i]
            self.traces[i] = (h, tokens, self._cache_response(tokens))
            self.tally["restored"] += 1
        self.withheld = []

    def _withhold(self, h: Hashable) -> None:
        """Evict the pooled traces of prompt hash `h` from the global tree until another prompt's request."""
        self._restore()
        for i, (g, _, rid) in enumerate(self.traces):
            if g is not None and g == h and self._cached(rid):
                self.cache.evict_cached_response(rid)
                self.withheld.append(i)
                self.tally["withheld"] += 1

    def _drop_active(self) -> None:
        """The running request ended without joining the pool: its live response leaves the global tree."""
        if self.active is not None:
            self.cache.stop_request(self.active)
            if self._cached(self.active):
                self.cache.evict_cached_response(self.active)
                self.tally["live_evicted"] += 1
            self.active = None

    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None, hidden=None) -> None:
        out = [int(t) for t in output]
        if self.active is not None and prompt_hash is not None and prompt_hash == self._active_hash:
            rid, self.active = self.active, None  # the request just served: complete its cached response
            if out[:len(self._response)] == self._response:
                if len(out) > len(self._response):
                    self.cache.add_active_response(rid, out[len(self._response):])
                self.cache.stop_request(rid)
            else:  # the cache holds something else: replace it by the trace itself
                self.cache.stop_request(rid)
                self._evict(rid)
                rid = self._cache_response(out) if out else None
            if not out and rid is not None:
                self._evict(rid)
                rid = None
            self._restore()
            self.traces.append((prompt_hash, out, rid))
            return
        rid = self._cache_response(out) if out and self.config.max_cached_requests != 0 else None
        self.traces.append((prompt_hash, out, rid))

    def evict_traces(self, count: int) -> None:
        count = min(count, len(self.traces))
        if count <= 0:
            return
        for _, _, rid in self.traces[:count]:
            self._evict(rid)
        self.traces = self.traces[count:]
        self.withheld = [i - count for i in self.withheld if i >= count]

    # ------------------------------------------------------------ one request
    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        h = hash_prompt(list(prompt)) if prompt_hash is None else prompt_hash
        self._drop_active()
        self._withhold(h)
        self.active, self._active_hash = self._new_id("served"), h
        self._prompt_len, self._response = len(prompt), []
        self.cache.start_request(self.active, [int(t) for t in prompt])

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        c = self.config
        self.tally["passes"] += 1
        if self.active is None:
            raise RuntimeError(f"{self.name}: propose before begin_request")
        new = [int(t) for t in context[self._prompt_len + len(self._response):]]
        if new:  # vLLM appends each step's sampled tokens before it speculates
            self.cache.add_active_response(self.active, new)
            self._response.extend(new)
        limit = self.spec_limit(budget)
        if limit <= 0:
            return Draft()
        pattern = [int(t) for t in context[-c.max_tree_depth:]]
        extra = {"max_spec_offset": c.max_spec_offset} if c.max_spec_offset else {}  # vLLM passes none
        out = self.cache.speculate(self.active, pattern, max_spec_tokens=limit, max_spec_factor=c.max_spec_factor,
                                   min_token_prob=c.min_token_prob, use_tree_spec=c.use_tree_spec, **extra)
        draft = to_draft(out.token_ids, out.parents, limit, self.name)
        self.tally["drafted"] += len(draft)
        return draft

    def spec_limit(self, budget: int) -> int:
        """max_spec_tokens for a pass of `budget` nodes: vLLM's num_speculative_tokens (unset: the tree
        depth), within the budget."""
        n = self.config.num_speculative_tokens
        cap = self.config.max_tree_depth if n < 0 else (n or budget)
        return max(0, min(budget, cap))

    def observe(self, context: Sequence[int], result) -> None:
        pass  # the committed tokens reach the cache at the next propose (or at add_trace)

    def counters(self) -> dict:
        return {**self.tally, "pooled_traces": len(self.traces),
                "cached_responses": len(getattr(self.cache, "cached_requests", ()))}
