"""Replay: every drafter over a captured trace store, without the model.

Greedy decoding is deterministic, and the trace store holds every committed token x_t, the state and
the top-8 computed with x_t as input (data/store.py). A draft node's fate depends only on the true
continuation: it is accepted iff its root path spells the trace's next tokens. So replay runs the
decoder's own drafter classes through the live engine's loop (decoder/engine.py `decode_speculative`)
with the verification forward replaced by the store - SuffixDecoding's offline simulator, for every
arm, the semantic source included:

  per request, in serving order         drafter.begin_request(prompt)
    per pass (m tokens committed)       draft = drafter.propose(prompt + x[:m], nodes)        (draft_s)
                                        argmax = truth_argmax(draft, x[m:]): the next token at the
                                          anchor and at every node on the true path, -1 elsewhere
                                        accepted, bonus = greedy_accept(...)    (the engine's kernel)
                                        commit accepted + bonus, cut at the trace's end
                                        drafter.observe(context, the store's top-8 and states at the
                                          anchor and the nodes on the true path)              (update_s)
    pool "past" (default)               drafter.end_request(prompt, x, states): the trace joins the
                                          pool when its request ends; the first request sees none
    pool "warm"                         every trace enters before serving, none after; a request skips
                                          the traces of its own prompt hash (as every pool does)

Exact arms. A drafter whose proposals depend only on committed tokens and their states (pld, suffix,
sam, the semantic key) makes the same passes as live decoding (tests/test_replay.py compares them
pass by pass). The store lacks the model's outputs at REJECTED nodes: the adjacency table of Token
Recycling (recycling, lexical, the lexical host of oilbird) learns the top-8 at every verified node,
the rejected-branch ring buffer (oilbird's rollouts) the argmax at rejected nodes. Replay passes -1
there: the table skips those rows and the ring buffer records nothing. `exactness(drafter)` says which
arms that touches, and summary.json records it with the reason.

Time. Drafting and update times are measured per pass. The model's time comes from a profile of one
verification forward against node count and context (decoder/profile.py, `python -m decoder
profile`): estimated arm time = prefill + sum over passes of verify(nodes, context) + drafting +
update + pool insertion; plain greedy = prefill + verify(0, context) per token.

Pools (decoder/pools.py): `--index SPEC` puts the semantic key's states in a faiss index instead of
the float16 matrix (exact, the default, is unchanged); `--store-budget B` bounds the past pool to the
data/budget.py window (request r drafts from requests s(r) .. r-1 only); a store with a `tenant`
column gets one drafter per tenant, so no request drafts from another tenant's traces.

Outputs: runs/<bench>/<model>/replay/<arm>/ (replay-warm/ for the warm pool; with several --nodes
values, one nodes-<N>/ folder per value inside the arm's): cycles.parquet as the live decoder's and
summary.json (see README, "Replay").
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from data.budget import check_budget
from data.errors import OilbirdError
from data.models import model_slug
from data.stateindex import check_trainable
from data.stats import RequestBootstrap
from data.store import current_summary, open_store, store_dir, store_fingerprint
from decoder.draft import ROOT, VerifyResult
from decoder.engine import Cycle, check_draft, pass_record
from decoder.passes import DEPTH_ROWS, SEMANTIC_SOURCE, paired_ratio, pass_statistics
from decoder.pools import PoolSettings, TenantPools, check_index, index_summary, resolve_budget, warmup_note
from decoder.tree import greedy_accept

# What `make census` replays: the decision needs the key on and off, and the two lexical baselines.
DECISION_ARMS = ("suffix", "lexical", "oilbird", "oilbird-no-semantic")
PAIRED = {"oilbird": "oilbird-no-semantic"}  # arm -> the arm its paired gain is measured against
POOLS = ("past", "warm")


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
    jobs: int = 0  # worker processes (arms run in parallel); 0 = min(arms, CPU cores)
    progress: bool = True
    index: str = "exact"  # --index: the semantic key's index (data/stateindex.py); exact = the float16 matrix
    store_budget: str | None = None  # --store-budget: tokens ("200k") or megabytes ("64MB"); None = unbounded
    knn_recall_every: int = 8  # faiss index: every Nth trained query repeated exactly for knn_recall; 0 = off
    index_train_size: int = 0  # states a faiss coder collects before training (0: the spec's own need)
    results_dir: str | None = None  # where the arm folders go (default runs/<bench>/<model>/replay[-warm])
    pair_against: str | None = None  # every arm's paired tau gain against this arm (default: PAIRED, oilbird vs oilbird-no-semantic)


# ---------------------------------------------------------------- the store as the verifier

@dataclass
class Trace:
    """One request of the store: prompt, generated tokens, and per token the state and top-8 computed
    with it as input (`known[t]` False where the store has none: the last token, never fed)."""

    prompt: list[int]
    tokens: list[int]
    hidden: np.ndarray  # [n, d] float16
    topk: np.ndarray  # [n, 8] int32, -1 rows where unknown
    first_hidden: np.ndarray  # [d] the state that predicted tokens[0] (at the prompt's last token)
    first_topk: np.ndarray  # [8]
    tenant: str = ""  # whose traffic; "" = the default tenant (stores without the column)

    def pool_states(self) -> np.ndarray:
        """float32 states for the drafter's pool: zeros where unknown (the live engine's convention)."""
        return self.hidden.astype(np.float32)


def load_traces(store, limit: int | None, max_new_tokens: int | None) -> list[Trace]:
    """The store's requests in serving order, each cut at max_new_tokens (greedy with a lower cap)."""
    n_req = store.n_requests if limit is None else min(limit, store.n_requests)
    flat_tokens = store.positions["token"].to_numpy()
    # stores written before tenants lack the column: one tenant
    tenants = store.requests["tenant"].to_list() if "tenant" in store.requests.columns else [""] * n_req
    traces = []
    for r in range(n_req):
        lo, hi = int(store.offsets[r]), int(store.offsets[r + 1])
        if max_new_tokens is not None:
            hi = min(hi, lo + max_new_tokens)
        known = store.hidden_valid[lo:hi].copy()
        if len(known):
            known[-1] = False  # the cut trace's last token is never fed back
        hidden = store.hidden[lo:hi].copy()
        hidden[~known] = 0
        topk = store.topk[lo:hi].copy()
        topk[~known] = -1
        traces.append(Trace(prompt=store.prompt(r), tokens=flat_tokens[lo:hi].astype(int).tolist(),
                            hidden=hidden, topk=topk, first_hidden=store.prompt_last_hidden[r],
                            first_topk=store.prompt_last_topk[r], tenant=tenants[r] or ""))
    return traces


