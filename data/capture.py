"""Capture: greedy decoding of a benchmark, request by request, into a trace store.

One decoding step, top to bottom (`greedy_batch`): feed the last tokens of every live row with
the KV cache, read the capture layer's output from the LayerTap and the top-8 of the logits,
take the argmax, and stop a row at EOS, at a benchmark stop string, or at the token cap.
Rows of a batch are left-padded; finished rows are dropped from the cache so a long request
runs alone. `reference` mode is teacher-forced: one forward over prompt + reference output.
"""

from __future__ import annotations

import datetime
import hashlib
import platform
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from data.benchmarks import Request, data_fingerprint, get_benchmark, load_requests
from data.errors import OilbirdError
from data.models import TOPK, LayerTap, LoadedModel, encode_prompt, load_model
from data.store import StoreWriter, TraceRecord, store_dir


@dataclass
class CaptureConfig:
    bench: str
    model: str = "smollm2-135m"
    limit: int | None = None  # first N requests in serving order; None = all
    max_new_tokens: int | None = None  # None = the benchmark's default (1024; HumanEval 512; ClassEval 2048)
    batch_size: int = 1  # rows decoded together; tokens equal batch-1 greedy (tested)
    mode: str = "generate"  # generate | reference (teacher-forced over the benchmark's reference)
    out: str = "runs"
    force: bool = False  # overwrite a store made with other settings
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    device: str | None = None
    layer: int | None = None  # default round(0.85 L)
    flush_every: int = 8  # requests per positions part file (the resume granularity)
    prefix_reuse: bool = True  # batch 1: reuse the previous prompt's KV for a shared start (tested equal)
    progress: bool = True


@dataclass
class Generated:
    tokens: list[int]
    hidden: np.ndarray  # [n, d] float32; row i = state with tokens[i] as input
    hidden_valid: np.ndarray  # [n] bool (the last token is never fed back)
    topk: np.ndarray  # [n, 8]
    prompt_last_hidden: np.ndarray  # [d]
    prompt_last_topk: np.ndarray  # [8]
    stop_reason: str
    seconds: float = 0.0


