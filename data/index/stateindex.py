"""The semantic key's index: one interface over exact and faiss-compressed cosine kNN.

A spec names the index, lower-case, comma-separated, knobs as key=value:

    auto                 the decoder's default (DEFAULT_INDEX): the exact float16 matrix, scored
                         whole while the pool is small, then through an inverted-file pruner trained
                         on the pool and re-trained as it grows (data/index/pruner.py); the census refuses
                         it (its recall is defined on exact search or a named spec)
    exact                the reference: every state kept whole, exact cosine (census/knn.py, the
                         decoder's float16 pool); StateIndex never builds it, callers keep their path
    flat                 faiss IndexFlatIP over float32 unit rows (exact up to float32 rounding)
    sq8, sq4, sq6, fp16  scalar quantization (d bytes per state for sq8)
    pq64                 product codes, 64 bytes per state (M must divide d; 8 bits per code)
    pq64x4fs             4-bit product codes scanned with SIMD (faiss fast-scan): 32 bytes, fast
    pca128[,sq8|pq32]    PCA projection to 128 dims (centred, then renormalised), then a coder
    opq64,pq64           rotation learnt for the product quantizer
    ivf1024,pq64         inverted file over 1024 centroids; knob nprobe (default 16)
    hnsw32[,sq8]         HNSW graph with 32 links; knob efSearch (default 64); cannot evict

Rows are added in serving order with increasing int64 ids (the caller's entry or row numbers).
`search` returns, per query, the k best ids by the index's inner product on unit rows, leaving out
ids below `lo` (evicted or outside the budget) and ids inside `exclude` ranges (same-prompt traces).
The strictly-past rule is the caller's: it adds a request's rows only after the request's queries.

Training: a coder that must be fit (sq, pq, pca, opq, ivf) collects its first `train_size` states
(default: the spec's own need, e.g. 39 x 256 for pq) in an exact float32 buffer, answering queries
exactly from it meanwhile (the warm-up a deployment would have), then trains on them, encodes them
and drops the buffer. `trained` says which phase the index is in; `warmup_queries` counts the
queries answered from the buffer. A spec whose hard minimum (a k-means needs at least as many
points as centroids) exceeds the states the caller will ever have is refused with `check_trainable`.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from data.errors import OilbirdError

CODER = re.compile(r"^(sq4|sq6|sq8|fp16|flat|pq(\d+)(x(\d+))?(fs)?|pca(\d+)|opq(\d+)|ivf(\d+)|hnsw(\d+))$")
KNOBS = {"nprobe": 16, "efsearch": 64}
DEFAULT_INDEX = "auto"  # the decoder's and replay's --index default (the census keeps exact)
TRAIN_PER_CENTROID = 39  # faiss's own advice: k-means wants >= 39 points per centroid
# The counts a spec may name, checked here because faiss does not: hnsw0 fails a C++ assertion that
# aborts the process, hnsw1 segfaults, ivf0 and opq0 raise deep inside a search or a training (issue 35).
# An HNSW node needs 2 links or more; 256 links per node is already 4x faiss's largest suggested M (64).
# 65536 lists is faiss's own largest IVF suggestion (for 100M+ vectors); our pools are far smaller.
SPEC_RANGES = {"hnsw": (2, 256), "ivf": (1, 65536), "opq": (1, None), "pca": (1, None)}


@dataclass(frozen=True)
class IndexSpec:
    """A parsed --index spec."""

    text: str  # canonical spec, as recorded in summary.json
    factory: str | None  # faiss index_factory string; None for exact
    knobs: dict = field(default_factory=dict)  # nprobe / efsearch
    train_min: int = 0  # fewest states training accepts
    train_size: int = 0  # states collected before training (0: no training)
    evictable: bool = True
    auto: bool = False  # the auto index (data/index/pruner.py over the float16 matrix)

    @property
    def exact(self) -> bool:
        return self.factory is None and not self.auto


def parse_index_spec(text: str, d: int | None = None) -> IndexSpec:
    """Parse a spec (see the module docstring); d, when known, checks pq's M divides it."""
    raw = (text or "").strip().lower()
    if raw in ("", "exact"):
        return IndexSpec("exact", None)
    if raw == "auto":
        return IndexSpec("auto", None, auto=True)
    knobs, coders = _spec_parts(text, raw)
    pre, ivf, hnsw, storage = _spec_roles(text, coders, knobs)
    fac, train_min, train_size = _spec_factory(text, d, pre, ivf, hnsw, storage, knobs)
    canon = ",".join(pre + ivf + hnsw + storage + [f"{k}={v}" for k, v in sorted(knobs.items())])
    return IndexSpec(canon, fac, knobs, train_min, train_size, evictable=not hnsw)