def truth_argmax(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> tuple[np.ndarray, dict[int, int]]:
    """The model's next token at the anchor (row 0) and after every draft node (row 1 + i), as far as
    the truth tells it: known for nodes whose root path spells truth[:depth], -1 elsewhere.

    Returns (argmax [1 + N] int64, {node: depth} for the nodes on the true path)."""
    n_truth = len(truth)
    argmax = np.full(1 + len(tokens), -1, np.int64)
    argmax[0] = truth[0] if n_truth else -1
    on_path: dict[int, int] = {}
    for i, (tok, p) in enumerate(zip(tokens, parents)):
        depth = 1 if p == ROOT else on_path.get(p, -1) + 1
        if depth >= 1 and depth <= n_truth and tok == truth[depth - 1]:
            on_path[i] = depth
            if depth < n_truth:
                argmax[1 + i] = truth[depth]
    return argmax, on_path


class StoreRows:
    """`VerifyResult.hidden` in replay: row 0 = the anchor, 1 + i = node i, read from the store.

    Only rows of the anchor and of nodes on the true path exist; any other row raises, so a drafter
    that would need a state the store lacks fails loudly instead of reading a made-up one."""

    def __init__(self, trace: Trace, m: int, on_path: dict[int, int]) -> None:
        self.trace, self.m, self.on_path = trace, m, on_path

    def __getitem__(self, row: int) -> np.ndarray:
        row = int(row)
        if row == 0:
            return self.trace.first_hidden if self.m == 0 else self.trace.hidden[self.m - 1]
        depth = self.on_path.get(row - 1)
        if depth is None:
            raise LookupError(f"replay: the state at rejected draft node {row - 1} is not in the trace store")
        return self.trace.hidden[self.m + depth - 1]


def store_topk(trace: Trace, m: int, n_nodes: int, on_path: dict[int, int]) -> np.ndarray:
    """[1 + N, 8]: the store's top-8 at the anchor and at nodes on the true path, -1 rows elsewhere."""
    topk = np.full((1 + n_nodes, trace.topk.shape[1]), -1, np.int32)
    topk[0] = trace.first_topk if m == 0 else trace.topk[m - 1]
    for i, depth in on_path.items():
        topk[1 + i] = trace.topk[m + depth - 1]
    return topk


def replay_request(drafter, trace: Trace, nodes: int, vocab_size: int) -> list[Cycle]:
    """One request: the live engine's pass loop with the store as the verifier (module docstring)."""
    tokens, n = trace.tokens, len(trace.tokens)
    context = list(trace.prompt)
    cycles: list[Cycle] = []
    m = 0
    measured = hasattr(drafter, "untimed_s")  # measurement-only work inside propose (knn_recall shadows)
    while m < n:
        u0 = drafter.untimed_s if measured else 0.0
        t0 = time.perf_counter()
        draft = drafter.propose(context, nodes)
        t1 = time.perf_counter()
        t0 += (drafter.untimed_s - u0) if measured else 0.0
        check_draft(draft, nodes, vocab_size)
        truth = tokens[m:]
        argmax, on_path = truth_argmax(draft.tokens, draft.parents, truth)
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, argmax)
        kept = min(len(accepted) + 1, n - m)  # the trace ends where greedy decoding stopped
        committed = truth[:kept]
        result = VerifyResult(draft=draft, accepted_nodes=accepted, bonus=bonus, committed=committed,
                              argmax=argmax, topk=store_topk(trace, m, len(draft), on_path),
                              hidden=StoreRows(trace, m, on_path))
        t2 = time.perf_counter()
        drafter.observe(context, result)
        context.extend(committed)
        t3 = time.perf_counter()
        cycles.append(pass_record(draft, accepted, kept, t1 - t0, 0.0, t3 - t2))  # verify time: from a profile
        m += kept
    return cycles


