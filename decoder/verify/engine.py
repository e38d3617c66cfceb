"""The decoding engine: one request at a time (batch 1), any Hugging Face causal LM, KV cache kept.

Both loops share one convention (see decoder/verify/tree.py): the cache holds the context minus its
last token, and every pass feeds that last token (the anchor) again. `decode_greedy` (the `ar`
arm) feeds the anchor alone and commits the argmax; `decode_speculative` runs the one speculative
loop (decoder/loop.py `speculate`) with `ModelVerifier`, which feeds the anchor plus a draft tree in
one forward (additive float mask, 2D position ids), commits the longest accepted root path plus the
bonus token, and compacts the cache to the anchor + accepted nodes.

Stopping is the capture rule (data/capture/greedy.py), checked after every committed token in order:
an EOS id (kept in the output), a benchmark stop string in the decoded tail of the generated
tokens (kept), or the token cap, cut per request where the model's context ends
(`StopRule.within`, data/capture/greedy.py `context_cap`), as capture cuts it. A pass that commits several
tokens is cut where plain greedy decoding would have stopped, so every arm's output equals the
`ar` output token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from data.capture.greedy import context_cap
from data.capture.models import LayerTap, LoadedModel, cache_kwargs, text_config
from data.errors import OilbirdError
from data.store.schema import TOPK
from decoder.draft import Draft, Drafter, VerifyResult
from decoder.loop import Cycle, Generation, Speculation, speculate
from decoder.verify.tree import (
    compact_cache,
    greedy_accept,
    tree_attention_mask,
    tree_position_ids,
)

STOP_TAIL_TOKENS = 24  # a stop string spans few tokens: decode only this many (as capture does)


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

    def within(self, context: int | None, prompt_len: int) -> "StopRule":
        """This rule for one request: its cap cut where the model's context ends (prompt + output <=
        context, data/capture/greedy.py `context_cap`), so every arm stops where the captured trace did."""
        cap = context_cap(self.max_new_tokens, prompt_len, context)
        return self if cap == self.max_new_tokens else replace(self, max_new_tokens=cap)

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
    cfg = text_config(model)
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

    logits: torch.Tensor | None  # [N+1, V] float32 (None: the graph verifier reads back no logits)
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


@torch.no_grad()
def decode_greedy(lm: LoadedModel, prompt: Sequence[int], stop: StopRule) -> Generation:
    """Plain greedy decoding, one forward per token: the `ar` arm and the losslessness reference."""
    t_start = time.perf_counter()
    stop = stop.within(lm.context, len(prompt))
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


class ModelVerifier:
    """The live verifier (decoder/loop.py `Verifier`): one tree-masked greedy forward per pass on a KV cache,
    the stop rule applied token by token, the cache compacted to the anchor + the accepted nodes; the loop's
    `beside` work runs on a helper thread during the forward (`set_overlap`) or before it. With
    the passes it keeps what the Generation carries: the capture-layer state and top-8 of every fed token
    (through `tap`) and the audit's evidence, the top-8 of the row that chose each committed token."""

    timed = True
    stop_reason: str | None = None  # set by every verify (the stop rule), reset by start
    overlaps = False  # set_overlap(True): the loop's beside work runs on a helper thread while the forward runs
    _helper = None

    def __init__(self, lm: LoadedModel, tap: LayerTap, stop: StopRule, overlap: bool = False) -> None:
        self.lm, self.tap, self.stop = lm, tap, stop
        self.vocab_size = lm.vocab_size
        self.set_overlap(overlap)

    def set_overlap(self, overlap: bool) -> None:
        """Run the loop's `beside` work (decoder/loop.py: the previous pass's bookkeeping) on one helper thread
        while this thread runs the forward: torch's kernels release the GIL, so the host's Python runs meanwhile
        (on a GPU, while this thread waits on the device). The forward stays on the calling thread: a forward on
        a worker thread ran oilbird at 0.90x greedy against 1.20x serial on gsm8k on this 2-core CPU (two OpenMP
        teams on two cores). Off: `beside` runs first."""
        self.overlaps = bool(overlap)
        if overlap and self._helper is None:
            from concurrent.futures import ThreadPoolExecutor

            self._helper = ThreadPoolExecutor(1, thread_name_prefix="oilbird-beside")

    def verify(self, context: Sequence[int], draft: Draft, beside: Callable[[], None] | None = None) -> VerifyResult:
        if beside is None:
            return self.verify_pass(context, draft)
        if not self.overlaps:
            beside()
            return self.verify_pass(context, draft)
        running = self._helper.submit(beside)
        try:
            return self.verify_pass(context, draft)
        finally:
            running.result()  # the beside work has finished (and raised, if it did) before the pass returns

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown()
            self._helper = None

    @torch.no_grad()
    def start(self, prompt: Sequence[int]) -> None:
        self.cache = _new_cache()
        prefill(self.lm.model, self.cache, prompt)
        self.tap.output = None  # the prefill's states are not needed
        self.begin(prompt)

    def begin(self, prompt: Sequence[int]) -> None:
        """The request's bookkeeping, reset (every live verifier's start ends here)."""
        self.request_stop = self.stop.within(self.lm.context, len(prompt))
        self.stop_reason = None
        self.output: list[int] = []
        self.states: list[np.ndarray] = []  # states[i] = state with output[i] as input (one behind the output)
        self.tops: list[np.ndarray] = []
        self.chosen_ids: list[np.ndarray] = []  # per committed token: the top-8 of the row that chose it
        self.chosen_logits: list[np.ndarray] = []
        self.first_state = self.first_top = None
        self._past_len, self._rows = 0, [0]

    def verify_pass(self, context: Sequence[int], draft: Draft) -> VerifyResult:
        """One pass: the tree-masked forward, acceptance, the commit (`record`)."""
        past_len = len(context) - 1  # the cache holds the context but its last token (the anchor)
        fwd = verify_tree(self.lm.model, self.cache, past_len, context[-1], draft.tokens, draft.parents, self.tap)
        accepted, bonus = greedy_accept(draft.tokens, draft.parents, fwd.argmax)
        self._past_len = past_len
        return self.record(draft, accepted, bonus, fwd)

    def record(self, draft: Draft, accepted: list[int], bonus: int, fwd: TreeForward) -> VerifyResult:
        """Commit a verified pass (the stop rule, token by token) and keep what the Generation carries: the
        fed tokens' states and top-8, the audit's evidence. Shared by every live verifier (eager and graph)."""
        rows = [0] + [1 + i for i in accepted]  # the anchor and the accepted nodes: the kept KV rows
        if self.output:
            self.states.append(fwd.hidden[0])
            self.tops.append(fwd.topk[0])
        else:
            self.first_state, self.first_top = fwd.hidden[0], fwd.topk[0]
        self.states.extend(fwd.hidden[rows[1:]])
        self.tops.extend(fwd.topk[rows[1:]])
        new = [draft.tokens[i] for i in accepted] + [bonus]
        kept, self.stop_reason = self.request_stop.commit(self.output, new)
        self.chosen_ids.extend(fwd.topk[rows[:kept]])  # row j chose new[j]
        self.chosen_logits.extend(fwd.topk_logits[rows[:kept]])
        self._rows = rows
        return VerifyResult(draft=draft, accepted_nodes=accepted, bonus=bonus, committed=new[:kept],
                            argmax=fwd.argmax, topk=fwd.topk, hidden=fwd.hidden)

    def advance(self, result: VerifyResult) -> None:
        if self.stop_reason is None:
            compact_cache(self.cache, self._past_len, self._rows)

    def generation(self, run: Speculation) -> Generation:
        """The request's Generation: tokens, passes, times, the fed tokens' states and the audit's evidence."""
        n = len(self.output)
        hidden = np.zeros((n, self.lm.d_model), np.float32)
        topk = np.zeros((n, TOPK), np.int64)
        valid = np.arange(n) < n - 1  # the last token is never fed back (as in capture)
        if n > 1:
            hidden[:n - 1] = np.stack(self.states[:n - 1])
            topk[:n - 1] = np.stack(self.tops[:n - 1])
        return Generation(tokens=self.output, stop_reason=run.stop_reason, seconds=run.seconds,
                          prefill_s=run.prefill_s, cycles=run.cycles, hidden=hidden, hidden_valid=valid, topk=topk,
                          prompt_last_hidden=self.first_state, prompt_last_topk=self.first_top,
                          chosen_ids=np.stack(self.chosen_ids), chosen_logits=np.stack(self.chosen_logits))


@torch.no_grad()
def decode_speculative(lm: LoadedModel, tap: LayerTap, prompt: Sequence[int], drafter: Drafter,
                       stop: StopRule, nodes: int = 60, verifier: ModelVerifier | None = None) -> Generation:
    """Draft, verify the tree in one forward, commit the accepted path + bonus; repeat until a stop
    (decoder/loop.py `speculate` with the model as the verifier: `verifier`, or a serial ModelVerifier). Calls
    drafter.begin_request, then per pass propose / observe_split; the caller owns add_trace (the pool
    insertion), so its cost is measured apart from the passes."""
    verifier = verifier or ModelVerifier(lm, tap, stop)
    return verifier.generation(speculate(drafter, verifier, prompt, nodes))