def prompt_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def _stopped_by_string(tokenizer, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    if not stop_strings:
        return False
    tail = tokenizer.decode(tokens[-24:], skip_special_tokens=False)  # a stop string spans few tokens
    return any(s in tail for s in stop_strings)


@dataclass
class PrefixCache:
    """The previous batch-1 prompt's KV cache, reused when the next prompt starts the same way
    (successive turns of a dialogue share everything but the newest turn)."""

    tokens: list[int] = field(default_factory=list)
    cache: object = None
    min_reuse: int = 16  # shorter shared prefixes are not worth a cache copy
    reused_tokens: int = 0  # prompt tokens not recomputed so far


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cache_len(cache) -> int:
    return int(cache.get_seq_length())


@torch.no_grad()
def greedy_batch(lm: LoadedModel, tap: LayerTap, prompts: list[list[int]], max_new_tokens: int,
                 stop_strings: tuple[str, ...] = (), prefix: PrefixCache | None = None) -> list[Generated]:
    """Greedy decoding of several prompts together; each row's tokens equal its batch-1 decoding.

    With `prefix` (batch 1 only) the shared start of the previous prompt is not recomputed.
    """
    from transformers import DynamicCache

    dev, n = lm.device, len(prompts)
    t0 = time.perf_counter()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    reuse = 0
    if prefix is not None and n == 1 and prefix.cache is not None:
        reuse = min(common_prefix_len(prefix.tokens, prompts[0]), width - 1)  # >= 1 token to compute
        if reuse < prefix.min_reuse:
            reuse = 0
    if reuse:
        cache = prefix.cache
        cache.crop(reuse - _cache_len(cache))
        prefix.reused_tokens += reuse
    else:
        cache = DynamicCache()
    out = lm.model(input_ids=ids[:, reuse:], attention_mask=mask, position_ids=positions[:, reuse:],
                   past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1].float()
    state = tap.take()[:, -1].float()
    results = [Generated([], np.zeros((0, lm.d_model)), np.zeros(0, bool), np.zeros((0, TOPK)),
                         state[i].cpu().numpy(), logits[i].topk(TOPK).indices.cpu().numpy(), "")
               for i in range(n)]
    hiddens: list[list[np.ndarray]] = [[] for _ in range(n)]
    topks: list[list[np.ndarray]] = [[] for _ in range(n)]
    live = list(range(n))  # batch row -> request index
    next_pos = positions[:, -1] + 1
    while live:
        nxt = logits.argmax(-1)
        keep = []
        for row, i in enumerate(live):
            tok = int(nxt[row])
            res = results[i]
            res.tokens.append(tok)
            if tok in lm.eos_ids:
                res.stop_reason = "eos"
            elif _stopped_by_string(lm.tokenizer, res.tokens, stop_strings):
                res.stop_reason = "stop_string"
            elif len(res.tokens) >= max_new_tokens:
                res.stop_reason = "length"
            else:
                keep.append(row)
                continue
            res.seconds = time.perf_counter() - t0
        if not keep:
            break
        if len(keep) < len(live):  # drop finished rows from the cache
            sel = torch.tensor(keep, device=dev)
            cache.batch_select_indices(sel)
            mask, next_pos, nxt = mask[sel], next_pos[sel], nxt[sel]
            live = [live[r] for r in keep]
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=dev)], dim=1)
        out = lm.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                       past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
        logits = out.logits[:, -1].float()
        state = tap.take()[:, -1].float().cpu().numpy()
        top = logits.topk(TOPK).indices.cpu().numpy()
        for row, i in enumerate(live):
            hiddens[i].append(state[row])
            topks[i].append(top[row])
    if prefix is not None and n == 1:
        cache.crop(width - _cache_len(cache))  # keep exactly the prompt's KV for the next request
        prefix.tokens, prefix.cache = list(prompts[0]), cache
    for i, res in enumerate(results):
        k = len(res.tokens)
        h = np.zeros((k, lm.d_model), np.float32)
        tk = np.zeros((k, TOPK), np.int64)
        if hiddens[i]:
            h[:len(hiddens[i])] = np.stack(hiddens[i])
            tk[:len(topks[i])] = np.stack(topks[i])
        res.hidden, res.topk = h, tk
        res.hidden_valid = np.arange(k) < len(hiddens[i])
    return results


