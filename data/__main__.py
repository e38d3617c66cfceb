"""`python -m data list | capture | show | verify | migrate`: benchmarks, trace capture, a store's
summary, its full integrity check, and the rewrite of a store written in an older Parquet layout
(store format 1: null state rows, which pyarrow < 26 cannot read) in the current one."""

from __future__ import annotations

from data.versions import require_dependencies

require_dependencies()  # before the stage imports what it checks: one line, never a traceback

import argparse
import sys

from data.benchmarks.jsonl import MAX_LINE_HELP
from data.errors import OilbirdError, cli_entry
from data.store.layout import RUNS


def _cmd_list(args) -> int:
    from data.benchmarks.registry import list_benchmarks, load_requests

    print(f"{'benchmark':<18} {'requests':>8}  {'max_new':>7}  source")
    for info in list_benchmarks():
        try:
            count = str(len(load_requests(info.name)))
        except OilbirdError as e:
            count = "n/a"
            print(f"  ({info.name}: {e})", file=sys.stderr)
        print(f"{info.name:<18} {count:>8}  {info.max_new_tokens:>7}  {info.source}")
    print("jsonl:PATH          your own traffic: one {\"id\", \"messages\"|\"prompt\", \"reference\"?, \"tenant\"?} per line")
    return 0


def _limit(bench: str, text: str | None) -> int | None:
    """--limit: a count, or `grid` (the grid's limit for this benchmark, said on stderr)."""
    if text is None:
        return None
    if text == "grid":
        from data.benchmarks.registry import grid_limit, grid_limit_note

        print(grid_limit_note(bench) + " (--limit grid)", file=sys.stderr)
        return grid_limit(bench)
    try:
        return int(text)  # load_requests refuses one below 1
    except ValueError:
        raise OilbirdError(f"--limit must be a positive number of requests or 'grid' (got {text!r})") from None


def _cmd_capture(args) -> int:
    from data.benchmarks.jsonl import line_bound
    from data.capture.run import CaptureConfig, capture
    from data.store.layout import check_writable, model_slug, store_dir

    # before the model loads: a --model or --bench that would leave its folder, and an --out that cannot
    # be written (a file, /proc, immutable), each end in one line here, not in a traceback after the work
    check_writable(store_dir(args.out, args.bench, model_slug(args.model)))
    limit = _limit(args.bench, args.limit)
    cfg = CaptureConfig(bench=args.bench, model=args.model, limit=limit, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, mode=args.mode, out=args.out, force=args.force,
                        dtype=args.dtype, device=args.device, layer=args.layer, progress=not args.quiet,
                        truncate=args.truncate, flush_every=args.flush_every,
                        prefix_cache=args.prefix_cache, prefix_cache_mb=args.prefix_cache_mb,
                        prefix_reuse=args.prefix_cache > 0, engine=args.engine, vllm_eager=args.vllm_eager,
                        agree_with=args.agree_with)
    if args.ray is not None:  # one store per shard, over Ray actors (data/capture/ray_capture.py)
        from data.capture.ray_capture import capture_on_ray
        from data.raycluster import parse_ray

        print(capture_on_ray(cfg, parse_ray(args.ray), args.workers, args.max_line_bytes))
        return 0
    if args.workers is not None:
        raise OilbirdError("--workers sets the number of Ray actors: it needs --ray auto|local:N|ADDRESS")
    with line_bound(args.max_line_bytes):
        path = capture(cfg)
    print(path)
    return 0


def _cmd_show(args) -> int:
    from data.store.sampling import sampling_line
    from data.store.storeset import open_store_or_set

    st = open_store_or_set(args.path, load_hidden=False)
    lens = st.requests["output_tokens"].list.len()
    print(f"{st.path}: {st.meta['bench']} / {st.meta['model']} ({st.meta['mode']}), layer {st.meta['layer']} "
          f"of {st.meta['n_layers']}, d_model {st.meta['d_model']}")
    print(f"requests {st.n_requests}, generated tokens {int(lens.sum())}, mean {lens.mean():.1f}, "
          f"max {lens.max()}; stop reasons {dict(st.requests['stop_reason'].value_counts().iter_rows())}")
    store_set = st.meta.get("store_set")
    if store_set:  # data/store/storeset.py
        print(f"store set of {len(store_set['members'])} stores, fingerprint {st.fingerprint}; "
              + (store_set["note"] or "one stream in the order requests finished (finished_at)"))
    print(tenant_line(st.requests["tenant"].to_list()))
    print(sampling_line(st.requests))  # how the tokens were chosen (data/store/sampling.py)
    if st.verified:
        files = len(st.meta.get("checksums") or {}) or "every member's"  # a set's meta holds no checksums
        print(f"checksums: verified ({files} files); `python -m data verify` checks the values too")
    else:
        print("checksums: none recorded (a store written before checksums): unverified")
    runs = st.meta.get("runs") or []
    if len(runs) > 1 or st.meta.get("truncated"):
        widths = sorted({str(r.get("batch_size")) for r in runs})
        print(f"captured in {len(runs)} run(s), batch sizes {', '.join(widths)}; "
              f"{len(st.meta.get('truncated') or {})} prompt(s) truncated from the left")
    print(reuse_line(st.meta, st.requests["prompt_tokens"].list.len().to_list()))
    return 0


def tenant_line(tenants: list[str]) -> str:
    """How many tenants the requests belong to, and with several, the requests of each (first seen first)."""
    counts: dict[str, int] = {}
    for t in tenants:
        counts[t] = counts.get(t, 0) + 1
    if len(counts) <= 1:
        name = next(iter(counts), "")
        return f"tenants 1 ({repr(name) if name else 'the default tenant'})"
    return f"tenants {len(counts)}: " + ", ".join(f"{t!r} {n}" for t, n in counts.items())