def _spec_parts(text: str, raw: str) -> tuple[dict, list[str]]:
    """The spec's knobs (name -> value) and its coder parts, in the order written."""
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    knobs, coders = {}, []
    for p in parts:
        if "=" in p:
            key, _, val = p.partition("=")
            if key not in KNOBS or not val.isdigit() or int(val) < 1:
                raise OilbirdError(f"unknown index knob '{p}' in '{text}'; knobs: nprobe=N, efsearch=N")
            knobs[key] = int(val)
        elif CODER.match(p):
            coders.append(p)
        else:
            raise OilbirdError(f"unknown index spec '{text}' (part '{p}'); use auto, exact, flat, sq8, pq64, pca128, "
                               "opq64,pq64, ivf1024,pq64, hnsw32 (knobs nprobe=N, efsearch=N)")
    if not coders:
        raise OilbirdError(f"index spec '{text}' names no index")
    for c in coders:
        _check_count(text, c)
    return knobs, coders


def _check_count(text: str, coder: str) -> None:
    """A count (hnsw links, ivf lists, opq or pca width) inside SPEC_RANGES, else one line with the range."""
    kind = next((k for k in SPEC_RANGES if coder.startswith(k)), None)
    if kind is None:
        return
    n, (lo, hi) = int(coder[len(kind):]), SPEC_RANGES[kind]
    if n < lo or (hi is not None and n > hi):
        valid = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
        raise OilbirdError(f"index spec '{text}': {coder} is out of range; {kind}N takes N = {valid}")


def _spec_roles(text: str, coders: list[str], knobs: dict) -> tuple[list[str], list[str], list[str], list[str]]:
    """(transform, ivf, hnsw, coder): each at most one, written in that order, knobs matching them."""
    ivf = [c for c in coders if c.startswith("ivf")]
    hnsw = [c for c in coders if c.startswith("hnsw")]
    pre = [c for c in coders if c.startswith(("pca", "opq"))]
    storage = [c for c in coders if c not in ivf + hnsw + pre]
    if len(ivf) + len(hnsw) > 1 or len(storage) > 1 or len(pre) > 1:
        raise OilbirdError(f"index spec '{text}': at most one of ivf/hnsw, one transform and one coder")
    order = pre + ivf + hnsw + storage
    if coders != order:
        raise OilbirdError(f"index spec '{text}': write it as transform, ivf or hnsw, coder "
                           f"(e.g. '{','.join(order)}')")
    if "nprobe" in knobs and not ivf:
        raise OilbirdError(f"index spec '{text}': nprobe needs an ivf index")
    if "efsearch" in knobs and not hnsw:
        raise OilbirdError(f"index spec '{text}': efsearch needs an hnsw index")
    return pre, ivf, hnsw, storage


