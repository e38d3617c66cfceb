"""Capture: greedy decoding of a benchmark, request by request, into a trace store.

One decoding step, top to bottom (`greedy_stream`): feed the last tokens of every live row with
the KV cache, read the capture layer's output from the LayerTap and the top-8 of the logits,
take the argmax, and stop a row at EOS, at a benchmark stop string, or at the token cap.
Rows of a batch are right-aligned and left-padded; a finished request's row takes the next
request, and once no request is left the free rows are dropped. The cache appends in place
(data.kvcache). `reference` mode is teacher-forced: one forward over prompt + reference output,
reusing the KV of the longest prefix it shares with an earlier request (`ReferencePrefixCache`) and
asking the LM head only for the positions the store keeps (`teacher_forced_cached`).
"""

from __future__ import annotations

import copy
import datetime
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch

from data.benchmarks import Request, data_fingerprint, get_benchmark, load_requests
from data.errors import OilbirdError
from data.models import TOPK, LayerTap, LoadedModel, cache_kwargs, encode_prompt, load_model
from data.store import PROMPT_HASH_SCHEME, StoreWriter, TraceRecord, prompt_hash, store_dir


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
    truncate: str | None = None  # None: refuse a prompt longer than the context; "left": keep its last tokens
    prefix_reuse: bool = True  # reuse the previous prompt's KV for a shared start (tested equal)
    prefix_cache: int = 4  # reference mode: KV entries kept (LRU) for prefix reuse; 0 = off (one full forward each)
    prefix_cache_mb: float = 1024.0  # reference mode: bound on the entries' KV bytes
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
    prompt_tokens_reused: int = 0  # prompt positions whose KV came from an earlier request (not recomputed)


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
    out = lm.model(input_ids=ids, position_ids=pos, **cache_kwargs(lm.model, cache), use_cache=True, logits_to_keep=1)
    logits = out.logits[0, -1].float()
    state = tap.take()[0, -1].float().cpu().numpy()
    if prefix is not None:
        prefix.tokens, prefix.cache = list(prompt), cache
    res = Generated([], np.zeros((0, lm.d_model)), np.zeros(0, bool), np.zeros((0, TOPK)),
                    state, logits.topk(TOPK).indices.cpu().numpy(), "", prompt_tokens_reused=reuse)
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
        out = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(lm.model, cache), use_cache=True)
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


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _exact_classes():
    """A SlackCache whose layers keep no spare room: a reference forward knows its final length,
    so its buffers are allocated once at that size and become the prefix cache's entry as they are."""
    global _EXACT
    if _EXACT is None:
        from transformers.cache_utils import Cache

        from data.kvcache import SlackCache, SlackLayer

        class ExactLayer(SlackLayer):
            room = 0

        class ExactCache(SlackCache):
            def __init__(self):
                Cache.__init__(self, layer_class_to_replicate=ExactLayer)

        _EXACT = (ExactLayer, ExactCache)
    return _EXACT


_EXACT = None


@dataclass(eq=False)  # compared by identity (list.remove), never by its arrays
class _KVEntry:
    tokens: np.ndarray  # prompt + reference token ids of an earlier request
    kv: list  # per layer (keys, values), [1, H, len(tokens), D]; never written after it is stored
    nbytes: int


