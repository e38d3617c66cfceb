"""Greedy decoding with the capture layer's states: what `--mode generate` stores.

One decoding step, top to bottom (`greedy_stream`): feed the last tokens of every live row with
the KV cache, read the capture layer's output from the LayerTap and the top-8 of the logits,
take the argmax, and stop a row at EOS, at a benchmark stop string, or at the token cap, which
never runs past the model's context (`context_cap`).
Rows of a batch are right-aligned and left-padded; a finished request's row takes the next
request, and once no request is left the free rows are dropped. The cache appends in place
(data.capture.kvcache). A prompt that starts as the previous one did reuses its KV (`PrefixCache`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np
import torch

from data.capture.models import LayerTap, LoadedModel, cache_kwargs
from data.store.schema import TOPK


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
    off_argmax: int = 0  # tokens that were not the model's top-1 there: 0 greedily (vLLM's recorder counts it)


def context_cap(max_new_tokens: int, prompt_len: int, context: int | None) -> int:
    """One request's token cap: max_new_tokens, but never past the model's context, prompt + output
    <= context (vLLM's rule too: its requests stop there with reason length), since positions beyond
    it were never trained and decode silently into noise. At least 1: the first token is chosen at
    the prompt's last position, inside the context (a longer prompt is refused before decoding)."""
    if not context:
        return max_new_tokens
    return max(1, min(max_new_tokens, context - prompt_len))


def context_note(n_cut: int, max_new_tokens: int, context: int) -> str:
    """The one line said when `context_cap` cuts the cap of some requests."""
    return (f"note: {n_cut} request(s) stop at the model's context of {context} positions (prompt + output) "
            f"before --max-new-tokens {max_new_tokens}, with stop reason length")


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
    cap: int = 0  # its token cap (context_cap), set when it joins the batch
    hiddens: list = field(default_factory=list)
    topks: list = field(default_factory=list)
    t0: float = 0.0


@torch.no_grad()
def _prefill(lm: LoadedModel, tap: LayerTap, index: int, prompt: list[int], prefix: PrefixCache | None):
    """Batch-1 forward over one prompt (reusing the previous prompt's shared start); returns its cache and row."""
    from data.capture.kvcache import SlackCache

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
    takes its place. Every row's tokens equal its batch-1 greedy decoding (tested). One function of
    ~65 lines on purpose: the step (forward, read, stop, admit, trim) is one loop over shared state
    (cache, mask, rows), and its pieces are already the helpers above.
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
            row.cap = context_cap(max_new_tokens, len(row.prompt), lm.context)
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
            elif len(res.tokens) >= row.cap:
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

