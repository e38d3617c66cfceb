"""Serving harness: every arm serves the same benchmark in order, measured side by side.

`run_decode(DecodeConfig(...))` loads the model once, runs `ar` first (the reference for speed and
for losslessness; added when the user leaves it out), then each drafter arm with a fresh pool,
and writes one folder per arm under `runs/<bench>/<model>/decode/<arm>/`. An arm may be a variant
`arm@field=value:...` of a library arm (e.g. oilbird@theta=0.7), as replay takes it
(decoder/drafters `parse_variant`); its folder carries the variant's name.

  cycles.parquet    one row per verification pass: request, pass, nodes, accepted, committed,
                    sources (per accepted node, e.g. "adjacency|sam"), draft_s, verify_s, update_s
  requests.parquet  one row per request: request, id, group, prompt_hash, output_tokens,
                    stop_reason, seconds, prefill_s, pool_s, passes
  summary.json      tau (with a request-bootstrap interval), tokens/s, speedup over this invocation's
                    ar, time split and overhead fraction, the lossless audit against ar, the pass
                    statistics of decoder/passes.py (per-source drafted/accepted tokens, nodes and
                    drafting time per pass); for arms with the semantic key: sole_source_share (the
                    paper's: sole-semantic tokens / all committed tokens) and sole_source_share_of_draft
                    (/ accepted draft tokens), each {value, interval, sole, tokens|accepted},
                    semantic_time_s (the key's queries), retrieval_fraction (key + ring buffer time /
                    cycle time), store_bytes_per_token and the drafter's counters

The folder is written beside its final place and renamed in, so it is never half old, half new.

The pool: a request's prompt, generated tokens and states (data/store.py convention: row i = the
state with token i as input, the last row zeros) enter the arm's drafter through `end_request`
once the request has finished. `--warm-from STORE` feeds a captured trace store's requests the
same way before serving. A request must not draft from its own trace: drafters receive the prompt
in `begin_request` and in `end_request`, and skip pool traces whose prompt hash
(`data.capture.prompt_hash`) equals the current request's; this matters with `--warm-from` a
store of the same benchmark and with repeated prompts.

Pools (decoder/pools.py): `--index SPEC` keeps the semantic key's states in a faiss index (exact,
the default, is the float16 matrix, unchanged); `--store-budget B` bounds the past pool to the
data/budget.py window; requests of different tenants (`Request.tenant`) are served by different
drafters of the arm, so none drafts from another tenant's traces (warm traces go to their own
tenant's drafter). summary.json adds index, bytes_per_state, warmup_queries, knn_recall, tenants,
store_budget, store_budget_tokens and max_pool_tokens.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from data.benchmarks import get_benchmark, load_requests
from data.budget import check_budget
from data.capture import library_versions, prompt_hash
from data.errors import OilbirdError
from data.models import LayerTap, LoadedModel, encode_prompt, load_model
from data.store import atomic_write_json, atomic_write_table, open_store, store_dir
from data.stats import RequestBootstrap
from decoder.draft import Drafter
from decoder.engine import Cycle, Generation, check_supported, decode_greedy, decode_speculative, stop_rule, verify_tree
from decoder.passes import SEMANTIC_SOURCE, pass_statistics
from decoder.pools import TenantPools, check_index, index_summary, resolve_budget, warmup_note

REFERENCE_ARM = "ar"
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
    index: str = "exact"  # --index: the semantic key's index (data/stateindex.py); exact = the float16 matrix
    store_budget: str | None = None  # --store-budget: tokens ("200k") or megabytes ("64MB"); None = unbounded
    knn_recall_every: int = 8  # faiss index: every Nth trained query repeated exactly for knn_recall; 0 = off
    index_train_size: int = 0  # states a faiss coder collects before training (0: the spec's own need)

    def shared(self) -> dict:
        """Config fields every arm with a semantic pool takes (make_drafter's `shared`)."""
        return {"index": self.index, "knn_recall_every": self.knn_recall_every,
                "index_train_size": self.index_train_size}


def library_factory(name: str) -> ArmFactory:
    """A library arm, or a variant of one (`arm@field=value:...`, decoder/drafters parse_variant)."""
    from decoder.drafters import make_drafter

    return lambda lm, cfg: make_drafter(name, vocab_size=lm.vocab_size, nodes=cfg.nodes, shared=cfg.shared())


def library_drafters() -> dict[str, ArmFactory]:
    """The drafters registered in decoder/drafters/__init__.py (none while that package is absent)."""
    import importlib.util

    spec = importlib.util.find_spec("decoder.drafters")
    if spec is None or spec.origin is None:  # no package, or a folder without __init__.py yet
        return {}
    from decoder.drafters import arm_names

    # the library's own "ar" (an empty-draft drafter) would shadow the plain greedy reference
    return {name: library_factory(name) for name in arm_names() if name != REFERENCE_ARM}


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
    known = [REFERENCE_ARM, *factories]
    library = library_drafters()
    for a in names:
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


def decode_dir(out: str | Path, bench: str, model_slug: str) -> Path:
    """runs/<bench>/<model>/decode (beside the trace store of the same benchmark and model)."""
    return store_dir(out, bench, model_slug).parent / "decode"


def load_warm_pool(path: str, lm: LoadedModel) -> list[tuple[list[int], list[int], np.ndarray, str]]:
    """(prompt, output tokens, states float32, tenant) of every request of a captured store, in order."""
    store = open_store(path, model_fingerprint=lm.fingerprint, d_model=lm.d_model)
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
    lm.model(input_ids=torch.tensor([head], device=lm.device), past_key_values=cache, use_cache=True)
    verify_tree(lm.model, cache, len(head), head[-1], head[:8], list(range(-1, min(8, len(head)) - 1)))


@dataclass
class ArmRun:
    name: str
    generations: list[Generation]
    pool_s: list[float]  # end_request time per request
    warm_s: float = 0.0
    drafter_stats: dict | None = None  # the drafter's own counters (`stats()`), e.g. the semantic key's
    pools: dict | None = None  # TenantPools.summary (drafter arms): tenants, budget, the largest pool


def serve_arm(name: str, lm: LoadedModel, prompts: list[list[int]], cfg: DecodeConfig, stop,
              factory: ArmFactory | None, warm_pool, progress_desc: str, tenants: list[str] | None = None,
              budget_tokens: int | None = None) -> ArmRun:
    """Serve every prompt in order with the arm: one drafter per tenant (decoder/pools.py), `ar` with none."""
    from tqdm import tqdm

    tenants = tenants or [""] * len(prompts)
    pools = TenantPools(lambda: factory(lm, cfg), budget_tokens) if factory is not None else None
    warm_s = 0.0
    if pools is not None and warm_pool:
        t0 = time.perf_counter()
        for prompt, output, hidden, tenant in warm_pool:  # a warm trace feeds its own tenant's drafter only
            pools.warm(tenant, len(output)).end_request(prompt, output, hidden)
        warm_s = time.perf_counter() - t0
    gens: list[Generation] = []
    pool_s: list[float] = []
    tokens = passes = 0
    seconds = 0.0
    bar = tqdm(total=len(prompts), unit="req", desc=progress_desc, disable=not cfg.progress, dynamic_ncols=True)
    tap = LayerTap(lm.model, lm.layer) if pools is not None else None
    try:
        for r, prompt in enumerate(prompts):
            if pools is None:
                g = decode_greedy(lm, prompt, stop)
                pool_s.append(0.0)
            else:
                t0 = time.perf_counter()
                drafter = pools.begin(r, tenants[r])  # moves the budget window: evictions count as pool time
                evict_s = time.perf_counter() - t0
                g = decode_speculative(lm, tap, prompt, drafter, stop, cfg.nodes)
                t0 = time.perf_counter()
                drafter.end_request(list(prompt), list(g.tokens), g.hidden)
                pools.end(r, tenants[r], len(g.tokens))
                pool_s.append(time.perf_counter() - t0 + evict_s)
                g.hidden = g.topk = None  # in the drafter's pool now; not kept twice
            gens.append(g)
            tokens += len(g.tokens)
            passes += len(g.cycles)
            seconds += g.seconds + pool_s[-1]
            bar.set_postfix(tau=f"{tokens / max(1, passes):.2f}", tok_s=f"{tokens / max(seconds, 1e-9):.1f}",
                            refresh=False)
            bar.update(1)
    finally:
        bar.close()
        if tap is not None:
            tap.close()
    stats = pools.stats() if pools is not None else None
    return ArmRun(name, gens, pool_s, warm_s, stats, pools.summary() if pools is not None else None)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a prefix differs at the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_audit(run: ArmRun, reference: ArmRun, request_ids: list[str]) -> dict:
    mismatches = []
    for r, (g, ref) in enumerate(zip(run.generations, reference.generations)):
        pos = first_difference(g.tokens, ref.tokens)
        if pos is not None:
            mismatches.append({"request": r, "id": request_ids[r], "first_diff": pos,
                               "ar_tokens": len(ref.tokens), "arm_tokens": len(g.tokens)})
    n = len(run.generations)
    return {"reference": REFERENCE_ARM, "requests": n, "matched": n - len(mismatches),
            "lossless": not mismatches, "mismatches": mismatches}


def tokens_per_s(run: ArmRun) -> float:
    """Generated tokens over the wall time of serving them: prefill, passes and pool insertion."""
    seconds = sum(g.seconds for g in run.generations) + sum(run.pool_s)
    return sum(len(g.tokens) for g in run.generations) / seconds if seconds > 0 else 0.0


def summarize(run: ArmRun, reference: ArmRun | None, request_ids: list[str], base: dict,
              bootstrap: int = 2000, seed: int = 0) -> dict:
    gens = run.generations
    cycles = [c for g in gens for c in g.cycles]
    draft_s = sum(c.draft_s for c in cycles)
    verify_s = sum(c.verify_s for c in cycles)
    update_s = sum(c.update_s for c in cycles)
    cycle_s = draft_s + verify_s + update_s
    stats = run.drafter_stats or {}
    has_key = any(SEMANTIC_SOURCE in c.node_sources for c in cycles) or bool(stats.get("semantic_key"))
    boot = RequestBootstrap(len(gens), bootstrap, seed) if bootstrap > 0 else None
    passes = pass_statistics([g.cycles for g in gens], has_key, boot)
    retrieval_s = stats.get("semantic_time_s", 0.0) + stats.get("rollout_time_s", 0.0)
    tok_s = tokens_per_s(run)
    ref_tok_s = tokens_per_s(reference) if reference is not None else 0.0
    stops: dict[str, int] = {}
    for g in gens:
        stops[g.stop_reason] = stops.get(g.stop_reason, 0) + 1
    return {
        **base,
        "kind": "live",
        "arm": run.name,
        "requests": len(gens),
        **passes,
        "tau": passes["tau"] or 0.0,
        "seconds": sum(g.seconds for g in gens) + sum(run.pool_s),
        "tokens_per_s": tok_s,
        "speedup": tok_s / ref_tok_s if ref_tok_s else None,
        "ar_tokens_per_s": ref_tok_s or None,
        "time": {"prefill_s": sum(g.prefill_s for g in gens), "draft_s": draft_s, "verify_s": verify_s,
                 "update_s": update_s, "pool_s": sum(run.pool_s), "warm_pool_s": run.warm_s},
        "draft_fraction": draft_s / cycle_s if cycle_s else 0.0,
        "update_fraction": update_s / cycle_s if cycle_s else 0.0,
        "overhead_fraction": (draft_s + update_s) / cycle_s if cycle_s else 0.0,
        "semantic_time_s": stats.get("semantic_time_s") if stats else None,
        "retrieval_fraction": retrieval_s / cycle_s if stats and cycle_s else None,
        "store_bytes_per_token": stats.get("store_bytes_per_token") if stats else None,
        "drafter_stats": stats or None,
        **index_summary(stats, base.get("index", "exact")),
        **(run.pools or {"tenants": None, "store_budget_tokens": base.get("store_budget_tokens"),
                         "max_pool_tokens": None, "pool_evictions": None, "evicted_traces": None}),
        "stop_reasons": stops,
        "lossless": lossless_audit(run, reference, request_ids) if reference is not None else None,
    }


def cycles_table(per_request: list[list[Cycle]]) -> pa.Table:
    """One row per verification pass (live and replay alike)."""
    rows = [(r, p, c) for r, cycles in enumerate(per_request) for p, c in enumerate(cycles)]
    return pa.table({
        "request": pa.array([r for r, _, _ in rows], pa.int32()),
        "pass": pa.array([p for _, p, _ in rows], pa.int32()),
        "nodes": pa.array([c.nodes for _, _, c in rows], pa.int32()),
        "accepted": pa.array([c.accepted for _, _, c in rows], pa.int32()),
        "committed": pa.array([c.committed for _, _, c in rows], pa.int32()),
        "sources": pa.array([c.sources for _, _, c in rows], pa.list_(pa.string())),
        "draft_s": pa.array([c.draft_s for _, _, c in rows], pa.float64()),
        "verify_s": pa.array([c.verify_s for _, _, c in rows], pa.float64()),
        "update_s": pa.array([c.update_s for _, _, c in rows], pa.float64()),
    })


def requests_table(run: ArmRun, requests, prompts: list[list[int]]) -> pa.Table:
    gens = run.generations
    return pa.table({
        "request": pa.array(range(len(gens)), pa.int32()),
        "id": pa.array([r.id for r in requests], pa.string()),
        "group": pa.array([r.group for r in requests], pa.string()),
        "prompt_hash": pa.array([prompt_hash(p) for p in prompts], pa.string()),
        "output_tokens": pa.array([g.tokens for g in gens], pa.list_(pa.int32())),
        "stop_reason": pa.array([g.stop_reason for g in gens], pa.string()),
        "seconds": pa.array([g.seconds for g in gens], pa.float64()),
        "prefill_s": pa.array([g.prefill_s for g in gens], pa.float64()),
        "pool_s": pa.array(run.pool_s, pa.float64()),
        "passes": pa.array([len(g.cycles) for g in gens], pa.int32()),
    })


def write_folder(folder: Path, files: dict[str, dict | pa.Table]) -> None:
    """Write `files` ({relative path: JSON object or table}) into a fresh folder beside `folder`, then
    swap it in: a reader sees the old folder or the new one, never half of each."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        for rel, obj in files.items():
            if isinstance(obj, pa.Table):
                atomic_write_table(tmp / rel, obj)
            else:
                atomic_write_json(tmp / rel, obj)
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            folder.rename(old)
        tmp.rename(folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run_decode(cfg: DecodeConfig, lm: LoadedModel | None = None,
               extra_arms: dict[str, ArmFactory] | None = None) -> dict[str, dict]:
    """Serve the benchmark with every arm; returns {arm: summary} (also written under decode/<arm>/)."""
    if cfg.nodes < 0:
        raise OilbirdError(f"--nodes must be 0 or more (got {cfg.nodes})")
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
    tenants = [getattr(r, "tenant", "") or "" for r in requests]  # before data.benchmarks had tenants: one
    prompts = [encode_prompt(lm, r.messages) for r in requests]
    if any(not p for p in prompts):
        raise OilbirdError("a request encodes to an empty prompt; nothing to decode from")
    warm_up(lm, prompts[0])
    out_dir = decode_dir(cfg.out, cfg.bench, lm.slug)
    base = {
        "bench": cfg.bench, "model": lm.name, "model_fingerprint": lm.fingerprint,
        "device": lm.device.type, "dtype": str(lm.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "nodes": cfg.nodes, "max_new_tokens": max_new, "stop_strings": list(stop_strings),
        "limit": cfg.limit, "warm_from": cfg.warm_from, "warm_requests": len(warm_pool),
        "index": spec.text, "store_budget": budget_info, "store_budget_tokens": budget_tokens,
        "arms_run": arms, "ar_added": added, "decode_dir": str(out_dir),
        "invocation": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
    }
    ids = [r.id for r in requests]
    summaries: dict[str, dict] = {}
    reference: ArmRun | None = None
    for k, name in enumerate(arms):
        run = serve_arm(name, lm, prompts, cfg, stop, factories.get(name), warm_pool,
                        f"{name} ({k + 1}/{len(arms)})", tenants, budget_tokens)
        if name == REFERENCE_ARM:
            reference = run
            # every arm commits ar's tokens: a budget below one of its traces is refused before any drafting
            check_budget(budget_tokens, [len(g.tokens) for g in run.generations])
        summary = summarize(run, reference, ids, base)
        write_folder(out_dir / name, {"cycles.parquet": cycles_table([g.cycles for g in run.generations]),
                                      "requests.parquet": requests_table(run, requests, prompts),
                                      "summary.json": summary})
        summaries[name] = summary
    return summaries


def format_table(summaries: dict[str, dict]) -> str:
    """tau, tokens/s, speedup, overhead and the audit per arm, as printed at the end of a run."""
    width = max([12, *(len(n) + 1 for n in summaries)])
    lines = [f"{'arm':<{width}} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'overhead':>9} {'sole':>6} {'lossless':>10}"]
    for name, s in summaries.items():
        audit = s["lossless"]
        share = s.get("sole_source_share")
        sole = f"{100 * share['value']:>5.1f}%" if share and share["value"] is not None else f"{'-':>6}"
        lines.append(f"{name:<{width}} {s['tau']:>6.2f} {s['tokens_per_s']:>8.1f} "
                     f"{(s['speedup'] or 0):>7.2f}x {100 * s['overhead_fraction']:>8.1f}% {sole} "
                     f"{audit['matched']:>4}/{audit['requests']:<5}")
    return "\n".join(lines)