class ReferencePrefixCache:
    """KV caches of earlier requests' prompt + reference tokens, for teacher-forced capture.

    A new request reuses the entry sharing the longest prefix with its prompt + reference (any
    earlier request still held, not only the previous one, so interleaved conversations hit too),
    capped at its prompt length - 1: the last prompt token and the reference are always computed,
    because their states and top-k are what the store keeps. The reused positions are copied out
    of the entry into the new request's buffers (an entry is never modified), and the new request's
    full KV becomes an entry in turn. Least recently used entries go first once there are more than
    `entries` or their KV exceeds `max_mb`; an entry that is a prefix of the newer one is dropped
    (the newer one serves every request it would). Shared prefixes shorter than `min_reuse` tokens
    are recomputed (the copy is not worth it).
    """

    def __init__(self, entries: int = 4, max_mb: float = 1024.0, min_reuse: int = 16):
        if entries < 1:
            raise ValueError("a ReferencePrefixCache holds at least one entry")
        self.max_entries = int(entries)
        self.max_bytes = int(max_mb * 2**20)
        self.min_reuse = int(min_reuse)
        self._entries: list[_KVEntry] = []  # least recently used first
        self.lookups = self.hits = self.reused_tokens = self.peak_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def begin(self, tokens: list[int], limit: int):
        """(positions reused, a cache holding them with room for exactly len(tokens) positions)."""
        _, cache_cls = _exact_classes()
        seq = np.asarray(tokens, np.int64)
        best, best_len = None, 0
        for e in self._entries:
            n = _lcp(e.tokens, seq)
            if n > best_len:
                best, best_len = e, n
        self.lookups += 1
        reuse = min(best_len, limit)
        cache = cache_cls()
        if best is None or reuse < max(1, self.min_reuse):
            return 0, cache
        self._entries.remove(best)
        self._entries.append(best)  # most recently used
        layer_cls, _ = _exact_classes()
        total = len(tokens)
        for k, v in best.kv:
            layer = layer_cls()
            bufs = []
            for src in (k, v):
                buf = src.new_empty(src.shape[:2] + (total,) + src.shape[3:])
                buf[:, :, :reuse] = src[:, :, :reuse]
                bufs.append(buf)
            layer.adopt(bufs[0], bufs[1], reuse)
            cache.layers.append(layer)
        self.hits += 1
        self.reused_tokens += reuse
        return reuse, cache

    def store(self, tokens: list[int], cache) -> None:
        """Keep the KV of `tokens` (the cache a forward over all of them filled) as an entry."""
        seq = np.asarray(tokens, np.int64)
        kv = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            if k is None or k.shape[-2] != len(seq):
                return  # not a cache of these tokens: keep nothing
            if getattr(layer, "_kbuf", None) is not None and layer._kbuf.shape[-2] != len(seq):
                k, v = k.clone(), v.clone()  # do not hold spare room
            kv.append((k, v))
        nbytes = sum(t.numel() * t.element_size() for pair in kv for t in pair)
        if not kv or nbytes > self.max_bytes:
            return
        for e in list(self._entries):
            n = _lcp(e.tokens, seq)
            if n == len(seq):  # an entry already holds these tokens (and maybe more)
                self._entries.remove(e)
                self._entries.append(e)
                return
            if n == len(e.tokens):  # the new entry serves every request this one would
                self._entries.remove(e)
        self._entries.append(_KVEntry(seq, kv, nbytes))
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._entries.pop(0)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def clear(self) -> None:
        self._entries.clear()


@torch.no_grad()
def teacher_forced_cached(lm: LoadedModel, tap: LayerTap, prompt: list[int], output: list[int],
                          prefix: ReferencePrefixCache | None = None) -> Generated:
    """teacher_forced, computing only what the store needs: the KV of the longest prefix shared with
    an earlier request (prefix cache) is reused, the rest of prompt + output is forwarded, and the LM
    head runs only at the last prompt token and the output tokens (logits_to_keep). Same columns as
    teacher_forced, equal to float tolerance (tested)."""
    t0 = time.perf_counter()
    seq = list(prompt) + list(output)
    p, total = len(prompt), len(seq)
    if p < 1:
        raise OilbirdError("teacher-forced capture needs a prompt of at least one token")
    keep = total - p + 1  # positions p-1 .. total-1: the last prompt token and every output token
    if prefix is not None:
        reuse, cache = prefix.begin(seq, limit=p - 1)
    else:
        reuse, cache = 0, None
    ids = torch.tensor([seq[reuse:]], device=lm.device)
    pos = torch.arange(reuse, total, device=lm.device)[None]
    out = lm.model(input_ids=ids, position_ids=pos, **cache_kwargs(lm.model, cache), use_cache=cache is not None,
                   logits_to_keep=keep)
    logits = out.logits[0, -keep:].float()
    states = tap.take()[0, -keep:].float().cpu().numpy()  # the tap saw the forwarded positions only
    top = logits.topk(TOPK).indices.cpu().numpy()
    del out, logits
    if prefix is not None:
        prefix.store(seq, cache)
    return Generated(tokens=list(output), hidden=states[1:], hidden_valid=np.ones(len(output), bool),
                     topk=top[1:], prompt_last_hidden=states[0], prompt_last_topk=top[0],
                     stop_reason="reference", seconds=time.perf_counter() - t0, prompt_tokens_reused=reuse)


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


