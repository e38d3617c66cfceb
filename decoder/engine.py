"""The decoding engine: one request at a time (batch 1), any Hugging Face causal LM, KV cache kept.

Both loops share one convention (see decoder/tree.py): the cache holds the context minus its
last token, and every pass feeds that last token (the anchor) again. `decode_greedy` (the `ar`
arm) feeds the anchor alone and commits the argmax; `decode_speculative` feeds the anchor plus a
draft tree in one forward (additive float mask, 2D position ids), commits the longest accepted
root path plus the bonus token, and compacts the cache to the anchor + accepted nodes.

Stopping is the capture rule (data/capture.py), checked after every committed token in order:
an EOS id (kept in the output), a benchmark stop string in the decoded tail of the generated
tokens (kept), or the token cap. A pass that commits several tokens is cut where plain greedy
decoding would have stopped, so every arm's output equals the `ar` output token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from data.errors import OilbirdError
from data.models import TOPK, LayerTap, LoadedModel, cache_kwargs
from decoder.draft import Draft, Drafter, VerifyResult
from decoder.tree import compact_cache, greedy_accept, tree_attention_mask, tree_position_ids

STOP_TAIL_TOKENS = 24  # a stop string spans few tokens: decode only this many (as capture does)


@dataclass
class Cycle:
    """One verification pass."""

    nodes: int  # draft nodes verified (0 for ar)
    accepted: int  # draft nodes on the accepted path that were committed (a stop can cut the path)
    committed: int  # tokens appended to the output (accepted + bonus, cut at a stop)
    sources: list[str]  # per accepted (committed) node: its sources joined by "|", sorted (e.g. "adjacency|sam")
    draft_s: float
    verify_s: float  # forward, readback, acceptance and the stop check
    update_s: float  # cache compaction and drafter.observe
    node_sources: dict[str, int] = field(default_factory=dict)  # drafted nodes per source


@dataclass
class Generation:
    """One decoded request. `hidden`/`topk` follow the trace store's convention (data/store.py):
    row i is the state (top-8) computed with tokens[i] as input; the last row is zeros (never fed)."""

    tokens: list[int]
    stop_reason: str  # eos | stop_string | length
    seconds: float  # wall time of the request: prefill + every pass
    prefill_s: float
    cycles: list[Cycle]
    hidden: np.ndarray | None = None  # [n, d] float32
    hidden_valid: np.ndarray | None = None  # [n] bool
    topk: np.ndarray | None = None  # [n, 8] int64
    prompt_last_hidden: np.ndarray | None = None  # [d] the state that predicts tokens[0]
    prompt_last_topk: np.ndarray | None = None  # [8]
    # The lossless audit's evidence (decoder/audit.py): row k = the top-8 ids and logits of the forward
    # row that chose tokens[k] (ar: its one-token forward; a speculative arm: the anchor or accepted
    # node whose argmax committed it). Kept after the pool takes hidden/topk: [n, 8] each.
    chosen_ids: np.ndarray | None = None
    chosen_logits: np.ndarray | None = None


@dataclass
class StopRule:
    """When plain greedy decoding stops (the capture rule)."""

    tokenizer: object
    eos_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    max_new_tokens: int

    def reason(self, output: Sequence[int]) -> str | None:
        """Why decoding stops right after output[-1], or None to go on."""
        if output[-1] in self.eos_ids:
            return "eos"
        if self.stop_strings:
            tail = self.tokenizer.decode(list(output[-STOP_TAIL_TOKENS:]), skip_special_tokens=False)
            if any(s in tail for s in self.stop_strings):
                return "stop_string"
        if len(output) >= self.max_new_tokens:
            return "length"
        return None

    def commit(self, output: list[int], new: Sequence[int]) -> tuple[int, str | None]:
        """Append `new` to `output` one token at a time up to the first stop; (tokens kept, reason)."""
        for k, tok in enumerate(new, 1):
            output.append(int(tok))
            reason = self.reason(output)
            if reason is not None:
                return k, reason
        return len(new), None


def stop_rule(lm: LoadedModel, stop_strings: Sequence[str], max_new_tokens: int) -> StopRule:
    if max_new_tokens < 1:
        raise OilbirdError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    return StopRule(lm.tokenizer, lm.eos_ids, tuple(stop_strings), int(max_new_tokens))


def check_supported(model: torch.nn.Module) -> None:
    """The tree mask replaces the model's own masks: refuse models whose layers are not plain causal."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise OilbirdError(f"{cfg.model_type} has {', '.join(sorted(kinds - {'full_attention'}))} layers; "
                           "the tree verifier supports full-attention models only")


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def prefill(model: torch.nn.Module, cache, prompt: Sequence[int]) -> None:
    """Cache every prompt token but the last (the first anchor)."""
    if len(prompt) < 1:
        raise OilbirdError("empty prompt: nothing to decode from")
    if len(prompt) > 1:
        ids = torch.tensor([list(prompt[:-1])], device=model.device)
        model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)


