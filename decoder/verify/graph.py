"""The static-shape tree verifier (`--verifier graph`): every pass one forward of a fixed shape, compiled once per
shape in the warm-up, with everything between the host's draft and the host's commit done on the device.

Why not the eager verifier's way (decoder/verify/engine.py `ModelVerifier`): its cache reallocates by torch.cat every
forward, the mask and positions are built on the host per node, the shape changes every pass (0-60 nodes, a
growing context) and about seven host-device copies block each pass. A compiled graph (and on a GPU a CUDA graph)
needs fixed shapes and fixed buffers, as gpt-fast, SGLang and vLLM keep them:

  rows      the anchor + draft nodes, padded to the smallest bucket that holds them (BUCKETS, extended to cover
            the node budget); a padding row attends to itself only (no row is fully masked: SDPA gives NaN on
            one) and its logits are ignored;
  cache     a transformers `Cache` of `SlotLayer`s: keys/values preallocated at `capacity` positions; the
            verifier owns the write slot (`start`, a device scalar): a forward writes its rows at start .. start + rows - 1, whatever it held.
            transformers' StaticLayer advances a counter of its own on every call (and every CUDA-graph replay),
            which a verifier that keeps only the accepted rows cannot use;
  mask      built on the device from the pass's ancestor matrix ([rows, rows], copied into a fixed buffer) and
            `start`: a row sees the context (< start) and its own ancestors in the block;
  accept    on the device: a node agrees when its token is its parent row's argmax and every ancestor agrees;
            the deepest agreeing row wins (ties: the earliest, as decoder/verify/tree.py `greedy_accept`);
  compact   on the device, a fixed-shape copy: the block's rows reordered so the accepted path sits at
            start, start + 1, ... (the next pass writes past it);
  readback  one per pass: a [rows, 3 + 16 + d] float32 block (argmax, the path order, its length, the top-8
            ids and logits, the capture-layer states).

Compiled with torch.compile (inductor; `reduce-overhead`, CUDA graphs, on a GPU), each bucket in `warm_up`; every
compile is counted by the backend (`compiles`), and one after the warm-up is a recompile (`recompiles_after_warmup`
in summary.json's `verifier` block). A request whose context would pass the cache's end grows it first (the next
capacity step; each bucket then compiles again, counted as `growth_compiles`, said once), never writes past it.
The capture layer's state reaches the readback through a forward hook that copies into a buffer (a tensor
mutation, which the compiled graph keeps; a hook's Python side effects it would drop).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import types
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from data.capture.models import LoadedModel, cache_kwargs, decoder_layers, text_config
from data.errors import OilbirdError
from data.store.schema import TOPK
from decoder.draft import Draft, VerifyResult, subtree
from decoder.verify.engine import ModelVerifier, StopRule, TreeForward, _new_cache, check_supported, prefill

BUCKETS = (1, 16, 32, 64)  # rows of a verify forward (the anchor + draft nodes): `ar` passes take the first
CAPACITY_STEP = 256  # the cache's capacity is a multiple of this


def buckets_for(nodes: int, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The buckets a node budget needs: `buckets` up to the first that holds 1 + nodes rows, extended by doubling
    when none does (a budget of 100 nodes adds 128)."""
    out = sorted({int(b) for b in buckets if b >= 1} | {1})
    while out[-1] < nodes + 1:
        out.append(out[-1] * 2)
    return tuple(b for b in out if b < nodes + 1) + (next(b for b in out if b >= nodes + 1),)


def capacity_for(positions: int) -> int:
    return CAPACITY_STEP * max(1, math.ceil(positions / CAPACITY_STEP))


