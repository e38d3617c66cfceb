"""Capture: greedy decoding of a benchmark, request by request, into a trace store.

One decoding step, top to bottom (`greedy_stream`): feed the last tokens of every live row with
the KV cache, read the capture layer's output from the LayerTap and the top-8 of the logits,
take the argmax, and stop a row at EOS, at a benchmark stop string, or at the token cap.
Rows of a batch are right-aligned and left-padded; a finished request's row takes the next
request, and once no request is left the free rows are dropped. The cache appends in place
(data.kvcache). `reference` mode is teacher-forced: one forward over prompt + reference output.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

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
    batch_size: int = 1  # rows decoded together (continuous batching); tokens equal batch-1 greedy (tested)
    mode: str = "generate"  # generate | reference (teacher-forced over the benchmark's reference)
    out: str = "runs"
    force: bool = False  # overwrite a store made with other settings
    dtype: str | None = None  # default float32 on CPU, bfloat16 on CUDA
    device: str | None = None
    layer: int | None = None  # default round(0.85 L)
    flush_every: int = 8  # requests per positions part file (the resume granularity)
    prefix_reuse: bool = True  # reuse the previous prompt's KV for a shared start (tested equal)
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
    """The previous prompt's KV cache, reused when the next prompt starts the same way
    (successive turns of a dialogue share everything but the newest turn)."""

    tokens: list[int] = field(default_factory=list)
    cache: object = None
    min_reuse: int = 16  # shorter shared prefixes are not worth it
    reused_tokens: int = 0  # prompt tokens not recomputed so far


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _cache_len(cache) -> int:
    return int(cache.get_seq_length())


@dataclass
class _Row:
    """One request being decoded: its output so far and the logits that choose its next token."""

    index: int
    prompt: list[int]
    logits: torch.Tensor  # [V] next-token logits
    result: Generated
    hiddens: list = field(default_factory=list)
    topks: list = field(default_factory=list)
    t0: float = 0.0


@torch.no_grad()
def _prefill(lm: LoadedModel, tap: LayerTap, index: int, prompt: list[int], prefix: PrefixCache | None):
    """Batch-1 forward over one prompt (reusing the previous prompt's shared start); returns its cache and row."""
    from data.kvcache import SlackCache

    t0 = time.perf_counter()
    reuse = 0
    if prefix is not None and prefix.cache is not None:
        reuse = min(common_prefix_len(prefix.tokens, prompt), len(prompt) - 1)  # >= 1 token to compute
        reuse = reuse if reuse >= prefix.min_reuse else 0
    if reuse:
        cache = prefix.cache
        cache.crop(reuse - _cache_len(cache))
        prefix.reused_tokens += reuse
    else:
        cache = SlackCache()
    ids = torch.tensor([prompt[reuse:]], device=lm.device)
    pos = torch.arange(reuse, len(prompt), device=lm.device)[None]
    out = lm.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1].float()
    state = tap.take()[0, -1].float().cpu().numpy()
    if prefix is not None:
        prefix.tokens, prefix.cache = list(prompt), cache
    res = Generated([], np.zeros((0, lm.d_model)), np.zeros(0, bool), np.zeros((0, TOPK)),
                    state, logits.topk(TOPK).indices.cpu().numpy(), "")
    return cache, _Row(index, list(prompt), logits, res, t0=t0)