def fit_prompts(lm: LoadedModel, requests: list[Request], max_new: int, truncate: str | None,
                outputs: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, int]]:
    """Every request's prompt tokens, checked against the model's context before anything is
    written. A prompt longer than the context is refused; with truncate="left" a prompt that
    does not leave room for max_new tokens keeps its most recent tokens (and its BOS, if any).
    With `outputs` (reference mode: each request's reference tokens) the room a prompt must leave
    is its own reference's length, and prompt + reference longer than the context is refused
    (or, with truncate="left", the prompt is cut so that both fit).
    Returns the prompts and {request id: original length} of the truncated ones."""
    prompts, truncated = [], {}
    ctx = lm.context
    bos = getattr(lm.tokenizer, "bos_token_id", None)
    for i, req in enumerate(requests):
        try:
            p = encode_prompt(lm, req.messages)
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


def capture(cfg: CaptureConfig, lm: LoadedModel | None = None) -> str:
    """Capture (or resume) a trace store; returns its path."""
    if cfg.mode not in ("generate", "reference"):
        raise OilbirdError(f"unknown mode '{cfg.mode}'; use generate or reference")
    if cfg.batch_size < 1:
        raise OilbirdError("--batch-size must be at least 1")
    if cfg.flush_every < 1:
        raise OilbirdError("--flush-every must be at least 1")
    if cfg.truncate not in (None, "left"):
        raise OilbirdError(f"unknown --truncate '{cfg.truncate}'; use left")
    if cfg.prefix_cache < 0:
        raise OilbirdError("--prefix-cache must be 0 (off) or more entries")
    if not cfg.prefix_cache_mb > 0:
        raise OilbirdError("--prefix-cache-mb must be positive")
    info = get_benchmark(cfg.bench)
    requests = load_requests(cfg.bench, cfg.limit)
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
    every_request = load_requests(cfg.bench)  # the whole benchmark: its fingerprint, and the N of "first N of M"
    meta = {
        "model": lm.name, "model_path": lm.path, "model_fingerprint": lm.fingerprint, "layer": lm.layer,
        "n_layers": lm.n_layers, "d_model": lm.d_model, "vocab_size": lm.vocab_size,
        "dtype": str(lm.dtype).removeprefix("torch."), "device": lm.device.type,
        "tokenizer_hash": lm.tokenizer_hash, "chat_template_hash": lm.chat_template_hash,
        "bench": cfg.bench, "data_fingerprint": data_fingerprint(every_request), "requests_total": len(every_request),
        "mode": cfg.mode, "max_new_tokens": max_new, "stop_strings": list(info.stop_strings),
        "truncate": cfg.truncate, "prompt_hash_scheme": PROMPT_HASH_SCHEME,
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    writer = StoreWriter(path, meta, force=cfg.force)
    start = writer.done
    _check_committed(path, writer, requests)
    if start >= len(requests):
        if not writer.meta.get("complete"):
            writer.finish(limit=cfg.limit, requests_total=len(every_request))
        print(f"{path}: already holds {start} requests (asked for {len(requests)}); nothing to capture",
              file=sys.stderr)
        return str(path)
    writer.reopen()  # extending a finished store (a larger --limit): incomplete on disk before any part
    writer.meta["prompt_hash_scheme"] = PROMPT_HASH_SCHEME
    truncated_done = dict(writer.meta.get("truncated") or {})  # of the committed requests
    # per committed request, the prompt tokens whose KV was reused (None: captured before this was recorded);
    # committed with the rows (StoreWriter.append's meta), so it stays aligned through a kill and a resume
    reused_done = list(writer.meta.get("prompt_tokens_reused") or [])[:start]
    reused_done += [None] * (start - len(reused_done))
    # one entry per capture run, so a resumed store says which batch width made which requests
    runs = list(writer.meta.get("runs") or ([] if not start else [
        {"batch_size": None, "requests_from": 0, "requests_to": start, "seconds": writer.meta.get("seconds_total")}]))
    use_prefix = cfg.prefix_reuse and cfg.prefix_cache > 0
    run = {"batch_size": cfg.batch_size, "requests_from": start, "requests_to": start, "seconds": 0.0}
    if cfg.mode == "reference":
        run["batch_size"] = 1  # teacher-forced requests are forwarded one at a time (batching measured no gain)
        run["prefix_cache"] = cfg.prefix_cache if use_prefix else 0
    if start:
        print(f"{path}: resuming after request {start - 1} ({start} of {len(requests)} done)", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=len(requests), initial=start, unit="req", desc=f"capture {cfg.bench}",
               disable=not cfg.progress, dynamic_ncols=True)
    tokens_done, t_start = 0, time.perf_counter()
    todo = requests[start:]
    prompts = all_prompts[start:]
    finished: dict[int, Generated] = {}  # completed out of order, committed in serving order
    committed, pending = 0, []
    prefix = PrefixCache() if use_prefix else None
    with LayerTap(lm.model, lm.layer) as tap:
        if cfg.mode == "generate":
            results = greedy_stream(lm, tap, prompts, max_new, info.stop_strings, cfg.batch_size, prefix)
        elif use_prefix:
            ref_cache = ReferencePrefixCache(cfg.prefix_cache, cfg.prefix_cache_mb)
            results = ((k, teacher_forced_cached(lm, tap, p, o, ref_cache))
                       for k, (p, o) in enumerate(zip(prompts, all_refs[start:])))
        else:  # the plain path: one full forward per request, logits at every position
            results = ((k, teacher_forced(lm, tap, p, o)) for k, (p, o) in enumerate(zip(prompts, all_refs[start:])))
        for k, gen in results:
            finished[k] = gen
            tokens_done += len(gen.tokens)
            while committed in finished:
                g, req, prompt = finished.pop(committed), todo[committed], prompts[committed]
                pending.append(TraceRecord(
                    request=start + committed, id=req.id, group=req.group, prompt_hash=prompt_hash(prompt),
                    prompt_tokens=prompt, output_tokens=g.tokens, stop_reason=g.stop_reason,
                    seconds=g.seconds, hidden=g.hidden, hidden_valid=g.hidden_valid, topk=g.topk,
                    prompt_last_hidden=g.prompt_last_hidden, prompt_last_topk=g.prompt_last_topk,
                    tenant=req.tenant))
                if req.id in truncated:
                    truncated_done[req.id] = truncated[req.id]
                reused_done.append(int(g.prompt_tokens_reused))
                committed += 1
                if len(pending) >= cfg.flush_every or committed == len(todo):
                    run.update(requests_to=start + committed, seconds=round(time.perf_counter() - t_start, 3))
                    writer.append(pending, meta={"runs": runs + [dict(run)], "truncated": dict(truncated_done),
                                                 "prompt_tokens_reused": list(reused_done)})
                    pending = []
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens_done / max(1e-9, time.perf_counter() - t_start):.1f}")
    bar.close()
    run["seconds"] = round(time.perf_counter() - t_start, 3)
    runs.append(run)
    writer.finish(limit=cfg.limit, requests_total=len(every_request), runs=runs, truncated=truncated_done, prompt_tokens_reused=reused_done,
                  seconds_total=round(sum(r["seconds"] or 0.0 for r in runs), 3))
    return str(path)
