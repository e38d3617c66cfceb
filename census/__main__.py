"""`python -m census --bench B --model M`: the identifiability-gap census of one trace store;
`python -m census grid --benches a,b --model M`: the cross-benchmark table;
`python -m census sweep-index --bench B --model M --index exact,sq8,pq64`: the semantic key per index;
`python -m census sweep-budget --bench B --model M --budgets 10k,50k,200k,all`: the census per store budget."""

from __future__ import annotations

from data.versions import require_dependencies

require_dependencies()  # before the stage imports what it checks: one line, never a traceback

import argparse
import sys

from census.definitions import CensusConfig
from data.errors import OilbirdError, cli_entry

DEFAULTS = CensusConfig()


def _census_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m census",
                                description="Census of a trace store: available, producible, gap, key recall "
                                            "(`python -m census grid ...` for the cross-benchmark table)")
    p.add_argument("--bench", required=True, help="benchmark name, as captured")
    p.add_argument("--model", default="smollm2-135m", help="model name or alias, as captured")
    p.add_argument("--out", default="runs", help="runs root (default runs/)")
    p.add_argument("--store", default=None,
                   help="trace store folder, or a store set (a folder of stores, or store folders comma-separated: "
                        "one stream, docs/store.md) (default runs/<bench>/<model>/traces); results still go to "
                        "runs/<bench>/<model>/census")
    p.add_argument("--pool", choices=["past", "warm"], default=DEFAULTS.pool,
                   help="past: strictly earlier requests (default); warm: every other request")
    p.add_argument("--horizon", type=int, default=DEFAULTS.horizon, help="verbatim future for `available` (2)")
    p.add_argument("--min-suffix", type=int, default=DEFAULTS.min_suffix, help="oracle back-off floor (2)")
    p.add_argument("--max-suffix", type=int, default=DEFAULTS.max_suffix, help="oracle's longest suffix (16)")
    p.add_argument("--candidates", type=int, default=DEFAULTS.candidates, help="candidate budget of every key (8)")
    p.add_argument("--payload-cap", type=int, default=DEFAULTS.payload_cap, help="cap of the payload lengths (32)")
    p.add_argument("--bootstrap", type=int, default=DEFAULTS.bootstrap, help="request-level bootstrap draws (2000)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="bootstrap seed (0)")
    p.add_argument("--device", default=None, help="kNN device (default: cuda when available)")
    _index_args(p)
    p.add_argument("--store-budget", default=None,
                   help="bound the past pool: tokens (200k) or megabytes (64MB); default unbounded; 0 is refused, all = unbounded")
    p.add_argument("--no-embeddings", action="store_true", help="skip the static-embedding key (no model load)")
    p.add_argument("--if-missing", action="store_true",
                   help="skip when the census with these settings exists for the store as it is now")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _index_args(p: argparse.ArgumentParser, index: bool = True) -> None:
    if index:
        p.add_argument("--index", default=DEFAULTS.index,
                       help="semantic key's index: exact (default), flat, sq8, pq64, pca128,sq8, opq64,pq64, "
                            "ivf1024,pq64, hnsw32 (data/index/stateindex.py)")
    p.add_argument("--index-train", type=int, default=None,
                   help="states an index collects before it trains (default: the spec's own need)")
    p.add_argument("--recall-sample", type=int, default=DEFAULTS.recall_sample,
                   help="positions sampled to check an index against exact (1024)")


def _sweep_parser(kind: str) -> argparse.ArgumentParser:
    if kind == "index":
        p = argparse.ArgumentParser(prog="python -m census sweep-index",
                                    description="The semantic key under several indexes (lexical part computed once); "
                                                "writes runs/<bench>/<model>/sweeps/index.json")
        p.add_argument("--index", action="append", required=True,
                       help="specs, comma-separated (opq64,pq64 groups into one spec; ';' always separates)")
        p.add_argument("--store-budget", default=None, help="bound the past pool, in tokens (200k); 0 is refused, all = unbounded")
    else:
        p = argparse.ArgumentParser(prog="python -m census sweep-budget",
                                    description="The census under several store budgets; writes "
                                                "runs/<bench>/<model>/sweeps/budget.json")
        p.add_argument("--budgets", required=True, help="comma-separated: tokens (10k), megabytes (64MB), all")
        p.add_argument("--index", default=DEFAULTS.index, help="semantic key's index (default exact)")
    p.add_argument("--bench", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs")
    p.add_argument("--pool", choices=["past", "warm"], default=DEFAULTS.pool)
    p.add_argument("--candidates", type=int, default=DEFAULTS.candidates)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="sampling seed (0)")
    p.add_argument("--device", default=None)
    _index_args(p, index=False)
    p.add_argument("--quiet", action="store_true")
    return p


def _grid_parser() -> argparse.ArgumentParser:
    from census.grid import GridCapture
    from data.benchmarks.jsonl import MAX_LINE_HELP
    from data.benchmarks.registry import GRID_BENCHES

    cap = GridCapture()
    p = argparse.ArgumentParser(prog="python -m census grid", description="Avail / Gap / Recall across benchmarks "
                                "(a census missing or older than its store is computed first)")
    p.add_argument("--benches", default=",".join(GRID_BENCHES),
                   help=f"comma-separated benchmark names (default: the grid's {len(GRID_BENCHES)})")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs")
    p.add_argument("--pool", choices=["past", "warm"], default="past")
    p.add_argument("--capture", action="store_true",
                   help="capture (or resume) a missing store first, with the grid's per-benchmark limit "
                        "(data/benchmarks/registry.py GRID_LIMITS: 20 min of capture on 2 cores)")
    p.add_argument("--max-new-tokens", type=int, default=cap.max_new_tokens,
                   help=f"--capture's token cap ({cap.max_new_tokens})")
    p.add_argument("--batch-size", type=int, default=cap.batch_size, help=f"--capture's rows ({cap.batch_size})")
    p.add_argument("--no-limits", action="store_true", help="--capture whole benchmarks (no GRID_LIMITS)")
    p.add_argument("--max-line-bytes", default=None, metavar="N", help=MAX_LINE_HELP)
    p.add_argument("--quiet", action="store_true")
    return p


@cli_entry
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grid"]:
        return _grid(_grid_parser().parse_args(argv[1:]))
    if argv[:1] in (["sweep-index"], ["sweep-budget"]):
        return _sweep(argv[0][6:], _sweep_parser(argv[0][6:]).parse_args(argv[1:]))
    args = _census_parser().parse_args(argv)
    from census.output import format_summary, run_census

    cfg = CensusConfig(pool=args.pool, horizon=args.horizon, min_suffix=args.min_suffix, max_suffix=args.max_suffix,
                       candidates=args.candidates, payload_cap=args.payload_cap, bootstrap=args.bootstrap,
                       seed=args.seed, device=args.device, index=args.index, index_train=args.index_train,
                       recall_sample=args.recall_sample, store_budget=args.store_budget).validate()
    if args.if_missing and not args.no_embeddings:
        from data.store.layout import census_dir, model_slug, store_dir
        from data.store.storeset import current_summary  # a store or a store set

        slug = model_slug(args.model)
        target = census_dir(args.out, args.bench, slug, cfg.pool)
        if (target / "positions.parquet").exists() and current_summary(
                target / "summary.json", args.store or store_dir(args.out, args.bench, slug), config=cfg.as_dict()):
            print(f"{target}: census of the store as it is now exists (--if-missing); not recomputed",
                  file=sys.stderr)
            print(target)
            return 0
    from data.store.layout import check_writable, model_dir, model_slug

    # before any work: the census writes its temporary folder beside census/, in the model's folder
    check_writable(model_dir(args.out, args.bench, model_slug(args.model)))
    target, summary = run_census(args.bench, args.model, cfg, args.out,
                                 embeddings=None if args.no_embeddings else "load", progress=not args.quiet,
                                 store=args.store)
    print(format_summary(summary))
    t = summary["timing"]
    print(f"  {summary['positions']} positions in {t['census_s']:.1f} s ({t['positions_per_s']:.0f}/s on {t['device']})")
    print(target)
    return 0


def _sweep(kind: str, args) -> int:
    from census import sweep
    from data.store.layout import check_writable, model_slug, sweeps_dir

    check_writable(sweeps_dir(args.out, args.bench, model_slug(args.model)))  # before any work
    cfg = CensusConfig(pool=args.pool, candidates=args.candidates, seed=args.seed, device=args.device,
                       index_train=args.index_train, recall_sample=args.recall_sample, bootstrap=0)
    if kind == "index":
        cfg.store_budget = args.store_budget
        result = sweep.sweep_index(args.bench, args.model, sweep.split_specs(args.index), cfg, args.out,
                                   progress=not args.quiet)
        print(sweep.format_index_sweep(result))
    else:
        cfg.index = args.index
        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        if not budgets:
            raise OilbirdError("--budgets names no budget; e.g. --budgets 10k,50k,200k,all")
        result = sweep.sweep_budget(args.bench, args.model, budgets, cfg, args.out, progress=not args.quiet)
        print(sweep.format_budget_sweep(result))
    print(sweeps_dir(args.out, args.bench, model_slug(args.model)) / f"{kind}.json")
    return 0


def _grid(args) -> int:
    from census.grid import GridCapture, format_grid, grid_table
    from data.benchmarks.jsonl import line_bound
    from data.store.files import atomic_write_bytes, atomic_write_json, clean_leftovers
    from data.store.layout import check_writable, grid_dir, grid_name, model_slug

    benches = [b.strip() for b in args.benches.split(",") if b.strip()]
    if not benches:
        raise OilbirdError("--benches names no benchmark")
    target = check_writable(grid_dir(args.out, model_slug(args.model)))  # before any work
    name = grid_name(args.pool)
    capture = GridCapture(args.max_new_tokens, args.batch_size, not args.no_limits) if args.capture else None
    with line_bound(args.max_line_bytes):
        grid = grid_table(benches, args.model, CensusConfig(pool=args.pool), args.out, progress=not args.quiet,
                          capture=capture)
    text = format_grid(grid)
    clean_leftovers(target)  # temporary files of a killed earlier run
    atomic_write_json(target / f"{name}.json", grid)
    atomic_write_bytes(target / f"{name}.txt", (text + "\n").encode())
    print(text)
    print(target / f"{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