@dataclass
class TreeForward:
    """What one verify forward returns (row 0 = the anchor, row 1 + i = node i)."""

    logits: torch.Tensor  # [N+1, V] float32
    argmax: np.ndarray  # [N+1]
    topk: np.ndarray  # [N+1, 8]
    topk_logits: np.ndarray  # [N+1, 8] float32, the logits of `topk`
    hidden: np.ndarray | None  # [N+1, d] float32 capture-layer states, when a tap is given


@torch.no_grad()
def verify_tree(model: torch.nn.Module, cache, past_len: int, anchor: int, tokens: Sequence[int],
                parents: Sequence[int], tap: LayerTap | None = None) -> TreeForward:
    """One forward over [anchor] + tree on top of a cache of `past_len` tokens (the cache then holds
    past_len + N + 1 positions until compact_cache)."""
    dev = model.device
    ids = torch.tensor([[int(anchor), *map(int, tokens)]], device=dev)
    mask = tree_attention_mask(parents, past_len, model.dtype, dev)
    pos = tree_position_ids(parents, past_len, dev)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True)
    logits = out.logits[0].float()
    hidden = tap.take()[0].float().cpu().numpy() if tap is not None else None
    top = logits.topk(TOPK, dim=-1)
    return TreeForward(logits=logits, argmax=logits.argmax(-1).cpu().numpy(), topk=top.indices.cpu().numpy(),
                       topk_logits=top.values.cpu().numpy(), hidden=hidden)


def check_draft(draft: Draft, budget: int, vocab_size: int) -> None:
    """A drafter's tree must fit the budget, list parents before children, and hold valid token ids."""
    n = len(draft.tokens)
    if n > budget:
        raise ValueError(f"drafter proposed {n} nodes over a budget of {budget}")
    if len(draft.parents) != n or len(draft.sources) != n:
        raise ValueError("draft tokens, parents and sources differ in length")
    if n and not (0 <= min(draft.tokens) and max(draft.tokens) < vocab_size):
        raise ValueError(f"draft holds a token id outside 0..{vocab_size - 1}")


@torch.no_grad()
def decode_greedy(lm: LoadedModel, prompt: Sequence[int], stop: StopRule) -> Generation:
    """Plain greedy decoding, one forward per token: the `ar` arm and the losslessness reference."""
    t_start = time.perf_counter()
    cache = _new_cache()
    prefill(lm.model, cache, prompt)
    prefill_s = time.perf_counter() - t_start
    output: list[int] = []
    cycles: list[Cycle] = []
    chosen: list[torch.return_types.topk] = []  # per token, on the device: read back once at the end
    anchor, reason = int(prompt[-1]), None
    while reason is None:
        t0 = time.perf_counter()
        logits = lm.model(input_ids=torch.tensor([[anchor]], device=lm.device), **cache_kwargs(lm.model, cache),
                          use_cache=True).logits[0, -1]
        anchor = int(logits.argmax())
        chosen.append(logits.float().topk(TOPK))
        _, reason = stop.commit(output, [anchor])
        cycles.append(Cycle(0, 0, 1, [], 0.0, time.perf_counter() - t0, 0.0))
    seconds = time.perf_counter() - t_start  # the audit's readback is not decoding work
    return Generation(tokens=output, stop_reason=reason, seconds=seconds, prefill_s=prefill_s, cycles=cycles,
                      chosen_ids=torch.stack([c.indices for c in chosen]).cpu().numpy(),
                      chosen_logits=torch.stack([c.values for c in chosen]).cpu().numpy())