# ---------------------------------------------------------------- arms

ADJACENCY_REASON = ("the adjacency table learns the model's top-8 at every verified node; the store holds it "
                    "at the anchor and the accepted nodes only, so rows of rejected nodes are skipped")
RING_REASON = ("the rejected-branch ring buffer needs the model's argmax at rejected nodes, which the store "
               "lacks: it stays empty in replay")


def exactness(drafter) -> tuple[bool, str]:
    """Whether replay makes the same passes as live decoding for this drafter, and why not."""
    reasons = []
    if getattr(drafter, "table", None) is not None:
        reasons.append(ADJACENCY_REASON)
    ring = getattr(drafter, "ring", None)
    if ring is not None and ring.capacity > 0 and getattr(drafter.config, "rollouts", 0) > 0:
        reasons.append(RING_REASON)
    if reasons:
        return False, "; ".join(reasons)
    return True, "proposals depend only on committed tokens and their states, all in the store"


def uses_states(drafter) -> bool:
    """Whether the drafter queries the semantic key (and so needs the store's states in its pool)."""
    config = getattr(drafter, "config", None)
    return (getattr(drafter, "pool", None) is not None and bool(getattr(config, "semantic", False))
            and getattr(config, "key_level", "position") != "null")


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


# ---------------------------------------------------------------- one arm

@dataclass
class ArmReplay:
    arm: str
    nodes: int
    cycles: list[list[Cycle]]  # per request
    pool_s: np.ndarray  # end_request time per request
    seconds: float  # wall time of the arm's replay
    exact: bool
    exact_reason: str
    has_key: bool
    stats: dict | None = None
    warm_s: float = 0.0
    pools: dict | None = None  # TenantPools.summary: tenants, the budget, the largest pool drafted from


