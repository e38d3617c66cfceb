"""The `auto` index: an inverted file over PCA-projected states, trained on the pool itself and
re-trained as it grows, queried in one compiled call (data/index/keyscan.c).

The semantic key's default index (`--index auto`, data/index/stateindex.py) keeps every state whole, as the
exact key does (unit rows, float16), and scores neighbours exactly from those rows. While the pool is
small it scores every row (the exact key, unchanged). Past `prune_from` states the rows are also
filed in an `IvfPruner`, and a query (`IvfPruner.nearest`) scores only the rows it lists:

  1. project the unit query with the pool's PCA (to `pca_dims`);
  2. visit the `nprobe` inverted lists whose centroids are nearest (more, one at a time, while fewer
     than k rows outside the served prompt's group were found), keep the `width` = 3k best rows (4k from
     1,024 lists) by an approximate inner product: the list's coarse score plus the int16-quantised query
     against the row's 8-bit codes (its residual from the list's centroid over a per-dimension step: a
     quarter of float32's bytes, as faiss's IVF-SQ8 by residual);
  3. re-score those rows exactly from the pool's float16 rows and keep the k best.

So a returned similarity is always the exact float16 cosine; pruning can only miss a neighbour,
never misplace one (the recall against exact search at the same k is what the bench measures).

Schedule, as the pool grows (the defaults are measured on API-Bank states, SmolLM2, 2 cores;
`make bench-draft` times and checks them at 4k to 1M states):
  - lists: nlist = the largest power of two <= sqrt(2 n) at training, between 32 and 4096
    (trained at 32k rows -> 256 lists, at 524k -> 1024); nprobe = max(`nprobe_min` = 4, nlist / 64);
  - training: k-means and PCA on `train_per_list` x nlist rows spread evenly over the pool (not its
    first rows, so the lists follow the traffic as it drifts);
  - re-training: when the pool holds `retrain_growth` times the rows of the last training, every row
    is filed again under the new lists (geometric, so a row is re-filed O(1) times on average);
  - appends file the new rows only (projection, nearest centroid and codes in the kernel, appended to
    their lists, which double when full: no copy of the rest);
  - eviction drops rows by id (ids are the caller's global row numbers, which only grow).
The pruner holds pca_dims + 12 bytes per state (the projected row's 8-bit codes, its id and its prompt
group) beside the float16 row: `bytes_per_state`. Training uses faiss's k-means (spherical) and a PCA in
torch; a query never calls faiss: it is data/index/keyscan.c, or `nearest_reference` (numpy, the same steps,
ties and arithmetic: the kernel's reference in the tests, and the path where the kernel cannot be built).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from data.index import keyscan


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
    nprobe_min: int = 4  # lists visited per query, at least (nlist / 64 when larger). At 65k API-Bank states:
    #                      recall 0.988 with 8 lists and 4 per neighbour, 0.978 with 4 and 3 (and a query 30% faster)
    candidates_per_k: int = 3  # rows re-scored exactly per neighbour asked for (2: recall 0.969 at 65k)
    candidates_per_k_large: int = 4  # ... once the lists number large_lists or more (at 1M API-Bank states, 1,024
    large_lists: int = 1024  #         lists and 16 visited: recall 0.948 with 3 per neighbour, 0.966 with 4)
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

    def bytes_per_state(self, d: int) -> float:
        """A filed state's bytes: its projected row's 8-bit codes, its int64 id and its int32 prompt group."""
        return float(self.projected_dims(d)) + 12.0


class IvfPruner:
    """The auto index past prune_from: PCA, inverted lists of 8-bit codes, exact re-scoring (module docstring)."""

    _jobs = 0  # queries handed to the kernel's worker so far, in this process (`submit_key`)
    _out = 0  # the one out there now (its ticket; 0: none)

    def __init__(self, d: int, config: PrunerConfig | None = None) -> None:
        import faiss  # k-means at training (the [faiss] extra); without it the auto index stays exact

        self.faiss = faiss
        keyscan.library()  # built now if it must be (pool time), not at the first query (drafting time)
        self.d = d
        self.config = config or PrunerConfig()
        self.dims = self.config.projected_dims(d)
        self.trained = False
        self.nlist = self.nprobe = 0
        self.trained_rows = 0  # pool rows at the last training
        self.trainings = 0
        self.train_s = 0.0  # seconds spent training and re-filing (pool time, not query time)
        self.ntotal = 0  # rows filed
        self.mean = np.zeros(d, np.float32)  # PCA: y = unit((x - mean) @ proj_t)
        # proj_t and cent_t are float16 values (the kernel reads the float16 copies: half the bytes of a query
        # that runs with cold caches), kept here widened for numpy
        self.proj_t = np.eye(d, self.dims, dtype=np.float32)
        self.scale = np.ones(self.dims, np.float32)  # code step per projected dimension
        self.cent_t = np.zeros((self.dims, 0), np.float32)  # centroids, transposed [dims, nlist]
        self.codes: list[np.ndarray] = []  # per list: int8 [capacity, dims]
        self.ids: list[np.ndarray] = []  # per list: int64 [capacity], the caller's global row numbers
        self.groups: list[np.ndarray] = []  # per list: int32 [capacity], the rows' prompt groups
        self.sizes = np.zeros(0, np.int64)
        self.codes_ptr = np.zeros(0, np.int64)  # per list: the address of codes[l] / ids[l] (the kernel's view)
        self.ids_ptr = np.zeros(0, np.int64)
        self.groups_ptr = np.zeros(0, np.int64)
        self._ks: keyscan.KeyScan | None = None  # the kernel's view of the arrays (`_index_address`)
        self._k = 0  # neighbours its scratch holds
        self._bound = None  # the pool's matrix it points at
        self._set_for: tuple | None = None  # (k, row_base, n) it was last set for (`_query_address`)
        self.ticket = 0  # this pruner's last `submit_key`

    @property
    def spec(self) -> str:
        """The structure answering now, in data/index/stateindex.py's spec words."""
        pca = f"pca{self.dims}," if self.dims != self.d else ""
        return f"{pca}ivf{self.nlist},sq8,nprobe={self.nprobe},rerank={self.candidates_per_k}k"

    def due(self, n: int) -> bool:
        """Whether a pool of n rows should (re-)train: first at prune_from, then at each growth step."""
        if not self.trained:
            return n >= self.config.prune_from
        return n >= self.config.retrain_growth * self.trained_rows

    def train(self, rows, ids: np.ndarray, groups: np.ndarray) -> None:
        """(Re-)train on the pool's rows (float16 or float32, [n, d], unit) and file all of them (`add`)."""
        self.drain()
        import time

        c = self.config
        t0 = time.perf_counter()
        n = len(ids)
        self.nlist = c.lists_for(n)
        self.nprobe = min(self.nlist, c.nprobe_for(self.nlist))
        take = min(n, c.train_per_list * self.nlist)
        sample = _as_f32(_take(rows, np.linspace(0, n - 1, take).astype(np.int64)) if take < n else rows[:n])
        # torch, not numpy, for the training's algebra: numpy's OpenBLAS leaves its threads spinning for about
        # 0.1 s after a large product, and on 2 cores that stalled the next drafting pass by as much
        import torch

        x = torch.from_numpy(sample)
        if self.dims != self.d:  # PCA: the sample's top `dims` principal axes
            mean = x.mean(dim=0)
            centred = (x - mean).double()
            _, vectors = torch.linalg.eigh(centred.T @ centred)
            self.mean = mean.numpy().astype(np.float32)
            self.proj_t = np.ascontiguousarray(vectors.flip(1)[:, : self.dims].numpy(), np.float16).astype(np.float32)
        y = torch.nn.functional.normalize((x - torch.from_numpy(self.mean)) @ torch.from_numpy(self.proj_t), dim=1)
        y = np.ascontiguousarray(y.numpy())
        kmeans = self.faiss.Kmeans(self.dims, self.nlist, niter=c.kmeans_iters, spherical=True, seed=1234,
                                   min_points_per_centroid=1, verbose=False)  # few rows per list: the small pool
        kmeans.train(y)
        self.cent_t = np.ascontiguousarray(kmeans.centroids.T.astype(np.float16).astype(np.float32))
        # codes are residuals from the row's centroid (as faiss's IVF-SQ by_residual): at 1M states, codes of
        # the rows themselves gave recall 0.917 at the same 16 lists and 24 re-scored rows
        assigned = torch.from_numpy(y) @ torch.from_numpy(self.cent_t)
        residual = y - self.cent_t.T[assigned.argmax(dim=1).numpy()]
        self.scale = (np.maximum(np.abs(residual).max(axis=0), 1e-12) / 127).astype(np.float32)
        self.codes = [np.zeros((0, self.dims), np.int8) for _ in range(self.nlist)]
        self.ids = [np.zeros(0, np.int64) for _ in range(self.nlist)]
        self.groups = [np.zeros(0, np.int32) for _ in range(self.nlist)]
        self.sizes = np.zeros(self.nlist, np.int64)
        self.codes_ptr = np.zeros(self.nlist, np.int64)
        self.ids_ptr = np.zeros(self.nlist, np.int64)
        self.groups_ptr = np.zeros(self.nlist, np.int64)
        self.ntotal = 0
        self.trained = True
        self._ks, self._set_for = None, None  # the kernel's view is made again over the new arrays
        self.add(rows, ids, groups)
        self.trained_rows = n
        self.trainings += 1
        self.train_s += time.perf_counter() - t0

    def add(self, rows, ids: np.ndarray, groups: np.ndarray) -> None:
        """File rows (unit, [m, d]) under their ids (increasing global row numbers) with their prompt groups
        (a query skips the served prompt's group while scanning): each to its nearest
        centroid's list, appended (the lists double when full). Float16 rows (the pool's) are encoded by
        data/index/keyscan.c's `keyscan_encode` when it is built, else by `encode_reference`."""
        self.drain()
        step = 65536  # bounded float32 copies
        for lo in range(0, len(ids), step):
            lists, codes = self.encode(rows[lo:lo + step])
            chunk, chunk_groups = np.asarray(ids[lo:lo + step], np.int64), np.asarray(groups[lo:lo + step], np.int32)
            order = np.argsort(lists, kind="stable")
            bounds = np.searchsorted(lists[order], np.arange(self.nlist + 1))
            for li in np.flatnonzero(np.diff(bounds)):  # the lists this chunk touches
                sel = order[bounds[li]:bounds[li + 1]]
                self._append(int(li), codes[sel], chunk[sel], chunk_groups[sel])

    def encode(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """(list, int8 codes) of each row ([m, d], a torch tensor or an array)."""
        lib = keyscan.library()
        half = rows.numpy() if hasattr(rows, "numpy") and str(rows.dtype) == "torch.float16" else rows
        if lib is None or not isinstance(half, np.ndarray) or half.dtype != np.float16 or not len(half):
            return self.encode_reference(rows)
        half = np.ascontiguousarray(half)
        lists, codes = np.zeros(len(half), np.int32), np.zeros((len(half), self.dims), np.int8)
        lib.keyscan_encode(self._index_address(), keyscan.address(half), len(half), keyscan.address(lists),
                           keyscan.address(codes))
        return lists, codes

    def encode_reference(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """`encode` in numpy, with keyscan.c's arithmetic (`_sums`, `_unit_rows`) and ties."""
        lists, codes = np.zeros(len(rows), np.int32), np.zeros((len(rows), self.dims), np.int8)
        for lo in range(0, len(rows), 64):  # bounded [64, d, dims] products
            x = _as_f32(rows[lo:lo + 64]) - self.mean
            y = _unit_rows(_sums(x, self.proj_t))
            best = np.argmax(_sums(y, self.cent_t), axis=1)
            lists[lo:lo + 64] = best
            codes[lo:lo + 64] = np.clip(np.rint((y - self.cent_t.T[best]) / self.scale), -127, 127)
        return lists, codes

    def _append(self, li: int, codes: np.ndarray, ids: np.ndarray, groups: np.ndarray) -> None:
        size, m = int(self.sizes[li]), len(ids)
        if size + m > len(self.ids[li]):
            cap = max(16, 2 * len(self.ids[li]), size + m)
            grown = np.zeros((cap, self.dims), np.int8), np.zeros(cap, np.int64), np.zeros(cap, np.int32)
            for new, old in zip(grown, (self.codes[li], self.ids[li], self.groups[li])):
                new[:size] = old[:size]
            self.codes[li], self.ids[li], self.groups[li] = grown
            for table, new in zip((self.codes_ptr, self.ids_ptr, self.groups_ptr), grown):
                table[li] = keyscan.address(new)
        self.codes[li][size:size + m] = codes
        self.ids[li][size:size + m] = ids
        self.groups[li][size:size + m] = groups
        self.sizes[li] = size + m
        self.ntotal += m

    def remove_below(self, lo: int) -> None:
        """Drop every row with id < lo."""
        self.drain()
        if not self.trained or lo <= 0:
            return
        for li in range(self.nlist):
            size = int(self.sizes[li])
            keep = np.flatnonzero(self.ids[li][:size] >= lo)
            if len(keep) < size:
                for a in (self.codes[li], self.ids[li], self.groups[li]):
                    a[: len(keep)] = a[keep]
                self.sizes[li] = len(keep)
                self.ntotal -= size - len(keep)

    def nearest(self, state: np.ndarray, k: int, matrix, row_base: int, n: int,
                excluded: int) -> tuple[np.ndarray, np.ndarray]:
        """(exact cosines, local rows) of the k nearest rows of the pool's float16 `matrix` ([>= n, d], a
        torch tensor or an array; local row r has global id row_base + r) to `state`, decreasing, rows of
        prompt group `excluded` never returned: the kernel, else `nearest_reference`."""
        lib = keyscan.library()
        if lib is None:
            keyscan.note_numpy_path()
            return self.nearest_reference(state, k, matrix, row_base, n, excluded)
        found = lib.keyscan_query(self._query_address(k, matrix, row_base, n),
                                  keyscan.address(np.ascontiguousarray(state, np.float32)), excluded, k,
                                  *self._out_address)
        return self._out_scores[:found].copy(), self._out_rows[:found].copy()

    def nearest_with_chains(self, state: np.ndarray, k: int, matrix, row_base: int, n: int,
                            excluded: int, chain_spec: int, theta: float) -> tuple[np.ndarray, np.ndarray, int]:
        """`nearest` and, when its best cosine reaches theta, the chains of data/index/keyscan.c's ChainSpec at address
        `chain_spec` (written to its buffers), in one kernel call: (scores, rows, chains written, -1 when the best
        cosine is below theta). Kernel only."""
        self.drain()  # (a query out on the worker would read the buffers this one writes)
        return self._answer(keyscan.library().keyscan_run(self._job_address_for(state, k, matrix, row_base, n,
                                                                                excluded, chain_spec, theta)))

    def submit_key(self, state: np.ndarray, k: int, matrix, row_base: int, n: int, excluded: int, chain_spec: int,
                   theta: float) -> bool:
        """`nearest_with_chains` started on the kernel's worker thread (data/index/keyscan.c): returns at once, True when
        the worker took it (`collect_key` has the answer), False when no worker could start (kernel only). Until
        the collect, the caller changes none of the arrays the query reads (every change here drains first)."""
        address = self._job_address_for(state, k, matrix, row_base, n, excluded, chain_spec, theta)
        if keyscan.library().keyscan_submit(address) != 0:
            return False
        IvfPruner._jobs += 1
        self.ticket = IvfPruner._out = IvfPruner._jobs
        return True

    def collect_key(self, ticket: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The answer to the `submit_key` that set `ticket`, as `nearest_with_chains` returns it (waits for the
        worker). The worker holds one job per process: a later submit (any pool's) would have replaced it."""
        if IvfPruner._out != ticket:
            raise RuntimeError("the key's query was replaced on the worker before its answer was collected")
        IvfPruner._out = 0
        found = keyscan.library().keyscan_collect()
        if found < 0:  # a process forked while the query was out: its worker is the parent's
            raise RuntimeError("the key's query is not out on this process's worker")
        return self._answer(found)

    def _job_address_for(self, state: np.ndarray, k: int, matrix, row_base: int, n: int, excluded: int,
                         chain_spec: int, theta: float) -> int:
        """The address of the kernel's `KeyJob` (keyscan_key's arguments in one struct: a call from Python
        with cold caches costs per argument), set for this query, the state copied into its buffer."""
        self._query_address(k, matrix, row_base, n)  # the view as the pool is now (its address is the job's)
        np.copyto(self._query, state)  # a worker reads the state after the submit returns: a buffer of our own
        if self._job_for != (chain_spec, excluded, k, theta):
            job = self._job
            job.cs, job.excluded, job.k, job.theta = chain_spec, excluded, k, theta
            self._job_for = (chain_spec, excluded, k, theta)
        return self._job_address

    def _answer(self, found: int) -> tuple[np.ndarray, np.ndarray, int]:
        return self._out_scores[:found].copy(), self._out_rows[:found].copy(), self._count.item()

    @staticmethod
    def drain() -> None:
        """No query left on the worker (before an array it reads changes; its answer is dropped)."""
        lib = keyscan.loaded()
        if lib is not None and IvfPruner._out:
            IvfPruner._out = 0
            lib.keyscan_drain()

    def _query_address(self, k: int, matrix, row_base: int, n: int) -> int:
        """`_index_address(k)` pointed at the pool's matrix as it is now."""
        if self._set_for != (k, row_base, n) or self._bound is not matrix:  # else as the last query left it
            self._index_address(k)
            if self._bound is not matrix:  # by identity: the pool's matrix is replaced when it grows or is compacted
                self._ks.matrix, self._bound = keyscan.address(matrix), matrix
            self._ks.row_base, self._ks.n = row_base, n
            self._set_for = (k, row_base, n)
        return self._ks_address

    def _index_address(self, k: int | None = None) -> int:
        """The address of the kernel's view of the index, made after a training and again when a query asks
        for more neighbours than its scratch holds; its width set for queries of k neighbours."""
        if self._ks is None or (k is not None and k > self._k):
            self._make_view(max(k or 8, self._k))
        if k is not None and self._ks.width != self._width(k):
            self._ks.width = self._width(k)
        return self._ks_address

    def _width(self, k: int) -> int:
        """Rows kept for the exact re-score of a query of k neighbours."""
        return max(k, self.candidates_per_k * k)

    @property
    def candidates_per_k(self) -> int:
        c = self.config
        return c.candidates_per_k_large if self.nlist >= c.large_lists else c.candidates_per_k

    def _make_view(self, k: int) -> None:
        width = self._width(k)
        self._work = (np.zeros(self.d + self.dims + self.nlist + width, np.float32),
                      np.zeros(2 * self.nlist, np.int32), np.zeros(width, np.int64), np.zeros(self.dims, np.int16))
        self._out_scores, self._out_rows = np.zeros(k, np.float32), np.zeros(k, np.int64)
        self._out_address = (keyscan.address(self._out_scores), keyscan.address(self._out_rows))
        self._count = np.zeros(1, np.int32)
        self._query = np.zeros(self.d, np.float32)
        self._count_address = keyscan.address(self._count)
        a = keyscan.address
        self._halves = (np.ascontiguousarray(self.proj_t, np.float16), np.ascontiguousarray(self.cent_t, np.float16))
        assert all(x.flags.c_contiguous for x in (self.mean, self.scale, *self._halves))  # the kernel reads them flat
        self._ks = keyscan.KeyScan(self.d, self.dims, self.nlist, self.nprobe, width, 0, a(self.mean),
                                   a(self._halves[0]), a(self.scale), a(self._halves[1]), a(self.codes_ptr),
                                   a(self.ids_ptr), a(self.groups_ptr), a(self.sizes), None, 0, 0,
                                   *(a(w) for w in self._work))
        self._ks_address = ctypes.addressof(self._ks)
        self._k, self._bound, self._set_for = k, None, None
        # `submit_key`'s job: this view, the query buffer and the outputs fixed; the rest set per submit
        self._job = keyscan.KeyJob(self._ks_address, None, a(self._query), *self._out_address, self._count_address,
                                   -1, 0, 0.0)
        self._job_address, self._job_for = ctypes.addressof(self._job), None

    def nearest_reference(self, state: np.ndarray, k: int, matrix, row_base: int, n: int,
                          excluded: int) -> tuple[np.ndarray, np.ndarray]:
        """`nearest` in numpy (keyscan.c's steps, its ties and its arithmetic)."""
        if k <= 0 or n <= 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int64)
        matrix = matrix.numpy() if hasattr(matrix, "numpy") else matrix
        q = _unit_rows(np.asarray(state, np.float32).reshape(1, -1))[0]
        p = _sums(q - self.mean, self.proj_t)
        cs = _sums(p, self.cent_t)
        order = np.argsort(-cs, kind="stable")
        w = self.scale * p
        wmax = np.float32(np.abs(w).max())
        to_q = np.float32(32767) / wmax if wmax > 0 else np.float32(0)
        wq = np.rint(w * to_q).astype(np.int32) if wmax > 0 else np.zeros(self.dims, np.int32)
        visit = self.nprobe
        while True:  # the nprobe best lists, then one more at a time while fewer than k rows are left
            lists = order[:visit]
            ids = np.concatenate([self.ids[li][: self.sizes[li]] for li in lists])
            base = np.concatenate([np.full(self.sizes[li], cs[li], np.float32) for li in lists])
            codes = np.concatenate([self.codes[li][: self.sizes[li]] for li in lists])
            local = ids - row_base
            ok = (local >= 0) & (local < n)
            ok &= np.concatenate([self.groups[li][: self.sizes[li]] for li in lists]) != excluded
            if ok.sum() >= k or visit >= self.nlist:
                break
            visit += 1
        ids, codes, local, base = ids[ok], codes[ok], local[ok], base[ok]
        residual = (codes.astype(np.int32) @ wq).astype(np.float32) / to_q if wmax > 0 else np.float32(0)
        approx = base + residual
        kept = local[np.lexsort((ids, -approx))[: self._width(k)]]
        exact = (matrix[kept].astype(np.float64) @ q.astype(np.float64)).astype(np.float32)
        top = np.lexsort((kept, -exact))[:k]
        return exact[top], kept[top]

    def bytes_per_state(self) -> float:
        return self.config.bytes_per_state(self.d)


def _sums(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """x @ m (x [d] or [r, d] float32, m [d, c]) as keyscan.c sums it: each product rounded, then added in
    index order (an add.accumulate is sequential, where BLAS blocks and fuses)."""
    products = x[..., :, None] * m
    return np.add.accumulate(products, axis=-2, dtype=np.float32)[..., -1, :]


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows over their L2 norm as keyscan.c scales them: the norm a double sum, its inverse rounded to float32
    once (zero rows stay zero)."""
    norms = np.sqrt(np.square(x.astype(np.float64)).sum(axis=-1, keepdims=True))
    inverse = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0).astype(np.float32)
    return (x * inverse).astype(np.float32)


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
