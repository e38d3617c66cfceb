"""A KV cache that appends in place, for decoding many steps on CPU.

transformers' DynamicLayer appends a step with torch.cat, copying the whole layer every step;
at 16 rows and ~1,100 cached positions that copy took a third of a SmolLM2 decoding step on CPU.
A SlackLayer keeps keys/values as views of buffers with `room` spare positions and writes the
new columns into them. It is a subclass, used through the public Cache interface; anything that
reassigns `keys`/`values` (beam reordering, batch_select_indices) is
honoured: the next update copies them into a fresh buffer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

ROOM = 256  # spare positions per buffer: one copy every ROOM decoding steps


class SlackLayer(DynamicLayer):
    room = ROOM

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._kbuf = self._vbuf = self._view = None

    def owns(self) -> bool:
        """True while keys/values are still the views this layer made of its buffers."""
        return self._view is not None and self.keys is self._view

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take buffers [B, H, capacity, D] whose first `length` positions hold the cache."""
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._kbuf, self._vbuf = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self._view = self.keys

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.get_seq_length(), key_states.shape[-2]
        if not self.owns() or n + add > self._kbuf.shape[-2]:  # first write, reassigned, or full
            bufs = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buf = new.new_empty(new.shape[:2] + (n + add + self.room,) + new.shape[3:])
                if n:
                    buf[:, :, :n] = old
                bufs.append(buf)
            self.adopt(bufs[0], bufs[1], n)
        self._kbuf[:, :, n:n + add] = key_states
        self._vbuf[:, :, n:n + add] = value_states
        self.adopt(self._kbuf, self._vbuf, n + add)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if self.owns() and tokens_to_remove < 0:
            self.adopt(self._kbuf, self._vbuf, self.get_seq_length() + tokens_to_remove)
        else:
            super().crop(tokens_to_remove)

    def trim(self, first: int) -> None:
        """Drop the first `first` positions of every row: a view of the same buffers, no copy."""
        if not self.owns():
            self.keys, self.values = self.keys[:, :, first:], self.values[:, :, first:]
            return
        self.adopt(self._kbuf[:, :, first:], self._vbuf[:, :, first:], self.get_seq_length() - first)

    def select(self, rows: torch.Tensor, first: int) -> None:
        """Keep batch rows `rows` and drop the first `first` positions (one copy; the room stays)."""
        k, v = (self._kbuf, self._vbuf) if self.owns() else (self.keys, self.values)
        self.adopt(k[rows][:, :, first:], v[rows][:, :, first:], self.get_seq_length() - first)


class SlackCache(DynamicCache):
    """A DynamicCache whose layers are SlackLayers; a drop-in for DynamicCache()."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=SlackLayer)
