"""The speculative loop, written once, and the request runner: live decoding and replay differ only in
the verifier they hand it.

One request (`speculate`), as gpt-fast's `speculative_decode` reads:

    verifier.start(prompt); drafter.begin_request(prompt)           (prefill_s)
    until the verifier says stop:
        draft = drafter.propose(context, nodes)                       (draft_s, measurement-only work left out)
        result = verifier.verify(context, draft, beside)              (verify_s: accepted path + bonus, cut at a stop)
        later = drafter.observe_split(context, result)                (update_s, with verifier.advance)
        verifier.advance(result); context += result.committed
    later()                                                           (the last pass's bookkeeping: its update_s)

Drafting beside the verify: `observe_split` learns now what the next propose reads (the context, the key's
query state, the gate) and hands back the rest (calibration labels, the adjacency update, the ring buffer:
decoder/draft.py `Drafter.observe_split`). That rest and the pass's record are `beside`, the host work the next
verify runs while it verifies where the verifier overlaps (`Verifier.overlaps`: the live verifiers run it on a
helper thread while the model's forward runs), and before it where it does not (`beside_s`, then apart from
`verify_s`). The next propose therefore drafts without the previous pass's bookkeeping in every verifier alike
(live, eager or graph, overlapped or not, and replay): the passes do not depend on where the bookkeeping ran.

A `Verifier` is what decides acceptance: the model's tree-masked greedy forward (decoder/verify/engine.py
`ModelVerifier`), the stored greedy trace (decoder/replay/traces.py `TraceVerifier`), and next a serving
engine's. Both loops share the per-pass record (`pass_record` -> `Cycle`) and the request's result
(`Generation`).

Every arm's requests, in serving order (`serve_requests`): the tenant's drafter from the pools
(decoder/pools.py `TenantPools.begin`, which moves the --store-budget window), the request decoded, then
its trace added to the pool (`Drafter.add_trace`, keyed by the prompt hash); the window move and the
insertion are the request's pool time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from data.store.schema import prompt_hash
from decoder.draft import Draft, Drafter, VerifyResult
from decoder.pools import TenantPools


@dataclass
class Cycle:
    """One verification pass."""

    nodes: int  # draft nodes verified (0 for ar)
    accepted: int  # draft nodes on the accepted path that were committed (a stop can cut the path)
    committed: int  # tokens appended to the output (accepted + bonus, cut at a stop)
    sources: list[str]  # per accepted (committed) node: its sources joined by "|", sorted (e.g. "adjacency|sam")
    draft_s: float
    verify_s: float  # forward, readback, acceptance and the stop check (overlapped: the beside work ran within it)
    update_s: float  # cache compaction and the drafter's observation of what the next propose reads
    node_sources: dict[str, int] = field(default_factory=dict)  # drafted nodes per source
    # the previous pass's deferred bookkeeping and record, run beside this pass's verify (decoder/draft.py
    # observe_split): off the critical path where the verifier overlaps, on it (added to the pass) where not
    beside_s: float = 0.0


@dataclass
class Generation:
    """One decoded request. `hidden`/`topk` follow the trace store's convention (data/store/schema.py):
    row i is the state (top-8) computed with tokens[i] as input; the last row is zeros (never fed)."""

    tokens: list[int]
    stop_reason: str  # eos | stop_string | length (replay: trace_end)
    seconds: float  # wall time of the request: prefill + every pass
    prefill_s: float
    cycles: list[Cycle]
    hidden: np.ndarray | None = None  # [n, d] float32
    hidden_valid: np.ndarray | None = None  # [n] bool
    topk: np.ndarray | None = None  # [n, 8] int64
    prompt_last_hidden: np.ndarray | None = None  # [d] the state that predicts tokens[0]
    prompt_last_topk: np.ndarray | None = None  # [8]
    # The lossless audit's evidence (decoder/verify/audit.py): row k = the top-8 ids and logits of the forward
    # row that chose tokens[k] (ar: its one-token forward; a speculative arm: the anchor or accepted
    # node whose argmax committed it). Kept after the pool takes hidden/topk: [n, 8] each.
    chosen_ids: np.ndarray | None = None
    chosen_logits: np.ndarray | None = None


class Verifier(Protocol):
    """What decides which draft tokens are committed, one request at a time."""

    vocab_size: int  # draft token ids must lie below it
    timed: bool  # whether verify's wall time is the model's (live); replay records 0 (a profile estimates it)
    stop_reason: str | None  # why the request stopped; None while it goes on
    overlaps: bool  # whether `beside` runs while the verify does (else: before it)

    def start(self, prompt: Sequence[int]) -> None:
        """Before the first pass (live: prefill the cache)."""
        ...

    def verify(self, context: Sequence[int], draft: Draft, beside: Callable[[], None] | None = None) -> VerifyResult:
        """The accepted root path and the bonus; `committed` is cut where decoding stops (`stop_reason`). `beside`,
        host work that does not touch the verifier, has run when verify returns."""
        ...

    def advance(self, result: VerifyResult) -> None:
        """After the drafter observed `result`, before the context grows (live: compact the cache)."""
        ...


class Beside:
    """The previous pass's deferred bookkeeping (`Drafter.observe_split`'s rest) and its record: what the next
    verify runs beside it. `seconds`: how long it took."""

    def __init__(self, later: Callable[[], None] | None, record: tuple | None, cycles: list[Cycle]) -> None:
        self.later, self.record, self.cycles, self.seconds = later, record, cycles, 0.0

    def __call__(self) -> None:
        t0 = time.perf_counter()
        if self.later is not None:
            self.later()
        if self.record is not None:
            self.cycles.append(pass_record(*self.record))
        self.seconds = time.perf_counter() - t0


def check_draft(draft: Draft, budget: int, vocab_size: int) -> None:
    """A drafter's tree must fit the budget, list parents before children, and hold valid token ids."""
    n = len(draft.tokens)
    if n > budget:
        raise ValueError(f"drafter proposed {n} nodes over a budget of {budget}")
    if len(draft.parents) != n or len(draft.sources) != n:
        raise ValueError("draft tokens, parents and sources differ in length")
    if n and not (0 <= min(draft.tokens) and max(draft.tokens) < vocab_size):
        raise ValueError(f"draft holds a token id outside 0..{vocab_size - 1}")