def ancestor_block(parents: Sequence[int], rows: int) -> np.ndarray:
    """[rows, rows] bool: (r, c) when input c is row r itself or one of its ancestors (0 = the anchor, 1 + i = node
    i); a padding row (past the nodes) is its own only ancestor. Built by doubling the parent pointers (log2 of the
    depth steps), not a Python loop over nodes."""
    n = len(parents)
    up = np.arange(rows)  # each row's parent row; the anchor and padding rows point at themselves
    if n:
        p = np.asarray(parents, np.int64)
        if np.any(p >= np.arange(n)) or np.any(p < -1):
            raise ValueError("parents must precede their children")
        up[1:n + 1] = p + 1
    anc = np.eye(rows, dtype=bool)
    hop = up  # after k rounds, each row holds its ancestors up to 2^k levels up and hop[r] is 2^k levels up
    for _ in range(max(1, int(n).bit_length())):  # depth <= n < 2^bit_length(n): the anchor is reached
        anc |= anc[hop]
        hop = hop[hop]
    return anc


def _slot_layer_class():
    """SlotLayer, one layer of the slot cache (transformers' public Cache interface: a layer whose `update` returns
    the keys and values to attend over): keys/values [1, heads, capacity, head dim] written at the verifier's slot
    `start`. Built on first use so that importing this module does not import transformers."""
    from transformers.cache_utils import CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        is_compileable = True
        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.start = keys, values, start
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            slots = self.start + torch.arange(key_states.shape[-2], device=key_states.device)
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
            return self.keys, self.values

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[-2], 0

        def get_seq_length(self) -> int:
            return 0  # never asked: every forward brings its own positions and 4D mask

        def get_max_length(self) -> int:
            return self.keys.shape[-2]

    return SlotLayer


@dataclass
class GraphStats:
    """The verifier's counters (summary.json `verifier`)."""

    compiles: int = 0  # graphs compiled by the backend, warm-up included
    warmup_compiles: int = 0
    growth_compiles: int = 0  # compiled again after the cache grew (its shapes changed)
    warmup_s: float = 0.0
    cache_growths: int = 0
    overflow_passes: int = 0  # drafts cut to the largest bucket
    passes: int = 0

    @property
    def recompiles_after_warmup(self) -> int:
        return self.compiles - self.warmup_compiles - self.growth_compiles


