"""`python -m decoder --bench B --model M --arms ar,sam,lexical`: serve a benchmark with every arm, side by side.

More commands share the entry point:
  python -m decoder replay --bench B --model M [--arms ...]   every arm over a captured store, no model (replay/run.py)
  python -m decoder ablations --bench B --model M             the ablation table and ladder (replay/ablations.py)
  python -m decoder profile --model M [--bench B]             verification cost vs node count (cost/profile.py)
  python -m decoder vllm-run --model DIR --prompts P.json --arm A --out R.json   one arm served by vLLM (decoder/vllm/run.py)
  python -m decoder vllm-check [--k K]                        the OILBIRD_VLLM_* settings checked as the Oilbird proposer
                                                              reads them in vLLM's engine process: run it before `vllm serve`
  python -m decoder serve [--model M] [--port P] [--arm A] [-- VLLM_ARGS]   vllm serve with Oilbird (decoder/vllm/serve.py)
replay and ablations run their arms in worker processes here (--jobs N) or as one Ray task each (--ray
auto|local:N|ADDRESS; decoder/replay/arms.py), with the same results.
"""

from __future__ import annotations

from data.versions import require_dependencies

require_dependencies()  # before the stage imports what it checks: one line, never a traceback

import argparse
import sys
from pathlib import Path

from data.errors import cli_entry

ARMS_HELP = """arms:
  ar                     plain greedy decoding (the reference; always run first)
  ar-static              transformers' generate, greedy, static cache, compiled (CUDA: transformers' own
                         auto-compile; CPU: asked for; --no-compile: eager): the greedy decoder a GPU user
                         runs, a second speed reference (speedup_vs_fastest_ar) audited against ar
  pld, suffix, sam, recycling, lexical
                         the lexical drafters (prompt lookup, SuffixDecoding, SAM-Decoding,
                         Token Recycling, and the merged spine/branch/adjacency tree)
  suffix-arctic, suffix-arctic-tree
                         ArcticInference's SuffixDecodingCache (vLLM's suffix method) at vLLM's
                         defaults (depth 24, factor 1, a chain of <= 24), and in tree mode at the
                         node budget (depth 64, factor 4); needs arctic-inference (make install)
  toolspec, toolspec-memory
                         ToolSpec: the prompt's tool schema through its FSM, then n-gram, then
                         Token Recycling; -memory adds its retrieval of the 10 nearest past outputs
  oilbird                the method: lexical tree in 60 - 16 nodes, then the semantic key's chains,
                         the automaton branches and rejected-branch rollouts merged from the root
                         into the 16 reserved nodes
ablations of oilbird (same drafter, one setting changed):
  oilbird-no-semantic    --no-semantic: the key never queried, everything else equal
  semantic-only          both lexical sources off, no gate: key chains + rollouts + root branching
                         (the anchor's top-8 adjacency successors, one token each) from the root
  semantic-null          semantic-only retrieving nothing from the key (its null control)
  oilbird-root-attached  retrieved chains hung from the root instead of merged into the tree
  oilbird-request-key    one key query per request selecting whole traces
  oilbird-fixed-depth    copy depth by neighbour rank instead of by similarity
  oilbird-one-source     one source per step instead of merged (SAM-Decoding's rule): the lexical
                         tree when the automaton's match is >= one_source_min_match (5) tokens, else
                         the semantic draft, each at the whole budget
  pld+pool, recycling+pool
                         those hosts handed the cross-request pool under their own exact key
                         (pld: longest suffix n-gram <= 3; recycling: the anchor token), up to 16
                         tokens in the same 16 reserved nodes: the rung +key is measured against
  toolspec+pool          the same for the ToolSpec host (its exact key: suffix n-gram of 7 down to 5)
  pld+key, recycling+key, toolspec+key
                         that exact key replaced by the semantic key at an unchanged node budget
                         (asked on every pass); +key-added: the key beside the host's own exact match
variants: arm@field=value[:field=value] changes one config field of any arm, e.g. oilbird@theta=0.9,
  oilbird@calib_window=0, oilbird@retrieval_budget=8, oilbird@k=16 (decoder/drafters/__init__.py)
one arm served several ways in one run (suffixes, combinable: oilbird+graph+serial):
  arm+graph, arm+eager   the arm through that verifier, whatever --verifier says (each sized by its own profile)
  arm+serial             the arm with each pass's deferred bookkeeping before its verify, not beside it
summary.json of the key arms adds sole_source_share (sole-semantic tokens / all committed tokens, the
paper's), sole_source_share_of_draft (/ accepted draft tokens), semantic_time_s, retrieval_fraction and
store_bytes_per_token; every arm records index, bytes_per_state, warmup_queries and knn_recall (--index),
tenants (one drafter per tenant), store_budget_tokens and max_pool_tokens (--store-budget)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("replay", "ablations", "profile"):
        code = preflight(argv[0], argv[1:])
        if code:
            return code
    if argv and argv[0] == "replay":
        from decoder.replay.run import replay_main

        return replay_main(argv[1:])
    if argv and argv[0] == "ablations":
        from decoder.replay.ablations import main as ablations_main

        return ablations_main(argv[1:])
    if argv and argv[0] == "vllm-run":
        from decoder.vllm.run import vllm_run_main

        return vllm_run_main(argv[1:])
    if argv and argv[0] == "serve":
        from decoder.vllm.serve import serve_main as vllm_serve_main

        return vllm_serve_main(argv[1:])
    if argv and argv[0] == "profile":
        from decoder.cost.profile import profile_main

        return profile_main(argv[1:])
    if argv and argv[0] == "vllm-check":
        return vllm_check_main(argv[1:])
    return serve_main(argv)


@cli_entry
def vllm_check_main(argv: list[str]) -> int:
    """The proposer's settings as its constructor checks them (decoder/vllm/proposer.py proposer_settings), in this
    process: `vllm serve` with the proposer's dict built by hand runs none of our code before its workers, where a
    bad OILBIRD_VLLM_* value ends the engine's start in pages of tracebacks."""
    p = argparse.ArgumentParser(
        prog="python -m decoder vllm-check",
        description="Check the OILBIRD_VLLM_* settings the Oilbird proposer (decoder.vllm.proposer.OilbirdProposer) "
                    "reads in vLLM's engine process, as its constructor does, before `vllm serve` starts one: one "
                    "line and exit 2 for a bad one, else one OK line. Nothing is written.")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens of the speculative config (default 8)")
    args = p.parse_args(argv)
    from decoder.vllm.proposer import proposer_settings

    s, _ = proposer_settings(k=args.k)
    print(f"OK: the Oilbird proposer's settings hold: arm {s.arm}, k {s.k}, nodes {s.nodes}, index {s.index}, "
          f"profile {s.profile or 'none (a flat cost)'}, stats {s.stats or 'none'}, log {s.log or 'none'}, "
          f"store {s.store or 'none'}")
    return 0


