"""SlackCache: in-place appends that hold what DynamicCache holds, and the row moves capture makes."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from data.capture.kvcache import SlackCache, SlackLayer
from data.capture.models import cache_kwargs, load_model


def _kv(rows: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)


def _same(slack_layer, keys, values):
    assert torch.equal(slack_layer.keys, keys) and torch.equal(slack_layer.values, values)


def test_appends_in_place_and_hold_what_dynamic_holds():
    slack, dyn = SlackCache(), DynamicCache()
    for step, n in enumerate([5, 1, 1, 3, 1]):
        k, v = _kv(2, n, step)
        got, want = slack.update(k, v, 0), dyn.update(k, v, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    layer = slack.layers[0]
    assert isinstance(layer, SlackLayer) and slack.get_seq_length() == 11
    buffer = layer._kbuf.data_ptr()
    for step in range(5):
        slack.update(*_kv(2, 1, 10 + step), 0)
    assert layer._kbuf.data_ptr() == buffer  # decoding steps within the room allocate nothing


def test_grows_when_the_room_runs_out(monkeypatch):
    monkeypatch.setattr(SlackLayer, "room", 2)
    slack, dyn = SlackCache(), DynamicCache()
    buffers = set()
    for step in range(9):
        k, v = _kv(1, 1 + step % 2, step)
        slack.update(k, v, 0)
        dyn.update(k, v, 0)
        buffers.add(slack.layers[0]._kbuf.data_ptr())
    _same(slack.layers[0], dyn.layers[0].keys, dyn.layers[0].values)
    assert 2 < len(buffers) < 9


def test_crop_trim_select_then_append():
    slack = SlackCache()
    k, v = _kv(3, 6, 0)
    slack.update(k, v, 0)
    layer = slack.layers[0]
    buffer = layer._kbuf.data_ptr()
    slack.crop(-2)
    _same(layer, k[:, :, :4], v[:, :, :4])
    layer.crop(-1)
    _same(layer, k[:, :, :3], v[:, :, :3])
    k2, v2 = _kv(3, 2, 1)
    slack.update(k2, v2, 0)  # overwrites the cropped positions
    k, v = torch.cat([k[:, :, :3], k2], 2), torch.cat([v[:, :, :3], v2], 2)
    _same(layer, k, v)
    layer.trim(2)
    _same(layer, k[:, :, 2:], v[:, :, 2:])
    assert layer._kbuf.data_ptr() > buffer and layer.owns()  # a view into the same memory
    layer.select(torch.tensor([2, 0]), 1)
    _same(layer, k[[2, 0]][:, :, 3:], v[[2, 0]][:, :, 3:])
    k3, v3 = _kv(2, 1, 2)
    slack.update(k3, v3, 0)
    _same(layer, torch.cat([k[[2, 0]][:, :, 3:], k3], 2), torch.cat([v[[2, 0]][:, :, 3:], v3], 2))


def test_keys_reassigned_from_outside_are_honoured():
    slack = SlackCache()
    k, v = _kv(3, 4, 0)
    slack.update(k, v, 0)
    slack.batch_select_indices(torch.tensor([1]))  # DynamicLayer's own reassignment
    assert not slack.layers[0].owns()
    k2, v2 = _kv(1, 1, 1)
    slack.update(k2, v2, 0)
    _same(slack.layers[0], torch.cat([k[[1]], k2], 2), torch.cat([v[[1]], v2], 2))


def test_model_decoding_matches_dynamic_cache(tiny_dirs):
    lm = load_model(tiny_dirs["llama"])
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for cache in (DynamicCache(), SlackCache()):
        with torch.no_grad():
            logits = [lm.model(input_ids=ids, **cache_kwargs(lm.model, cache), use_cache=True).logits[:, -1]]
            for step in range(8):
                nxt = logits[-1].argmax(-1, keepdim=True)
                pos = torch.full((2, 1), 9 + step)
                logits.append(lm.model(input_ids=nxt, position_ids=pos, **cache_kwargs(lm.model, cache), use_cache=True).logits[:, -1])
        results.append(torch.stack(logits))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-5)
    assert torch.equal(results[0].argmax(-1), results[1].argmax(-1))