class GraphVerifier(ModelVerifier):
    """The live verifier (decoder/loop.py `Verifier`) with one fixed-shape compiled forward per pass (module
    docstring); its bookkeeping, the stop rule and the Generation are ModelVerifier's (`begin`, `record`)."""

    kind = "graph"

    def __init__(self, lm: LoadedModel, stop: StopRule, nodes: int, capacity: int = 2048,
                 buckets: Sequence[int] = BUCKETS, compile: bool = True) -> None:
        check_supported(lm.model)
        self.lm, self.stop, self.tap = lm, stop, None
        self.vocab_size = lm.vocab_size
        self.buckets = buckets_for(nodes, buckets)
        self.stats = GraphStats()
        self._said_growth = False
        model, dev = lm.model, lm.device
        cfg = text_config(model)
        self.dtype = model.dtype
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv_shape = (1, heads, head_dim)
        self.start_slot = torch.zeros((), dtype=torch.long, device=dev)
        from transformers.cache_utils import Cache

        slot_layer = _slot_layer_class()
        self.cache = Cache(layers=[slot_layer(*self._kv(capacity), self.start_slot)
                                   for _ in range(cfg.num_hidden_layers)])
        self.capacity = capacity
        rows = self.buckets[-1]
        self._state = torch.zeros((rows, lm.d_model), dtype=self.dtype, device=dev)
        self._tapping = False
        layer = decoder_layers(model)[lm.layer - 1]
        self._hook = layer.register_forward_hook(self._copy_state)
        # the pass's inputs, fixed buffers per bucket (a CUDA graph replays from fixed addresses)
        self._ids = {b: torch.zeros((1, b), dtype=torch.long, device=dev) for b in self.buckets}
        self._anc = {b: torch.zeros((b, b), dtype=torch.bool, device=dev) for b in self.buckets}
        self._parent = {b: torch.zeros(b, dtype=torch.long, device=dev) for b in self.buckets}  # the parent's row
        # every bucket past 1 row shares one graph, symbolic in the rows (inductor's C++ kernels take minutes to
        # build on a CPU, per shape); a 1-row pass (ar, an empty draft) keeps its own, static graph
        for b in (b for b in self.buckets if b > 1):
            for t, dims in ((self._ids[b], (1,)), (self._anc[b], (0, 1)), (self._parent[b], (0,))):
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        self._warm = False
        self._past_len = self._length = 0
        self._regrow: set[int] = set()
        self._cache_key = next(iter(cache_kwargs(model, None)))  # `cache` or `past_key_values`, by release
        self._compile = compile
        if compile:
            self._step = torch.compile(self._own_forward(), backend=self._backend(dev), dynamic=None, fullgraph=False)
        else:
            self._step = self._forward

    def _own_forward(self):
        """`_forward` with a code object of this verifier's own. Dynamo keeps its compiled graphs per code object,
        at most `recompile_limit` (8) of them, then runs the function eagerly without a word: verifiers of several
        models or capacities in one process (a bench's two benchmarks, the tests) would share one method's 8."""
        f = GraphVerifier._forward
        code = f.__code__.replace(co_name=f"_forward_{id(self):x}")
        return types.MethodType(types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__),
                                self)

    def _kv(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, d = self._kv_shape
        kv = [torch.zeros((b, h, capacity, d), dtype=self.dtype, device=self.lm.device) for _ in range(2)]
        for t in kv:  # a fixed address: the graph mutates it in place (a CUDA graph replays on it)
            torch._dynamo.mark_static_address(t)
        return kv[0], kv[1]

    def _backend(self, dev: torch.device):
        """Inductor, each compile counted; CUDA graphs on a GPU (torch.compile's `reduce-overhead`)."""
        from torch._inductor.compile_fx import compile_fx

        patches = {"triton.cudagraphs": True} if torch.device(dev).type == "cuda" else {}

        def backend(gm, example_inputs):
            self.stats.compiles += 1
            return compile_fx(gm, example_inputs, config_patches=patches)

        return backend

    def _copy_state(self, module, args, output) -> None:
        if self._tapping:
            x = output[0] if isinstance(output, (tuple, list)) else output
            self._state[:x.shape[1]].copy_(x[0])

    def close(self) -> None:
        self._hook.remove()
        super().close()

    def describe(self, since: GraphStats | None = None) -> dict:
        """summary.json's `verifier` block: the compiles and recompiles of the whole run so far (the verifier is
        shared by every arm), and with `since` (a `snapshot` taken when an arm began) that arm's passes,
        overflows and cache growths."""
        s, b = self.stats, since or GraphStats()
        return {"kind": self.kind, "buckets": list(self.buckets), "capacity": self.capacity,
                "compiles": s.compiles, "recompiles_after_warmup": s.recompiles_after_warmup,
                "growth_compiles": s.growth_compiles, "cache_growths": s.cache_growths - b.cache_growths,
                "overflow_passes": s.overflow_passes - b.overflow_passes, "passes": s.passes - b.passes,
                "warmup_s": round(s.warmup_s, 3)}

    def snapshot(self) -> GraphStats:
        return dataclasses.replace(self.stats)

    # -- the compiled pass ---------------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, anc: torch.Tensor, parent: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        rows = ids.shape[1]
        dev = ids.device
        capacity = self.cache.layers[0].keys.shape[-2]
        depth = anc.sum(1) - 1
        col = torch.arange(capacity, device=dev)
        rel = col - start
        in_block = (rel >= 0) & (rel < rows)
        allowed = (col < start)[None, :] | (anc[:, rel.clamp(0, rows - 1)] & in_block[None, :])
        mask = torch.zeros((rows, capacity), dtype=self.dtype, device=dev)
        mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]
        out = self.lm.model(input_ids=ids, attention_mask=mask, position_ids=(start + depth)[None],
                            **{self._cache_key: self.cache}, use_cache=True)
        logits = out.logits[0].float()
        argmax = logits.argmax(-1)
        top = logits.topk(TOPK, dim=-1)
        r = torch.arange(rows, device=dev)
        is_node = parent != r  # the anchor and the padding rows are their own parents
        agrees = (is_node & (ids[0] == argmax[parent])) | (r == 0)  # the anchor always "agrees"
        path_ok = ~(anc & ~agrees[None, :]).any(1)
        score = torch.where(path_ok, depth, torch.full_like(depth, -1))
        best = score.argmax()  # the first maximum: ties to the earliest row
        on_path = anc.index_select(0, best.view(1))[0]  # (no data-dependent indexing: one graph)
        order = torch.where(on_path, depth, rows + r).argsort()  # the path by depth, then the rest
        length = score.max() + 1  # the anchor + the accepted nodes
        if rows > 1:  # the accepted path into place: start, start + 1, ... (a 1-row pass has nothing to move)
            slots, moved = start + r, start + order
            for layer in self.cache.layers:
                layer.keys.index_copy_(2, slots, layer.keys.index_select(2, moved))
                layer.values.index_copy_(2, slots, layer.values.index_select(2, moved))
        state = self._state[:rows].float()
        return torch.cat([argmax[:, None].float(), order[:, None].float(), length.expand(rows)[:, None].float(),
                          top.indices.float(), top.values, state], 1)

    @torch.no_grad()
    def _run(self, rows: int) -> np.ndarray:
        before = self.stats.compiles
        self._tapping = True
        try:
            packed = self._step(self._ids[rows], self._anc[rows], self._parent[rows], self.start_slot)
        finally:
            self._tapping = False
        if self.stats.compiles > before and rows in self._regrow:  # this bucket's first pass on a grown cache
            self.stats.growth_compiles += self.stats.compiles - before
            self._regrow.discard(rows)
        return packed.cpu().numpy()  # the pass's one readback

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile (and on a GPU capture) every bucket before any timing: twice each, so CUDA graphs record."""
        t0 = time.perf_counter()
        self.start_slot.fill_(0)
        for b in self.buckets:
            self._anc[b].copy_(torch.eye(b, dtype=torch.bool))
            self._parent[b].copy_(torch.arange(b))
            for _ in range(2):
                self._run(b)
        self.stats.warmup_compiles = self.stats.compiles
        self.stats.warmup_s += time.perf_counter() - t0
        if self._compile and not self.stats.compiles:
            print("graph verifier: torch.compile compiled nothing in the warm-up (dynamo fell back to eager); the "
                  "passes run the fixed-shape forward eagerly", file=sys.stderr)
        self._warm = True

    # -- the Verifier contract -----------------------------------------------------------------------------------

    def _grow(self, positions: int) -> None:
        """A larger cache (the next capacity step), its prefix copied; the buckets compile again at their next
        pass (new shapes), counted apart from recompiles."""
        capacity = capacity_for(positions)
        if not self._said_growth:
            print(f"graph verifier: the cache grows from {self.capacity} to {capacity} positions (each bucket "
                  "compiles again once)", file=sys.stderr)
            self._said_growth = True
        for layer in self.cache.layers:
            k, v = self._kv(capacity)
            k[:, :, :self.capacity] = layer.keys
            v[:, :, :self.capacity] = layer.values
            layer.keys, layer.values = k, v
        self.capacity = capacity
        self.stats.cache_growths += 1
        self._regrow = set(self.buckets)

    def ensure_capacity(self, positions: int) -> None:
        if positions > self.capacity:
            self._grow(positions)

    @torch.no_grad()
    def start(self, prompt: Sequence[int]) -> None:
        if not self._warm:
            self.warm_up()
        n = len(prompt) - 1  # cached: the prompt but its last token (the first anchor)
        self.ensure_capacity(n + self.buckets[-1])
        cache = _new_cache()
        prefill(self.lm.model, cache, prompt)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            if n:
                mine.keys[:, :, :n] = theirs.keys
                mine.values[:, :, :n] = theirs.values
        self.begin(prompt)
        self._past_len = n

    def verify_pass(self, context: Sequence[int], draft: Draft) -> VerifyResult:
        past_len = len(context) - 1
        if past_len != self._past_len:
            raise RuntimeError(f"graph verifier: context of {past_len + 1} tokens, cache of {self._past_len}")
        limit = self.buckets[-1] - 1
        if len(draft) > limit:  # a budget past the largest bucket: its first nodes (closed under parents)
            draft = subtree(draft, range(limit))
            self.stats.overflow_passes += 1
        n = len(draft)
        rows = next(b for b in self.buckets if b >= n + 1)
        self.ensure_capacity(past_len + rows)
        ids = np.zeros(rows, np.int64)
        ids[0] = int(context[-1])
        ids[1:n + 1] = draft.tokens
        parent = np.arange(rows)
        parent[1:n + 1] = np.asarray(draft.parents, np.int64) + 1
        self._ids[rows].copy_(torch.from_numpy(ids)[None])
        self._anc[rows].copy_(torch.from_numpy(ancestor_block(draft.parents, rows)))
        self._parent[rows].copy_(torch.from_numpy(parent))
        self.start_slot.fill_(past_len)
        packed = self._run(rows)
        self.stats.passes += 1
        length = int(packed[0, 2])
        path = packed[:length, 1].astype(np.int64)  # rows: the anchor, then the accepted nodes by depth
        accepted = [int(r) - 1 for r in path[1:]]
        argmax = packed[:n + 1, 0].astype(np.int64)
        bonus = int(argmax[path[-1]])
        fwd = TreeForward(logits=None, argmax=argmax, topk=packed[:n + 1, 3:3 + TOPK].astype(np.int64),
                          topk_logits=packed[:n + 1, 3 + TOPK:3 + 2 * TOPK],
                          hidden=packed[:n + 1, 3 + 2 * TOPK:])
        self._length = length
        return self.record(draft, accepted, bonus, fwd)

    def rewind(self, context: Sequence[int]) -> None:
        """Back to the cache of `context` but its last token, a prefix this verifier holds (a profile times many
        passes at one context): the slots past it are written again by the next pass."""
        if len(context) - 1 > self._past_len + self._length:
            raise RuntimeError("graph verifier: rewind past what the cache holds")
        self.begin(context)
        self._past_len = len(context) - 1

    def advance(self, result: VerifyResult) -> None:
        # the accepted rows were moved into place on the device; the cache now ends after them
        self._past_len += self._length


def check_verifier(kind: str) -> str:
    if kind not in ("graph", "eager", "auto"):
        raise OilbirdError(f"--verifier must be graph, eager or auto (got {kind!r})")
    return kind


def resolve_verifier(kind: str, device: torch.device | str) -> str:
    """auto: graph on a GPU, eager on a CPU (where compiling buys little at batch 1 and costs minutes to start;
    both are tested there)."""
    kind = check_verifier(kind)
    if kind == "auto":
        return "graph" if torch.device(device).type == "cuda" else "eager"
    return kind


def resolve_overlap(overlap: str, device: torch.device | str) -> bool:
    """--overlap: on, off, or auto (on where the model runs on a GPU, whose host thread otherwise waits on the device;
    off on a CPU, where the forward and the host share the cores: beside work of about 0.2 ms a pass, and a helper
    thread's hand-off costing as much, measured no gain on this 2-core CPU: docs/decoder.md)."""
    if overlap not in ("on", "off", "auto"):
        raise OilbirdError(f"--overlap must be on, off or auto (got {overlap!r})")
    return overlap == "on" or (overlap == "auto" and torch.device(device).type == "cuda")