@torch.no_grad()
def teacher_forced(lm: LoadedModel, tap: LayerTap, prompt: list[int], output: list[int]) -> Generated:
    """One forward over prompt + output: the same columns as generation, without generating."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt + output], device=lm.device)
    logits = lm.model(input_ids=ids, use_cache=False).logits[0].float()
    states = tap.take()[0].float().cpu().numpy()
    top = logits.topk(TOPK).indices.cpu().numpy()
    p = len(prompt)
    return Generated(tokens=list(output), hidden=states[p:], hidden_valid=np.ones(len(output), bool),
                     topk=top[p:], prompt_last_hidden=states[p - 1], prompt_last_topk=top[p - 1],
                     stop_reason="reference", seconds=time.perf_counter() - t0)


def reference_tokens(lm: LoadedModel, req: Request) -> list[int]:
    """The reference text as the model would emit it: its tokens, then the first EOS id."""
    if req.reference is None:
        raise OilbirdError(f"request {req.id} has no reference output: --mode reference needs a benchmark with references")
    toks = lm.tokenizer(req.reference, add_special_tokens=False)["input_ids"]
    eos = sorted(lm.eos_ids)
    return [int(t) for t in toks] + eos[:1]


def library_versions() -> dict:
    import polars
    import pyarrow
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "polars": polars.__version__,
            "pyarrow": pyarrow.__version__, "numpy": np.__version__}


def capture(cfg: CaptureConfig, lm: LoadedModel | None = None) -> str:
    """Capture (or resume) a trace store; returns its path."""
    if cfg.mode not in ("generate", "reference"):
        raise OilbirdError(f"unknown mode '{cfg.mode}'; use generate or reference")
    if cfg.batch_size < 1:
        raise OilbirdError("--batch-size must be at least 1")
    info = get_benchmark(cfg.bench)
    requests = load_requests(cfg.bench, cfg.limit)
    max_new = cfg.max_new_tokens or info.max_new_tokens
    if max_new < 1:
        raise OilbirdError("--max-new-tokens must be at least 1")
    if lm is None:
        lm = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, layer=cfg.layer)
    elif cfg.layer is not None and cfg.layer != lm.layer:
        raise OilbirdError(f"--layer {cfg.layer} differs from the loaded model's capture layer {lm.layer}")
    path = store_dir(cfg.out, cfg.bench, lm.slug)
    meta = {
        "model": lm.name, "model_path": lm.path, "model_fingerprint": lm.fingerprint, "layer": lm.layer,
        "n_layers": lm.n_layers, "d_model": lm.d_model, "vocab_size": lm.vocab_size,
        "dtype": str(lm.dtype).removeprefix("torch."), "device": lm.device.type,
        "tokenizer_hash": lm.tokenizer_hash, "chat_template_hash": lm.chat_template_hash,
        "bench": cfg.bench, "data_fingerprint": data_fingerprint(load_requests(cfg.bench)),
        "mode": cfg.mode, "max_new_tokens": max_new, "stop_strings": list(info.stop_strings),
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    writer = StoreWriter(path, meta, force=cfg.force)
    start = writer.done
    if start >= len(requests):
        if not writer.meta.get("complete"):
            writer.finish(limit=cfg.limit)
        print(f"{path}: already holds {start} requests (asked for {len(requests)}); nothing to capture",
              file=sys.stderr)
        return str(path)
    if writer.meta.get("complete"):
        writer.meta["complete"] = False  # extending a finished store (a larger --limit)
    if start:
        print(f"{path}: resuming after request {start - 1} ({start} of {len(requests)} done)", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=len(requests), initial=start, unit="req", desc=f"capture {cfg.bench}",
               disable=not cfg.progress, dynamic_ncols=True)
    tokens_done, t_start = 0, time.perf_counter()
    pending: list[TraceRecord] = []
    prefix = PrefixCache() if cfg.prefix_reuse and cfg.batch_size == 1 else None
    with LayerTap(lm.model, lm.layer) as tap:
        i = start
        while i < len(requests):
            chunk = requests[i:i + (cfg.batch_size if cfg.mode == "generate" else 1)]
            prompts = [encode_prompt(lm, r.messages) for r in chunk]
            if cfg.mode == "generate":
                gens = greedy_batch(lm, tap, prompts, max_new, info.stop_strings, prefix)
            else:
                gens = [teacher_forced(lm, tap, prompts[0], reference_tokens(lm, chunk[0]))]
            for k, (req, prompt, g) in enumerate(zip(chunk, prompts, gens)):
                pending.append(TraceRecord(
                    request=i + k, id=req.id, group=req.group, prompt_hash=prompt_hash(prompt),
                    prompt_tokens=prompt, output_tokens=g.tokens, stop_reason=g.stop_reason,
                    seconds=g.seconds, hidden=g.hidden, hidden_valid=g.hidden_valid, topk=g.topk,
                    prompt_last_hidden=g.prompt_last_hidden, prompt_last_topk=g.prompt_last_topk))
                tokens_done += len(g.tokens)
            i += len(chunk)
            if len(pending) >= cfg.flush_every or i >= len(requests):
                writer.append(pending)
                pending = []
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{tokens_done / max(1e-9, time.perf_counter() - t_start):.1f}")
    bar.close()
    writer.finish(limit=cfg.limit, seconds_total=writer.meta.get("seconds_total", 0.0) + time.perf_counter() - t_start)
    return str(path)
