"""Disguised copies of a trace store: the workload of a larger pool made from a real one.

Tile 0 is the store itself. Every later tile k is a disguised copy (`make_disguise`): its token ids
go through a random permutation of the vocabulary, its states through a random orthogonal rotation
plus Gaussian noise (`noise` x the rms of the source's states, `noise_scale`), and its prompts change
with its tokens, so its prompt hashes differ. Each tile keeps the statistics of real traffic (the
same repetition within the tile, real state geometry), while no tile can draft from another (its
tokens are another vocabulary, its states point elsewhere): a tiled pool is the workload of a pool
that size, not new evidence about recall.

Used by benchmarks/bench_scale.py (a tiled store written to disk, one random stream for every
tile) and benchmarks/bench_draft.py (tiled warm pools made on the fly, one stream per tile and per
trace, so a trace's copy is the same at every pool size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Disguise:
    """Tile `tile`'s disguise: a vocabulary permutation and a rotation (both None for tile 0, the
    store itself)."""

    tile: int
    perm: np.ndarray | None = None  # [vocab] int64: token id -> disguised id
    rot: np.ndarray | None = None  # [d, d] float32 orthogonal

    @property
    def identity(self) -> bool:
        return self.perm is None

    def tokens(self, ids) -> np.ndarray:
        """Token ids (any int array or list) as this tile's ids, int64."""
        ids = np.asarray(ids, np.int64)
        return ids if self.perm is None else self.perm[ids]

    def states(self, x: np.ndarray, scale: float, rng: np.random.Generator) -> np.ndarray:
        """States rotated plus N(0, scale^2) noise, float16 (tile 0: unchanged, float16)."""
        x = np.asarray(x, np.float32)
        if self.rot is None:
            return x.astype(np.float16)
        return (x @ self.rot + scale * rng.standard_normal(x.shape).astype(np.float32)).astype(np.float16)


def make_disguise(tile: int, rng: np.random.Generator, d: int, vocab: int) -> Disguise:
    """Tile `tile`'s disguise drawn from `rng` (the permutation, then the rotation); tile 0 draws nothing."""
    if tile == 0:
        return Disguise(0)
    perm = rng.permutation(vocab)
    rot, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return Disguise(tile, perm, rot.astype(np.float32))


def noise_scale(noise: float, states: np.ndarray) -> float:
    """The noise's standard deviation: `noise` x the rms of the (valid) source states."""
    return noise * float(np.sqrt(np.mean(np.asarray(states, np.float32) ** 2)))


def store_vocab(store) -> int:
    """One more than the largest token id the store holds (generated, top-k, prompts): a permutation of
    range(store_vocab) keeps every id in range."""
    return int(max(store.positions["token"].max(), store.topk.max(),
                   max(max(p) for p in store.requests["prompt_tokens"].to_list() if p))) + 1


def interleaved(counts: list[int]) -> list[tuple[int, int]]:
    """Serving order of tiled traffic: (tile, item) for item 0 of every tile, then item 1, ...;
    `counts[k]` items of tile k (a tile may hold fewer items than the others)."""
    most = max(counts, default=0)
    return [(k, r) for r in range(most) for k, n in enumerate(counts) if r < n]