def reuse_line(meta: dict, prompt_lengths: list[int]) -> str:
    """The share of prompt tokens whose KV came from an earlier request (meta.json prompt_tokens_reused)."""
    reused = meta.get("prompt_tokens_reused")
    if not isinstance(reused, list) or not reused:
        return "prompt tokens reused: not recorded (a store captured before the per-request record)"
    known = [(int(r), int(n)) for r, n in zip(reused, prompt_lengths) if r is not None]
    if not known:
        return "prompt tokens reused: not recorded for any request"
    got, total = sum(r for r, _ in known), sum(n for _, n in known)
    line = (f"prompt tokens reused: {got} of {total} ({100.0 * got / max(1, total):.1f}%; computed "
            f"{total - got}), {sum(r > 0 for r, _ in known)} of {len(known)} requests reused an earlier prefix")
    if len(known) < len(prompt_lengths):
        line += f"; {len(prompt_lengths) - len(known)} request(s) captured before the record"
    return line


def _cmd_verify(args) -> int:
    from data.store.storeset import verify_store_or_set  # a store, or a store set: every member, then the set

    print(verify_store_or_set(args.path))
    return 0


def _cmd_migrate(args) -> int:
    from data.store.migrate import migrate_store

    print(migrate_store(args.path))
    return 0


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data", description="Oilbird data: benchmarks, models, trace capture")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="benchmarks with request counts and sources").set_defaults(fn=_cmd_list)
    c = sub.add_parser("capture", help="greedy-decode a benchmark into a trace store (resumes if interrupted)")
    c.add_argument("--bench", required=True, help="benchmark name (python -m data list) or jsonl:PATH")
    c.add_argument("--model", default="smollm2-135m", help="HF id, local dir, or alias smollm2-135m | stories260k")
    c.add_argument("--limit", default=None,
                   help="first N requests only; `grid`: the cross-benchmark grid's limit for this benchmark "
                        "(data/benchmarks/registry.py GRID_LIMITS, sized for 20 min of capture on 2 cores)")
    c.add_argument("--max-new-tokens", type=int, default=None, help="token cap (default: per benchmark)")
    c.add_argument("--batch-size", type=int, default=1, help="rows decoded together (default 1; the make targets use 32)")
    c.add_argument("--mode", choices=["generate", "reference"], default="generate")
    c.add_argument("--out", default=RUNS, help=f"output root (default {RUNS}/)")
    c.add_argument("--force", action="store_true", help="overwrite a store made with other settings")
    c.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default fp32 CPU, bf16 CUDA)")
    c.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    c.add_argument("--layer", type=int, default=None, help="capture layer, 1-based (default round(0.85 L))")
    c.add_argument("--truncate", choices=["left"], default=None,
                   help="left: a prompt that does not fit the model's context with --max-new-tokens keeps its most "
                        "recent tokens (recorded in meta.json); default: refuse a prompt longer than the context")
    c.add_argument("--flush-every", type=int, default=8,
                   help="requests per positions part, the resume granularity (default 8)")
    c.add_argument("--prefix-cache", type=int, default=4,
                   help="reference mode: KV entries of earlier requests kept for prefix reuse (LRU, default 4); "
                        "0 = off: one full forward per request, as before (in generate mode 0 turns off the "
                        "previous prompt's reuse)")
    c.add_argument("--prefix-cache-mb", type=float, default=1024.0,
                   help="reference mode: bound on the prefix cache's KV memory in MB (default 1024)")
    c.add_argument("--engine", choices=["harness", "vllm"], default="harness",
                   help="harness (default: this package's decoding loop) or vllm (capture by serving; docs/vllm.md)")
    c.add_argument("--vllm-eager", action="store_true",
                   help="with --engine vllm: serve in eager mode (enforce_eager) instead of vLLM's default compilation")
    c.add_argument("--agree-with", default=None, metavar="STORE",
                   help="a store of the same requests by the other engine: identical requests, first divergence "
                        "and state cosine go into this store's meta.json 'agreement' (data/capture/agreement.py)")
    c.add_argument("--ray", default=None, metavar="auto|local:N|ADDRESS",
                   help="capture over Ray actors, one engine each, into a store set (one store per shard, requests "
                        "split round robin; each shard resumes on a rerun): a running cluster or a local one (auto), "
                        "a local one with N CPUs, or a cluster's HOST:PORT / ray://HOST:PORT (docs/capture.md)")
    c.add_argument("--workers", type=int, default=None,
                   help="with --ray: the number of shards and actors (default: the set's own on a rerun, else one "
                        "per GPU of the cluster, or per CPU without GPUs)")
    c.add_argument("--max-line-bytes", default=None, metavar="N", help=MAX_LINE_HELP)
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(fn=_cmd_capture)
    s = sub.add_parser("show", help="summarise a trace store (or a store set: one stream)")
    s.add_argument("path")
    s.set_defaults(fn=_cmd_show)
    v = sub.add_parser("verify", help="full integrity check of a trace store: checksums, schema, prompt hashes, "
                                      "row counts, values; prints OK or the first problem. A store set (a folder "
                                      "of stores, or store folders comma-separated) checks every member, then "
                                      "that they combine")
    v.add_argument("path")
    v.set_defaults(fn=_cmd_verify)
    m = sub.add_parser("migrate", help="rewrite a trace store of an older layout (store format 1: null state rows, "
                                       "unreadable by pyarrow < 26) in the current one, atomically; verifies it "
                                       "first, and a store already current is left as it is")
    m.add_argument("path")
    m.set_defaults(fn=_cmd_migrate)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