def replay_arm(arm: str, traces: list[Trace], nodes: int, pool: str, vocab_size: int,
               progress=None, settings: PoolSettings | None = None) -> ArmReplay:
    """Serve every trace with fresh drafters of `arm` (one per tenant; pools empty, or warm), in order.

    `settings`: the index spec and the budget window (decoder/pools.py); default exact, unbounded."""
    from data.capture import prompt_hash
    from decoder.drafters import make_drafter

    settings = settings or PoolSettings()
    make = lambda: make_drafter(arm, vocab_size=vocab_size, nodes=nodes, shared=settings.shared())  # noqa: E731
    pools = TenantPools(make, settings.budget_tokens)
    probe = make()
    exact, reason = exactness(probe)
    states = uses_states(probe)
    t_start = time.perf_counter()
    warm_s = 0.0
    if pool == "warm":
        for tr in traces:  # each tenant's drafter gets its own tenant's traces only
            pools.warm(tr.tenant, len(tr.tokens)).end_request(tr.prompt, tr.tokens, tr.pool_states())
        warm_s = time.perf_counter() - t_start
    per_request: list[list[Cycle]] = []
    pool_s = np.zeros(len(traces))
    for r, tr in enumerate(traces):
        t0 = time.perf_counter()
        drafter = pools.begin(r, tr.tenant)  # moves the budget window: evictions count as pool time
        pool_s[r] = time.perf_counter() - t0
        drafter.begin_request(tr.prompt, prompt_hash(tr.prompt))
        per_request.append(replay_request(drafter, tr, nodes, vocab_size))
        if pool == "past":
            t0 = time.perf_counter()
            drafter.end_request(tr.prompt, tr.tokens, tr.pool_states() if states else None)
            pool_s[r] += time.perf_counter() - t0
        pools.end(r, tr.tenant, len(tr.tokens) if pool == "past" else 0)
        if progress is not None:
            progress(1)
    stats = pools.stats()
    has_key = bool(stats and stats.get("semantic_key")) or any(
        SEMANTIC_SOURCE in c.node_sources for cs in per_request for c in cs)
    return ArmReplay(arm, nodes, per_request, pool_s, time.perf_counter() - t_start, exact, reason, has_key,
                     stats, warm_s, pools.summary())


# ---------------------------------------------------------------- time estimate