def _admit(cache, mask, row_cache, row_len: int, slot: int | None):
    """Put a batch-1 cache into the batch cache, right-aligned with the other rows: into the free
    row `slot` (None = a new row at the end). Nothing else moves unless the prompt is longer than
    the batch, which then gets left-padded (one copy into new buffers with room to decode into)."""
    if cache is None:
        cache = copy.deepcopy(row_cache)  # the row's cache stays the prefix cache; the batch owns a copy
        return cache, torch.ones((1, row_len), dtype=torch.long, device=mask_device(row_cache))
    width = mask.shape[1]
    if slot is not None and row_len <= width:
        for layer, new in zip(cache.layers, row_cache.layers):
            layer.keys[slot, :, width - row_len:] = new.keys[0]  # views: writes land in the buffer
            layer.values[slot, :, width - row_len:] = new.values[0]
        mask[slot] = 0  # the slot's older columns stay finite and are masked out
        mask[slot, width - row_len:] = 1
        return cache, mask
    total = max(width, row_len)
    n_rows = mask.shape[0] + (slot is None)
    slot = mask.shape[0] if slot is None else slot
    for layer, new in zip(cache.layers, row_cache.layers):
        bufs = []
        for old, row in ((layer.keys, new.keys), (layer.values, new.values)):
            buf = old.new_zeros((n_rows, old.shape[1], total + layer.room, old.shape[3]))  # padding: zeros
            buf[:old.shape[0], :, total - width:total] = old  # a free row's old columns stay finite, masked
            buf[slot, :, total - row_len:total] = row[0]
            bufs.append(buf)
        layer.adopt(bufs[0], bufs[1], total)
    grown = mask.new_zeros((n_rows, total))
    grown[:mask.shape[0], total - width:] = mask
    grown[slot] = 0
    grown[slot, total - row_len:] = 1
    return cache, grown


def mask_device(cache) -> torch.device:
    return cache.layers[0].keys.device


def _select_rows(cache, mask, keep: list[int]):
    """Keep the batch rows `keep` (a copy), and drop the leading columns that are padding in every kept row."""
    sel = torch.tensor(keep, device=mask.device)
    mask = mask[sel]
    first = int(mask.any(0).nonzero()[0, 0])
    for layer in cache.layers:
        layer.select(sel, first)
    return cache, mask[:, first:]


def _trim(cache, mask):
    """Drop the leading columns that are padding in every row (a view: nothing is copied)."""
    first = int(mask.any(0).nonzero()[0, 0])
    if first:
        for layer in cache.layers:
            layer.trim(first)
    return cache, mask[:, first:]


def _finish(lm: LoadedModel, row: _Row) -> Generated:
    res, k = row.result, len(row.result.tokens)
    res.hidden = np.zeros((k, lm.d_model), np.float32)
    res.topk = np.zeros((k, TOPK), np.int64)
    if row.hiddens:
        res.hidden[:len(row.hiddens)] = np.stack(row.hiddens)
        res.topk[:len(row.topks)] = np.stack(row.topks)
    res.hidden_valid = np.arange(k) < len(row.hiddens)
    res.seconds = time.perf_counter() - row.t0
    return res


