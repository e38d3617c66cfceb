"""The `auto` index's candidate generator: an inverted file over PCA-projected states, trained on the
pool itself and re-trained as it grows.

The semantic key's default index (`--index auto`, data/stateindex.py) keeps every state whole, as the
exact key does (unit rows, float16), and scores neighbours exactly from those rows. While the pool is
small it scores every row (the exact key, unchanged). Past `prune_from` states the rows are also
filed in an `IvfPruner`, and a query scores only the candidates it returns:

  1. project the query with the pool's PCA (to `pca_dims`, then back on the unit sphere);
  2. visit the `nprobe` inverted lists whose centroids are nearest, keep the `width` best rows by
     the projected inner product (faiss IVF over the projected rows, 8-bit scalar codes: on API-Bank
     states as fast as float32 rows and as good for pruning, at a quarter of the bytes);
  3. the caller re-scores those rows exactly from its own float16 rows and keeps the k best.

So a returned similarity is always the exact float16 cosine; pruning can only miss a neighbour,
never misplace one (the recall against exact search at the same k is what the bench measures).

Schedule, as the pool grows (the defaults are measured on API-Bank states, SmolLM2, 2 cores;
`make bench-draft` times and checks them at 4k to 1M states):
  - lists: nlist = the largest power of two <= sqrt(2 n) at training, between 32 and 4096
    (trained at 32k rows -> 256 lists, at 524k -> 1024); nprobe = max(`nprobe_min` = 8, nlist / 64);
  - training: k-means and PCA on `train_per_list` x nlist rows spread evenly over the pool (not its
    first rows, so the lists follow the traffic as it drifts);
  - re-training: when the pool holds `retrain_growth` times the rows of the last training, every row
    is filed again under the new lists (geometric, so a row is re-filed O(1) times on average);
  - appends file the new rows only (faiss add: projection and nearest centroid, no copy of the rest);
  - eviction drops rows by id (ids are the caller's global row numbers, which only grow).
The pruner holds pca_dims + 8 bytes per state (the projected row's 8-bit codes and its id) beside
the float16 row: `bytes_per_state`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data.stateindex import one_faiss_thread


@dataclass(frozen=True)
class PrunerConfig:
    """The auto index's settings (module docstring); the defaults are the measured ones."""

    prune_from: int = 2048  # states at which the pruner is first trained (below: every row scored). Measured on
    #                         API-Bank states, one thread: every float16 row scored, 0.072 ms at 1,024 rows and
    #                         0.132 ms at 2,048; pruned, 0.057 and 0.059 ms
    retrain_growth: float = 4.0  # re-train once the pool holds this many times the last training's rows
    pca_dims: int = 128  # projection width (no projection when the state width is below 2 x this)
    min_lists: int = 32
    max_lists: int = 4096
    nprobe_min: int = 8  # lists visited per query, at least (nlist / 64 when larger); 4 gave recall 0.955 on API-Bank
    candidates_per_k: int = 4  # rows re-scored exactly per neighbour asked for
    train_per_list: int = 48  # training rows per list (faiss warns below 39)
    kmeans_iters: int = 10

    def lists_for(self, n: int) -> int:
        """Lists for a pool trained at n rows: the largest power of two <= sqrt(2 n) (sized for the
        pool midway to its next re-training), clamped."""
        return int(min(self.max_lists, max(self.min_lists, 2 ** int(math.log2(max(1.0, math.sqrt(2 * n)))))))

    def nprobe_for(self, nlist: int) -> int:
        return max(self.nprobe_min, nlist // 64)

    def projected_dims(self, d: int) -> int:
        return self.pca_dims if d >= 2 * self.pca_dims else d


class IvfPruner:
    """Candidate rows for a query: faiss IVF (8-bit codes) over the PCA projection of the pool's unit rows."""

    def __init__(self, d: int, config: PrunerConfig | None = None) -> None:
        import faiss  # the [faiss] extra; without it the auto index stays exact (decoder/drafters/semantic.py)

        self.faiss = faiss
        self.d = d
        self.config = config or PrunerConfig()
        self.dims = self.config.projected_dims(d)
        self.index = None  # faiss IndexPreTransform(PCA, L2norm, IVF-SQ8) or a bare IVF-SQ8; None before training
        self.nlist = self.nprobe = 0
        self.trained_rows = 0  # pool rows at the last training
        self.trainings = 0
        self.train_s = 0.0  # seconds spent training and re-filing (pool time, not query time)
        self._scores = np.empty((1, 0), np.float32)  # search buffers, reused
        self._labels = np.empty((1, 0), np.int64)

    @property
    def spec(self) -> str:
        """The structure answering now, in data/stateindex.py's spec words."""
        pca = f"pca{self.dims}," if self.dims != self.d else ""
        return f"{pca}ivf{self.nlist},sq8,nprobe={self.nprobe}"

    def due(self, n: int) -> bool:
        """Whether a pool of n rows should (re-)train: first at prune_from, then at each growth step."""
        if self.index is None:
            return n >= self.config.prune_from
        return n >= self.config.retrain_growth * self.trained_rows

    def train(self, rows, ids: np.ndarray) -> None:
        """(Re-)train on the pool's rows (float16 or float32, [n, d], unit) and file all of them."""
        import time

        faiss, c = self.faiss, self.config
        t0 = time.perf_counter()
        n = len(ids)
        self.nlist = c.lists_for(n)
        self.nprobe = min(self.nlist, c.nprobe_for(self.nlist))
        take = min(n, c.train_per_list * self.nlist)
        sample = _as_f32(_take(rows, np.linspace(0, n - 1, take).astype(np.int64)) if take < n else rows[:n])
        pre = f"PCA{self.dims},L2norm," if self.dims != self.d else ""
        index = faiss.index_factory(self.d, f"{pre}IVF{self.nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
        ivf = faiss.extract_index_ivf(index)
        ivf.cp.niter = c.kmeans_iters
        ivf.cp.min_points_per_centroid = 1  # few rows per list is the small-pool case, not an error
        index.train(sample)
        ivf.nprobe = self.nprobe
        self.index, self.ivf = index, ivf
        self.add(rows, ids)
        self.trained_rows = n
        self.trainings += 1
        self.train_s += time.perf_counter() - t0

    def add(self, rows, ids: np.ndarray) -> None:
        """File rows (unit, [m, d]) under their ids (increasing global row numbers)."""
        step = 65536  # bounded float32 copies
        for lo in range(0, len(ids), step):
            self.index.add_with_ids(_as_f32(rows[lo:lo + step]), np.ascontiguousarray(ids[lo:lo + step], np.int64))

    def remove_below(self, lo: int) -> None:
        """Drop every row with id < lo."""
        if self.index is not None and lo > 0:
            self.index.remove_ids(self.faiss.IDSelectorRange(0, lo))

    def candidates(self, query: np.ndarray, width: int, nprobe: int | None = None) -> np.ndarray:
        """Ids of up to `width` rows nearest the unit query (float32, contiguous [d]) in the projection,
        -1 padded, visiting `nprobe` lists (default the schedule's). Calls faiss's own search with
        reused buffers: the Python wrapper's allocation and checks cost a fifth of a query."""
        if self._labels.shape[1] != width:
            self._scores = np.empty((1, width), np.float32)
            self._labels = np.empty((1, width), np.int64)
        sp = self.faiss.swig_ptr
        with one_faiss_thread(self.faiss):  # one query: one thread (data/stateindex.py says why)
            if nprobe is None or nprobe == self.nprobe:  # faiss's attribute setter is slow: only when widening
                self.index.search_c(1, sp(query), width, sp(self._scores), sp(self._labels))
                return self._labels[0].copy()
            self.ivf.nprobe = min(self.nlist, nprobe)
            try:
                self.index.search_c(1, sp(query), width, sp(self._scores), sp(self._labels))
            finally:
                self.ivf.nprobe = self.nprobe
            return self._labels[0].copy()

    def bytes_per_state(self) -> float:
        return float(self.dims) + 8.0  # the projected row (8-bit codes) and its int64 id


def _take(rows, index: np.ndarray):
    """rows[index] for a torch tensor or an array."""
    if hasattr(rows, "index_select"):
        import torch

        return rows.index_select(0, torch.from_numpy(index))
    return rows[index]


def _as_f32(x) -> np.ndarray:
    """A contiguous float32 numpy copy of rows given as a torch tensor or an array."""
    if hasattr(x, "numpy"):
        x = x.float().numpy() if str(x.dtype) != "torch.float32" else x.numpy()
    return np.ascontiguousarray(x, np.float32)
