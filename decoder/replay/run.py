"""Replay: every drafter over a captured trace store, without the model.

Replay runs the decoder's own drafter classes through the one speculative loop and the one request
runner the live decoder uses (decoder/loop.py `speculate`, `serve_requests`), with the model's
verification forward replaced by the store (decoder/replay/traces.py `TraceVerifier`: SuffixDecoding's
offline simulator, for every arm, the semantic source included; which arms replay exactly, and why the
others do not, is `exactness` there):

  per request, in serving order         the loop: begin_request, then per pass propose (draft_s),
                                          verify against the trace, observe (update_s)
    pool "past" (default)               drafter.add_trace(x, prompt hash, states): the trace joins the
                                          pool when its request ends; the first request sees none
    pool "warm"                         every trace enters before serving, none after; a request skips
                                          the traces of its own prompt hash (as every pool does)

Time. Drafting and update times are measured per pass. The model's time comes from a profile of one
verification forward against node count and context (decoder/cost/profile.py, `python -m decoder
profile`): estimated arm time = prefill + sum over passes of verify(nodes, context) + drafting +
update + pool insertion; plain greedy = prefill + verify(0, context) per token.

Pools (decoder/pools.py): `--index SPEC` picks the semantic key's index (default auto: the float16
matrix, pruned by an inverted file once the pool is large; exact scores every row; a faiss spec
keeps the states in faiss instead); `--store-budget B` bounds the past pool to the
data/index/budget.py window (request r drafts from requests s(r) .. r-1 only); a store with a `tenant`
column gets one drafter per tenant, so no request drafts from another tenant's traces.

Arm runs (decoder/replay/arms.py): each (arm, nodes) replays on its own, in worker processes on this
machine (`--jobs`) or as one Ray task each (`--ray auto|local:N|HOST:PORT`); the outputs are the same
either way, timings aside (tests/test_scale_rayablations.py).

Outputs: runs/<bench>/<model>/replay/<arm>/ (replay-warm/ for the warm pool; with several --nodes
values, one nodes-<N>/ folder per value inside the arm's): cycles.parquet as the live decoder's and
summary.json (see docs/replay.md). Every summary records `store_fingerprint` (the store it was computed on:
`replay_is_current` and the reports compare it with the store's current one, data/store/reader.py
`current_fingerprint`), `store_verified` (false on a store without checksums), `store_sealed` (false on an
unsealed meta.json, whose hand edits cannot be caught) and `store_note` (the line saying either, printed under
the table), and `sampled_requests` ({count, of, unknown} of the replayed requests: those whose stored tokens were
sampled, data/store/sampling.py; a count above 0 is one `note:` line on stderr, and what replay's figures then
estimate is docs/replay.md, "Sampled traces").
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from data.errors import OilbirdError
from data.index.budget import check_budget
from data.index.stateindex import DEFAULT_INDEX, check_trainable
from data.stats import RequestBootstrap
from data.store.layout import (
    component,
    default_profile_path,
    model_slug,
    replay_dir,
    store_dir,
)
from data.store.meta import unsealed_note
from data.store.sampling import sampled_note, sampled_requests
from data.store.storeset import current_summary, open_store_or_set, read_store_meta, set_provenance
from decoder.draft import nodes_error
from decoder.verify.passes import paired_ratio, pass_statistics
from decoder.policy import DECISION_ARMS, FORM_PAIRS, decision_arms, paired_arm
from decoder.pools import (
    INDEX_HELP,
    PoolSettings,
    check_index,
    index_summary,
    resolve_budget,
    warmup_note,
)
from decoder.cost.pricing import arm_batch, check_coverage, check_nodes, cost_sized_arms, priced_span
from decoder.cost.spread import spread_ends, spread_width
from decoder.replay.arms import (  # noqa: F401  (replay_arm: one arm's replay, imported from here by its users)
    ArmReplay,
    check_ray,
    replay_arm,
    run_in_processes,
    run_on_ray,
)
from decoder.replay.traces import Trace, load_traces, uses_states
from decoder.replay.workers import check_jobs

# `--arms decision` (what `make census` replays): decoder/policy.py's decision_arms for the profile's engine
DECISION = "decision"
DECISION_NODES = 60  # the node budget the decision reads when several were replayed (reports/results.py), else the largest
POOLS = ("past", "warm")
SIZINGS = ("profile", "flat")
UNVERIFIED_NOTE = ("replayed on an unverified trace store (no checksums in its meta.json, as in a store written "
                   "before checksums existed), so its files could not be checked against what capture wrote")


@dataclass
class ReplayConfig:
    bench: str
    model: str = "smollm2-135m"  # names the store: runs/<bench>/<model slug>/traces
    arms: tuple[str, ...] = DECISION_ARMS  # ("all",) = every arm the decoder knows but ar
    nodes: tuple[int, ...] = (60,)  # draft node budgets; one output folder each when several
    pool: str = "past"  # past: strictly online (a trace joins when its request ends) | warm: all others
    limit: int | None = None  # first N requests of the store
    max_new_tokens: int | None = None  # None = the store's cap; smaller cuts every trace there
    out: str = "runs"
    store: str | None = None  # default runs/<bench>/<model slug>/traces
    bootstrap: int = 2000  # request-bootstrap draws for the intervals (0 = none)
    seed: int = 0
    profile: str | None = None  # None = runs/profiles/<model slug>-cpu.json when it exists
    jobs: int = 0  # worker processes (arms run in parallel); 0 = min(arms, CPU cores); not with ray
    ray: str | None = None  # --ray auto|local:N|HOST:PORT: one Ray task per (arm, nodes) (decoder/replay/arms.py);
    #                         None = this machine's worker processes (jobs)
    progress: bool = True
    index: str = DEFAULT_INDEX  # --index: the semantic key's index (data/index/stateindex.py; decoder/pools.py)
    store_budget: str | None = None  # --store-budget: tokens ("200k") or megabytes ("64MB"); None = unbounded
    knn_recall_every: int = 8  # auto or faiss index: every Nth inexact query repeated exactly (knn_recall); 0 = off
    index_train_size: int = 0  # states a faiss coder collects before training (0: the spec's own need)
    results_dir: str | None = None  # where the arm folders go (default runs/<bench>/<model>/replay[-warm])
    pair_against: str | None = None  # every arm's paired tau gain against this arm (default: PAIRED, oilbird vs oilbird-no-semantic)
    sizing: str = "profile"  # profile: the arms with size auto size their drafts by the profile that prices them
    #                          (decoder/drafters/sizing.py); flat: by a flat cost, every candidate kept (the fixed-budget
    #                          tree: the ablations' setting, the paper's B = 60)


# ---------------------------------------------------------------- arms

def resolve_arms(arms: Sequence[str]) -> list[str]:
    from decoder.drafters import arm_names

    known = [a for a in arm_names() if a != "ar"]
    names = [a.strip() for a in arms if a.strip()]
    if names == ["all"]:
        return known
    if not names:
        raise OilbirdError(f"--arms is empty; give e.g. {','.join(DECISION_ARMS)} (or all)")
    from decoder.drafters import make_drafter, parse_variant

    for a in names:
        if parse_variant(a)[0] not in known:
            raise OilbirdError(f"unknown arm '{a}' for replay; known: {', '.join(known)} (or all; a variant "
                               "as arm@field=value, e.g. oilbird@theta=0.7)")
        if "@" in a:
            make_drafter(a, vocab_size=2, nodes=1)  # a bad field or value fails here, before any work
    dupes = sorted({a for a in names if names.count(a) > 1})
    if dupes:
        raise OilbirdError(f"--arms names {', '.join(dupes)} twice")
    return names


# ---------------------------------------------------------------- time estimate

def estimate(run: ArmReplay, traces: list[Trace], cost, boot: RequestBootstrap | None) -> tuple[dict, np.ndarray, np.ndarray]:
    """Estimated seconds per request for plain greedy and for this arm, and the summary block."""
    from decoder.cost.profile import profile_vllm_mode

    R = len(traces)
    ar_r, arm_r = np.zeros(R), np.zeros(R)
    verify_total = draft_total = update_total = 0.0
    for r, (tr, cycles) in enumerate(zip(traces, run.cycles)):
        past0 = len(tr.prompt) - 1  # the cache holds the context minus the anchor
        prefill = float(cost.prefill_s(len(tr.prompt)))
        ar_r[r] = prefill + float(np.sum(cost.verify_s(np.zeros(len(tr.tokens)), past0 + np.arange(len(tr.tokens)))))
        nodes = np.array([c.nodes for c in cycles], float)
        check_nodes(cost, run.arm, int(nodes.max(initial=0)))  # the passes themselves: only measured counts priced
        past = past0 + np.concatenate([[0], np.cumsum([c.committed for c in cycles])[:-1]]) if cycles else np.zeros(0)
        verify = float(np.sum(cost.verify_s(nodes, past))) if cycles else 0.0
        draft = sum(c.draft_s for c in cycles)
        update = sum(c.update_s for c in cycles)
        arm_r[r] = prefill + verify + draft + update + run.pool_s[r]
        verify_total, draft_total, update_total = verify_total + verify, draft_total + draft, update_total + update
    cycle_total = verify_total + draft_total + update_total
    speedup, interval = paired_ratio(ar_r, arm_r, boot)
    block = {
        "profile": cost.meta.get("path"), "engine": cost.meta.get("engine", "harness"),
        "vllm_mode": profile_vllm_mode(cost.meta),
        "device": cost.meta.get("device"), "device_name": cost.meta.get("device_name"),
        "profile_threads": cost.meta.get("threads"),
        "speedup": speedup, "speedup_interval": interval,
        "ar_seconds": float(ar_r.sum()), "arm_seconds": float(arm_r.sum()),
        "verify_seconds": verify_total, "draft_seconds": draft_total, "update_seconds": update_total,
        "pool_seconds": float(run.pool_s.sum()),
        "draft_fraction": draft_total / cycle_total if cycle_total else None,
        "overhead_fraction": (draft_total + update_total) / cycle_total if cycle_total else None,
    }
    return block, ar_r, arm_r


# ---------------------------------------------------------------- the command

def replay_is_current(cfg: ReplayConfig) -> bool:
    """Every arm of `cfg` has a result with its settings, computed from the store as it is now, and with
    the speed estimate when a verification-cost profile exists (`--if-missing`)."""
    from data.capture.models import pick_device

    check_config(cfg)
    if cfg.store or cfg.results_dir or cfg.index != DEFAULT_INDEX or cfg.store_budget:
        return False  # only the default layout is looked up
    slug = model_slug(cfg.model)
    cfg = expand_decision(cfg, slug)
    root, store = replay_dir(cfg.out, cfg.bench, slug, cfg.pool), store_dir(cfg.out, cfg.bench, slug)
    profile = Path(cfg.profile) if cfg.profile else default_profile_path(cfg.out, slug, pick_device(None).type)
    for arm in resolve_arms(cfg.arms):
        for nodes in cfg.nodes:
            folder = root / component(arm, "arm") / ("" if len(cfg.nodes) == 1 else f"nodes-{nodes}")
            s = current_summary(folder / "summary.json", store, nodes=nodes, pool=cfg.pool, limit=cfg.limit,
                                bootstrap_draws=cfg.bootstrap, seed=cfg.seed, index=cfg.index)
            if s is None or (cfg.max_new_tokens and s.get("max_new_tokens") != cfg.max_new_tokens):
                return False
            if s.get("sizing", "flat") != cfg.sizing:
                return False
            if s.get("estimate") is None and profile.exists():
                return False
            if s.get("estimate") is not None and "profile_spread" not in s and any(
                    arm == on and off in cfg.arms for on, off in FORM_PAIRS.values()):
                return False  # the verdict's pair, replayed before its profile's spread was checked
            if not (folder / "cycles.parquet").exists():
                return False
    return True


def check_config(cfg: ReplayConfig) -> None:
    if cfg.pool not in POOLS:
        raise OilbirdError(f"--pool must be past or warm (got {cfg.pool!r})")
    if not cfg.nodes:
        raise OilbirdError("--nodes is empty; give e.g. 60 or 16,32,60")
    bad = [nodes_error(n, least=1) for n in cfg.nodes if nodes_error(n, least=1)]
    if bad:
        raise OilbirdError(bad[0])
    if len(set(cfg.nodes)) != len(cfg.nodes):
        raise OilbirdError("--nodes names a value twice")
    check_jobs(cfg.jobs)
    check_ray(cfg.ray, cfg.jobs)
    if cfg.limit is not None and cfg.limit < 1:
        raise OilbirdError(f"--limit must be at least 1 (got {cfg.limit})")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise OilbirdError(f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})")
    if cfg.bootstrap < 0:
        raise OilbirdError(f"--bootstrap must be 0 or more (got {cfg.bootstrap})")
    if cfg.sizing not in SIZINGS:
        raise OilbirdError(f"--sizing must be {' or '.join(SIZINGS)} (got {cfg.sizing!r})")
    if cfg.knn_recall_every < 0 or cfg.index_train_size < 0:
        raise OilbirdError("knn_recall_every and index_train_size must be 0 or more")


def load_cost(cfg: ReplayConfig, slug: str, fingerprint: str):
    """The verification-cost profile (decoder/cost/profile.py), or (None, why not)."""
    from data.capture.models import pick_device
    from decoder.cost.profile import CostModel

    path = Path(cfg.profile) if cfg.profile else default_profile_path(cfg.out, slug, pick_device(None).type)
    if not cfg.profile and not path.exists():
        return None, (f"no profile at {path}: no estimated speedup (make one with "
                      f"`python -m decoder profile --model {cfg.model} --bench {cfg.bench}`)")
    cost = CostModel.load(path, model_fingerprint=fingerprint, model=cfg.model)
    cost.meta["path"] = str(path)
    return cost, None


def run_replay(cfg: ReplayConfig) -> dict[tuple[str, int], dict]:
    """Replay every (arm, nodes); write each arm's folder; returns {(arm, nodes): summary}."""
    check_config(cfg)
    slug = model_slug(cfg.model)
    cfg = expand_decision(cfg, slug)
    arms = resolve_arms(cfg.arms)
    path, store, cap, vocab_size = open_replay_store(cfg, arms, slug)
    meta = store.meta
    spec = check_index(cfg.index, store.d_model)
    budget_tokens, budget_info = resolve_budget(cfg.store_budget, spec, store.d_model, cfg.pool)
    cost, cost_note = load_cost(cfg, slug, meta["model_fingerprint"])
    ends, spread_note = spread_ends(cost) if cost is not None else (None, None)  # a damaged spread: refused here
    traces = load_traces(store, cfg.limit, cfg.max_new_tokens)
    context_note = None if cost is None else check_coverage(  # only what the profile measured (decoder/cost/pricing.py)
        cost, arms, cfg.nodes, cost_sized_arms(arms, cfg.sizing),
        priced_span([len(t.prompt) for t in traces], [len(t.tokens) for t in traces], cost.contexts_range()[0]))
    if context_note:
        print(f"note: {context_note}", file=sys.stderr)
    # what makes these results stale when the store changes (reports, --if-missing), and whether its files were checked
    fingerprint, verified, set_info = store.fingerprint, bool(store.verified), set_provenance(store)
    sealed = bool(store.meta_sealed)
    store_notes = [n for n, ok in ((UNVERIFIED_NOTE, verified), (unsealed_note(path, "replayed"), sealed)) if not ok]
    if (set_info.get("store_set") or {}).get("note"):
        print(f"note: {set_info['store_set']['note']}", file=sys.stderr)
    if not traces or not any(tr.tokens for tr in traces):
        raise OilbirdError(f"trace store {path} holds no generated tokens to replay")
    sampled = sampled_requests(store.requests, len(traces))  # of the replayed requests (docs/replay.md)
    if sampled_note(sampled):
        print(f"note: {sampled_note(sampled)}", file=sys.stderr)
    del store
    check_budget(budget_tokens, [len(tr.tokens) for tr in traces])
    index_note = check_index_fits(spec, cfg, arms, traces, vocab_size, budget_tokens)
    settings = PoolSettings(spec.text, budget_tokens, cfg.knn_recall_every, cfg.index_train_size,
                            step_cost=cost if cfg.sizing == "profile" else None)
    runs = run_jobs(cfg, [(arm, nodes) for arm in arms for nodes in cfg.nodes], traces, path, vocab_size, settings)

    boot = RequestBootstrap(len(traces), cfg.bootstrap, cfg.seed) if cfg.bootstrap > 0 else None
    base = {
        "kind": "replay", "bench": cfg.bench, "model": meta["model"], "model_fingerprint": meta["model_fingerprint"],
        "store": str(path), "store_fingerprint": fingerprint, "store_verified": verified, "store_sealed": sealed,
        "store_note": "; ".join(store_notes) or None, **set_info, "sampled_requests": sampled,
        "pool": cfg.pool, "limit": cfg.limit,
        "max_new_tokens": cfg.max_new_tokens or cap, "store_max_new_tokens": cap, "requests": len(traces),
        "bootstrap_draws": cfg.bootstrap, "seed": cfg.seed, "sizing": cfg.sizing,
        "invocation": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    summaries: dict[tuple[str, int], dict] = {}
    arm_seconds: dict[tuple[str, int], np.ndarray] = {}  # estimated seconds per request, with a profile
    for key, run in runs.items():
        summaries[key] = summarize_run(run, base, boot, spec, index_note, cost_note, budget_info)
        if cost is not None:
            batch = arm_batch(run.arm)
            summaries[key]["estimate"], _, arm_seconds[key] = estimate(run, traces, cost.at_batch(batch), boot)
            summaries[key]["estimate"]["batch"] = batch
            summaries[key]["estimate"]["context_note"] = context_note
            summaries[key]["estimate_by_batch"] = {
                str(b): {k: v for k, v in estimate(run, traces, cost.at_batch(b), boot)[0].items()
                         if k in ("speedup", "speedup_interval", "ar_seconds", "arm_seconds")}
                for b in cost.batch_sizes()}
    add_paired_gains(summaries, runs, arm_seconds, cfg.pair_against, boot)
    if cost is not None:
        add_profile_spread(cfg, summaries, runs, traces, path, vocab_size, settings, boot, cost, ends, spread_note)
    write_results(cfg, slug, summaries, runs)
    return summaries


def run_jobs(cfg: ReplayConfig, jobs: list[tuple[str, int]], traces: list[Trace], path: Path, vocab_size: int,
             settings: PoolSettings) -> dict[tuple[str, int], ArmReplay]:
    """Every (arm, nodes) of `jobs`, on Ray (`cfg.ray`: one task each) or in this machine's worker processes."""
    if cfg.ray is not None:  # one Ray task per (arm, nodes) (decoder/replay/arms.py); the same runs
        return run_on_ray(cfg.ray, jobs, traces, cfg.pool, vocab_size, settings, cfg.progress)
    return run_in_processes(jobs, traces, path, cfg.pool, cfg.limit, cfg.max_new_tokens, vocab_size, settings,
                            cfg.jobs or min(len(jobs), os.cpu_count() or 1), cfg.progress)


def add_profile_spread(cfg: ReplayConfig, summaries: dict, runs: dict, traces: list[Trace], path: Path,
                       vocab_size: int, settings: PoolSettings, boot: RequestBootstrap | None, cost,
                       ends: dict | None, note: str | None) -> None:
    """The verdict's pair (decoder/policy.py FORM_PAIRS, both replayed here) at both ends of the profile's measured
    spread (decoder/cost/spread.py): the key-on arm's summary gets `profile_spread` {reps, width, note, ends:
    {fast, slow: the inputs of the verdict there}}; `ends` null and `note` saying so when the spread is unknown.

    Only what the profile changes is replayed again: the pair's cost-sized arms (size auto under --sizing
    profile), sized by the end's costs, at the node budget the decision reads; an arm the profile does not size
    passes the same way at either end, so its run is reused and only priced again."""
    nodes = DECISION_NODES if DECISION_NODES in cfg.nodes else max(cfg.nodes)
    pairs = [pair for pair in dict.fromkeys(FORM_PAIRS.values()) if all((a, nodes) in runs for a in pair)]
    if not pairs:
        return
    block = {"reps": cost.meta.get("reps"), "width": spread_width(cost), "note": note, "ends": None}
    if ends is None:
        for on, _ in pairs:
            summaries[(on, nodes)]["profile_spread"] = dict(block)
        return
    pair_arms = [a for pair in pairs for a in pair]
    resized = [a for a, sized in zip(pair_arms, cost_sized_arms(pair_arms, cfg.sizing)) if sized]
    per_pair: dict[str, dict] = {on: {} for on, _ in pairs}
    for end, end_cost in ends.items():
        end_runs = dict(runs)
        if resized and cfg.progress:
            print(f"replay: {', '.join(resized)} again at the {end} end of the profile's spread", file=sys.stderr)
        if resized:
            end_runs.update(run_jobs(cfg, [(a, nodes) for a in resized], traces, path, vocab_size,
                                     dataclasses.replace(settings, step_cost=end_cost)))
        for on, off in pairs:
            r_on, r_off = end_runs[(on, nodes)], end_runs[(off, nodes)]
            share = pass_statistics(r_on.cycles, r_on.has_key, boot)["sole_source_share"] or {}
            ratio, iv = paired_ratio(np.array([len(c) for c in r_off.cycles], float),
                                     np.array([len(c) for c in r_on.cycles], float), boot)
            per_pair[on][end] = {
                "sole_source_share": {"value": share.get("value"), "interval": share.get("interval")},
                "paired_gain": {"versus": off, "tau_ratio": ratio, "interval": iv},
                "speedup": estimate(r_on, traces, end_cost, boot)[0]["speedup"],
                "speedup_versus": estimate(r_off, traces, end_cost, boot)[0]["speedup"],
                "mean_nodes": float(np.mean([c.nodes for cs in r_on.cycles for c in cs] or [0.0])),
                "resized": any(a in resized for a in (on, off)),  # sized again by the end's costs (else repriced)
            }
    for on, _ in pairs:
        summaries[(on, nodes)]["profile_spread"] = {**block, "ends": per_pair[on]}


def expand_decision(cfg: ReplayConfig, slug: str) -> ReplayConfig:
    """`--arms decision`: the arms the profile's engine runs (decoder/policy.py decision_arms: its form, at every
    batch size it measured); without a profile, the harness's trees."""
    if [a.strip() for a in cfg.arms] != [DECISION]:
        return cfg
    store = Path(cfg.store) if cfg.store else store_dir(cfg.out, cfg.bench, slug)
    fingerprint = read_store_meta(store).get("model_fingerprint") if (store / "meta.json").exists() or (
        store.is_dir() or "," in str(store)) else None  # a store, or a set (data/store/storeset.py)
    cost, _ = load_cost(cfg, slug, fingerprint) if fingerprint else (None, None)
    return dataclasses.replace(cfg, arms=decision_arms(cost.meta.get("engine") if cost else None,
                                                       cost.batch_sizes() if cost else (1,)))


def open_replay_store(cfg: ReplayConfig, arms: list[str], slug: str):
    """(path, the opened store, its token cap, the vocabulary size), refusing a store replay cannot use."""
    from data.capture.store_model import check_store_model
    from decoder.drafters import make_drafter

    path = Path(cfg.store) if cfg.store else store_dir(cfg.out, cfg.bench, slug)
    if not (path / "meta.json").exists() and not path.is_dir() and "," not in str(cfg.store or ""):  # or a set
        raise OilbirdError(f"no trace store for {cfg.bench} / {slug} at {path}: run `python -m data capture "
                           f"--bench {cfg.bench} --model {cfg.model} --out {cfg.out}` first (or `make census "
                           f"BENCH={cfg.bench}`)")
    store = open_store_or_set(path)
    meta = store.meta
    check_store_model(meta, cfg.model, path)  # the census's check: never one model's results under another's name
    cap = int(meta["max_new_tokens"])
    if cfg.max_new_tokens is not None and cfg.max_new_tokens > cap:
        raise OilbirdError(f"--max-new-tokens {cfg.max_new_tokens} exceeds the store's cap of {cap}: replay cannot "
                           f"see past what was captured (recapture with --max-new-tokens {cfg.max_new_tokens})")
    largest = int(max(store.positions["token"].max(), store.topk.max(initial=0),
                      max(max(p) for p in store.requests["prompt_tokens"].to_list() if p)))
    vocab_size = int(meta.get("vocab_size") or 0) or 1 + largest
    if largest >= vocab_size:  # an unsealed meta.json (older code's) with vocab_size edited, or a damaged part
        raise OilbirdError(f"trace store {path} holds token id {largest}, outside its meta.json vocab_size "
                           f"{vocab_size}: meta.json was edited or the store is damaged (`python -m data verify "
                           f"{path}` says which)")
    if not store.hidden_valid.any():
        needs = [a for a in arms if uses_states(make_drafter(a, vocab_size=vocab_size, nodes=1))]
        if needs:
            raise OilbirdError(f"arm {needs[0]} needs hidden states and the store at {path} holds none; "
                               "recapture in generate mode (`python -m data capture`)")
    return path, store, cap, vocab_size


def check_index_fits(spec, cfg: ReplayConfig, arms: list[str], traces: list[Trace], vocab_size: int,
                     budget_tokens: int | None) -> str | None:
    """A faiss index must be trainable on the states any pool could hold; the note when it never trains."""
    from decoder.drafters import make_drafter

    if spec.exact or spec.auto or not any(uses_states(make_drafter(a, vocab_size=vocab_size, nodes=1)) for a in arms):
        return None
    # the most states any pool could hold: the replayed traces' valid states
    n_states = sum(int(np.count_nonzero(np.abs(tr.hidden).sum(axis=1))) for tr in traces)
    check_trainable(spec, n_states)
    note = warmup_note(spec, cfg.index_train_size, min(n_states, budget_tokens or n_states))
    if note:
        print(f"note: {note}", file=sys.stderr)
    return note


def summarize_run(run: ArmReplay, base: dict, boot: RequestBootstrap | None, spec, index_note: str | None,
                  cost_note: str | None, budget_info: dict | None) -> dict:
    """One (arm, nodes)'s summary.json, its estimate (with a profile) and paired gain left empty."""
    stats = pass_statistics(run.cycles, run.has_key, boot)
    tau, tau_iv = stats.pop("tau"), stats.pop("tau_interval")
    return {**base, "arm": run.arm, "nodes": run.nodes, **stats, "tau": {"value": tau, "interval": tau_iv},
            "exact": run.exact, "exact_reason": run.exact_reason, "seconds": run.seconds, "warm_pool_s": run.warm_s,
            "drafter_stats": run.stats, "estimate": None, "estimate_note": cost_note, "paired_gain": None,
            **index_summary(run.stats, spec), "index_note": index_note if run.stats else None,
            "store_budget": budget_info, **run.pools}


def add_paired_gains(summaries: dict, runs: dict, arm_seconds: dict, pair_against: str | None,
                     boot: RequestBootstrap | None) -> None:
    """Each arm's paired tau gain (and, with estimated seconds per request, speedup gain) over the arm it
    is paired with (decoder/policy.py paired_arm, or `pair_against` for every arm), replayed in the same command."""
    for (arm, nodes), s in summaries.items():
        other = paired_arm(arm) if pair_against is None else pair_against
        if other is None or other == arm:
            continue
        if (other, nodes) not in runs:
            s["paired_gain_note"] = f"replay {other} in the same command for the paired gain"
            continue
        passes_on = np.array([len(c) for c in runs[(arm, nodes)].cycles], float)
        passes_off = np.array([len(c) for c in runs[(other, nodes)].cycles], float)
        ratio, iv = paired_ratio(passes_off, passes_on, boot)  # same tokens: tau ratio = passes ratio, inverted
        gain = {"versus": other, "tau_ratio": ratio, "interval": iv, "speedup_ratio": None, "speedup_interval": None}
        if (arm, nodes) in arm_seconds:
            gain["speedup_ratio"], gain["speedup_interval"] = paired_ratio(
                arm_seconds[(other, nodes)], arm_seconds[(arm, nodes)], boot)
        s["paired_gain"] = gain


def write_results(cfg: ReplayConfig, slug: str, summaries: dict, runs: dict) -> None:
    """One folder per arm, written whole and swapped in (decoder.live.results.write_folder)."""
    from decoder.live.results import cycles_table, write_folder

    root = Path(cfg.results_dir) if cfg.results_dir else replay_dir(cfg.out, cfg.bench, slug, cfg.pool)
    for arm in dict.fromkeys(a for a, _ in summaries):
        files: dict = {}
        for nodes in cfg.nodes:
            prefix = "" if len(cfg.nodes) == 1 else f"nodes-{nodes}/"
            files[prefix + "summary.json"] = summaries[(arm, nodes)]
            files[prefix + "cycles.parquet"] = cycles_table(runs[(arm, nodes)].cycles)
        write_folder(root / component(arm, "arm"), files)


def replay_main(argv: list[str] | None = None) -> int:
    import argparse

    from data.errors import cli_entry
    from decoder.replay.table import format_table

    @cli_entry
    def main(argv):
        p = argparse.ArgumentParser(
            prog="python -m decoder replay",
            description="Replay drafter arms over a captured trace store without the model: per arm tau with "
                        "request-bootstrap intervals, per-source attribution, the sole-source share, drafting "
                        "time per pass and, with a profile (python -m decoder profile), the estimated speedup. "
                        "Writes runs/<bench>/<model>/replay/<arm>/{cycles.parquet,summary.json}.")
        p.add_argument("--bench", required=True, help="benchmark of the store (runs/<bench>/<model>/traces)")
        p.add_argument("--model", default="smollm2-135m", help="model of the store (alias, HF id or directory)")
        p.add_argument("--arms", default=",".join(DECISION_ARMS),
                       help=f"comma-separated arms, all, or decision (the arms the profile's engine runs: trees for the "
                            f"harness, chains for vLLM at each measured batch size; what make census replays) "
                            f"(default {','.join(DECISION_ARMS)}; see python -m decoder --help)")
        p.add_argument("--nodes", default="60", help="draft node budget(s), e.g. 60 or 16,32,60 (default 60)")
        p.add_argument("--pool", default="past", choices=POOLS,
                       help="past: a trace joins the pool when its request ends (default); warm: every other request's")
        p.add_argument("--limit", type=int, default=None, help="first N requests of the store")
        p.add_argument("--max-new-tokens", type=int, default=None, help="cut every trace at N tokens (default: the store's cap)")
        p.add_argument("--bootstrap", type=int, default=2000, help="request-bootstrap draws (default 2000; 0 = none)")
        p.add_argument("--profile", default=None,
                       help="verification-cost profile for the speedup estimate (default runs/profiles/<model>-cpu.json)")
        p.add_argument("--store", default=None, help="trace store folder, or a store set (a folder of stores, or store "
                       "folders comma-separated: one stream, docs/store.md) (default runs/<bench>/<model>/traces)")
        p.add_argument("--out", default="runs", help="output root (default runs/)")
        p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core, at most one per arm)")
        p.add_argument("--ray", default=None, metavar="auto|local:N|ADDRESS",
                       help="one Ray task per (arm, nodes), one per CPU of the cluster: auto (a running cluster, else a "
                            "local one), local:N (N CPUs here) or a cluster's HOST:PORT (ray://HOST:PORT from outside "
                            "it); the same results as without it (docs/scale.md); not with --jobs")
        p.add_argument("--index", default=DEFAULT_INDEX, metavar="SPEC", help=INDEX_HELP)
        p.add_argument("--store-budget", default=None, metavar="B",
                       help="bound the past pool to B generated tokens (200k, 1.5M) or megabytes (64MB): the oldest "
                            "traces leave when a join exceeds it, down to 7/8 of it (default: unbounded; 0 is refused, all = unbounded)")
        p.add_argument("--index-train", type=int, default=0, metavar="N",
                       help="states a faiss index collects (answering exactly) before it trains (default: the spec's own need)")
        p.add_argument("--if-missing", action="store_true",
                       help="skip when every arm's result with these settings exists for the store as it is now")
        p.add_argument("--sizing", default="profile", choices=SIZINGS,
                       help="profile: arms with size auto (oilbird, oilbird-chain, ...) size each draft by the profile "
                            "that prices them, for tokens per second (default); flat: every candidate kept, the "
                            "fixed-budget tree")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        args = p.parse_args(argv)
        try:
            nodes = tuple(int(v) for v in args.nodes.split(",") if v.strip())
        except ValueError:
            raise OilbirdError(f"--nodes must be comma-separated integers (got {args.nodes!r})") from None
        cfg = ReplayConfig(bench=args.bench, model=args.model, arms=tuple(args.arms.split(",")), nodes=nodes,
                           pool=args.pool, limit=args.limit, max_new_tokens=args.max_new_tokens, out=args.out,
                           store=args.store, bootstrap=args.bootstrap, profile=args.profile, jobs=args.jobs,
                           progress=not args.quiet, index=args.index, store_budget=args.store_budget,
                           index_train_size=args.index_train, sizing=args.sizing, ray=args.ray)
        if args.if_missing and replay_is_current(cfg):
            print(f"{replay_dir(cfg.out, cfg.bench, model_slug(cfg.model), cfg.pool)}: every arm's replay of the store "
                  "as it is now exists (--if-missing); not recomputed", file=sys.stderr)
            return 0
        t0 = time.perf_counter()
        summaries = run_replay(cfg)
        print(format_table(summaries))
        print(f"written: {replay_dir(cfg.out, cfg.bench, model_slug(cfg.model), cfg.pool)}/<arm>/ "
              f"({time.perf_counter() - t0:.1f} s)")
        return 0

    return main(argv)


if __name__ == "__main__":
    sys.exit(replay_main())
