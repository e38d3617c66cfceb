"""`make bench-vllm BENCH=apibank [LIMIT=48] [MAX_NEW=256] [BATCH=1,8] [K=8] [ROUNDS=3]`: Oilbird inside vLLM,
side by side with vLLM's own methods, on the same requests.

Arms, each in its own process (`python -m decoder vllm-run`, one engine; vLLM's metrics are process-wide):
  vllm-greedy           no speculation: the reference every arm must equal, and the speed baseline
  vllm-ngram            vLLM's prompt lookup at vLLM's defaults (n = 5), K draft tokens
  vllm-suffix           vLLM's suffix method (ArcticInference's SuffixDecoding) at vLLM's defaults: up to 24
                        draft tokens (--suffix-k; vLLM's default when num_speculative_tokens is unset, the tree
                        depth), each kept only above min_token_prob 0.1
  oilbird-no-semantic   decoder/vllm/proposer.py, the key off
  oilbird               decoder/vllm/proposer.py, the key on
The Oilbird arms draft the cost-aware chain: up to --oilbird-k tokens (32), cut per row and step where the
expected tokens per second stop growing, priced on the vLLM profile (--profile, default `make census`'s
runs/profiles/<model>-cpu-vllm.json; without one every chain runs to --oilbird-k), at each batch size B the
profile measured as `<arm>@batch=B` (sized by that batch's step cost).
Every arm runs at vLLM's default compilation (dynamo + inductor on a CPU; what vLLM serves with); with --eager
(`make bench-vllm EAGER=1`) each also runs in eager mode (enforce_eager) in the first --eager-rounds rounds (1),
right after its compiled run; each row names its mode, and its speedups are over vllm-greedy in the same mode.
One engine per (arm, batch size, round, mode), each in a fresh process: an engine that had served the requests
once would serve them again with their prefills in its prefix cache and, for `suffix`, their own earlier answers
in its response tree (measured: `suffix` at batch 1 ran 150 tok/s after the same engine had served them at batch
8, 58 tok/s fresh), so no engine serves two batch sizes.
Requests: the first LIMIT of the store (`runs/<bench>/<model>/traces`, captured first when missing), their
prompts as the store's token ids, greedy, at most MAX_NEW new tokens. Per batch size B the requests run in
waves of B. Per round, every (batch, arm) pair runs once, the arms' order rotated each round; rows give the
median over the rounds and its range (min-max).

Written to runs/<bench>/<model>/vllm/summary.json (atomically, after every arm), per arm and batch size:
mode, requests, generated_tokens, wall_s, tok_s, speedup_vs_ar (tok/s over vllm-greedy's at the same batch size,
same round, same mode), vs_suffix (the same over vllm-suffix's), mean_acceptance_length (vLLM's counters: 1 + accepted / drafts), identical_to_ar (requests whose
tokens equal vllm-greedy's), and for the Oilbird arms replay_mean_acceptance_length: the replay of the same
chain arm (`<arm>@chain=K`) over the store's first LIMIT requests, pool past, counted as vLLM counts
(passes that verified no draft left out). `agreement_with_store` says how many of vllm-greedy's outputs equal
the store's (our harness's capture) and where the others first diverge: the replay predicts vLLM's acceptance
exactly only on the requests both engines decode alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from data.capture.models import resolve_model
from data.capture.vllm_engine import require_vllm
from data.errors import OilbirdError, cli_entry
from data.readfile import read_json
from data.store.files import atomic_write_json
from data.store.layout import model_slug, store_dir
from data.store.reader import open_store

ARMS = ("vllm-greedy", "vllm-ngram", "vllm-suffix", "oilbird-no-semantic", "oilbird")
REPO = Path(__file__).resolve().parents[1]


def replay_acceptance(arm: str, traces, k: int, nodes: int, vocab: int, cost=None) -> dict:
    """The replay of `arm@chain=k` over `traces` (pool past), sized by `cost` (the profile the arm runs with),
    counted as vLLM counts acceptance."""
    from decoder.pools import PoolSettings
    from decoder.replay.run import replay_arm

    name = f"{arm}{':' if '@' in arm else '@'}chain={k}"
    run = replay_arm(name, traces, nodes, "past", vocab, settings=PoolSettings(knn_recall_every=0, step_cost=cost))
    cycles = [c for cs in run.cycles for c in cs]
    drafted = [c for c in cycles if c.nodes > 0]
    return {"arm": name, "passes": len(cycles), "passes_with_draft": len(drafted),
            "mean_draft_tokens": round(sum(c.nodes for c in cycles) / len(cycles), 4),
            "tau": round(sum(c.committed for c in cycles) / len(cycles), 4),
            "mean_acceptance_length": round(1 + sum(c.accepted for c in drafted) / len(drafted), 4) if drafted else None}


def agreement(outputs: list[list[int]], traces) -> dict:
    """vLLM greedy against the store's tokens (our harness's greedy), request by request."""
    same, first = 0, []
    for out, tr in zip(outputs, traces):
        ref = list(tr.tokens)
        n = min(len(out), len(ref))
        div = next((i for i in range(n) if out[i] != ref[i]), None)
        if div is None and len(out) == len(ref):
            same += 1
        else:
            first.append(div if div is not None else n)
    return {"requests": len(outputs), "identical": same,
            "first_divergence": {"median": float(np.median(first)) if first else None, "positions": first}}


def run_one(model_dir: str, prompts: Path, arm: str, batch: int | list[int], k: int, max_new: int, nodes: int,
            out: Path, profile: str = "", mode: str = "compiled") -> dict:
    """One engine (`vllm-run`, its own process) of `arm` serving the prompts at each batch size of `batch` in turn."""
    batches = [batch] if isinstance(batch, int) else list(batch)
    batch = ",".join(map(str, batches))
    cmd = [sys.executable, "-m", "decoder", "vllm-run", "--model", model_dir, "--prompts", str(prompts),
           "--arm", arm, "--batch", batch, "--k", str(k), "--max-new", str(max_new), "--nodes", str(nodes),
           "--out", str(out), *(["--profile", profile] if profile else []), *(["--eager"] if mode == "eager" else [])]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise OilbirdError(f"{arm} at batch {batch} ({mode}) failed: {tail[0]}")
    return read_json(out, f"vllm-run result of {arm} at batch {batch} ({mode})")


@cli_entry
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_vllm.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="apibank")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="runs")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--k", type=int, default=8, help="vllm-ngram's draft tokens per row and step (default 8)")
    ap.add_argument("--suffix-k", type=int, default=24, help="vllm-suffix's most draft tokens (default 24, vLLM's)")
    ap.add_argument("--oilbird-k", type=int, default=32, help="the Oilbird arms' longest chain (default 32)")
    ap.add_argument("--profile", default=None, help="the vLLM profile that sizes the Oilbird chains (default: "
                                                    "runs/profiles/<model>-cpu-vllm.json when it exists; none: flat)")
    ap.add_argument("--nodes", type=int, default=60, help="the Oilbird tree's node budget before its best chain")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true",
                    help="also run every arm in vLLM's eager mode (enforce_eager), in the same rounds (default: "
                         "vLLM's default compilation only)")
    ap.add_argument("--eager-rounds", type=int, default=1,
                    help="with --eager: the eager runs in the first N rounds only (default 1)")
    a = ap.parse_args(argv)
    try:
        batches = [int(b) for b in a.batch.split(",") if b.strip()]
    except ValueError:
        raise OilbirdError(f"--batch {a.batch!r}: write batch sizes as 1,8") from None
    arms = [x for x in a.arms.split(",") if x]
    if "vllm-greedy" not in arms:
        raise OilbirdError("--arms must include vllm-greedy (the reference and the speed baseline)")
    if min(batches + [a.limit, a.max_new, a.k, a.suffix_k, a.oilbird_k, a.rounds, a.eager_rounds]) < 1:
        raise OilbirdError("--batch, --limit, --max-new, --k, --suffix-k, --oilbird-k, --rounds and --eager-rounds "
                           "must be at least 1")
    require_vllm()
    slug = model_slug(a.model)
    path = store_dir(a.out, a.bench, slug)
    if not (path / "meta.json").exists():
        raise OilbirdError(f"no trace store at {path}: `make bench-vllm` captures first, or run "
                           f"python -m data capture --bench {a.bench} --model {a.model}")
    from decoder.replay.traces import load_traces

    store = open_store(path)
    traces = load_traces(store, a.limit, a.max_new)
    vocab = int(store.meta.get("vocab_size") or 0) or int(max(max(t.tokens) for t in traces) + 1)
    model_dir = resolve_model(a.model)
    from decoder.cost.profile import profile_path
    from decoder.vllm.proposer import load_step_cost

    profile = a.profile if a.profile is not None else str(profile_path(a.out, slug, "cpu", "vllm"))
    if a.profile is None and not Path(profile).exists():
        print(f"note: no vLLM profile at {profile}: the Oilbird chains run to {a.oilbird_k} tokens (a flat cost)",
              file=sys.stderr)
        profile = ""
    cost = load_step_cost(profile, "oilbird")  # an unreadable one: one line, before any engine starts

    def run_name(arm: str, batch: int) -> str:
        """An Oilbird arm at batch B is sized for B's step cost when the profile measured it."""
        if arm.startswith("oilbird") and cost is not None and batch in cost.by_batch:
            return f"{arm}@batch={batch}"
        return arm

    def k_of(arm: str) -> int:
        return {"vllm-suffix": a.suffix_k, "vllm-ngram": a.k}.get(arm, a.oilbird_k)
    out_dir = path.parent / "vllm"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    summary = {"kind": "bench-vllm", "bench": a.bench, "model": a.model, "store": str(path),
               "store_fingerprint": store.fingerprint,
               "device": {"type": "cpu", "cores": os.cpu_count(), "machine": platform.machine()},
               "settings": {"limit": len(traces), "max_new": a.max_new, "batches": batches, "k": a.k,
                            "suffix_k": a.suffix_k, "oilbird_k": a.oilbird_k, "profile": profile or None,
                            "nodes": a.nodes, "arms": arms, "rounds": a.rounds, "dtype": "float32",
                            "prefix_caching": True, "modes": ["compiled", "eager"] if a.eager else ["compiled"],
                            "eager_rounds": min(a.eager_rounds, a.rounds) if a.eager else 0},
               "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "complete": False, "rows": [], "replay": {}, "agreement_with_store": None}
    for arm in arms:
        if arm.startswith("oilbird") or arm.startswith("semantic"):
            for batch in batches:
                name = run_name(arm, batch)
                if name not in summary["replay"]:
                    summary["replay"][name] = replay_acceptance(name, traces, a.oilbird_k, a.nodes, vocab, cost)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps([list(map(int, t.prompt)) for t in traces]))
        runs: dict[tuple[int, int, str, str], dict] = {}
        for rnd in range(a.rounds):
            modes = ["compiled"] + (["eager"] if a.eager and rnd < a.eager_rounds else [])
            for batch in batches:
                order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
                for arm in order:
                    for mode in modes:
                        t0 = time.perf_counter()
                        r = run_one(model_dir, prompts, run_name(arm, batch), batch, k_of(arm), a.max_new, a.nodes,
                                    Path(tmp) / f"{arm}-{batch}-{rnd}-{mode}.json", profile, mode)
                        runs[(rnd, batch, arm, mode)] = r
                        print(f"round {rnd + 1} batch {batch} {arm} ({mode}): {r['tok_s']} tok/s, "
                              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                        summary["rows"] = rows_of(runs, summary["replay"], run_name)
                        summary["runs"] = [{"round": q + 1, "batch": b, "arm": x, "mode": m, "tok_s": v["tok_s"],
                                            "wall_s": v["wall_s"], "load_s": v["load_s"]}
                                           for (q, b, x, m), v in sorted(runs.items())]
                        ref = runs.get((0, batches[0], "vllm-greedy", "compiled"))
                        if ref is not None:
                            summary["agreement_with_store"] = agreement(ref["outputs"], traces)
                        atomic_write_json(summary_path, summary)
    summary["complete"] = True
    summary["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    atomic_write_json(summary_path, summary)
    print(format_rows(summary["rows"], a.rounds))
    print(summary_path)
    return 0


def format_rows(rows: list[dict], rounds: int) -> str:
    """The table the bench prints: per batch, arm and vLLM mode, tok/s, its speedup over vllm-greedy in the same
    mode and its ratio to vllm-suffix in the same mode, medians over the rounds with their range, the acceptance
    length and how many requests equal vllm-greedy's (compiled)."""
    lines = [f"{'batch':>5} {'arm':<28} {'mode':<8} {'rounds':>6} {'tok/s median [range]':>24} "
             f"{'x greedy [range]':>22} {'x suffix [range]':>22} {'accept len':>10} {'= greedy':>9}"
             f"   (arms interleaved over {rounds} round(s))"]

    def ratio(v, rng):
        return f"{v:.3f} [{rng[0]:.3f}-{rng[1]:.3f}]" if v is not None else "n/a"

    for r in rows:
        lo, hi = r["tok_s_range"]
        acc = r.get("mean_acceptance_length")
        lines.append(f"{r['batch']:>5} {r['ran_as']:<28} {r['mode']:<8} {r['rounds']:>6} {r['tok_s']:>9.1f} "
                     f"[{lo:.1f}-{hi:.1f}]{'':>2} {ratio(r.get('speedup_vs_ar'), r.get('speedup_range')):>22} "
                     f"{ratio(r.get('vs_suffix'), r.get('vs_suffix_range')):>22} "
                     f"{acc if acc is None else round(acc, 2)!s:>10} {r['identical_to_ar']!s:>4}/{r['requests']}")
    return "\n".join(lines)


def _ratios(runs: dict, batch: int, arm: str, mode: str, base: str) -> list[float]:
    """tok/s of `arm` over `base`'s in the same round, batch size and mode, one per round both ran."""
    return [v["tok_s"] / runs[(q, b, base, m)]["tok_s"] for (q, b, x, m), v in runs.items()
            if b == batch and x == arm and m == mode and (q, b, base, m) in runs and runs[(q, b, base, m)]["tok_s"]]


def rows_of(runs: dict, replay: dict, run_name=lambda arm, batch: arm) -> list[dict]:
    """One row per (arm, batch, mode): figures of its first round, speeds as medians over its rounds with their
    range; `identical_to_ar` against vllm-greedy's compiled outputs (every mode must equal them)."""
    rows = []
    seen = set()
    for (rnd, batch, arm, mode), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3], kv[0][0])):
        if (batch, arm, mode) in seen:
            continue
        seen.add((batch, arm, mode))
        rounds = [v for (q, b, x, m), v in runs.items() if b == batch and x == arm and m == mode]
        ratios = _ratios(runs, batch, arm, mode, "vllm-greedy")
        vs_suffix = _ratios(runs, batch, arm, mode, "vllm-suffix") if arm != "vllm-suffix" else []
        greedy = next((v for (q, b, x, m), v in sorted(runs.items()) if b == batch and x == "vllm-greedy"
                       and m == "compiled"), None)
        identical = (sum(o == g for o, g in zip(r["outputs"], greedy["outputs"])) if greedy else None)
        row = {"arm": arm, "batch": batch, "mode": mode, "requests": r["requests"],
               "generated_tokens": r["generated_tokens"],
               "wall_s": float(np.median([v["wall_s"] for v in rounds])),
               "tok_s": float(np.median([v["tok_s"] for v in rounds])),
               "tok_s_range": [min(v["tok_s"] for v in rounds), max(v["tok_s"] for v in rounds)],
               "speedup_vs_ar": round(float(np.median(ratios)), 4) if ratios else None,
               "speedup_range": [round(min(ratios), 4), round(max(ratios), 4)] if ratios else None,
               "vs_suffix": round(float(np.median(vs_suffix)), 4) if vs_suffix else None,
               "vs_suffix_range": [round(min(vs_suffix), 4), round(max(vs_suffix), 4)] if vs_suffix else None,
               "ran_as": run_name(arm, batch), "k": r.get("k"),
               "mean_acceptance_length": r["spec"]["mean_acceptance_length"], "identical_to_ar": identical,
               "identical_every_round": all(sum(o == g for o, g in zip(v["outputs"], greedy["outputs"]))
                                            == len(greedy["outputs"]) for v in rounds) if greedy else None,
               "rounds": len(rounds), "load_s": r["load_s"]}
        rp = replay.get(run_name(arm, batch))
        if rp is not None:
            row["replay_mean_acceptance_length"] = rp["mean_acceptance_length"]
            if row["mean_acceptance_length"] and rp["mean_acceptance_length"]:
                row["acceptance_vs_replay"] = round(row["mean_acceptance_length"] / rp["mean_acceptance_length"], 4)
        if r.get("proposer"):
            p = r["proposer"]
            row["proposer"] = {key: p.get(key) for key in ("unaligned_steps", "unverified_rows", "untapped_steps",
                                                           "draft_s", "steps")}
            row["proposer"]["key_queries"] = (p.get("drafter") or {}).get("key_queries")
            row["proposer"]["pool_states"] = (p.get("drafter") or {}).get("pool_states")
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