@torch.no_grad()
def greedy_stream(lm: LoadedModel, tap: LayerTap, prompts: Iterable[list[int]], max_new_tokens: int,
                  stop_strings: tuple[str, ...] = (), batch_size: int = 1,
                  prefix: PrefixCache | None = None) -> Iterator[tuple[int, Generated]]:
    """Greedy decoding with continuous batching; yields (prompt index, result) as requests finish.

    Each prompt is prefilled alone (reusing the previous prompt's KV where they share a start),
    then joins the decoding batch as a left-padded row; a finished row leaves and the next prompt
    takes its place. Every row's tokens equal its batch-1 greedy decoding (tested).
    """
    pending = iter(enumerate(prompts))
    rows: list[_Row | None] = []  # one per batch row; None = a free row (its request finished)
    cache, mask = None, None
    exhausted = False
    while True:
        while not exhausted and sum(r is not None for r in rows) < batch_size:  # admit new requests
            nxt = next(pending, None)
            if nxt is None:
                exhausted = True
                break
            row_cache, row = _prefill(lm, tap, nxt[0], nxt[1], prefix)
            slot = rows.index(None) if None in rows else None
            cache, mask = _admit(cache, mask, row_cache, len(row.prompt), slot)
            if slot is None:
                rows.append(row)
            else:
                rows[slot] = row
        for b, row in enumerate(rows):  # choose the next token of every row fed since; stop finished rows
            if row is None or row.logits is None:
                continue
            tok = int(row.logits.argmax())
            row.logits = None
            res = row.result
            res.tokens.append(tok)
            if tok in lm.eos_ids:
                res.stop_reason = "eos"
            elif _stopped_by_string(lm.tokenizer, res.tokens, stop_strings):
                res.stop_reason = "stop_string"
            elif len(res.tokens) >= max_new_tokens:
                res.stop_reason = "length"
            else:
                continue
            rows[b] = None
            yield row.index, _finish(lm, row)
        if None in rows and not exhausted:
            continue  # refill the free rows before the next step
        keep = [b for b, row in enumerate(rows) if row is not None]
        if not keep:
            rows, cache, mask = [], None, None
            if exhausted:
                return
            continue
        if len(keep) < len(rows):  # the last requests: drop the free rows
            cache, mask = _select_rows(cache, mask, keep)
            rows = [rows[b] for b in keep]
        else:
            cache, mask = _trim(cache, mask)
        ids = torch.tensor([[row.result.tokens[-1]] for row in rows], device=lm.device)
        pos = torch.tensor([[len(row.prompt) + len(row.result.tokens) - 1] for row in rows], device=lm.device)
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        out = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        states = tap.take()[:, -1].float().cpu().numpy()
        top = logits.topk(TOPK).indices.cpu().numpy()
        for b, row in enumerate(rows):
            row.logits = logits[b]
            row.hiddens.append(states[b])
            row.topks.append(top[b])


def greedy_batch(lm: LoadedModel, tap: LayerTap, prompts: list[list[int]], max_new_tokens: int,
                 stop_strings: tuple[str, ...] = (), prefix: PrefixCache | None = None,
                 batch_size: int | None = None) -> list[Generated]:
    """Greedy decoding of a list of prompts (all in one batch unless batch_size says otherwise), in order."""
    out: dict[int, Generated] = dict(greedy_stream(lm, tap, prompts, max_new_tokens, stop_strings,
                                                   batch_size or len(prompts), prefix))
    return [out[i] for i in range(len(prompts))]


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
    todo = requests[start:]
    prompts = [encode_prompt(lm, r.messages) for r in todo]
    finished: dict[int, Generated] = {}  # completed out of order, committed in serving order
    committed, pending = 0, []
    prefix = PrefixCache() if cfg.prefix_reuse else None
    with LayerTap(lm.model, lm.layer) as tap:
        if cfg.mode == "generate":
            results = greedy_stream(lm, tap, prompts, max_new, info.stop_strings, cfg.batch_size, prefix)
        else:
            results = ((k, teacher_forced(lm, tap, p, reference_tokens(lm, r)))
                       for k, (r, p) in enumerate(zip(todo, prompts)))
        for k, gen in results:
            finished[k] = gen
            tokens_done += len(gen.tokens)
            while committed in finished:
                g, req, prompt = finished.pop(committed), todo[committed], prompts[committed]
                pending.append(TraceRecord(
                    request=start + committed, id=req.id, group=req.group, prompt_hash=prompt_hash(prompt),
                    prompt_tokens=prompt, output_tokens=g.tokens, stop_reason=g.stop_reason,
                    seconds=g.seconds, hidden=g.hidden, hidden_valid=g.hidden_valid, topk=g.topk,
                    prompt_last_hidden=g.prompt_last_hidden, prompt_last_topk=g.prompt_last_topk))
                committed += 1
                if len(pending) >= cfg.flush_every or committed == len(todo):
                    writer.append(pending)
                    pending = []
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens_done / max(1e-9, time.perf_counter() - t_start):.1f}")
    bar.close()
    writer.finish(limit=cfg.limit, seconds_total=writer.meta.get("seconds_total", 0.0) + time.perf_counter() - t_start)
    return str(path)
