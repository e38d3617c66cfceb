"""`python -m decoder profile`: the time of one verification forward against draft nodes and context.

What is measured, on one device, model and dtype: for each context length L (the tokens already in
the KV cache, `past_len`), the wall time of `decoder.verify.engine.verify_tree` feeding the anchor plus a
draft tree of N nodes (N = 0 is the `ar` step: the anchor alone), the median of `reps` runs after
one warm-up, the cache cropped back to L after every run (the fastest and the slowest of the reps are
kept too, `verify_s_min` / `verify_s_max`: the spread the verdict is checked across,
decoder/cost/spread.py); and the time of `decoder.verify.engine.prefill` against prompt length. Replay
(which simulates every drafter over captured greedy traces without running the model) turns passes into wall-clock with it: the estimated time of a speculative arm is
the sum over requests of prefill_s(prompt_len) + the sum over its passes of verify_s(nodes,
past_len) + the measured drafting and update time; plain greedy decoding is prefill_s(prompt_len)
+ one verify_s(0, past_len) per generated token; the speedup is their ratio. `CostModel` reads the
profile and interpolates between the measured grid points.

Files: runs/profiles/<model>-<device>.json (data/store/layout.py `default_profile_path`); the format is `measure_profile`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from data.capture.models import text_config
from data.capture.vllm_engine import vllm_mode
from data.errors import OilbirdError, cli_entry
from data.store.layout import default_profile_path
from decoder.cost.model import FORMAT, REQUIRED_KEYS, CostModel, check_times  # noqa: F401 (read from here too)
from decoder.draft import MAX_NODES  # one bound for every CLI's --nodes
from decoder.cost.engine_choice import ENGINES
from decoder.cost.spread import spread_fields

DEFAULT_NODES = (0, 1, 2, 4, 8, 16, 24, 32, 48, 64)
DEFAULT_CONTEXTS = (256, 512, 1024, 2048)  # when no trace store says which lengths the traffic has
CONTEXT_ROUND = 16  # store quantiles are rounded up to a multiple of this (a tidy grid that covers the max)


@dataclass
class ProfileConfig:
    model: str = "smollm2-135m"  # HF id, local dir, or alias smollm2-135m | stories260k
    device: str | None = None  # default cuda when available
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    bench: str | None = None  # take the context lengths from runs/<bench>/<model>/traces
    contexts: tuple[int, ...] | None = None  # explicit context lengths (wins over bench)
    nodes: tuple[int, ...] = DEFAULT_NODES
    reps: int = 3  # timed runs per grid point; the median is kept
    out: str = "runs"  # runs root
    file: str | None = None  # output path; default runs/profiles/<model>-<device>[-vllm].json
    engine: str = "harness"  # harness (this package's verify_tree) | vllm (decoder/cost/vllm_profile.py: a vLLM step)
    #                          | auto (vllm where it can run the model, else harness: `choose_engine`)
    batch_sizes: tuple[int, ...] = (1,)  # vllm: also measure steps of B requests together (verify_s_by_batch)
    vllm_eager: bool = False  # vllm: measure in eager mode; default vLLM's default compilation (what serves)
    verifier: str = "eager"  # harness: eager (verify_tree) or graph (decoder/verify/graph.py, compiled first)
    progress: bool = True
    seed: int = 0  # the random token ids fed (their values do not change the cost; seeded anyway)


# ---------------------------------------------------------------- which context lengths

def contexts_from_store(store_path: str | Path, points: int = 4) -> list[int]:
    """Context lengths that span a store's: the shortest context a replay prices (the shortest prompt less
    its anchor), rounded down to a multiple of 16 (at least 1), then quantiles of the context lengths
    (prompt + position) over every generated position, each rounded up to a multiple of 16; deduplicated.

    points = 4 gives the shortest, the 50/90% quantiles and the longest (points = 1: the longest only): the
    whole range, so replay interpolates and never extrapolates (decoder/cost/pricing.py)."""
    from data.store.storeset import open_store_or_set

    if points < 1:
        raise OilbirdError(f"points must be at least 1 (got {points})")
    store = open_store_or_set(store_path, load_hidden=False)  # a store, or a store set read as one stream
    prompt = store.requests["prompt_tokens"].list.len().to_numpy().astype(np.int64)
    out = store.requests["output_tokens"].list.len().to_numpy().astype(np.int64)
    if out.sum() > 0:
        starts = np.repeat(np.cumsum(out) - out, out)
        lengths = np.repeat(prompt, out) + (np.arange(int(out.sum())) - starts)
    else:  # nothing generated: the prompts are all there is
        lengths = prompt
    qs = [1.0] if points == 1 else [*np.linspace(0.5, 0.9, points - 2), 1.0]
    values = np.quantile(lengths, qs)
    out = {max(CONTEXT_ROUND, int(math.ceil(v / CONTEXT_ROUND)) * CONTEXT_ROUND) for v in values}
    if points > 1:  # the shortest: replay's first step of the shortest prompt has its length less one in the cache
        out.add(max(1, (int(prompt.min()) - 1) // CONTEXT_ROUND * CONTEXT_ROUND))
    return sorted(out)


def max_positions(model: torch.nn.Module) -> int | None:
    cfg = text_config(model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def clip_contexts(model: torch.nn.Module, contexts: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """Context lengths that leave room for the anchor and the deepest tree within the model's positions
    (max_position_embeddings - 65 with the default nodes; stories260k has 512), sorted, deduplicated."""
    limit = max_positions(model)
    room = max([0, *nodes]) + 1
    if limit is not None:
        if limit - room < 1:
            raise OilbirdError(f"the model has {limit} positions: no room for {room - 1} nodes")
        contexts = [min(int(c), limit - room) for c in contexts]
    return sorted({int(c) for c in contexts})


# ---------------------------------------------------------------- measuring

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median_time(fn, reps: int, device: torch.device, after=None, spread: list | None = None) -> float:
    """Median wall time of `reps` calls of fn (synchronized on CUDA); `after` runs untimed after each; the
    fastest and the slowest of them appended to `spread` when given (the profile's verify_s_min / _max)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        if after is not None:
            after()
    if spread is not None:
        spread.append((float(min(times)), float(max(times))))
    return float(statistics.median(times))


@torch.no_grad()
def measure_profile(lm, contexts: Sequence[int], nodes: Sequence[int] = DEFAULT_NODES, reps: int = 3,
                    progress: bool = True, seed: int = 0, verifier: str = "eager", graph=None) -> dict:
    """Time verify_tree over the (context, nodes) grid and prefill over prompt lengths; a JSON-ready dict.

    Tree shape: the parents of Token Recycling's default template of N nodes (a real, bushy draft
    tree: 8 children of the anchor, deeper chains below the likeliest). Token ids are random
    (seeded): the cost of a forward does not depend on them. `verifier`: eager (verify_tree on a DynamicCache) or
    graph (a pass of decoder/verify/graph.py's GraphVerifier, compiled before timing: its cost is flat within a row
    bucket, and this is what sizes `--verifier graph` runs; recorded as the profile's `verifier`); `graph`: a
    warmed-up GraphVerifier to time (the live decoder's own, so it is compiled once), else one is built here."""
    from tqdm import tqdm
    from transformers import DynamicCache

    from decoder.draft import Draft
    from decoder.drafters.recycling import default_template
    from decoder.verify.engine import prefill, verify_tree

    if reps < 1:
        raise OilbirdError(f"--reps must be at least 1 (got {reps})")
    nodes = sorted({int(n) for n in nodes})
    if not nodes or nodes[0] < 0 or nodes[-1] > MAX_NODES:
        raise OilbirdError(f"--nodes must be counts in 0..{MAX_NODES} (got {nodes})")
    contexts = clip_contexts(lm.model, contexts, nodes)
    if not contexts or contexts[0] < 1:
        raise OilbirdError(f"context lengths must be at least 1 (got {contexts})")
    model, dev = lm.model, lm.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, lm.vocab_size, (contexts[-1] + 1 + nodes[-1],), generator=gen).tolist()
    draft = ids[contexts[-1] + 1:]  # draft token ids (any ids will do)
    trees = {n: list(default_template(n)[0]) if n else [] for n in nodes}
    # prefill: the prompt lengths whose forward builds each context (L cached + the anchor), plus a
    # couple of shorter prompts so the curve has a point near zero (short prompts are cheap)
    extra = sorted({p for p in (16, (contexts[0] + 1) // 2) if 2 <= p < contexts[0] + 1})
    own = verifier == "graph" and graph is None  # a graph verifier built (and closed) here
    if own:
        from decoder.verify.engine import StopRule
        from decoder.verify.graph import GraphVerifier, capacity_for

        never = StopRule(lm.tokenizer, frozenset(), (), 1 << 30)  # timing only: no pass may stop the request
        graph = GraphVerifier(lm, never, nodes[-1], capacity_for(contexts[-1] + 2 * nodes[-1] + 2))
        graph.warm_up()
    bar = tqdm(total=len(extra) + len(contexts) * (1 + len(nodes)), unit="pt", desc="profile",
               disable=not progress, dynamic_ncols=True)

    def timed_prefill(n: int) -> tuple[float, DynamicCache]:
        caches: list[DynamicCache] = []

        def run():
            caches[:] = [DynamicCache()]  # keep only the last cache
            prefill(model, caches[-1], ids[:n])

        return _median_time(run, reps, dev), caches[-1]

    timed_prefill(extra[0] if extra else contexts[0] + 1)  # warm-up: first-call allocations, kernel choice
    prefill_s: dict[int, float] = {}
    for p in extra:
        prefill_s[p], _ = timed_prefill(p)
        bar.update(1)
    verify_s, ends = [], []  # ends: per context, (fastest, slowest) of the reps at each node count
    for L in contexts:
        bar.set_postfix(context=L)
        prefill_s[L + 1], cache = timed_prefill(L + 1)  # the cache now holds L tokens; ids[L] is the anchor
        bar.update(1)
        row, row_ends = [], []
        context = ids[:L + 1]
        if graph is not None:
            graph.start(context)  # its slot cache holds the L-token prefix
        for n in nodes:
            if graph is None:
                def run(n=n, L=L, cache=cache):
                    verify_tree(model, cache, L, ids[L], draft[:n], trees[n])

                def crop(L=L, cache=cache):  # back to the L-token prefix (transformers 5 crops by a negative count)
                    cache.crop(L - cache.get_seq_length())
            else:
                def run(context=context, tree=Draft(list(draft[:n]), list(trees[n]), [{"profile"}] * n)):
                    graph.verify(context, tree)

                def crop(context=context):  # its cache back to the prefix: the next pass writes at L again
                    graph.rewind(context)

            run()
            crop()  # warm-up
            row.append(_median_time(run, reps, dev, after=crop, spread=row_ends))
            bar.update(1)
        verify_s.append(row)
        ends.append(row_ends)
    bar.close()
    if own:
        graph.close()
    lengths = sorted(prefill_s)
    return {
        "format": FORMAT, "model": lm.name, "model_fingerprint": lm.fingerprint,
        "device": dev.type, "device_name": device_name(dev), "dtype": str(lm.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "verifier": verifier,
        "nodes": nodes, "contexts": contexts, "verify_s": verify_s,
        "prefill_lengths": lengths, "prefill_s": [prefill_s[p] for p in lengths], "reps": reps,
        **spread_fields(ends),  # the fastest and slowest rep of every verify point (decoder/cost/spread.py)
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------- the cost model

# ---------------------------------------------------------------- the command

def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise OilbirdError(f"{flag} takes comma-separated integers (got '{text}')") from None
    if not values:
        raise OilbirdError(f"{flag} is empty")
    return values


def format_profile(d: dict) -> str:
    """The verify grid in ms (rows: contexts, columns: nodes) and the prefill curve."""
    head = f"{'context':>8} | " + " ".join(f"{n:>7}" for n in d["nodes"])
    lines = [f"verify forward, ms ({d['model']} on {d['device_name']}, {d['dtype']}, {d['threads']} threads)",
             head, "-" * len(head)]
    for L, row in zip(d["contexts"], d["verify_s"]):
        lines.append(f"{L:>8} | " + " ".join(f"{1e3 * s:>7.2f}" for s in row))
    for b, grid in (d.get("verify_s_by_batch") or {}).items():
        lines.append(f"a step of {b} requests, ms (rows: contexts, columns: nodes per request)")
        for L, row in zip(d["contexts"], grid):
            lines.append(f"{L:>8} | " + " ".join(f"{1e3 * s:>7.2f}" for s in row))
    lines.append("prefill, ms: " + ", ".join(f"{p} tok {1e3 * s:.1f}" for p, s in zip(d["prefill_lengths"], d["prefill_s"])))
    return "\n".join(lines)


def resolve_contexts(cfg: ProfileConfig, slug: str) -> tuple[int, ...]:
    if cfg.contexts is not None:
        if min(cfg.contexts) < 1:
            raise OilbirdError(f"--contexts must be lengths of at least 1 (got {','.join(map(str, cfg.contexts))})")
        return tuple(cfg.contexts)
    if cfg.bench is not None:
        from data.store.layout import store_dir
        from data.store.storeset import holds_traces

        path = store_dir(cfg.out, cfg.bench, slug)
        if not holds_traces(path):
            raise OilbirdError(f"no trace store at {path} to take context lengths from: capture one with "
                               f"`python -m data capture --bench {cfg.bench} --model {cfg.model}`")
        return tuple(contexts_from_store(path))
    return DEFAULT_CONTEXTS


def profile_vllm_mode(meta: dict) -> str | None:
    """The vLLM mode a vLLM profile was measured in: compiled or eager (a profile written before the mode was
    recorded was measured eager); None for a harness profile."""
    if meta.get("engine", "harness") != "vllm":
        return None
    return meta.get("vllm_mode") or "eager"


def profile_path(out, slug: str, device_type: str, engine: str = "harness", verifier: str = "eager") -> Path:
    """runs/profiles/<model>-<device>.json, <model>-<device>-graph.json for the harness's graph verifier, and
    <model>-<device>-vllm.json for a profile measured in vLLM."""
    if engine == "harness" and verifier == "graph":
        return default_profile_path(out, slug, f"{device_type}-graph")
    return default_profile_path(out, slug, device_type if engine == "harness" else f"{device_type}-{engine}")


def resolve_engine(cfg: ProfileConfig, say: bool = True) -> ProfileConfig:
    """`cfg` with --engine auto made vllm or harness (`choose_engine`; its note on stderr when `say`)."""
    if cfg.engine not in ENGINES:
        raise OilbirdError(f"--engine must be {', '.join(ENGINES)} (got {cfg.engine!r})")
    if cfg.engine != "auto":
        return cfg
    from data.capture.models import resolve_model
    from decoder.cost.engine_choice import choose_engine

    engine, note = choose_engine("auto", resolve_model(cfg.model), cfg.batch_sizes)
    if note and say:
        print(f"note: {note}", file=sys.stderr)
    return dataclasses.replace(cfg, engine=engine, batch_sizes=cfg.batch_sizes if engine == "vllm" else (1,))


def output_path(cfg: ProfileConfig) -> Path:
    """Where the profile goes: --file, else <out>/profiles/<model slug>-<device>[-vllm].json, the name built
    here from the model's slug (data/store/layout.py), never from the --model text (a path: `../x/y`)."""
    from data.capture.models import pick_device
    from data.store.layout import model_slug

    if cfg.file:
        return Path(cfg.file)
    return profile_path(cfg.out, model_slug(cfg.model), pick_device(cfg.device).type, resolve_engine(cfg, False).engine,
                        cfg.verifier)


def profile_falls_short(path: Path, cfg: ProfileConfig) -> str | None:
    """What an existing profile does not cover that `cfg` asks for (the longest context of --bench's store,
    a node count, a batch size), in words; None when it covers all (--if-missing then keeps it)."""
    from data.store.layout import model_slug

    try:
        cost = CostModel.load(path)
    except OilbirdError:  # not a profile (or not a regular file): never overwritten here; replay names what is wrong
        return None
    if max(cfg.nodes) > cost.nodes_range()[1]:
        return f"measured up to {cost.nodes_range()[1]} draft nodes, not {max(cfg.nodes)}"
    engine = resolve_engine(cfg, False)
    if engine.engine == "vllm" and profile_vllm_mode(cost.meta) != vllm_mode(cfg.vllm_eager):
        return f"was measured in vLLM's {profile_vllm_mode(cost.meta)} mode, not {vllm_mode(cfg.vllm_eager)}"
    missing = sorted(set(engine.batch_sizes) - set(cost.batch_sizes()))
    if missing:
        return f"measured batch sizes {','.join(map(str, cost.batch_sizes()))}, not {','.join(map(str, missing))}"
    if cfg.bench is not None and cfg.contexts is None:
        longest = resolve_contexts(cfg, model_slug(cfg.model))[-1]
        if longest > cost.contexts_range()[1]:  # the store grew past it (replay would refuse: decoder/cost/pricing.py)
            return f"measured contexts up to {cost.contexts_range()[1]}, the store reaches {longest}"
    return None


def run_profile(cfg: ProfileConfig) -> tuple[dict, Path]:
    """Check the config, load the model, measure, write the JSON; (profile, path)."""
    from data.capture.models import load_model
    from data.store.files import atomic_write_json
    from data.store.layout import model_slug
    from decoder.verify.engine import check_supported

    bad = [n for n in cfg.nodes if not 0 <= n <= MAX_NODES]
    if bad:
        raise OilbirdError(f"--nodes must be counts in 0..{MAX_NODES} (got {bad[0]})")
    if cfg.reps < 1:
        raise OilbirdError(f"--reps must be at least 1 (got {cfg.reps})")
    if min(cfg.batch_sizes) < 1:
        raise OilbirdError(f"--batch-sizes must be 1 or more (got {min(cfg.batch_sizes)})")
    cfg = resolve_engine(cfg)
    if max(cfg.batch_sizes) > 1 and cfg.engine != "vllm":
        raise OilbirdError("--batch-sizes above 1 needs --engine vllm (the harness verifies one request a pass)")
    if cfg.verifier not in ("eager", "graph"):
        raise OilbirdError(f"--verifier must be eager or graph (got {cfg.verifier!r})")
    if cfg.verifier == "graph" and cfg.engine != "harness":
        raise OilbirdError("--verifier graph times the harness's graph verifier: it needs --engine harness")
    if cfg.vllm_eager and cfg.engine != "vllm":
        raise OilbirdError("--vllm-eager sets vLLM's mode: it needs --engine vllm (or auto choosing vLLM)")
    if cfg.engine == "vllm":
        from data.capture.vllm_engine import require_vllm

        require_vllm()
    contexts = resolve_contexts(cfg, model_slug(cfg.model))  # before loading: bad input fails fast
    lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    check_supported(lm.model)
    clipped = clip_contexts(lm.model, contexts, cfg.nodes)
    if clipped != sorted(set(contexts)):
        print(f"note: context lengths clipped to the model's {max_positions(lm.model)} positions: "
              f"{','.join(map(str, clipped))}", file=sys.stderr)
    if cfg.engine == "vllm":
        from decoder.cost.vllm_profile import measure_vllm_profile

        dtype = str(lm.dtype).removeprefix("torch.")
        model_dir, lm.model = lm.path, None  # vLLM loads its own copy; this one is not needed any more
        d = measure_vllm_profile(model_dir, lm.name, lm.fingerprint, clipped, cfg.nodes, cfg.reps, dtype, cfg.seed,
                                 batch_sizes=cfg.batch_sizes, eager=cfg.vllm_eager)
    else:
        d = measure_profile(lm, clipped, cfg.nodes, cfg.reps, cfg.progress, cfg.seed, verifier=cfg.verifier)
    path = Path(cfg.file) if cfg.file else profile_path(cfg.out, lm.slug, lm.device.type, cfg.engine, cfg.verifier)
    atomic_write_json(path, d)
    return d, path


@cli_entry
def profile_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m decoder profile",
        description="Measure one verification forward against draft nodes and context length, and prefill "
                    "against prompt length, on this device: the cost model replay turns passes into time with. "
                    "Writes runs/profiles/<model>-<device>.json.")
    p.add_argument("--model", default="smollm2-135m", help="HF id, local dir, or alias smollm2-135m | stories260k")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 CPU, bf16 CUDA)")
    p.add_argument("--bench", default=None, metavar="B",
                   help="take the context lengths (the shortest, the 50/90%% quantiles, the longest) from runs/<B>/<model>/traces")
    p.add_argument("--contexts", default=None, metavar="L,L",
                   help=f"explicit context lengths (default: from --bench, else {','.join(map(str, DEFAULT_CONTEXTS))})")
    p.add_argument("--nodes", default=",".join(map(str, DEFAULT_NODES)), metavar="N,N",
                   help=f"draft node counts, each 0..{MAX_NODES} (default {','.join(map(str, DEFAULT_NODES))})")
    p.add_argument("--reps", type=int, default=3, help="timed runs per point, median kept (default 3)")
    p.add_argument("--out", default="runs", help="runs root (default runs/)")
    p.add_argument("--file", default=None, help="output path (default <out>/profiles/<model>-<device>.json)")
    p.add_argument("--if-missing", action="store_true",
                   help="do nothing when the output file already exists (what `make census` uses)")
    p.add_argument("--engine", choices=ENGINES, default="harness",
                   help="harness (default: one verify_tree forward), vllm (one vLLM engine step; "
                        "decoder/cost/vllm_profile.py; written as <model>-<device>-vllm.json) or auto (vllm where it "
                        "can run the model, else the harness, saying so: what `make census` uses)")
    p.add_argument("--print-path", action="store_true",
                   help="print the file the profile goes to (--file, else the default name for the model's slug and "
                        "the engine) and stop: how the Makefile names it")
    p.add_argument("--batch-sizes", default="1", metavar="B,B",
                   help="--engine vllm: also time steps of B requests together (verify_s_by_batch; replay prices "
                        "batch 1, one stream; default 1)")
    p.add_argument("--vllm-eager", action="store_true",
                   help="--engine vllm: measure vLLM in eager mode (default: vLLM's default compilation, what serves)")
    p.add_argument("--verifier", choices=("eager", "graph"), default="eager",
                   help="--engine harness: time the eager verifier (default) or the graph verifier (compiled first; "
                        "written as <model>-<device>-graph.json: what sizes `python -m decoder --verifier graph`)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    cfg = ProfileConfig(model=args.model, device=args.device, dtype=args.dtype, bench=args.bench,
                        contexts=_int_list(args.contexts, "--contexts") if args.contexts is not None else None,
                        nodes=_int_list(args.nodes, "--nodes"), reps=args.reps, out=args.out, file=args.file,
                        progress=not args.quiet, engine=args.engine,
                        batch_sizes=tuple(_int_list(args.batch_sizes, "--batch-sizes")), vllm_eager=args.vllm_eager,
                        verifier=args.verifier)
    if args.print_path:
        print(output_path(cfg))
        return 0
    if args.if_missing:
        target = output_path(cfg)
        short = profile_falls_short(target, cfg) if target.exists() else None
        if target.exists() and short is None:
            print(f"profile {target} exists; kept (delete it to measure again)", file=sys.stderr)
            return 0
        if short:
            print(f"note: profile {target} {short}: measuring it again", file=sys.stderr)
    d, path = run_profile(cfg)
    print(format_profile(d))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(profile_main())