def pass_record(draft: Draft, accepted: Sequence[int], kept: int, draft_s: float, verify_s: float,
                update_s: float) -> Cycle:
    """One pass as a Cycle (live decoding and replay alike): drafted nodes per source, and the accepted
    nodes that were committed (a stop can cut the accepted path) with their sources."""
    node_sources: dict[str, int] = {}
    for sources in draft.sources:
        for name in sources:
            node_sources[name] = node_sources.get(name, 0) + 1
    kept_nodes = accepted[:kept]
    return Cycle(len(draft), len(kept_nodes), kept, ["|".join(sorted(draft.sources[i])) for i in kept_nodes],
                 draft_s, verify_s, update_s, node_sources)


@torch.no_grad()
def decode_speculative(lm: LoadedModel, tap: LayerTap, prompt: Sequence[int], drafter: Drafter,
                       stop: StopRule, nodes: int = 60) -> Generation:
    """Draft, verify the tree in one forward, commit the accepted path + bonus; repeat until a stop.

    Calls drafter.begin_request, then per pass propose / observe; the caller owns end_request
    (the pool insertion), so its cost is measured apart from the passes.
    """
    t_start = time.perf_counter()
    cache = _new_cache()
    prefill(lm.model, cache, prompt)
    tap.output = None  # the prefill's states are not needed
    drafter.begin_request(list(prompt))
    prefill_s = time.perf_counter() - t_start
    context = [int(t) for t in prompt]  # prompt + output; the cache holds all of it but the last token
    output: list[int] = []
    states: list[np.ndarray] = []  # states[i] = state with output[i] as input (one behind the output)
    tops: list[np.ndarray] = []
    chosen_ids: list[np.ndarray] = []  # per committed token: the top-8 of the row that chose it
    chosen_logits: list[np.ndarray] = []
    first_state = first_top = None
    cycles: list[Cycle] = []
    reason = None
    measured = hasattr(drafter, "untimed_s")  # measurement-only work inside propose (knn_recall shadows)
    untimed0 = drafter.untimed_s if measured else 0.0
    while reason is None:
        u0 = drafter.untimed_s if measured else 0.0
        t0 = time.perf_counter()
        draft = drafter.propose(context, nodes)
        check_draft(draft, nodes, lm.vocab_size)
        t1 = time.perf_counter()
        t0 += (drafter.untimed_s - u0) if measured else 0.0  # left out of the drafting time
        past_len = len(context) - 1
        fwd = verify_tree(lm.model, cache, past_len, context[-1], draft.tokens, draft.parents, tap)
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, fwd.argmax)
        rows = [0] + [1 + i for i in accepted]  # the anchor and the accepted nodes: the kept KV rows
        if output:
            states.append(fwd.hidden[0])
            tops.append(fwd.topk[0])
        else:
            first_state, first_top = fwd.hidden[0], fwd.topk[0]
        states.extend(fwd.hidden[rows[1:]])
        tops.extend(fwd.topk[rows[1:]])
        new = [draft.tokens[i] for i in accepted] + [bonus]
        kept, reason = stop.commit(output, new)
        chosen_ids.extend(fwd.topk[rows[:kept]])  # row j chose new[j]
        chosen_logits.extend(fwd.topk_logits[rows[:kept]])
        t2 = time.perf_counter()
        result = VerifyResult(draft=draft, accepted_nodes=accepted, bonus=bonus, committed=new[:kept],
                              argmax=fwd.argmax, topk=fwd.topk, hidden=fwd.hidden)
        drafter.observe(context, result)
        if reason is None:
            compact_cache(cache, past_len, rows)
        context.extend(new[:kept])
        t3 = time.perf_counter()
        cycles.append(pass_record(draft, accepted, kept, t1 - t0, t2 - t1, t3 - t2))
    n = len(output)
    hidden = np.zeros((n, lm.d_model), np.float32)
    topk = np.zeros((n, TOPK), np.int64)
    valid = np.arange(n) < n - 1  # the last token is never fed back (as in capture)
    if n > 1:
        hidden[:n - 1] = np.stack(states[:n - 1])
        topk[:n - 1] = np.stack(tops[:n - 1])
    untimed = (drafter.untimed_s - untimed0) if measured else 0.0
    return Generation(tokens=output, stop_reason=reason, seconds=time.perf_counter() - t_start - untimed,
                      prefill_s=prefill_s, cycles=cycles, hidden=hidden, hidden_valid=valid, topk=topk,
                      prompt_last_hidden=first_state, prompt_last_topk=first_top,
                      chosen_ids=np.stack(chosen_ids), chosen_logits=np.stack(chosen_logits))
