"""Serving harness: every arm serves the same benchmark in order, measured side by side.

`run_decode(DecodeConfig(...))` loads the model once, runs `ar` first (the reference for speed and
for losslessness; added when the user leaves it out), then each drafter arm with a fresh pool,
and writes one folder per arm under `runs/<bench>/<model>/decode/<arm>/`. An arm may be a variant
`arm@field=value:...` of a library arm (e.g. oilbird@theta=0.7), as replay takes it
(decoder/drafters `parse_variant`); its folder carries the variant's name. `ar-static` is a second
greedy reference, transformers' generate with a static cache, compiled (decoder/verify/reference.py); its
summary.json adds `compiled` (whether the decode step ran compiled) and `generate` (the settings).

Rounds (`rounds`, --rounds R; default 1 here and in `python -m decoder`, 3 in the speed benches): every
arm serves the benchmark R times, each time with fresh pools; round r (0-based) runs the arms in their
order rotated to start at arm r mod n, so round 1 starts with ar and machine drift does not land on one
arm's side of a ratio. Per round, speedup = the arm's tokens/s over ar's of that round, and
speedup_vs_fastest_ar = over max(ar, ar-static) of that round; summary.json keeps tokens_per_s,
speedup and speedup_vs_fastest_ar as the median over the rounds, each with `_rounds` (one per round)
and `_range` ([min, max]), and `round_order` (the arms in the order each round ran them). Everything
else (tau, pass statistics, the time split, cycles.parquet, requests.parquet) comes from round 1.
The audit rule: every arm is audited against ar's round-1 tokens, after all rounds (ar has then always
run); ar runs first in round 1, so a --store-budget below one of its traces is refused before any
drafting. Decoding is deterministic: each later round's tokens are compared with the same arm's
round-1 tokens, and a difference is printed as a warning and recorded (`rounds_identical` false,
`round_mismatches`: [{round, requests}]).

  cycles.parquet    one row per verification pass: request, pass, nodes, accepted, committed,
                    sources (per accepted node, e.g. "adjacency|sam"), draft_s, verify_s, update_s,
                    beside_s (the previous pass's deferred bookkeeping, run beside this verify: decoder/loop.py)
  requests.parquet  one row per request: request, id, group, prompt_hash, output_tokens,
                    stop_reason, seconds, prefill_s, pool_s, passes
  summary.json      tau (with a request-bootstrap interval), tokens/s, speedup over this invocation's
                    ar and speedup_vs_fastest_ar (medians over the rounds, see Rounds), time split
                    and overhead fraction, `drafting` (the drafter's work on the critical path and beside the
                    verify, and whether the verifier overlapped: --overlap), the lossless audit against ar, the pass
                    statistics of decoder/verify/passes.py (per-source drafted/accepted tokens, nodes and
                    drafting time per pass); for arms with the semantic key: sole_source_share (the
                    paper's: sole-semantic tokens / all committed tokens) and sole_source_share_of_draft
                    (/ accepted draft tokens), each {value, interval, sole, tokens|accepted},
                    semantic_time_s (the key's queries), retrieval_fraction (key + ring buffer time /
                    cycle time), store_bytes_per_token and the drafter's counters

The folder is written beside its final place and renamed in, so it is never half old, half new.

The pool: a request's generated tokens and states (data/store/schema.py convention: row i = the state
with token i as input, the last row zeros) enter the arm's drafter through `add_trace`, under the
prompt's hash, once the request has finished (decoder/loop.py `serve_requests`). `--warm-from STORE`
feeds a captured trace store's requests the same way before serving. A request must not draft from
its own trace: drafters receive the prompt in `begin_request` and skip pool traces whose prompt hash
(`data.store.schema.prompt_hash`) equals the current request's; this matters with `--warm-from` a
store of the same benchmark and with repeated prompts.

Pools (decoder/pools.py): `--index SPEC` keeps the semantic key's states in a faiss index (exact,
the default, is the float16 matrix, unchanged); `--store-budget B` bounds the past pool to the
data/index/budget.py window; requests of different tenants (`Request.tenant`) are served by different
drafters of the arm, so none drafts from another tenant's traces (warm traces go to their own
tenant's drafter). summary.json adds index, bytes_per_state, warmup_queries, knn_recall, tenants,
store_budget, store_budget_tokens and max_pool_tokens.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from data.benchmarks.registry import get_benchmark, load_requests
from data.capture.greedy import context_cap, context_note
from data.capture.models import (
    LayerTap,
    LoadedModel,
    cache_kwargs,
    encode_prompt,
    load_model,
)
from data.errors import OilbirdError
from data.index.budget import check_budget
from data.index.stateindex import DEFAULT_INDEX
from data.store.layout import component, decode_dir
from data.store.storeset import open_store_or_set
from data.versions import library_versions
from decoder.draft import Drafter, nodes_error
from decoder.verify.engine import (
    ModelVerifier,
    check_supported,
    decode_greedy,
    decode_speculative,
    stop_rule,
    verify_tree,
)
from decoder.loop import Generation, serve_requests
from decoder.pools import (
    PoolSettings,
    TenantPools,
    check_index,
    key_device,
    resolve_budget,
    warmup_note,
)
from decoder.verify.reference import REFERENCE_ARM, STATIC_ARM, StaticGreedy
from decoder.live.results import (
    ArmRun,
    cycles_table,
    requests_table,
    speed_summary,
    summarize,
    tokens_per_s,
    write_folder,
)
from decoder.cost.live import check_profile_spec, resolve_live_profile
from decoder.verify.graph import GraphVerifier, capacity_for, check_verifier, resolve_overlap, resolve_verifier

# what `python -m decoder` and `make bench-decode` serve when --arms is not given: the baselines and
# Oilbird; the ablations (python -m decoder --help) are opt-in
DEFAULT_ARMS = ("ar", "pld", "suffix", "sam", "recycling", "lexical", "oilbird")

# An arm factory builds a fresh drafter (an empty pool) for a loaded model and a config.
ArmFactory = Callable[[LoadedModel, "DecodeConfig"], Drafter]


@dataclass
class DecodeConfig:
    bench: str
    model: str = "smollm2-135m"
    arms: tuple[str, ...] = ("ar", "lexical")  # ar always runs (first) as the reference
    limit: int | None = None  # first N requests in serving order; None = all
    nodes: int = 60  # draft node budget per verification pass
    max_new_tokens: int | None = None  # None = the benchmark's cap
    out: str = "runs"
    warm_from: str | None = None  # a trace store whose requests enter every arm's pool before serving
    stop_strings: tuple[str, ...] | None = None  # None = the benchmark's stop strings
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    device: str | None = None
    progress: bool = True
    index: str = DEFAULT_INDEX  # --index: the semantic key's index (data/index/stateindex.py; decoder/pools.py)
    store_budget: str | None = None  # --store-budget: tokens ("200k") or megabytes ("64MB"); None = unbounded
    knn_recall_every: int = 8  # auto or faiss index: every Nth inexact query repeated exactly (knn_recall); 0 = off
    index_train_size: int = 0  # states a faiss coder collects before training (0: the spec's own need)
    rounds: int = 1  # --rounds: every arm serves the benchmark this many times, the order rotated each round
    static_compile: bool | None = None  # ar-static: None = compile (decoder/verify/reference.py), False = --no-compile
    # --verifier: graph (decoder/verify/graph.py: fixed shapes, compiled), eager (ModelVerifier) or auto (graph on a
    # GPU, eager on a CPU)
    verifier: str = "auto"
    # --overlap: on, the previous pass's bookkeeping runs on a helper thread while the verify runs (decoder/loop.py,
    # drafting beside the verify); off, before the verify; auto, on where the model runs on a GPU, off on a CPU
    # (decoder/verify/graph.py resolve_overlap). The passes are the same either way; an arm written `arm+serial` runs
    # with it off beside arms with it on
    overlap: str = "auto"
    # --profile: what sizes the cost-aware arms' trees (decoder/cost/live.py): auto (this machine's harness profile,
    # measured once and cached), flat (the whole candidate tree) or a profile file. The library default is flat, so
    # that a run's trees do not depend on timing; `python -m decoder` defaults to auto.
    profile: str = "flat"
    step_cost: dict | None = None  # {verifier kind: the profile's CostModel}, resolved by prepare_serving (None: flat)

    def shared(self, device: torch.device | str = "cpu") -> dict:
        """Config fields every arm with a semantic pool takes (make_drafter's `shared`), the key's states on
        the model's `device` when it is a GPU (decoder/pools.py PoolSettings)."""
        shared = PoolSettings(self.index, None, self.knn_recall_every, self.index_train_size,
                              key_device(device)).shared()
        cost = (self.step_cost or {}).get(resolve_verifier(self.verifier, device))  # the arm's verifier's profile
        return {**shared, "step_cost": cost} if cost is not None else shared


def library_factory(name: str) -> ArmFactory:
    """A library arm, or a variant of one (`arm@field=value:...`, decoder/drafters parse_variant)."""
    from decoder.drafters import make_drafter

    return lambda lm, cfg: make_drafter(name, vocab_size=lm.vocab_size, nodes=cfg.nodes, shared=cfg.shared(lm.device))


def library_drafters() -> dict[str, ArmFactory]:
    """The drafters registered in decoder/drafters/__init__.py, but its `ar` (see below)."""
    from decoder.drafters import arm_names

    # the library's own "ar" (an empty-draft drafter) would shadow the plain greedy reference
    return {name: library_factory(name) for name in arm_names() if name not in (REFERENCE_ARM, STATIC_ARM)}


def resolve_arms(requested: tuple[str, ...], factories: dict[str, ArmFactory]) -> tuple[list[str], bool]:
    """The arms in run order (ar first) and whether ar was added because the user left it out.

    A variant `arm@field=value:...` of a library arm is added to `factories` (as replay takes it); a bad
    field or value fails here, before the model loads."""
    names = [a.strip() for a in requested if a.strip()]
    if not names:
        raise OilbirdError("--arms is empty; give e.g. ar,sam,lexical")
    dupes = sorted({a for a in names if names.count(a) > 1})
    if dupes:
        raise OilbirdError(f"--arms names {', '.join(dupes)} twice")
    known = [REFERENCE_ARM, STATIC_ARM, *factories]
    library = library_drafters()
    for a in names:
        base, kind = split_verifier(a)
        if kind is not None or serial_arm(a):  # `arm+graph` / `arm+eager` / `arm+serial`: one arm, several ways
            if base in (REFERENCE_ARM, STATIC_ARM):
                raise OilbirdError(f"arm '{a}': {base} verifies no draft; +graph, +eager and +serial are for "
                                   "drafter arms")
            resolve_arms((base,), factories)
            factories[a] = lambda lm, cfg, f=factories[base], k=kind: f(
                lm, dataclasses.replace(cfg, verifier=k or cfg.verifier))
            continue
        if a in known:
            continue
        base = a.partition("@")[0]
        if "@" not in a or base not in library:
            raise OilbirdError(f"unknown arm '{a}'; known: {', '.join(known)} (or a variant of a library arm "
                               "as arm@field=value, e.g. oilbird@theta=0.7)")
        from decoder.drafters import make_drafter

        make_drafter(a, vocab_size=2, nodes=1)  # a bad field or value: one line, before any work
        factories[a] = library_factory(a)
    added = REFERENCE_ARM not in names
    return [REFERENCE_ARM] + [a for a in names if a != REFERENCE_ARM], added


VERIFIER_SUFFIXES = ("+graph", "+eager")
SERIAL_SUFFIX = "+serial"


def split_verifier(arm: str) -> tuple[str, str | None]:
    """`oilbird+graph` -> ("oilbird", "graph"): an arm written with the verifier it runs through (bench-decode
    serves oilbird through both, side by side); a plain name -> (name, None): the run's --verifier. A trailing
    `+serial` (`serial_arm`) is not part of the base: `oilbird+graph+serial` -> ("oilbird", "graph")."""
    arm = arm.removesuffix(SERIAL_SUFFIX)
    for suffix in VERIFIER_SUFFIXES:
        if arm.endswith(suffix):
            return arm[:-len(suffix)], suffix[1:]
    return arm, None


def serial_arm(arm: str) -> bool:
    """`arm+serial` (after any +graph/+eager): the arm with the bookkeeping before each verify, not beside it."""
    return arm.endswith(SERIAL_SUFFIX)


def load_warm_pool(path: str, lm: LoadedModel) -> list[tuple[list[int], list[int], np.ndarray, str]]:
    """(prompt, output tokens, states float32, tenant) of every request of a captured store, or of a store set
    (data/store/storeset.py: its members as one stream), in order."""
    store = open_store_or_set(path, model_fingerprint=lm.fingerprint, d_model=lm.d_model)
    tenants = store.requests["tenant"].to_list() if "tenant" in store.requests.columns else None
    pool = []
    for r in range(store.n_requests):
        lo, hi = int(store.offsets[r]), int(store.offsets[r + 1])
        pool.append((store.prompt(r), [int(t) for t in store.tokens(r)], store.hidden[lo:hi].astype(np.float32),
                     (tenants[r] or "") if tenants else ""))
    return pool


@torch.no_grad()
def warm_up(lm: LoadedModel, prompt: list[int]) -> None:
    """One prefill and one tree forward before any timing, so the first arm does not pay start-up costs."""
    from transformers import DynamicCache

    cache = DynamicCache()
    head = prompt[:64]
    lm.model(input_ids=torch.tensor([head], device=lm.device), **cache_kwargs(lm.model, cache), use_cache=True)
    verify_tree(lm.model, cache, len(head), head[-1], head[:8], list(range(-1, min(8, len(head)) - 1)))


def serve_arm(name: str, lm: LoadedModel, prompts: list[list[int]], cfg: DecodeConfig, stop,
              factory: ArmFactory | None, warm_pool, progress_desc: str, tenants: list[str] | None = None,
              budget_tokens: int | None = None, static: StaticGreedy | None = None, graph=None) -> ArmRun:
    """Serve every prompt in order with the arm through the one request runner (decoder/loop.py
    `serve_requests`): one drafter per tenant (decoder/pools.py), `ar` with none, `ar-static` through
    `static` (transformers' generate, decoder/verify/reference.py); a drafter arm verifies with `graph` (the graph
    verifier, decoder/verify/graph.py) when given, else eagerly."""
    from tqdm import tqdm

    tenants = tenants or [""] * len(prompts)
    pools = TenantPools(lambda: factory(lm, cfg), budget_tokens) if factory is not None else None
    warm_s = 0.0
    if pools is not None and warm_pool:
        t0 = time.perf_counter()
        pools.add_warm(warm_pool)  # a warm trace feeds its own tenant's drafter only
        warm_s = time.perf_counter() - t0
    bar = tqdm(total=len(prompts), unit="req", desc=progress_desc, disable=not cfg.progress, dynamic_ncols=True)
    tap = LayerTap(lm.model, lm.layer) if pools is not None and graph is None else None
    overlap = resolve_overlap(cfg.overlap, lm.device) and not serial_arm(name)
    verifier = graph
    if pools is not None:
        verifier = verifier or ModelVerifier(lm, tap, stop)
        verifier.set_overlap(overlap)
    totals = {"tokens": 0, "passes": 0, "seconds": 0.0}

    def decode(r: int, drafter: Drafter | None) -> Generation:
        if static is not None:
            # generate stops by StaticGreedy's rule: this request's, cut at the context as ar's is
            static.stop = stop.within(lm.context, len(prompts[r]))
            return static.decode(prompts[r])
        if drafter is None:
            return decode_greedy(lm, prompts[r], stop)
        return decode_speculative(lm, tap, prompts[r], drafter, stop, cfg.nodes, verifier)  # graph: the run's stop rule

    def show(g: Generation, pool_s: float) -> None:
        totals["tokens"] += len(g.tokens)
        totals["passes"] += len(g.cycles)
        totals["seconds"] += g.seconds + pool_s
        bar.set_postfix(tau=f"{totals['tokens'] / max(1, totals['passes']):.2f}",
                        tok_s=f"{totals['tokens'] / max(totals['seconds'], 1e-9):.1f}", refresh=False)
        bar.update(1)

    before = graph.snapshot() if graph is not None else None
    try:
        gens, pool_s = serve_requests(prompts, tenants, pools, decode, on_request=show)
    finally:
        bar.close()
        if tap is not None:
            tap.close()
        if verifier is not None and verifier is not graph:
            verifier.close()
    stats = pools.counters() if pools is not None else None
    described = None
    if pools is not None:
        described = {**(graph.describe(before) if graph is not None else {"kind": "eager"}), "overlap": overlap}
    return ArmRun(name, gens, pool_s, warm_s, stats, pools.summary() if pools is not None else None, described)


@dataclass
class Serving:
    """What every arm of a run serves with, resolved once before any timing (`prepare_serving`)."""

    arms: list[str]  # run order of round 1 (ar first)
    factories: dict[str, ArmFactory]
    requests: list
    prompts: list[list[int]]
    tenants: list[str]
    stop: object  # decoder.verify.engine.StopRule
    warm_pool: list
    budget_tokens: int | None
    static: StaticGreedy | None  # ar-static, built and warmed (compiled) once; None when it does not run
    graph: object  # the graph verifier (decoder/verify/graph.py), compiled once for every drafter arm; None: eager
    graph_arms: set  # the drafter arms that verify through it
    base: dict  # the fields every arm's summary.json shares
    out_dir: Path


def check_context(lm: LoadedModel, requests, prompts: list[list[int]], max_new: int) -> None:
    """A prompt longer than the model's context is refused (capture's rule: data/capture/run.py fit_prompts);
    a cap that runs past it is cut per request (decoder/verify/engine.py StopRule.within), said in one note."""
    ctx = lm.context
    if not ctx:
        return
    for req, p in zip(requests, prompts):
        if len(p) > ctx:
            raise OilbirdError(f"request {req.id}: the prompt is {len(p)} tokens, longer than the model's context "
                               f"of {ctx} positions")
    cut = sum(context_cap(max_new, len(p), ctx) < max_new for p in prompts)
    if cut:
        print(context_note(cut, max_new, ctx), file=sys.stderr)


def prepare_serving(cfg: DecodeConfig, lm: LoadedModel | None,
                    extra_arms: dict[str, ArmFactory] | None) -> tuple[Serving, LoadedModel]:
    """Check the config and resolve the arms (bad input fails here, before the model loads), load the model
    unless given, encode the prompts, warm the model (and ar-static) up."""
    if nodes_error(cfg.nodes):
        raise OilbirdError(nodes_error(cfg.nodes))
    if cfg.rounds < 1:
        raise OilbirdError(f"--rounds must be at least 1 (got {cfg.rounds})")
    check_verifier(cfg.verifier)
    resolve_overlap(cfg.overlap, "cpu")  # a bad value: one line, before the model loads
    check_profile_spec(cfg.profile)
    info = get_benchmark(cfg.bench)
    factories = {**library_drafters(), **(extra_arms or {})}
    arms, added = resolve_arms(tuple(cfg.arms), factories)
    if added:
        print(f"note: running '{REFERENCE_ARM}' first as the reference for speedup and the lossless audit",
              file=sys.stderr)
    requests = load_requests(cfg.bench, cfg.limit)
    max_new = info.max_new_tokens if cfg.max_new_tokens is None else cfg.max_new_tokens
    if max_new < 1:
        raise OilbirdError(f"--max-new-tokens must be at least 1 (got {max_new})")
    stop_strings = info.stop_strings if cfg.stop_strings is None else tuple(cfg.stop_strings)
    if lm is None:
        lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    check_supported(lm.model)
    spec = check_index(cfg.index, lm.d_model)
    budget_tokens, budget_info = resolve_budget(cfg.store_budget, spec, lm.d_model, warm=bool(cfg.warm_from))
    note = warmup_note(spec, cfg.index_train_size, budget_tokens) if budget_tokens is not None else None
    if note:
        print(f"note: {note}", file=sys.stderr)
    stop = stop_rule(lm, stop_strings, max_new)
    warm_pool = load_warm_pool(cfg.warm_from, lm) if cfg.warm_from else []
    tenants = [getattr(r, "tenant", "") or "" for r in requests]  # before data.benchmarks.registry had tenants: one
    prompts = [encode_prompt(lm, r.messages, f"request {i} (id {r.id!r})") for i, r in enumerate(requests)]
    if any(not p for p in prompts):
        raise OilbirdError("a request encodes to an empty prompt; nothing to decode from")
    check_context(lm, requests, prompts, max_new)
    warm_up(lm, prompts[0])
    verifier = resolve_verifier(cfg.verifier, lm.device)
    kinds = {a: split_verifier(a)[1] or verifier for a in arms if a not in (REFERENCE_ARM, STATIC_ARM)}
    graph_arms = {a for a, k in kinds.items() if k == "graph"}
    graph = None
    if graph_arms:
        graph = GraphVerifier(lm, stop, cfg.nodes, capacity_for(max(len(p) for p in prompts) + max_new + 2 * cfg.nodes))
        print(f"note: --verifier graph: compiling the verify forward for {len(graph.buckets)} row buckets "
              f"({','.join(map(str, graph.buckets))}; untimed, minutes on a CPU)", file=sys.stderr)
        graph.warm_up()
    cfg.step_cost, sizing = {}, {}  # per verifier its own profile (decoder/cost/live.py); no drafter arm: none
    for kind in sorted(set(kinds.values())):
        cfg.step_cost[kind], _, sizing[kind] = resolve_live_profile(
            cfg.profile, lm, [len(p) for p in prompts], max_new, cfg.nodes, cfg.out, cfg.progress, kind,
            graph if kind == "graph" else None)
    static = None
    if STATIC_ARM in arms:  # built and warmed (compiled) once, before any timing
        static = StaticGreedy(lm, stop, max(len(p) for p in prompts), cfg.static_compile)
        if static.compile_requested:
            print(f"note: {STATIC_ARM}: compiling the decode step (untimed; a minute or so the first time on CPU)",
                  file=sys.stderr)
        static.warm_up(prompts[0])
    out_dir = decode_dir(cfg.out, cfg.bench, lm.slug)
    n = len(arms)
    base = {
        "bench": cfg.bench, "model": lm.name, "model_fingerprint": lm.fingerprint,
        "device": lm.device.type, "dtype": str(lm.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "nodes": cfg.nodes, "max_new_tokens": max_new, "stop_strings": list(stop_strings),
        "limit": cfg.limit, "warm_from": cfg.warm_from, "warm_requests": len(warm_pool),
        "index": spec.text, "store_budget": budget_info, "store_budget_tokens": budget_tokens,
        "arms_run": arms, "ar_added": added, "decode_dir": str(out_dir),
        "invocation": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        # round r starts at arm r mod n: round 1 at ar
        "rounds": cfg.rounds, "round_order": [arms[r % n:] + arms[:r % n] for r in range(cfg.rounds)],
        "sizing": sizing.get(verifier), "sizing_by_verifier": sizing, "verifier_kind": verifier,
    }
    return Serving(arms, factories, requests, prompts, tenants, stop, warm_pool, budget_tokens, static, graph,
                   graph_arms, base, out_dir), lm


def serve_rounds(cfg: DecodeConfig, lm: LoadedModel, sv: Serving):
    """Every arm once per round, in each round's rotated order. Returns round 1's run of every arm (tau, the
    audit and the tables come from it), tokens/s per round, and the rounds whose tokens differ from round 1's."""
    n, rounds = len(sv.arms), cfg.rounds
    first: dict[str, ArmRun] = {}
    speeds: dict[str, list[float]] = {a: [] for a in sv.arms}
    differ: dict[str, list[dict]] = {a: [] for a in sv.arms}
    for r, order in enumerate(sv.base["round_order"]):
        for k, name in enumerate(order):
            run = serve_arm(name, lm, sv.prompts, cfg, sv.stop, sv.factories.get(name), sv.warm_pool,
                            f"{name} (round {r + 1}/{rounds}, {k + 1}/{n})", sv.tenants, sv.budget_tokens,
                            sv.static if name == STATIC_ARM else None, sv.graph if name in sv.graph_arms else None)
            speeds[name].append(tokens_per_s(run))
            if r == 0:
                first[name] = run
                if name == REFERENCE_ARM:  # the first arm of round 1
                    # every arm commits ar's tokens: a budget below one of its traces is refused before any drafting
                    check_budget(sv.budget_tokens, [len(g.tokens) for g in run.generations])
                continue
            changed = [q for q, (g, g0) in enumerate(zip(run.generations, first[name].generations))
                       if g.tokens != g0.tokens]
            if changed:
                differ[name].append({"round": r + 1, "requests": changed})
                print(f"warning: {name} decoded {len(changed)} request(s) differently in round {r + 1} than in "
                      f"round 1 (requests {', '.join(map(str, changed[:8]))}{', ...' if len(changed) > 8 else ''})",
                      file=sys.stderr)
    return first, speeds, differ


def verifier_block(run: ArmRun) -> dict:
    """summary.json's `verifier`: how the arm's passes were verified (ar: one eager forward a token; ar-static:
    transformers' generate; a drafter arm: the graph verifier's counters in round 1, or eager)."""
    if run.name == REFERENCE_ARM:
        return {"kind": "eager-greedy"}
    if run.name == STATIC_ARM:
        return {"kind": "generate-static"}
    return run.verifier or {"kind": "eager"}


def run_decode(cfg: DecodeConfig, lm: LoadedModel | None = None,
               extra_arms: dict[str, ArmFactory] | None = None) -> dict[str, dict]:
    """Serve the benchmark with every arm; returns {arm: summary} (also written under decode/<arm>/)."""
    sv, lm = prepare_serving(cfg, lm, extra_arms)
    try:
        first, speeds, differ = serve_rounds(cfg, lm, sv)
    finally:
        if sv.graph is not None:
            sv.graph.close()
    reference = first[REFERENCE_ARM]
    ids = [r.id for r in sv.requests]
    summaries: dict[str, dict] = {}
    for name in sv.arms:
        run = first[name]
        speed = speed_summary(speeds[name], speeds[REFERENCE_ARM], speeds.get(STATIC_ARM))
        summary = summarize(run, reference, ids, sv.base, speed=speed)
        summary.update({"rounds_identical": not differ[name], "round_mismatches": differ[name]})
        if name == STATIC_ARM:
            summary.update(sv.static.summary())
        summary["verifier"] = verifier_block(run)
        kind = split_verifier(name)[1]
        if kind is not None:  # an arm with a verifier of its own: sized by that verifier's profile
            summary["sizing"] = sv.base["sizing_by_verifier"].get(kind)
        write_folder(sv.out_dir / component(name, "arm"), {"cycles.parquet": cycles_table([g.cycles for g in run.generations]),
                                         "requests.parquet": requests_table(run, sv.requests, sv.prompts),
                                         "summary.json": summary})
        summaries[name] = summary
    return summaries