def _spec_factory(text: str, d: int | None, pre: list[str], ivf: list[str], hnsw: list[str],
                  storage: list[str], knobs: dict) -> tuple[str, int, int]:
    """(faiss index_factory string, fewest training states, states collected before training); the
    ivf and hnsw knobs' defaults are filled into `knobs`."""
    factory, train_min, train_size = [], 0, 0
    if pre:
        c = pre[0]
        n = int(re.sub(r"\D", "", c))
        if c.startswith("pca"):
            if d is not None and not 1 <= n < d:
                raise OilbirdError(f"index spec '{text}': pca{n} needs 1 <= {n} < d = {d}")
            factory += [f"PCA{n}", "L2norm"]  # centred projection, back on the unit sphere
            train_min, train_size = max(train_min, n + 1), max(train_size, 4 * n)
        else:
            if d is not None and d % n:
                raise OilbirdError(f"index spec '{text}': opq{n} needs {n} dividing the state width ({d})")
            factory.append(f"OPQ{n}")
            train_min, train_size = max(train_min, 256), max(train_size, TRAIN_PER_CENTROID * 256)
    if ivf:
        n = int(ivf[0][3:])
        factory.append(f"IVF{n}")
        train_min, train_size = max(train_min, n), max(train_size, TRAIN_PER_CENTROID * n)
        knobs.setdefault("nprobe", KNOBS["nprobe"])
    if hnsw:
        factory.append(f"HNSW{int(hnsw[0][4:])}")
        knobs.setdefault("efsearch", KNOBS["efsearch"])
    if storage:
        c = storage[0]
        m = CODER.match(c)
        if c.startswith("pq"):
            M, bits = int(m.group(2)), int(m.group(4) or 8)
            dim = int(re.sub(r"\D", "", pre[0])) if pre and pre[0].startswith("pca") else d
            if M < 1 or (dim is not None and dim % M):
                raise OilbirdError(f"index spec '{text}': pq{M} needs M dividing the state width ({dim})")
            if not 1 <= bits <= 16:
                raise OilbirdError(f"index spec '{text}': pq bits must be 1..16")
            if m.group(5) and bits != 4:
                raise OilbirdError(f"index spec '{text}': fast-scan codes are 4 bits (write pq{M}x4fs)")
            if m.group(5) and hnsw:
                raise OilbirdError(f"index spec '{text}': hnsw cannot store fast-scan codes")
            factory.append((f"PQ{M}x{bits}" if bits != 8 else f"PQ{M}") + (m.group(5) or ""))
            train_min, train_size = max(train_min, 1 << bits), max(train_size, TRAIN_PER_CENTROID * (1 << bits))
        elif c == "flat":
            factory.append("Flat")
        else:
            factory.append("SQfp16" if c == "fp16" else c.upper())  # faiss spells fp16 SQfp16
            train_min, train_size = max(train_min, 1), max(train_size, 1000)
    elif not hnsw:
        factory.append("Flat")
    fac = ",".join(factory)
    if hnsw:  # faiss writes an hnsw's storage as HNSW32_SQ8
        fac = fac.replace(f"HNSW{int(hnsw[0][4:])},", f"HNSW{int(hnsw[0][4:])}_")
    return fac, train_min, train_size