def estimate(run: ArmReplay, traces: list[Trace], cost, boot: RequestBootstrap | None) -> tuple[dict, np.ndarray, np.ndarray]:
    """Estimated seconds per request for plain greedy and for this arm, and the summary block."""
    R = len(traces)
    ar_r, arm_r = np.zeros(R), np.zeros(R)
    verify_total = draft_total = update_total = 0.0
    for r, (tr, cycles) in enumerate(zip(traces, run.cycles)):
        past0 = len(tr.prompt) - 1  # the cache holds the context minus the anchor
        prefill = float(cost.prefill_s(len(tr.prompt)))
        ar_r[r] = prefill + float(np.sum(cost.verify_s(np.zeros(len(tr.tokens)), past0 + np.arange(len(tr.tokens)))))
        nodes = np.array([c.nodes for c in cycles], float)
        past = past0 + np.concatenate([[0], np.cumsum([c.committed for c in cycles])[:-1]]) if cycles else np.zeros(0)
        verify = float(np.sum(cost.verify_s(nodes, past))) if cycles else 0.0
        draft = sum(c.draft_s for c in cycles)
        update = sum(c.update_s for c in cycles)
        arm_r[r] = prefill + verify + draft + update + run.pool_s[r]
        verify_total, draft_total, update_total = verify_total + verify, draft_total + draft, update_total + update
    cycle_total = verify_total + draft_total + update_total
    speedup, interval = paired_ratio(ar_r, arm_r, boot)
    block = {
        "profile": cost.meta.get("path"), "device": cost.meta.get("device"), "device_name": cost.meta.get("device_name"),
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

def replay_dir(out: str | Path, bench: str, slug: str, pool: str = "past") -> Path:
    """runs/<bench>/<model>/replay (replay-<pool> for other pools), beside the trace store."""
    return store_dir(out, bench, slug).parent / ("replay" if pool == "past" else f"replay-{pool}")


def replay_is_current(cfg: ReplayConfig) -> bool:
    """Every arm of `cfg` has a result with its settings, computed from the store as it is now, and with
    the speed estimate when a verification-cost profile exists (`--if-missing`)."""
    from decoder.profile import default_profile_path
    from data.models import pick_device

    check_config(cfg)
    if cfg.store or cfg.results_dir or cfg.index != "exact" or cfg.store_budget:
        return False  # only the default layout is looked up
    slug = model_slug(cfg.model)
    root, store = replay_dir(cfg.out, cfg.bench, slug, cfg.pool), store_dir(cfg.out, cfg.bench, slug)
    profile = Path(cfg.profile) if cfg.profile else default_profile_path(cfg.out, slug, pick_device(None).type)
    for arm in resolve_arms(cfg.arms):
        for nodes in cfg.nodes:
            folder = root / arm / ("" if len(cfg.nodes) == 1 else f"nodes-{nodes}")
            s = current_summary(folder / "summary.json", store, nodes=nodes, pool=cfg.pool, limit=cfg.limit,
                                bootstrap_draws=cfg.bootstrap, seed=cfg.seed)
            if s is None or (cfg.max_new_tokens and s.get("max_new_tokens") != cfg.max_new_tokens):
                return False
            if s.get("estimate") is None and profile.exists():
                return False
            if not (folder / "cycles.parquet").exists():
                return False
    return True


def _worker(job: tuple) -> ArmReplay:
    """One (arm, nodes) in a worker process: the traces come from the store each worker reads itself."""
    arm, nodes, path, limit, cap, pool, vocab_size, queue, settings = job
    import torch

    torch.set_num_threads(1)  # one core per worker: the workers share the machine
    store = open_store(path)
    traces = load_traces(store, limit, cap)
    return replay_arm(arm, traces, nodes, pool, vocab_size, progress=(lambda k: queue.put(k)) if queue else None,
                      settings=settings)


def check_config(cfg: ReplayConfig) -> None:
    if cfg.pool not in POOLS:
        raise OilbirdError(f"--pool must be past or warm (got {cfg.pool!r})")
    if not cfg.nodes:
        raise OilbirdError("--nodes is empty; give e.g. 60 or 16,32,60")
    bad = [n for n in cfg.nodes if n <= 0]
    if bad:
        raise OilbirdError(f"--nodes values must be positive (got {bad[0]})")
    if len(set(cfg.nodes)) != len(cfg.nodes):
        raise OilbirdError("--nodes names a value twice")
    if cfg.limit is not None and cfg.limit < 1:
        raise OilbirdError(f"--limit must be at least 1 (got {cfg.limit})")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise OilbirdError(f"--max-new-tokens must be at least 1 (got {cfg.max_new_tokens})")
    if cfg.bootstrap < 0:
        raise OilbirdError(f"--bootstrap must be 0 or more (got {cfg.bootstrap})")
    if cfg.knn_recall_every < 0 or cfg.index_train_size < 0:
        raise OilbirdError("knn_recall_every and index_train_size must be 0 or more")


def load_cost(cfg: ReplayConfig, slug: str, fingerprint: str):
    """The verification-cost profile (decoder/profile.py), or (None, why not)."""
    from data.models import pick_device
    from decoder.profile import CostModel, default_profile_path

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
    arms = resolve_arms(cfg.arms)
    slug = model_slug(cfg.model)
    path = Path(cfg.store) if cfg.store else store_dir(cfg.out, cfg.bench, slug)
    if not (path / "meta.json").exists():
        raise OilbirdError(f"no trace store for {cfg.bench} / {slug} at {path}: run `python -m data capture "
                           f"--bench {cfg.bench} --model {cfg.model} --out {cfg.out}` first (or `make census "
                           f"BENCH={cfg.bench}`)")
    store = open_store(path)
    meta = store.meta
    cap = int(meta["max_new_tokens"])
    if cfg.max_new_tokens is not None and cfg.max_new_tokens > cap:
        raise OilbirdError(f"--max-new-tokens {cfg.max_new_tokens} exceeds the store's cap of {cap}: replay cannot "
                           f"see past what was captured (recapture with --max-new-tokens {cfg.max_new_tokens})")
    vocab_size = int(meta.get("vocab_size") or 0) or 1 + int(max(
        store.positions["token"].max(), max(max(p) for p in store.requests["prompt_tokens"].to_list() if p),
        store.topk.max(initial=0)))
    from decoder.drafters import make_drafter

    if not store.hidden_valid.any():
        needs = [a for a in arms if uses_states(make_drafter(a, vocab_size=vocab_size, nodes=1))]
        if needs:
            raise OilbirdError(f"arm {needs[0]} needs hidden states and the store at {path} holds none; "
                               "recapture in generate mode (`python -m data capture`)")
    spec = check_index(cfg.index, store.d_model)
    budget_tokens, budget_info = resolve_budget(cfg.store_budget, spec, store.d_model, cfg.pool)
    cost, cost_note = load_cost(cfg, slug, meta["model_fingerprint"])
    traces = load_traces(store, cfg.limit, cfg.max_new_tokens)
    if not traces or not any(tr.tokens for tr in traces):
        raise OilbirdError(f"trace store {path} holds no generated tokens to replay")
    del store
    check_budget(budget_tokens, [len(tr.tokens) for tr in traces])
    index_note = None
    if not spec.exact and any(uses_states(make_drafter(a, vocab_size=vocab_size, nodes=1)) for a in arms):
        # the most states any pool could hold: the replayed traces' valid states
        n_states = sum(int(np.count_nonzero(np.abs(tr.hidden).sum(axis=1))) for tr in traces)
        check_trainable(spec, n_states)
        index_note = warmup_note(spec, cfg.index_train_size, min(n_states, budget_tokens or n_states))
        if index_note:
            print(f"note: {index_note}", file=sys.stderr)
    settings = PoolSettings(spec.text, budget_tokens, cfg.knn_recall_every, cfg.index_train_size)
    jobs = [(arm, nodes) for arm in arms for nodes in cfg.nodes]
    n_workers = cfg.jobs or min(len(jobs), os.cpu_count() or 1)
    runs = _run_jobs(jobs, traces, path, cfg, cap, vocab_size, n_workers, settings)

    boot = RequestBootstrap(len(traces), cfg.bootstrap, cfg.seed) if cfg.bootstrap > 0 else None
    base = {
        "kind": "replay", "bench": cfg.bench, "model": meta["model"], "model_fingerprint": meta["model_fingerprint"],
        "store": str(path), "store_fingerprint": store_fingerprint(meta), "pool": cfg.pool, "limit": cfg.limit,
        "max_new_tokens": cfg.max_new_tokens or cap, "store_max_new_tokens": cap, "requests": len(traces),
        "bootstrap_draws": cfg.bootstrap, "seed": cfg.seed,
        "invocation": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    summaries: dict[tuple[str, int], dict] = {}
    per_request_time: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    for (arm, nodes), run in runs.items():
        stats = pass_statistics(run.cycles, run.has_key, boot)
        tau, tau_iv = stats.pop("tau"), stats.pop("tau_interval")
        s = {**base, "arm": arm, "nodes": nodes, **stats, "tau": {"value": tau, "interval": tau_iv},
             "exact": run.exact, "exact_reason": run.exact_reason, "seconds": run.seconds, "warm_pool_s": run.warm_s,
             "drafter_stats": run.stats, "estimate": None, "estimate_note": cost_note, "paired_gain": None,
             **index_summary(run.stats, spec), "index_note": index_note if run.stats else None,
             "store_budget": budget_info, **run.pools}
        if cost is not None:
            s["estimate"], ar_r, arm_r = estimate(run, traces, cost, boot)
            per_request_time[(arm, nodes)] = (ar_r, arm_r)
        summaries[(arm, nodes)] = s
    for (arm, nodes), s in summaries.items():
        other = PAIRED.get(arm) if cfg.pair_against is None else cfg.pair_against
        if other is None or other == arm:
            continue
        if (other, nodes) not in runs:
            s["paired_gain_note"] = f"replay {other} in the same command for the paired gain"
            continue
        passes_on = np.array([len(c) for c in runs[(arm, nodes)].cycles], float)
        passes_off = np.array([len(c) for c in runs[(other, nodes)].cycles], float)
        ratio, iv = paired_ratio(passes_off, passes_on, boot)  # same tokens: tau ratio = passes ratio, inverted
        gain = {"versus": other, "tau_ratio": ratio, "interval": iv, "speedup_ratio": None, "speedup_interval": None}
        if (arm, nodes) in per_request_time:
            gain["speedup_ratio"], gain["speedup_interval"] = paired_ratio(
                per_request_time[(other, nodes)][1], per_request_time[(arm, nodes)][1], boot)
        s["paired_gain"] = gain
    write_results(cfg, slug, summaries, runs)
    return summaries


def _run_jobs(jobs, traces, path, cfg: ReplayConfig, cap, vocab_size, n_workers,
              settings: PoolSettings) -> dict[tuple[str, int], ArmReplay]:
    from tqdm import tqdm

    total = len(jobs) * len(traces)
    bar = tqdm(total=total, unit="req", desc=f"replay {len(jobs)} arm run(s)", disable=not cfg.progress,
               dynamic_ncols=True)
    try:
        if n_workers <= 1 or len(jobs) == 1:
            out = {}
            for arm, nodes in jobs:
                bar.set_postfix(arm=arm, nodes=nodes, refresh=False)
                out[(arm, nodes)] = replay_arm(arm, traces, nodes, cfg.pool, vocab_size, progress=bar.update,
                                               settings=settings)
            return out
        ctx = multiprocessing.get_context("spawn")  # fork would copy torch/polars thread state
        with ctx.Manager() as manager:
            queue = manager.Queue()
            with ctx.Pool(n_workers) as pool:
                pending = pool.map_async(_worker, [(arm, nodes, str(path), cfg.limit, cfg.max_new_tokens, cfg.pool,
                                                    vocab_size, queue, settings) for arm, nodes in jobs], chunksize=1)
                done = 0
                while not pending.ready() or done < total:
                    try:
                        k = queue.get(timeout=0.2)
                    except Exception:
                        if pending.ready():
                            break
                        continue
                    done += k
                    bar.update(k)
                results = pending.get()
        return {(r.arm, r.nodes): r for r in results}
    finally:
        bar.close()


def write_results(cfg: ReplayConfig, slug: str, summaries: dict, runs: dict) -> None:
    """One folder per arm, written whole and swapped in (decoder.harness.write_folder)."""
    from decoder.harness import cycles_table, write_folder

    root = Path(cfg.results_dir) if cfg.results_dir else replay_dir(cfg.out, cfg.bench, slug, cfg.pool)
    for arm in dict.fromkeys(a for a, _ in summaries):
        files: dict = {}
        for nodes in cfg.nodes:
            prefix = "" if len(cfg.nodes) == 1 else f"nodes-{nodes}/"
            files[prefix + "summary.json"] = summaries[(arm, nodes)]
            files[prefix + "cycles.parquet"] = cycles_table(runs[(arm, nodes)].cycles)
        write_folder(root / arm, files)


def _fmt_iv(v, iv, digits=2, pct=False) -> str:
    if v is None:
        return "n/a"
    scale = 100 if pct else 1
    txt = f"{scale * v:.{digits}f}" + ("%" if pct else "")
    if iv:
        txt += f" [{scale * iv[0]:.{digits}f}-{scale * iv[1]:.{digits}f}]"
    return txt


def format_depth_table(on: dict, off: dict, depths: tuple[int, ...] = DEPTH_ROWS) -> str:
    """Where the key's gain lands: per depth of the accepted path, the share of passes reaching it with
    the key and without, and the tokens there that only the semantic source proposed (per pass)."""
    a, b = on["by_depth"], off["by_depth"]
    lines = [f"per depth of the accepted path: {on['arm']} ({a['passes']} passes) vs {off['arm']} ({b['passes']} passes)",
             f"{'depth':>5} {'reach on':>9} {'reach off':>9} {'semantic alone':>15} {'spine':>7} {'semantic':>9}"]
    src = a["by_source"]
    for d in depths:
        if d > min(a["depths"], b["depths"]):
            break
        lines.append(f"{d:>5} {100 * a['reach'][d - 1]:>8.1f}% {100 * b['reach'][d - 1]:>8.1f}% "
                     f"{100 * a['sole_semantic'][d - 1] / max(a['passes'], 1):>14.2f}% "
                     f"{100 * (src.get('spine') or [0] * d)[d - 1] / max(a['passes'], 1):>6.1f}% "
                     f"{100 * (src.get('semantic') or [0] * d)[d - 1] / max(a['passes'], 1):>8.1f}%")
    lines.append("(reach: passes accepting at least d draft tokens; the other columns: accepted tokens at depth d "
                 "per pass of the arm with the key, by the source that proposed them)")
    return "\n".join(lines)


def format_table(summaries: dict[tuple[str, int], dict]) -> str:
    """The table `python -m decoder replay` prints."""
    width = max([10, *(len(a) + 1 for a, _ in summaries)])
    head = (f"{'arm':<{width}} {'nodes':>5} {'tau [95%]':>20} {'est. speedup':>20} {'sole share':>22} "
            f"{'draft ms/pass':>13} {'draft %':>7} {'exact':>5} {'seconds':>7}")
    lines = [head]
    for (arm, nodes), s in summaries.items():
        est = s.get("estimate") or {}
        share = s.get("sole_source_share") or {}
        draft = s["draft_s_per_pass"]["mean"]
        frac = est.get("draft_fraction")
        lines.append(
            f"{arm:<{width}} {nodes:>5} {_fmt_iv(s['tau']['value'], s['tau']['interval']):>20} "
            f"{_fmt_iv(est.get('speedup'), est.get('speedup_interval')):>20} "
            f"{_fmt_iv(share.get('value'), share.get('interval'), 1, pct=True) if share else '-':>22} "
            f"{(1000 * draft if draft is not None else float('nan')):>13.3f} "
            f"{(f'{100 * frac:.1f}' if frac is not None else 'n/a'):>7} {('yes' if s['exact'] else 'no'):>5} "
            f"{s['seconds']:>7.1f}")
    for (arm, nodes), s in summaries.items():
        g = s.get("paired_gain")
        if g:
            lines.append(f"paired gain {arm} / {g['versus']} (nodes {nodes}): tau x{_fmt_iv(g['tau_ratio'], g['interval'], 3)}"
                         + (f", est. speedup x{_fmt_iv(g['speedup_ratio'], g['speedup_interval'], 3)}"
                            if g.get("speedup_ratio") is not None else ""))
    on = next((s for (arm, _), s in summaries.items() if arm == "oilbird" and s.get("paired_gain")), None)
    if on is not None:
        from decoder.verdict import verdict

        off = summaries.get((on["paired_gain"]["versus"], on["nodes"])) or {}
        share = on.get("sole_source_share") or {}
        v = verdict(share.get("value"), share.get("interval"), on["paired_gain"]["interval"],
                    (on.get("estimate") or {}).get("speedup"), (off.get("estimate") or {}).get("speedup"))
        lines.append(f"verdict: {v.decision.upper()} the semantic source ({'; '.join(v.reasons)})")
        lines.append(f"rule: {v.rule}")
        if on.get("by_depth") and off.get("by_depth"):
            lines.append(format_depth_table(on, off))
    notes = {s.get("estimate_note") for s in summaries.values() if s.get("estimate_note")}
    lines += [f"note: {n}" for n in sorted(notes)]
    return "\n".join(lines)


def replay_main(argv: list[str] | None = None) -> int:
    import argparse

    from data.errors import cli_entry

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
                       help=f"comma-separated arms, or all (default {','.join(DECISION_ARMS)}; see python -m decoder --help)")
        p.add_argument("--nodes", default="60", help="draft node budget(s), e.g. 60 or 16,32,60 (default 60)")
        p.add_argument("--pool", default="past", choices=POOLS,
                       help="past: a trace joins the pool when its request ends (default); warm: every other request's")
        p.add_argument("--limit", type=int, default=None, help="first N requests of the store")
        p.add_argument("--max-new-tokens", type=int, default=None, help="cut every trace at N tokens (default: the store's cap)")
        p.add_argument("--bootstrap", type=int, default=2000, help="request-bootstrap draws (default 2000; 0 = none)")
        p.add_argument("--profile", default=None,
                       help="verification-cost profile for the speedup estimate (default runs/profiles/<model>-cpu.json)")
        p.add_argument("--store", default=None, help="trace store folder (default runs/<bench>/<model>/traces)")
        p.add_argument("--out", default="runs", help="output root (default runs/)")
        p.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core, at most one per arm)")
        p.add_argument("--index", default="exact", metavar="SPEC",
                       help="the semantic key's index: exact (default, float16 matrix) or a faiss spec: flat, sq8, "
                            "pq64, pca128,sq8, opq64,pq64, ivf1024,pq64 (nprobe=N), hnsw32 (efsearch=N)")
        p.add_argument("--store-budget", default=None, metavar="B",
                       help="bound the past pool to B generated tokens (200k, 1.5M) or megabytes (64MB): the oldest "
                            "traces leave when a join exceeds it, down to 7/8 of it (default: unbounded)")
        p.add_argument("--index-train", type=int, default=0, metavar="N",
                       help="states a faiss index collects (answering exactly) before it trains (default: the spec's own need)")
        p.add_argument("--if-missing", action="store_true",
                       help="skip when every arm's result with these settings exists for the store as it is now")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        args = p.parse_args(argv)
        try:
            nodes = tuple(int(v) for v in args.nodes.split(",") if v.strip())
        except ValueError:
            raise OilbirdError(f"--nodes must be comma-separated integers (got {args.nodes!r})") from None
        cfg = ReplayConfig(bench=args.bench, model=args.model, arms=tuple(args.arms.split(",")), nodes=nodes,
                           pool=args.pool, limit=args.limit, max_new_tokens=args.max_new_tokens, out=args.out,
                           store=args.store, bootstrap=args.bootstrap, profile=args.profile, jobs=max(0, args.jobs),
                           progress=not args.quiet, index=args.index, store_budget=args.store_budget,
                           index_train_size=args.index_train)
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