def pass_record(draft: Draft, accepted: Sequence[int], kept: int, draft_s: float, verify_s: float,
                update_s: float, beside_s: float = 0.0) -> Cycle:
    """One pass as a Cycle (live decoding and replay alike): drafted nodes per source, and the accepted
    nodes that were committed (a stop can cut the accepted path) with their sources."""
    node_sources: dict[str, int] = {}
    for sources in draft.sources:
        for name in sources:
            node_sources[name] = node_sources.get(name, 0) + 1
    kept_nodes = accepted[:kept]
    return Cycle(len(draft), len(kept_nodes), kept, ["|".join(sorted(draft.sources[i])) for i in kept_nodes],
                 draft_s, verify_s, update_s, node_sources, beside_s)


@dataclass
class Speculation:
    """What `speculate` returns: the passes and the request's times."""

    cycles: list[Cycle]
    stop_reason: str
    prefill_s: float  # verifier.start and drafter.begin_request
    seconds: float  # the whole request, measurement-only drafting work left out


def speculate(drafter: Drafter, verifier: Verifier, prompt: Sequence[int], nodes: int,
              prompt_key: str | None = None) -> Speculation:
    """Draft under a budget of `nodes`, verify, commit the accepted path and the bonus, let the drafter
    observe; until the verifier stops (module docstring). `prompt_key`: the prompt's hash for
    begin_request (None: the drafter hashes the prompt itself, the same hash)."""
    t_start = time.perf_counter()
    untimed0 = drafter.untimed_s
    verifier.start(prompt)
    drafter.begin_request(list(prompt), prompt_key)
    prefill_s = time.perf_counter() - t_start
    context = [int(t) for t in prompt]  # prompt + committed tokens
    cycles: list[Cycle] = []
    beside = Beside(None, None, cycles)
    while verifier.stop_reason is None:
        u0 = drafter.untimed_s
        t0 = time.perf_counter()
        draft = drafter.propose(context, nodes)
        check_draft(draft, nodes, verifier.vocab_size)
        t1 = time.perf_counter()
        t0 += drafter.untimed_s - u0  # measurement-only work (knn_recall shadows) is not drafting time
        result = verifier.verify(context, draft, beside)
        t2 = time.perf_counter()
        later = drafter.observe_split(context, result)
        verifier.advance(result)
        context.extend(result.committed)
        t3 = time.perf_counter()
        verify_s = t2 - t1 - (0.0 if verifier.overlaps else beside.seconds) if verifier.timed else 0.0
        record = (draft, result.accepted_nodes, len(result.committed), t1 - t0, verify_s, t3 - t2, beside.seconds)
        beside = Beside(later, record, cycles)
    t0 = time.perf_counter()
    if beside.later is not None:  # the last pass's bookkeeping: the request ends, nothing to run beside
        beside.later()
    if beside.record is not None:  # on the critical path: it counts as the last pass's update
        draft, accepted, kept, draft_s, verify_s, update_s, beside_s = beside.record
        cycles.append(pass_record(draft, accepted, kept, draft_s, verify_s, update_s + time.perf_counter() - t0,
                                  beside_s))
    seconds = time.perf_counter() - t_start - (drafter.untimed_s - untimed0)
    return Speculation(cycles, verifier.stop_reason, prefill_s, seconds)


def serve_requests(prompts: Sequence[Sequence[int]], tenants: Sequence[str], pools: TenantPools | None,
                   decode: Callable[[int, Drafter | None], Generation], join: bool = True,
                   on_request: Callable[[Generation, float], None] | None = None) -> tuple[list[Generation], list[float]]:
    """Serve every request in order; returns (one Generation per request, pool seconds per request).

    `pools` (decoder/pools.py TenantPools, or None for an arm without a drafter: ar, ar-static) gives
    request r its tenant's drafter; `decode(r, drafter)` decodes it. With `join`, the finished trace
    (`Generation.tokens`, and `hidden` when set) enters that drafter's pool; the Generation then drops
    hidden/topk (kept once, in the pool). `on_request(generation, pool_s)` follows every request."""
    gens: list[Generation] = []
    pool_s: list[float] = []
    for r, prompt in enumerate(prompts):
        if pools is None:
            gens.append(decode(r, None))
            pool_s.append(0.0)
        else:
            t0 = time.perf_counter()
            drafter = pools.begin(r, tenants[r])  # moves the budget window: evictions count as pool time
            evict_s = time.perf_counter() - t0
            g = decode(r, drafter)
            t0 = time.perf_counter()
            if join:
                drafter.add_trace(list(g.tokens), prompt_hash(prompt), g.hidden)
            pools.end(r, tenants[r], len(g.tokens) if join else 0)
            pool_s.append(time.perf_counter() - t0 + evict_s)
            g.hidden = g.topk = None  # in the drafter's pool now; not kept twice
            gens.append(g)
        if on_request is not None:
            on_request(gens[-1], pool_s[-1])
    return gens, pool_s