@cli_entry
def preflight(command: str, argv: list[str]) -> int:
    """Before a replay, ablations or profile does any work: the folder its results go to is checked, so a
    --model or --bench that would leave its folder (`--model /path/sub/..`: slug '..') or an --out that
    cannot be written (a file, /proc, immutable) ends in one line now, not after minutes of work.

    Only the flags that name the folder are read here (the command's own parser reads them all, and
    answers --help and mistakes); a flag left out takes the command's default. With --if-missing nothing
    may need writing, so only the names are checked."""
    from data.store.layout import (
        PROFILES,
        ablations_dir,
        check_writable,
        component,
        model_slug,
        replay_dir,
    )

    if any(a in ("-h", "--help") for a in argv):
        return 0
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--bench", default="apibank" if command == "ablations" else None)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs")
    p.add_argument("--pool", default="past")
    p.add_argument("--file", default=None)
    p.add_argument("--if-missing", action="store_true")
    try:
        args, _ = p.parse_known_args(argv)
    except SystemExit:  # a flag without its value: the command's own parser says so
        return 0
    if command == "profile":
        if args.file:
            target = Path(args.file).parent
        else:
            target = Path(args.out) / PROFILES
            component(model_slug(args.model), "model slug")
    elif args.bench is None:
        return 0  # replay's parser says --bench is required
    elif command == "replay":
        if args.pool not in ("past", "warm"):
            return 0  # replay's parser names the choices
        target = replay_dir(args.out, args.bench, model_slug(args.model), args.pool)
    else:
        target = ablations_dir(args.out, args.bench, model_slug(args.model))
    if not args.if_missing:
        check_writable(target)
    return 0