def check_trainable(spec: IndexSpec, available: int) -> None:
    """One line when the states the caller has cannot train the spec."""
    if spec.train_min and available < spec.train_min:
        raise OilbirdError(f"index {spec.text} needs at least {spec.train_min} states to train "
                           f"(better {spec.train_size}); the store has {available}")


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm in float32, zero rows kept zero: the one normalisation of states
    for the index and the decoder's pools (census/knn.py's `unit_rows` is the exact key's float64
    variant, which its rounding bound needs)."""
    x = np.asarray(x, np.float32)
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, n, out=np.zeros_like(x), where=n > 0)


@contextlib.contextmanager
def one_faiss_thread(faiss):
    """Run the enclosed faiss call on one OpenMP thread, then restore the process's setting.

    A single query has nothing for faiss to split, but its thread team still meets at barriers, and
    when another process holds a core (a serving engine's forward, a second replay) each barrier waits
    out a time slice: one IVF query over 65k states took 5-13 ms on 2 threads beside a busy process
    against 0.06-0.3 ms on one (this machine, 2 cores). Batched searches and training keep every thread."""
    n = faiss.omp_get_max_threads()
    if n > 1:
        faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            faiss.omp_set_num_threads(n)


def unit_vector(x: np.ndarray) -> np.ndarray:
    """One state as a contiguous float32 unit vector [d] (zero stays zero): `unit` for a single query,
    without its array machinery (a query path runs it once per pass)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    n = math.sqrt(float(x @ x))
    return x / n if n > 0 else x.copy()


class StateIndex:
    """Cosine kNN over states with serving-order ids, exact warm-up then a faiss index."""

    def __init__(self, spec: IndexSpec | str, d: int, train_size: int | None = None):
        import faiss  # the [faiss] extra; only the compressed specs need it

        self.faiss = faiss
        self.spec = spec if isinstance(spec, IndexSpec) else parse_index_spec(spec, d)
        if self.spec.factory is None:
            raise OilbirdError("StateIndex builds faiss specs; the exact and auto keys are the caller's own path")
        self.d = d
        self.index = faiss.index_factory(d, self.spec.factory, faiss.METRIC_INNER_PRODUCT)
        needs_training = self.spec.train_min > 0 or not self.index.is_trained
        self.train_size = max(self.spec.train_min, train_size or self.spec.train_size) if needs_training else 0
        self.ivf = faiss.try_extract_index_ivf(self.index)
        for part in (self.index, self.ivf, getattr(self.index, "index", None)):
            if part is not None and hasattr(faiss.downcast_index(part), "do_polysemous_training"):
                faiss.downcast_index(part).do_polysemous_training = False  # minutes of training, unused here
        if self.ivf is not None:
            self.ivf.nprobe = self.spec.knobs["nprobe"]
        self.hnsw = None
        if "efsearch" in self.spec.knobs:
            inner = self.index
            while not hasattr(inner, "hnsw") and hasattr(inner, "index"):
                inner = faiss.downcast_index(inner.index)
            self.hnsw = inner.hnsw
            self.hnsw.efSearch = self.spec.knobs["efsearch"]
        self.trained = bool(self.index.is_trained) and self.train_size == 0
        self.buffer = np.zeros((0, d), np.float32)  # unit rows waiting for training (rows [0, buffered))
        self.buffer_ids = np.zeros(0, np.int64)
        self.buffered = 0
        self.seq = 0  # rows ever added to the faiss index
        self.base = 0  # sequence number of the faiss index's first kept row
        self._ids = np.zeros(0, np.int64)  # external id per kept sequence number (from base); grows by doubling
        self._n_ids = 0
        self.empty_bytes = 0
        self.warmup_queries = 0
        self.queries = 0

    # -------------------------------------------------------------- adding, evicting

    @property
    def ids(self) -> np.ndarray:
        """External id per kept sequence number (from base), increasing."""
        return self._ids[:self._n_ids]

    @property
    def ntotal(self) -> int:
        return self.buffered if not self.trained else int(self.index.ntotal)

    def add(self, states: np.ndarray, ids: np.ndarray) -> None:
        """Append rows (raw states; normalised here) with increasing ids above every earlier id."""
        x = unit(states).reshape(-1, self.d)
        ids = np.asarray(ids, np.int64).reshape(-1)
        if len(x) != len(ids):
            raise ValueError("one id per state")
        if not len(x):
            return
        if not self.trained:
            n = self.buffered + len(x)
            if n > len(self.buffer):  # grows by doubling: amortised O(1) per row
                cap = max(n, 2 * len(self.buffer), 1024)
                self.buffer = np.resize(self.buffer, (cap, self.d))
                self.buffer_ids = np.resize(self.buffer_ids, cap)
            self.buffer[self.buffered:n] = x
            self.buffer_ids[self.buffered:n] = ids
            self.buffered = n
            if self.buffered >= self.train_size:
                self._train()
            return
        self._encode(x, ids)

    def _train(self) -> None:
        x = self.buffer[:self.buffered].copy()
        ids = self.buffer_ids[:self.buffered].copy()
        self.buffer, self.buffer_ids, self.buffered = np.zeros((0, self.d), np.float32), np.zeros(0, np.int64), 0
        if not self.index.is_trained:
            self.index.train(x)
        self.empty_bytes = len(self.faiss.serialize_index(self.index))
        self.trained = True
        self._encode(x, ids)

    def _encode(self, x: np.ndarray, ids: np.ndarray) -> None:
        seq = np.arange(self.seq, self.seq + len(x), dtype=np.int64)
        if self.ivf is not None:
            self.index.add_with_ids(x, seq)
        else:
            self.index.add(x)
        self.seq += len(x)
        n = self._n_ids + len(ids)
        if n > len(self._ids):  # doubling: appends stay amortised O(1)
            self._ids = np.resize(self._ids, max(n, 2 * len(self._ids), 1024))
        self._ids[self._n_ids:n] = ids
        self._n_ids = n

    def evict_below(self, lo: int) -> None:
        """Drop every row with id < lo (oldest first: ids only grow)."""
        if not self.trained:
            c = int(np.searchsorted(self.buffer_ids[:self.buffered], lo))
            if c:
                self.buffer = self.buffer[c:self.buffered].copy()
                self.buffer_ids = self.buffer_ids[c:self.buffered].copy()
                self.buffered -= c
            return
        c = int(np.searchsorted(self.ids, lo))
        if c == 0:
            return
        if not self.spec.evictable:
            raise OilbirdError(f"index {self.spec.text} cannot evict (faiss HNSW has no removal); "
                               "use a flat-code or ivf spec with a store budget")
        if self.ivf is not None:
            self.index.remove_ids(self.faiss.IDSelectorRange(self.base, self.base + c))
        else:
            self.index.remove_ids(self.faiss.IDSelectorRange(0, c))
        self.base += c
        self._ids = self._ids[c:self._n_ids].copy()
        self._n_ids -= c

    # -------------------------------------------------------------- searching

    def search(self, queries: np.ndarray, k: int, *, lo: int = 0,
               exclude: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids [nq, k] int64, -1 padded; scores [nq, k] float32, nan padded), best first."""
        q = unit(queries).reshape(-1, self.d)
        nq = len(q)
        out_ids = np.full((nq, k), -1, np.int64)
        out_s = np.full((nq, k), np.nan, np.float32)
        self.queries += nq
        if nq == 0 or k <= 0 or self.ntotal == 0:
            return out_ids, out_s
        if not self.trained:
            self.warmup_queries += nq
            pool = self.buffer[:self.buffered]
            pool_ids = self.buffer_ids[:self.buffered]
            s = torch.from_numpy(q) @ torch.from_numpy(pool).T
            bad = self._blocked(pool_ids, lo, exclude)
            s[:, torch.from_numpy(bad)] = -float("inf")
            kk = min(k, len(pool_ids))
            v, i = torch.topk(s, kk, dim=1)
            v, i = v.numpy(), i.numpy()
            ok = np.isfinite(v)
            out_ids[:, :kk] = np.where(ok, pool_ids[i], -1)
            out_s[:, :kk] = np.where(ok, v, np.nan)
            return out_ids, out_s
        width = min(self.ntotal, k + 16)
        while True:
            if nq == 1:
                with one_faiss_thread(self.faiss):
                    scores, labels = self.index.search(q, width)
            else:
                scores, labels = self.index.search(q, width)
            seq = labels.astype(np.int64)
            got = seq >= 0
            pos = np.where(got, seq - (self.base if self.ivf is not None else 0), 0)
            ext = np.where(got, self.ids[np.clip(pos, 0, max(len(self.ids) - 1, 0))], -1)
            keep = got & ~self._blocked(ext, lo, exclude)
            enough = keep.sum(axis=1) >= k
            if enough.all() or width >= self.ntotal:
                break
            short = ~enough & (got.sum(axis=1) >= width)  # a full answer, filtered short: widen
            if not short.any():
                break
            width = min(self.ntotal, width * 4)
        for r in range(nq):
            sel = np.nonzero(keep[r])[0][:k]
            out_ids[r, :len(sel)] = ext[r, sel]
            out_s[r, :len(sel)] = scores[r, sel]
        return out_ids, out_s

    @staticmethod
    def _blocked(ids: np.ndarray, lo: int, exclude) -> np.ndarray:
        bad = ids < lo
        for a, b in exclude or ():
            bad |= (ids >= a) & (ids < b)
        return bad

    # -------------------------------------------------------------- accounting

    def bytes_per_state(self) -> float:
        """Serialized bytes per kept state, the fixed part (codebooks, projection) left out;
        float32 during warm-up."""
        if not self.trained:
            return 4.0 * self.d
        n = int(self.index.ntotal)
        if n == 0:
            return float("nan")
        return (len(self.faiss.serialize_index(self.index)) - self.empty_bytes) / n

    def fixed_bytes(self) -> int:
        return self.empty_bytes

    def describe(self) -> dict:
        return {"spec": self.spec.text, "factory": self.spec.factory, "trained": self.trained,
                "train_size": self.train_size, "bytes_per_state": round(self.bytes_per_state(), 2),
                "fixed_bytes": self.fixed_bytes(), "queries": self.queries, "warmup_queries": self.warmup_queries}


def split_specs(text: str) -> list[str]:
    """A list of specs: ';' separates them; within a part, commas join what can follow (a transform
    takes an ivf/hnsw or a coder, an ivf/hnsw takes a coder, knobs go with the spec before), so
    'exact,sq8,pca128,sq8,ivf256,pq64,nprobe=8' reads exact | sq8 | pca128,sq8 | ivf256,pq64,nprobe=8."""
    rank = {"pca": 0, "opq": 0, "ivf": 1, "hnsw": 1}
    specs: list[str] = []
    for chunk in text.split(";"):
        current: list[str] = []
        last = -1  # rank of the spec's last part: 0 transform, 1 ivf/hnsw, 2 coder
        for p in [p.strip() for p in chunk.split(",") if p.strip()]:
            low = p.lower()
            r = 3 if "=" in low else next((v for k, v in rank.items() if low.startswith(k)), 2)
            if low in ("exact", "auto"):
                r = 2
            joins = current and (r == 3 or (r > last and last < 2 and low not in ("exact", "auto")))
            if joins:
                current.append(p)
                last = max(last, r) if r < 3 else last
            else:
                if current:
                    specs.append(",".join(current))
                current, last = [p], r
        if current:
            specs.append(",".join(current))
    return specs
