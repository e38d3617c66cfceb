"""Capture: a benchmark decoded request by request into a trace store (data/store/writer.py).

`capture` loads the requests and the model, fits every prompt to the context before writing
anything, then decodes in serving order, greedily (data/capture/greedy.py, `--mode generate`) or
teacher-forced over the benchmark's references (data/capture/teacher.py, `--mode reference`), and commits
every `flush_every` requests, so an interrupted capture resumes where its last commit left off.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data.benchmarks.registry import get_benchmark, load_requests
from data.benchmarks.request import Request, data_fingerprint
from data.capture.greedy import (
    Generated,
    PrefixCache,
    context_cap,
    context_note,
    greedy_stream,
)
from data.capture.models import LayerTap, LoadedModel, encode_prompt, load_model
from data.capture.store_model import recorded_name
from data.capture.teacher import (
    ReferencePrefixCache,
    reference_tokens,
    teacher_forced,
    teacher_forced_cached,
)
from data.capture.traffic import TrafficChange, note_extension, refuse_changed, traffic_change
from data.errors import OilbirdError
from data.store.layout import RUNS, SHARD_DIR, shard_name, store_dir
from data.store.sampling import GREEDY, REFERENCE
from data.store.schema import PROMPT_HASH_SCHEME, prompt_hash
from data.store.storeset import folder_stores
from data.store.writer import StoreWriter, TraceRecord
from data.versions import library_versions

ENGINES = ("harness", "vllm")


@dataclass
class CaptureConfig:
    bench: str
    model: str = "smollm2-135m"
    limit: int | None = None  # first N requests in serving order; None = all
    max_new_tokens: int | None = None  # None = the benchmark's default (1024; HumanEval 512; ClassEval 2048)
    batch_size: int = 1  # rows decoded together (continuous batching); tokens equal batch-1 greedy (tested)
    mode: str = "generate"  # generate | reference (teacher-forced over the benchmark's reference)
    out: str = RUNS
    force: bool = False  # overwrite a store made with other settings
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    device: str | None = None
    layer: int | None = None  # default round(0.85 L)
    flush_every: int = 8  # requests per positions part file (the resume granularity)
    truncate: str | None = None  # None: refuse a prompt longer than the context; "left": keep its last tokens
    prefix_reuse: bool = True  # reuse the previous prompt's KV for a shared start (tested equal)
    prefix_cache: int = 4  # reference mode: KV entries kept (LRU) for prefix reuse; 0 = off (one full forward each)
    prefix_cache_mb: float = 1024.0  # reference mode: bound on the entries' KV bytes
    progress: bool = True
    engine: str = "harness"  # harness (this package's transformers loop) | vllm (capture by serving: data/capture/vllm_capture.py)
    agree_with: str | None = None  # a store of the same requests (the other engine's): their agreement goes into
    #                                meta.json "agreement" (data/capture/agreement.py) when the capture ends
    vllm_eager: bool = False  # --engine vllm: eager mode (enforce_eager) instead of vLLM's default compilation
    shard: tuple[int, int] | None = None  # (index, of): only requests index, index + of, ... (round robin), into
    #                                       <store>/shard-<index>, one store of a set (data/capture/ray_capture.py)


def fit_prompts(lm: LoadedModel, requests: list[Request], max_new: int, truncate: str | None,
                outputs: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, int]]:
    """Every request's prompt tokens, checked against the model's context before anything is
    written. A prompt longer than the context is refused; with truncate="left" a prompt that
    does not leave room for max_new tokens keeps its most recent tokens (and its BOS, if any).
    With `outputs` (reference mode: each request's reference tokens) the room a prompt must leave
    is its own reference's length, and prompt + reference longer than the context is refused
    (or, with truncate="left", the prompt is cut so that both fit).
    In generate mode a prompt that fits but leaves less room than max_new decodes up to the
    context only (data/capture/greedy.py `context_cap`), said in one note.
    Returns the prompts and {request id: original length} of the truncated ones."""
    prompts, truncated = [], {}
    ctx = lm.context
    bos = getattr(lm.tokenizer, "bos_token_id", None)
    for i, req in enumerate(requests):
        try:
            p = encode_prompt(lm, req.messages, f"request {i} (id {req.id!r})")
        except UnicodeEncodeError as e:  # a lone surrogate (e.g. "\\ud800") is not encodable text
            raise OilbirdError(f"request {req.id}: its text is not valid Unicode ({e.reason}: "
                               f"{e.object[e.start:e.end]!a})") from None
        room = max_new if outputs is None else len(outputs[i])
        if ctx and truncate == "left" and len(p) + room > ctx:
            head = p[:1] if bos is not None and p and p[0] == bos else []
            keep = ctx - room - len(head)
            if keep < 1:
                if outputs is not None:
                    raise OilbirdError(f"--truncate left: request {req.id}'s reference is {room} tokens (with EOS), "
                                       f"leaving no room for its prompt in the model's context of {ctx} positions")
                raise OilbirdError(f"--truncate left: --max-new-tokens {max_new} leaves no room for request "
                                   f"{req.id}'s prompt in the model's context of {ctx} positions")
            truncated[req.id] = len(p)
            p = head + p[len(p) - keep:]
        elif ctx and outputs is not None and len(p) + room > ctx:
            raise OilbirdError(f"request {req.id}: the prompt is {len(p)} tokens and its reference {room} (with EOS), "
                               f"{len(p) + room} positions, more than the model's context of {ctx} positions; "
                               "pass --truncate left to keep the prompt's most recent tokens")
        elif ctx and len(p) > ctx:
            raise OilbirdError(f"request {req.id}: the prompt is {len(p)} tokens, longer than the model's context "
                               f"of {ctx} positions; pass --truncate left to keep its most recent tokens")
        prompts.append(p)
    cut = sum(context_cap(max_new, len(p), ctx) < max_new for p in prompts) if outputs is None else 0
    if cut:  # decoding stops at the context (data/capture/greedy.py; vLLM's own rule): said once, not refused
        print(context_note(cut, max_new, ctx), file=sys.stderr)
    if truncated:
        room_text = "their references" if outputs is not None else f"--max-new-tokens {max_new}"
        print(f"note: truncated {len(truncated)} prompt(s) from the left to fit {ctx} positions with "
              f"{room_text} (meta.json \"truncated\" lists their original lengths)", file=sys.stderr)
    return prompts, truncated


def _check_committed(path, writer: StoreWriter, requests: list[Request]) -> None:
    """The requests a resumed store already holds are the traffic's first ones, tenant included
    (data_fingerprint in meta.json catches a change of the traffic; this names the request)."""
    done = writer.requests
    if not done.num_rows:
        return
    ids = done.column("id").to_pylist()
    tenants = done.column("tenant").to_pylist()
    for r, (rid, tenant) in enumerate(zip(ids, tenants)):
        if r >= len(requests):
            break
        req = requests[r]
        if rid != req.id or tenant != req.tenant:
            raise OilbirdError(f"trace store {path} holds request {r} as id {rid!r} of tenant {tenant!r}, but the "
                               f"traffic has id {req.id!r} of tenant {req.tenant!r}: the store was made from other "
                               "traffic; pass --force to overwrite it or --out for another folder")


def set_members(path: Path) -> list[str]:
    """The shard stores a store set's folder holds (`capture --ray`), by name."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if SHARD_DIR.fullmatch(p.name) and (p / "meta.json").is_file())


def check_store_folder(path: Path, sharded: bool) -> None:
    """One folder is one store or one set, never both: a one-store capture into a set's folder (any set:
    Ray's shards or stores placed by hand, data/store/storeset.py) would put a meta.json beside its members, and
    the folder would read as that one store; a set's shards into a store's folder would sit inside that store;
    Ray's shards beside stores placed by hand would mix two splits in one set."""
    members, stores = set_members(path), [m.name for m in folder_stores(path)]
    named = ", ".join(stores[:3]) + (", ..." if len(stores) > 3 else "")
    if not sharded and members and len(members) == len(stores):
        raise OilbirdError(f"{path} holds a store set captured on Ray ({len(members)} shard stores, {members[0]} ...): "
                           "capture it with --ray again (each shard resumes), or pass --out for another folder")
    if not sharded and stores:
        raise OilbirdError(f"{path} holds a store set ({len(stores)} stores: {named}): a one-store capture would write "
                           "a store beside its members, and the folder would then read as that one store; pass --out "
                           "for another folder")
    if sharded and (path / "meta.json").exists():
        raise OilbirdError(f"{path} holds one trace store, not a store set: --ray writes its shard stores where no "
                           "store is; pass --out for another folder")
    if sharded and len(stores) > len(members):
        raise OilbirdError(f"{path} holds a store set of stores not captured with --ray ({named}): --ray writes its "
                           "shard stores only beside its own; pass --out for another folder")


def check_config(cfg: CaptureConfig) -> None:
    """The settings a capture refuses before it loads anything (one line each)."""
    if cfg.mode not in ("generate", "reference"):
        raise OilbirdError(f"unknown mode '{cfg.mode}'; use generate or reference")
    if cfg.batch_size < 1:
        raise OilbirdError("--batch-size must be at least 1")
    if cfg.flush_every < 1:
        raise OilbirdError("--flush-every must be at least 1")
    if cfg.engine not in ENGINES:
        raise OilbirdError(f"unknown --engine '{cfg.engine}'; use {' or '.join(ENGINES)}")
    if cfg.vllm_eager and cfg.engine != "vllm":
        raise OilbirdError("--vllm-eager sets vLLM's mode: it needs --engine vllm")
    if cfg.engine == "vllm" and cfg.mode != "generate":
        raise OilbirdError("--engine vllm captures by serving (--mode generate); teacher forcing runs in the harness")
    if cfg.engine == "vllm":
        from data.capture.vllm_engine import require_vllm

        require_vllm()
    if cfg.truncate not in (None, "left"):
        raise OilbirdError(f"unknown --truncate '{cfg.truncate}'; use left")
    if cfg.agree_with and not (Path(cfg.agree_with) / "meta.json").is_file():
        raise OilbirdError(f"--agree-with {cfg.agree_with}: no trace store there (meta.json missing)")
    if cfg.prefix_cache < 0:
        raise OilbirdError("--prefix-cache must be 0 (off) or more entries")
    if not cfg.prefix_cache_mb > 0:
        raise OilbirdError("--prefix-cache-mb must be positive")


def store_meta(cfg: CaptureConfig, lm: LoadedModel, info, max_new: int, every_request: list[Request]) -> dict:
    """meta.json of a new store (StoreWriter keeps an existing store's, after checking its SETTINGS)."""
    return {
        # a folder by its resolved path, so the same model matches from any working directory
        "model": recorded_name(lm.name), "model_path": recorded_name(lm.path), "model_fingerprint": lm.fingerprint,
        "layer": lm.layer,
        "n_layers": lm.n_layers, "d_model": lm.d_model, "vocab_size": lm.vocab_size,
        "dtype": str(lm.dtype).removeprefix("torch."), "device": lm.device.type,
        "tokenizer_hash": lm.tokenizer_hash, "chat_template_hash": lm.chat_template_hash,
        "bench": cfg.bench, "data_fingerprint": data_fingerprint(every_request), "requests_total": len(every_request),
        "mode": cfg.mode, "max_new_tokens": max_new, "stop_strings": list(info.stop_strings),
        "truncate": cfg.truncate, "prompt_hash_scheme": PROMPT_HASH_SCHEME, "engine": cfg.engine,
        "versions": library_versions(),
        **({"shard": {"index": cfg.shard[0], "of": cfg.shard[1], "split": "round-robin"}} if cfg.shard else {}),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@dataclass
class _Commits:
    """The meta.json fields that describe the committed requests. They travel with each commit
    (StoreWriter.append's meta), so they stay aligned with the rows through a kill and a resume."""

    truncated: dict[str, int]  # of the committed requests: id -> the prompt's original length
    reused: list  # per committed request, the prompt tokens whose KV was reused (None: captured before it was recorded)
    runs: list[dict]  # one entry per earlier capture run, so a resumed store says which batch width made which requests
    run: dict  # this run's entry

    @classmethod
    def resume(cls, writer: StoreWriter, cfg: CaptureConfig, use_prefix: bool) -> "_Commits":
        start = writer.done
        reused = list(writer.meta.get("prompt_tokens_reused") or [])[:start]
        reused += [None] * (start - len(reused))
        runs = list(writer.meta.get("runs") or ([] if not start else [
            {"batch_size": None, "requests_from": 0, "requests_to": start, "seconds": writer.meta.get("seconds_total")}]))
        run = {"batch_size": cfg.batch_size, "requests_from": start, "requests_to": start, "seconds": 0.0}
        if cfg.mode == "reference":
            run["batch_size"] = 1  # teacher-forced requests are forwarded one at a time (batching measured no gain)
            run["prefix_cache"] = cfg.prefix_cache if use_prefix else 0
        if cfg.engine == "vllm":  # which of vLLM's modes served it (the states agree: tests/test_vllm.py)
            run["vllm_mode"] = "eager" if cfg.vllm_eager else "compiled"
        return cls(dict(writer.meta.get("truncated") or {}), reused, runs, run)

    def meta(self) -> dict:
        return {"runs": self.runs + [dict(self.run)], "truncated": dict(self.truncated),
                "prompt_tokens_reused": list(self.reused)}


def _generations(cfg: CaptureConfig, lm: LoadedModel, tap: LayerTap, prompts: list[list[int]],
                 refs: list[list[int]] | None, max_new: int, stop_strings: tuple[str, ...],
                 use_prefix: bool) -> Iterator[tuple[int, Generated]]:
    """(index in `prompts`, its generation), in completion order: greedy, or teacher-forced over `refs`."""
    if cfg.mode == "generate":
        return greedy_stream(lm, tap, prompts, max_new, stop_strings, cfg.batch_size,
                             PrefixCache() if use_prefix else None)
    if use_prefix:
        ref_cache = ReferencePrefixCache(cfg.prefix_cache, cfg.prefix_cache_mb)
        return ((k, teacher_forced_cached(lm, tap, p, o, ref_cache)) for k, (p, o) in enumerate(zip(prompts, refs)))
    # the plain path: one full forward per request, logits at every position
    return ((k, teacher_forced(lm, tap, p, o)) for k, (p, o) in enumerate(zip(prompts, refs)))


@contextlib.contextmanager
def _engine_stream(cfg: CaptureConfig, lm: LoadedModel, prompts: list[list[int]], refs, max_new: int,
                   stop_strings: tuple[str, ...], use_prefix: bool):
    """The (index, Generated) stream of the chosen engine: the harness with its layer tap, or vLLM serving
    with the trace recorder (data/capture/vllm_capture.py) in waves of max(batch size, flush_every)."""
    if cfg.engine == "harness":
        with LayerTap(lm.model, lm.layer) as tap:
            yield _generations(cfg, lm, tap, prompts, refs, max_new, stop_strings, use_prefix)
        return
    import os
    import tempfile
    from pathlib import Path

    from data.capture.vllm_capture import RECORDER_CLASS, TRACES_ENV, vllm_generations
    from data.capture.vllm_engine import EngineConfig, make_llm
    from data.capture.vllm_settings import BY_FIELD

    with tempfile.TemporaryDirectory(prefix="oilbird-vllm-") as tmp:
        os.environ[TRACES_ENV], os.environ[BY_FIELD["layer"].name] = tmp, str(lm.layer)
        llm = make_llm(EngineConfig(lm.path, dtype=str(lm.dtype).removeprefix("torch."), max_num_seqs=cfg.batch_size,
                                    prefix_caching=use_prefix, enforce_eager=cfg.vllm_eager),
                       {"method": "custom_class", "model": RECORDER_CLASS, "num_speculative_tokens": 1})
        try:
            yield vllm_generations(llm, prompts, max_new, stop_strings, max(cfg.batch_size, cfg.flush_every),
                                   Path(tmp))
        finally:
            del llm


def capture(cfg: CaptureConfig, lm: LoadedModel | None = None) -> str:
    """Capture (or resume) a trace store; returns its path."""
    check_config(cfg)
    info = get_benchmark(cfg.bench)
    requests = load_requests(cfg.bench, cfg.limit)
    if cfg.shard:  # round robin: request i is shard i % of's, so a larger --limit extends every shard at its end
        requests = requests[cfg.shard[0]::cfg.shard[1]]
    max_new = info.max_new_tokens if cfg.max_new_tokens is None else cfg.max_new_tokens  # 0 is not "default"
    if max_new < 1:
        raise OilbirdError(f"--max-new-tokens must be at least 1 (got {max_new})")
    if lm is None:
        lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, layer=cfg.layer)
    elif cfg.layer is not None and cfg.layer != lm.layer:
        raise OilbirdError(f"--layer {cfg.layer} differs from the loaded model's capture layer {lm.layer}")
    # before the store is touched: a request without a reference, or one that does not fit the context
    all_refs = [reference_tokens(lm, r) for r in requests] if cfg.mode == "reference" else None
    all_prompts, truncated = fit_prompts(lm, requests, max_new, cfg.truncate, all_refs)
    path = store_dir(cfg.out, cfg.bench, lm.slug)
    check_store_folder(path, cfg.shard is not None)
    if cfg.shard:
        path = path / shard_name(*cfg.shard)
    every_request = load_requests(cfg.bench)  # the whole benchmark: its fingerprint, and the N of "first N of M"
    meta = store_meta(cfg, lm, info, max_new, every_request)
    change = traffic_change(path, every_request, cfg.force)  # traffic grown (or edited) since the store's capture
    if change is not None:  # the writer compares the other settings; the traffic is judged here
        meta["data_fingerprint"] = change.store_fingerprint
    # the writer holds the store's lock until this block ends, however it ends (data/store/lock.py)
    with StoreWriter(path, meta, force=cfg.force) as writer:
        if change is not None:
            # a shard's rows are its own requests of the traffic (the refusal names the first that differs)
            own = every_request[cfg.shard[0]::cfg.shard[1]] if cfg.shard else every_request
            _take_grown_traffic(writer, change, own, all_prompts, all_refs, info)
        _check_committed(path, writer, requests)
        if writer.done >= len(requests):
            _finish_already_done(path, writer, cfg, len(requests), len(every_request))
        else:
            _capture_into(writer, cfg, lm, info, requests, all_prompts, all_refs, truncated, max_new,
                          len(every_request))
    if cfg.agree_with:
        from data.capture.agreement import record_agreement

        record_agreement(path, cfg.agree_with)
    return str(path)


def _take_grown_traffic(writer: StoreWriter, change: TrafficChange, every_request: list[Request],
                        prompts: list[list[int]], references: list[list[int]] | None, info) -> None:
    """Refuse traffic that is not the store's own grown at its end; for grown traffic, the store's traffic
    fields become the new traffic's with the next meta.json write (data/capture/traffic.py)."""
    source = info.source if info.name.startswith("jsonl:") else None
    if not change.extends:
        refuse_changed(writer.path, change, writer.requests, every_request, prompts, source, references)
    writer.meta.update(data_fingerprint=change.fingerprint, requests_total=change.total)
    if writer.done < len(prompts):
        note_extension(writer.path, change, writer.done)


def _finish_already_done(path: Path, writer: StoreWriter, cfg: CaptureConfig, asked: int, total: int) -> None:
    """The store already holds the requests asked for. An incomplete one is finished as it stands:
    when it holds more than asked (an extension killed, then rerun with a smaller --limit), its
    `limit` says what it holds, not what this run asked for."""
    held = writer.done
    if not writer.meta.get("complete"):
        if held > asked:
            print(f"note: {path} holds {held} requests, more than the {asked} asked for (an interrupted "
                  f"extension's); finished with all {held} (meta.json limit {held})", file=sys.stderr)
        writer.finish(limit=held if held > asked else cfg.limit, requests_total=total)
    print(f"{path}: already holds {held} requests (asked for {asked}); nothing to capture", file=sys.stderr)


def _capture_into(writer: StoreWriter, cfg: CaptureConfig, lm: LoadedModel, info, requests: list[Request],
                  all_prompts: list[list[int]], all_refs, truncated: dict[str, int], max_new: int,
                  total: int) -> None:
    """Decode the requests the store does not hold yet, commit them, and mark the store complete."""
    start = writer.done
    writer.reopen()  # extending a finished store (a larger --limit): incomplete on disk before any part
    writer.meta["prompt_hash_scheme"] = PROMPT_HASH_SCHEME
    use_prefix = cfg.prefix_reuse and cfg.prefix_cache > 0
    commits = _Commits.resume(writer, cfg, use_prefix)
    if start:
        print(f"{writer.path}: resuming after request {start - 1} ({start} of {len(requests)} done)", file=sys.stderr)
    refs = all_refs[start:] if all_refs is not None else None
    _capture_rest(cfg, lm, writer, commits, requests[start:], all_prompts[start:], refs, truncated, max_new,
                  info.stop_strings, use_prefix, len(requests))
    runs = commits.runs
    writer.finish(limit=cfg.limit, requests_total=total, runs=runs, truncated=commits.truncated,
                  prompt_tokens_reused=commits.reused, seconds_total=round(sum(r["seconds"] or 0.0 for r in runs), 3))


def _capture_rest(cfg: CaptureConfig, lm: LoadedModel, writer: StoreWriter, commits: _Commits, todo: list[Request],
                  prompts: list[list[int]], refs: list[list[int]] | None, truncated: dict[str, int], max_new: int,
                  stop_strings: tuple[str, ...], use_prefix: bool, total: int) -> None:
    """Decode `todo` and commit it in serving order, `flush_every` requests a part; this run's entry
    joins `commits.runs` at the end."""
    from tqdm import tqdm

    start = writer.done
    bar = tqdm(total=total, initial=start, unit="req", desc=f"capture {cfg.bench}",
               disable=not cfg.progress, dynamic_ncols=True)
    tokens_done, t_start = 0, time.perf_counter()
    finished: dict[int, Generated] = {}  # completed out of order, committed in serving order
    committed, pending = 0, []
    sampling = REFERENCE if cfg.mode == "reference" else GREEDY  # capture decodes at temperature 0: known
    with _engine_stream(cfg, lm, prompts, refs, max_new, stop_strings, use_prefix) as stream:
        for k, gen in stream:
            finished[k] = gen
            tokens_done += len(gen.tokens)
            while committed in finished:
                g, req, prompt = finished.pop(committed), todo[committed], prompts[committed]
                pending.append(TraceRecord(
                    request=start + committed, id=req.id, group=req.group, prompt_hash=prompt_hash(prompt),
                    prompt_tokens=prompt, output_tokens=g.tokens, stop_reason=g.stop_reason,
                    seconds=g.seconds, hidden=g.hidden, hidden_valid=g.hidden_valid, topk=g.topk,
                    prompt_last_hidden=g.prompt_last_hidden, prompt_last_topk=g.prompt_last_topk,
                    tenant=req.tenant, sampling=sampling,
                    off_argmax=None if sampling == REFERENCE else int(g.off_argmax)))
                if req.id in truncated:
                    commits.truncated[req.id] = truncated[req.id]
                commits.reused.append(int(g.prompt_tokens_reused))
                committed += 1
                if len(pending) >= cfg.flush_every or committed == len(todo):
                    commits.run.update(requests_to=start + committed,
                                       seconds=round(time.perf_counter() - t_start, 3))
                    writer.append(pending, meta=commits.meta())
                    pending = []
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens_done / max(1e-9, time.perf_counter() - t_start):.1f}")
    bar.close()
    commits.run["seconds"] = round(time.perf_counter() - t_start, 3)
    commits.runs.append(commits.run)
