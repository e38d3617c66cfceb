"""The taps (data/capture/vllm_tap.py) on a toy model shaped as vLLM's (a decoder stack `model.model.layers` whose
layers return (hidden, residual), a top-level forward, a `logits_processor`), with vLLM's forward context faked:
the states are the capture layer's residual stream at the step's real tokens only, eager and under torch.compile
of the decoder stack alike (the op is a graph node, a Python attribute hook would be traced once); a step the
compiled graph ran without the tap is counted and said once, never read from stale rows; FULL CUDA graphs are
said at start. The real engine is tests/test_vllm.py's."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from data.capture import vllm_tap
from data.capture.vllm_tap import STAMP, StepTap, full_graph_notice


class Layer(torch.nn.Module):
    def __init__(self, d: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return torch.tanh(self.lin(residual)), residual


class Stack(torch.nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(d, i) for i in range(n))

    def forward(self, x):
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual


class Top(torch.nn.Module):
    """vLLM's top-level model: not compiled, its decoder stack is."""

    def __init__(self, d: int = 16, n: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=d)
        self.model = Stack(d, n)
        self.logits_processor = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.model(x)


def _reference(top: Top, x: torch.Tensor, layer: int) -> np.ndarray:
    """The residual stream after decoder layer `layer` (1-based), computed by hand."""
    hidden, residual = x, None
    for i, lay in enumerate(top.model.layers[:layer]):
        hidden, residual = lay(hidden, residual)
    return (hidden + residual).detach().numpy()


@pytest.fixture
def context(monkeypatch):
    """vLLM's forward context, faked: `meta["qsl"]` is the step's query_start_loc (None: a dummy run)."""
    import vllm.forward_context as fc

    meta = {"qsl": None}

    def get():
        qsl = meta["qsl"]
        one = None if qsl is None else {"layer.0": types.SimpleNamespace(query_start_loc=torch.tensor(qsl))}
        return types.SimpleNamespace(attn_metadata=one)

    monkeypatch.setattr(fc, "get_forward_context", get)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    return meta


def _step(top: Top, tap: StepTap, x: torch.Tensor, qsl: list[int], context) -> object:
    context["qsl"] = qsl
    with torch.no_grad():
        hidden = top(x)
        top.logits_processor(hidden if qsl is None else hidden[: qsl[-1]])
    return tap.take()


@pytest.mark.parametrize("compiled", [False, True])
def test_the_taps_read_the_capture_layer_at_the_real_tokens(compiled, context):
    """Eager and with the decoder stack compiled (dynamo, hooks registered before, as vLLM's load_model): the
    states equal the residual stream after layer 3 at the real tokens (10 of a step padded to 16), the top-8 are
    the logits processor's; a dummy run (no metadata) gives no step."""
    torch.manual_seed(0)
    top = Top()
    tap = StepTap(top, layer=3, max_tokens=64)
    if compiled:
        torch._dynamo.reset()
        top.model = torch.compile(top.model, backend="aot_eager", fullgraph=True)
    for seed in range(3):  # three steps: the graph reruns, the buffer is rewritten, each read is a copy
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed))
        step = _step(top, tap, x, [0, 4, 10], context)
        assert step is not None and step.states.shape == (10, 16)
        np.testing.assert_allclose(step.states, _reference(top, x, 3)[:10], rtol=1e-5, atol=1e-6)
        assert step.query_start.tolist() == [0, 4, 10] and step.topk.shape == (10, 8)
        logits = top.logits_processor(torch.from_numpy(_reference(top, x, 4)[:10]))
        assert (step.topk[:, 0] == logits.argmax(-1).numpy()).all()
    kept = step.states.copy()
    _step(top, tap, torch.randn(16, 16), [0, 16], context)
    np.testing.assert_array_equal(step.states, kept)  # a taken step is not the buffer: the next step left it alone
    assert _step(top, tap, torch.randn(4, 16), None, context) is None  # a profile or dummy run
    assert tap.untapped_steps == 0


def test_a_step_the_graph_ran_without_the_tap_is_counted_and_said_once(context):
    """A compiled graph without the tap's op (a stale compile cache, a FULL CUDA graph's replay): the stamp the
    pre-hook reset is not this step's, so the step gives no states, is counted and is said once."""
    top = Top()
    said = []
    tap = StepTap(top, layer=2, max_tokens=64, notice=said.append)
    tap.handles[0].remove()  # the capture layer's in-graph hook: as if the graph had been compiled without it
    for _ in range(3):
        assert _step(top, tap, torch.randn(8, 16), [0, 8], context) is None
    assert tap.untapped_steps == 3 and len(said) == 1 and "ran without the taps" in said[0]
    # a graph that tapped another layer (a compile cache from another OILBIRD_VLLM_LAYER): refused the same way
    stamp = getattr(top.model.layers[1], STAMP)

    def foreign(module, inputs, output) -> None:
        stamp.copy_(torch.tensor([8, 4]))

    top.model.layers[3].register_forward_hook(foreign)
    assert _step(top, tap, torch.randn(8, 16), [0, 8], context) is None and tap.untapped_steps == 4
    assert len(said) == 1


def test_bad_layers_and_widths_are_one_line():
    from data.errors import OilbirdError

    with pytest.raises(OilbirdError, match="capture layer 9 outside the model's 1..4"):
        StepTap(Top(), layer=9)
    top = Top()
    top.config = None
    with pytest.raises(OilbirdError, match="no config.hidden_size"):
        StepTap(top, layer=2)


def test_full_cuda_graphs_are_said_at_start(monkeypatch):
    """vLLM's FULL CUDA graphs replay the whole model without the read-out: one line at start naming the mode and
    the setting that feeds the key; nothing on a CPU or with piecewise graphs."""
    from vllm.config.compilation import CUDAGraphMode

    cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE))
    monkeypatch.setattr(vllm_tap.torch.cuda, "is_available", lambda: True)
    line = full_graph_notice(cfg)
    assert line and "FULL_AND_PIECEWISE" in line and '"cudagraph_mode": "PIECEWISE"' in line and "\n" not in line
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert full_graph_notice(cfg) is None
    monkeypatch.setattr(vllm_tap.torch.cuda, "is_available", lambda: False)
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    assert full_graph_notice(cfg) is None
