"""Writing a trace store: whole requests appended under a commit protocol that survives a kill.

Commit protocol (StoreWriter.append), each step an atomic rename (data/store/files.py):
  1. positions-NNNNN.parquet is written;
  2. meta.json records it under `pending`, with the row count requests.parquet is about to have;
  3. requests.parquet is rewritten with the new rows: the commit point;
  4. meta.json moves `pending` into `checksums` and updates n_requests.
Killed before 3, requests.parquet still has its recorded checksum: the new part is named by no
one and the writer deletes it on resume. Killed between 3 and 4, requests.parquet's checksum is
not recorded yet: it is accepted (and recorded) only when it holds exactly the pending row count
and agrees row for row with the verified parts (data/store/reader.py `_load_committed`). Any other
checksum mismatch is damage.
meta.json fields that describe the committed rows (capture's `runs`, `truncated`, and
`prompt_tokens_reused`: per request, the prompt tokens whose KV came from an earlier request)
travel with step 2's `pending` and land with the commit, so they stay aligned with the rows.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.errors import OilbirdError
from data.store.files import (
    atomic_write_table,
    clean_leftovers,
    fault_point,
)
from data.store.lock import StoreLock
from data.store.meta import is_sealed, write_meta
from data.store.reader import _check_rows, _load_committed, position_parts, read_meta
from data.store.schema import (
    FORMAT_VERSION,
    STORE_FORMAT,
    TOPK,
    fixed_list,
    position_schema,
    request_schema,
)


def record_checksums(path: str | Path) -> dict:
    """Record the checksums of a store's files as they are now, and reseal its meta.json
    (data/store/meta.py), for a deliberate hand edit (a test that builds an unusual store); never a
    way to silence a damaged one."""
    path = Path(path)
    with StoreLock(path):  # a hand edit still writes meta.json: one writer at a time
        meta = read_meta(path)
        files = [f for f in [path / "requests.parquet", *position_parts(path)] if f.exists()]
        meta["checksums"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
        meta.pop("pending", None)
        write_meta(path, meta)
    return meta["checksums"]


@dataclass
class TraceRecord:
    """One finished request, as capture (or the decoder) produced it."""

    request: int
    id: str
    group: str
    prompt_hash: str
    prompt_tokens: list[int]
    output_tokens: list[int]
    stop_reason: str  # eos | stop_string | length | reference
    seconds: float
    hidden: np.ndarray  # [n_out, d] float (rows beyond hidden_valid are ignored)
    hidden_valid: np.ndarray  # [n_out] bool
    topk: np.ndarray  # [n_out, 8] int
    prompt_last_hidden: np.ndarray  # [d]
    prompt_last_topk: np.ndarray  # [8]
    tenant: str = ""  # the request's tenant ("" = the default one)
    finished_at: float | None = None  # Unix seconds it finished; None: the writer stamps its commit time
    sampling: str | None = None  # how its tokens were chosen (data/store/sampling.py SAMPLINGS); None: unknown
    off_argmax: int | None = None  # its tokens that were not the model's top-1 there; None: unknown


def records_to_tables(records: list[TraceRecord], d_model: int,
                      committed_at: float | None = None) -> tuple[pa.Table, pa.Table]:
    """A request table and a positions table of `records`; a record without `finished_at` gets
    `committed_at` (null when that is None too)."""
    n = len(records)
    req = pa.Table.from_arrays([
        pa.array([r.request for r in records], pa.int32()),
        pa.array([r.id for r in records], pa.string()),
        pa.array([r.group for r in records], pa.string()),
        pa.array([r.prompt_hash for r in records], pa.string()),
        pa.array([list(map(int, r.prompt_tokens)) for r in records], pa.list_(pa.int32())),
        pa.array([list(map(int, r.output_tokens)) for r in records], pa.list_(pa.int32())),
        pa.array([r.stop_reason for r in records], pa.string()),
        pa.array([float(r.seconds) for r in records], pa.float64()),
        fixed_list(np.stack([r.prompt_last_hidden for r in records]).astype(np.float16) if n else None,
                   n, d_model, pa.float16()),
        fixed_list(np.stack([r.prompt_last_topk for r in records]).astype(np.int32) if n else None,
                   n, TOPK, pa.int32()),
        pa.array([str(r.tenant) for r in records], pa.string()),
        pa.array(np.ones(n, bool), pa.bool_()),  # every record has its prompt's state
        pa.array([committed_at if r.finished_at is None else float(r.finished_at) for r in records], pa.float64()),
        pa.array([None if r.sampling is None else str(r.sampling) for r in records], pa.string()),
        pa.array([None if r.off_argmax is None else int(r.off_argmax) for r in records], pa.int32()),
    ], schema=request_schema(d_model))
    lens = [len(r.output_tokens) for r in records]
    total = int(sum(lens))
    hid = np.concatenate([np.asarray(r.hidden, np.float16).reshape(-1, d_model)[:k] for r, k in zip(records, lens)]) \
        if total else np.zeros((0, d_model), np.float16)
    valid = np.concatenate([np.asarray(r.hidden_valid, bool)[:k] for r, k in zip(records, lens)]) \
        if total else np.zeros(0, bool)
    topk = np.concatenate([np.asarray(r.topk, np.int32).reshape(-1, TOPK)[:k] for r, k in zip(records, lens)]) \
        if total else np.zeros((0, TOPK), np.int32)
    pos = pa.Table.from_arrays([
        pa.array(np.repeat([r.request for r in records], lens).astype(np.int32), pa.int32()),
        pa.array(np.concatenate([np.arange(k) for k in lens]).astype(np.int32) if total else [], pa.int32()),
        pa.array(np.concatenate([np.asarray(r.output_tokens, np.int32) for r in records]) if total else [], pa.int32()),
        fixed_list(hid, total, d_model, pa.float16(), valid),  # zeros where not valid: never a null row
        fixed_list(topk, total, TOPK, pa.int32(), valid),
        pa.array(valid, pa.bool_()),
    ], schema=position_schema(d_model))
    return req, pos


class StoreWriter:
    """Appends whole requests to a store, atomically, so an interrupted capture resumes cleanly.

    Commit protocol: see the module docstring (part, pending meta, requests.parquet, meta). On
    open, the store's write lock is taken (data/store/lock.py: a second writer stops at once, naming
    the holder's pid), then the store is brought back to its last commit: parts no request names are
    deleted, a requests.parquet committed just before a kill is recorded, temporary files are
    removed. The lock is held until `finish` or `close` (use the writer in a `with` block), or the
    process's exit.
    """

    # What an extension must share with the store, or it would mix states of two settings in one store
    # (a layer-4 part beside a layer-3 one). All of them are sealed in meta.json (data/store/meta.py).
    SETTINGS = ("model_fingerprint", "layer", "n_layers", "d_model", "vocab_size", "dtype", "tokenizer_hash",
                "chat_template_hash", "bench", "data_fingerprint", "mode", "max_new_tokens", "truncate", "engine")
    SETTING_DEFAULTS = {"engine": "harness"}  # stores written before the setting existed
    RECORDED_LATER = ("n_layers", "vocab_size")  # absent from some older stores' meta.json: compared when recorded

    def __init__(self, path: str | Path, meta: dict, *, force: bool = False):
        self.path = Path(path)
        self.d_model = int(meta["d_model"])
        # before any file is touched: a second writer would take our uncommitted part for an orphan
        self.lock = StoreLock(self.path).acquire()
        try:
            self._open(meta, force)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, meta: dict, force: bool) -> None:
        """Bring the store back to its last commit (class docstring), or start a new one."""
        if force and self.path.exists():
            for p in list(self.path.glob("*.parquet")) + [self.path / "meta.json"]:
                p.unlink(missing_ok=True)
        clean_leftovers(self.path)  # temporary files of a killed write
        if (self.path / "meta.json").exists():
            old = read_meta(self.path)  # refuses an edited meta.json (its seal) before anything is compared
            diff = [k for k in self.SETTINGS
                    if old.get(k, self.SETTING_DEFAULTS.get(k)) != meta.get(k, self.SETTING_DEFAULTS.get(k))
                    and not (k in self.RECORDED_LATER and (k not in old or k not in meta))]
            if diff:
                raise OilbirdError(f"trace store {self.path} was made with other settings ({', '.join(diff)} differ); "
                                   "pass --force to overwrite it or --out for another folder")
            self.meta = old
        else:
            self.meta = dict(meta, complete=False, format=FORMAT_VERSION, store_format=STORE_FORMAT, n_requests=0,
                             checksums={})
            self.meta.pop("migrated_from_format", None)  # a new store was never migrated
            write_meta(self.path, self.meta)
        got = _load_committed(self.path, self.meta)
        if not got.verified and got.requests.num_rows:
            _check_rows(self.path, got.requests, got.parts)  # nothing else vouches for an older store
        if got.promoted:  # the commit landed: so do the meta.json fields that describe its rows
            self.meta.update(self.meta["pending"].get("meta") or {})
        for part in got.orphans:
            part.unlink()  # written before a kill, never committed
        self.requests = got.requests.sort_by("request")
        n = self.requests.num_rows
        if (self.meta.get("checksums") != got.checksums or "pending" in self.meta or "migrating" in self.meta
                or self.meta.get("n_requests") != n or not is_sealed(self.meta)):  # an older store gets its seal
            self.meta.update(checksums=got.checksums, n_requests=n)
            self.meta.pop("pending", None)
            self.meta.pop("migrating", None)  # the files it rewrote are recorded now; migrate converts the rest
            write_meta(self.path, self.meta)

    @property
    def done(self) -> int:
        """Requests committed so far: capture resumes at this index (serving order)."""
        return self.requests.num_rows

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the store's write lock; the writer writes nothing more."""
        self.lock.release()

    def _check_open(self) -> None:
        if not self.lock.held:  # another writer may have changed the store since: our view is stale
            raise RuntimeError(f"StoreWriter({self.path}) used after finish() or close()")

    def reopen(self) -> None:
        """About to add requests to a finished store (a larger --limit): say so on disk first, so a
        kill from here on leaves a store that readers refuse as incomplete, not a short one."""
        self._check_open()
        if self.meta.get("complete"):
            self.meta["complete"] = False
            write_meta(self.path, self.meta)

    def append(self, records: list[TraceRecord], meta: dict | None = None) -> None:
        """Commit `records`; `meta` (fields describing the store with them, e.g. capture runs) is
        written into meta.json with the commit, and is lost with it when a kill comes first."""
        self._check_open()
        if not records:
            return
        expect = list(range(self.done, self.done + len(records)))
        if [r.request for r in records] != expect:
            raise ValueError(f"records must continue the store in order: expected {expect[:3]}...")
        if self.meta.get("complete"):
            self.reopen()
        # the commit time is when a request became readable: a store set orders its members' requests by it
        req, pos = records_to_tables(records, self.d_model, committed_at=time.time())
        name = f"positions-{len(position_parts(self.path)):05d}.parquet"
        part_sha = atomic_write_table(self.path / name, pos)
        fault_point("after_part_write")
        table = pa.concat_tables([self.requests, req])
        self.meta["pending"] = {"file": name, "sha256": part_sha, "n_requests": table.num_rows, "meta": meta or {}}
        write_meta(self.path, self.meta)
        fault_point("after_pending_meta")
        req_sha = atomic_write_table(self.path / "requests.parquet", table)  # the commit point
        self.requests = table
        fault_point("after_requests_write")
        self.meta.pop("pending")
        self.meta.update(meta or {})
        self.meta["checksums"].update({name: part_sha, "requests.parquet": req_sha})
        self.meta["n_requests"] = table.num_rows
        write_meta(self.path, self.meta)
        fault_point("after_commit")

    def finish(self, keep_lock: bool = False, **extra) -> None:
        """Mark the store complete and release its write lock; with `keep_lock` the writer goes on: the
        store reads as complete between its commits (serving writes the store: data/capture/served_store.py)."""
        self._check_open()
        self.meta.update(extra, complete=True, n_requests=self.done)
        self.meta.pop("pending", None)
        write_meta(self.path, self.meta)
        if not keep_lock:
            self.close()
