"""Teacher-forced capture (`--mode reference`): one forward over prompt + reference output.

`teacher_forced` is the plain forward; `teacher_forced_cached` reuses the KV of the longest prefix
a request shares with an earlier one (`ReferencePrefixCache`) and asks the LM head only for the
positions the store keeps. Both return greedy decoding's `Generated` columns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from data.benchmarks.request import Request
from data.capture.greedy import Generated
from data.capture.models import LayerTap, LoadedModel, cache_kwargs
from data.errors import OilbirdError
from data.store.schema import TOPK


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

        from data.capture.kvcache import SlackCache, SlackLayer

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