@cli_entry
def serve_main(argv: list[str] | None = None) -> int:
    from data.benchmarks.jsonl import MAX_LINE_HELP
    from data.index.stateindex import DEFAULT_INDEX
    from decoder.pools import INDEX_HELP

    p = argparse.ArgumentParser(
        prog="python -m decoder",
        description="Serve a benchmark in order with each arm (ar first, the reference), writing "
                    "runs/<bench>/<model>/decode/<arm>/{cycles.parquet,requests.parquet,summary.json}. "
                    "Also: `python -m decoder replay ...` (every arm over a captured store, without the model), "
                    "`python -m decoder ablations ...` (the ablation table, by replay; both take --jobs N or --ray "
                    "auto|local:N|ADDRESS: one Ray task per arm) and `python -m decoder profile ...` (verification "
                    "cost for replay's speedup estimate).",
        epilog=ARMS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", required=True, help="benchmark name (python -m data list) or jsonl:PATH")
    p.add_argument("--model", default="smollm2-135m", help="HF id, local dir, or alias smollm2-135m | stories260k")
    p.add_argument("--arms", default=None,
                   help="comma-separated arms (default: ar,pld,suffix,sam,recycling,lexical,oilbird); ar is always run first")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--nodes", type=int, default=60, help="draft node budget per verification pass (default 60)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="token cap (default: the benchmark's)")
    p.add_argument("--out", default="runs", help="output root (default runs/)")
    p.add_argument("--warm-from", default=None, metavar="STORE",
                   help="a captured trace store (runs/<bench>/<model>/traces), or a store set, whose requests start every pool")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 CPU, bf16 CUDA)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--index", default=DEFAULT_INDEX, metavar="SPEC", help=INDEX_HELP)
    p.add_argument("--store-budget", default=None, metavar="B",
                   help="bound the pool to B generated tokens (200k, 1.5M) or megabytes (64MB): the oldest traces "
                        "leave when a finished request takes it above B, down to 7/8 of B (default: unbounded; "
                        "not with --warm-from; 0 is refused, all = unbounded)")
    p.add_argument("--index-train", type=int, default=0, metavar="N",
                   help="states a faiss index collects (answering exactly) before it trains (default: the spec's own need)")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="serve with every arm R times, the arm order rotated each round (round r starts at arm r mod n); "
                        "tokens/s and speedups are medians over the rounds with [min, max], the rest from round 1 "
                        "(default 1; the speed benches use 3)")
    p.add_argument("--no-compile", action="store_true", help="ar-static without torch.compile (static cache, eager)")
    p.add_argument("--verifier", default="auto", choices=("auto", "graph", "eager"),
                   help="how drafter arms verify: graph (fixed shapes, compiled per row bucket in the warm-up), eager, "
                        "or auto (graph on a GPU, eager on a CPU; default)")
    p.add_argument("--overlap", default="auto", choices=("auto", "on", "off"),
                   help="on: the previous pass's bookkeeping runs on a helper thread while the verify runs; off: "
                        "before the verify; auto: on with a GPU, off on a CPU (default). The passes are the same; "
                        "an arm written arm+serial runs with it off beside arms with it on")
    p.add_argument("--profile", default="auto", metavar="PATH|auto|flat",
                   help="what sizes the cost-aware arms' trees: auto (this machine's harness profile, measured once "
                        "and cached under OUT/profiles; default), flat (every candidate verified) or a profile file")
    p.add_argument("--max-line-bytes", default=None, metavar="N", help=MAX_LINE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from data.benchmarks.jsonl import line_bound
    from data.store.layout import check_writable, decode_dir, model_slug
    from decoder.live.harness import DEFAULT_ARMS, DecodeConfig, run_decode
    from decoder.live.results import format_table

    check_writable(decode_dir(args.out, args.bench, model_slug(args.model)))  # before the model loads

    arms = tuple(args.arms.split(",")) if args.arms is not None else DEFAULT_ARMS
    cfg = DecodeConfig(bench=args.bench, model=args.model, arms=arms, limit=args.limit, nodes=args.nodes,
                       max_new_tokens=args.max_new_tokens, out=args.out, warm_from=args.warm_from,
                       dtype=args.dtype, device=args.device, progress=not args.quiet, index=args.index,
                       store_budget=args.store_budget, index_train_size=args.index_train, rounds=args.rounds,
                       static_compile=False if args.no_compile else None, verifier=args.verifier,
                       profile=args.profile, overlap=args.overlap)
    with line_bound(args.max_line_bytes):
        summaries = run_decode(cfg)
    print(format_table(summaries))
    print(f"written: {next(iter(summaries.values()))['decode_dir']}/<arm>/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
