"""The trace store as its readers see it: `open_store` checks a store and returns it in memory.

Layout of `runs/<bench>/<model>/traces/` (the folder: data/store/layout.py `store_dir`):
  meta.json          model, fingerprints, layer, n_layers, d_model, dtype, bench, mode, ... and
                     `complete` (false while a capture is running or was interrupted),
                     `n_requests` (committed so far), `checksums` (sha256 of every committed file),
                     `store_format` (the Parquet layout, data/store/schema.py: 2; absent = 1, the older one)
  requests.parquet   one row per finished request (request_schema); rewritten atomically after
                     every part, so it is the commit point of a resumable capture. Its column
                     `tenant` (string, "" = the default tenant) is absent from stores written
                     before tenants: readers fill it with "" (OPTIONAL_COLUMNS), and the
                     checksums, taken over the files' bytes, still hold. Its column `finished_at`
                     (float64, Unix seconds of the request's commit) is null in stores written before it
                     (a store set orders by it: data/store/storeset.py); so are its last two, `sampling`
                     and `off_argmax` (how the tokens were chosen: data/store/sampling.py)
  positions-NNNNN.parquet   one row per generated token (position_schema); a part holds whole
                     requests and is renamed into place before requests.parquet names them

The format (schemas, position semantics, the prompt hash): data/store/schema.py. Writing and the commit
protocol: data/store/writer.py. The full check behind `python -m data verify`: data/store/verify.py.

Readers (open_store) refuse a meta.json or store file that is not a regular file (a FIFO, a device:
data/readfile.py), a meta.json whose seal does not match its fields (data/store/meta.py: an edited
layer, vocab_size, model, ...), an incomplete store, then verify every checksum (sha256 runs at
about 1 GB/s: 0.07 s for a 72 MB store), the schema, the row counts and the prompt hashes. Stores
written before checksums existed (no `checksums` key) open unverified (`TraceStore.verified`).
Checksums cannot be dropped to pass that check (`written_with_checksums`): every writer that
records `checksums` has written `n_requests` beside them in the same meta.json (since checksums
exist) and a new store also gets `store_format` 2 (since that format exists); a store older
than checksums has neither (a migration of it sets `store_format` but also `migrated_from_format`,
and no `n_requests`). So a meta.json without `checksums` but with `n_requests`, or with
`store_format` >= 2 and no `migrated_from_format`, lost them after capture: the store is refused
as damaged (readers and a resuming writer alike, so a resume cannot re-record tampered files).
Only a store stripped of all three (and so indistinguishable from one older than checksums) still
opens unverified; every result computed on it records `store_verified: false` and says so.

What a result depends on is `TraceStore.fingerprint` (`store_fingerprint` of meta.json; for a
store without checksums, of its files' sha256 as read): results record it as `store_fingerprint`,
`current_fingerprint(path)` is the store's one as it is now, and a result whose fingerprint differs
is stale (`current_summary` recomputes it; the reports mark it).

A store killed between the commit point and its meta.json update (step 3 of 4 of the commit
protocol) is recognised here (`_load_committed`): its requests.parquet is accepted only when it
holds exactly the pending row count and agrees row for row with the verified parts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from data.errors import OilbirdError
from data.readfile import read_json, regular_file
from data.results import shown
from data.store.meta import check_seal, is_sealed
from data.store.parquetfile import _read_checked
from data.store.schema import (
    FORMAT_VERSION,
    META_KEYS,
    PROMPT_HASH_SCHEME,
    STORE_FORMAT,
    TOPK,
    bools,
    fixed_list_to_numpy,
    position_schema,
    request_schema,
    zero_invalid,
)
from data.store.statefiles import StateFile, StateFiles


@dataclass
class TraceStore:
    """A validated trace store in memory. Rows of `positions`, `hidden`, `topk` are aligned and
    sorted by (request, position); `offsets[r]:offsets[r+1]` are request r's rows."""

    path: Path
    meta: dict
    requests: pl.DataFrame  # request, id, group, prompt_hash, prompt_tokens, output_tokens, stop_reason, seconds,
    #                         tenant ("" in a store written before tenants), finished_at, sampling, off_argmax
    positions: pl.DataFrame  # request, position, token
    hidden: np.ndarray  # [n_positions, d_model] float16 (zeros where null)
    hidden_valid: np.ndarray  # [n_positions] bool
    topk: np.ndarray  # [n_positions, 8] int32 (zeros where null)
    prompt_last_hidden: np.ndarray  # [n_requests, d_model] float16
    prompt_last_topk: np.ndarray  # [n_requests, 8] int32
    offsets: np.ndarray  # [n_requests + 1] int64
    verified: bool = False  # every file matched its checksum in meta.json (False: a store older than checksums)
    file_checksums: dict | None = None  # sha256 of each committed file as read (`fingerprint` of an unverified store)
    state_files: StateFiles | None = None  # where the states lie when opened with defer_hidden (hidden is [0, d])

    @property
    def meta_sealed(self) -> bool:
        """meta.json carries its seal (data/store/meta.py); False: written before the seal existed."""
        return is_sealed(self.meta)

    @property
    def n_requests(self) -> int:
        return self.requests.height

    @property
    def d_model(self) -> int:
        return int(self.meta["d_model"])

    def tokens(self, r: int) -> np.ndarray:
        return self.positions["token"].to_numpy()[self.offsets[r]:self.offsets[r + 1]]

    def prompt(self, r: int) -> list[int]:
        return list(self.requests["prompt_tokens"][r])

    @property
    def fingerprint(self) -> str:
        """The `store_fingerprint` a result computed from this store records (`current_fingerprint` is the
        same for the store on disk): meta.json's checksums, or for a store without them the files' own
        sha256 as read, so a hand edit of an unverified store still makes its results stale."""
        if self.verified or self.file_checksums is None:
            return store_fingerprint(self.meta)
        return store_fingerprint(dict(self.meta, checksums=self.file_checksums, n_requests=self.n_requests))


def store_fingerprint(meta: dict) -> str:
    """What a result computed from a store depends on: its committed files (their sha256s) and request
    count. Results record it, and `--if-missing` reuses a result only when the store still has it."""
    blob = json.dumps({"checksums": meta.get("checksums") or {}, "n_requests": meta.get("n_requests"),
                       "model_fingerprint": meta.get("model_fingerprint")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def current_fingerprint(store_path: str | Path) -> str | None:
    """The `store_fingerprint` of the store at `store_path` as it is now (what `TraceStore.fingerprint`
    gives when it is opened), or None when it has no readable meta.json or requests.parquet. Reads
    meta.json only; a store without checksums has its files hashed (sha256, about 1 GB/s)."""
    path = Path(store_path)
    try:
        meta = read_json(path / "meta.json", "trace store meta.json")  # never blocks on a FIFO, never reads a device
    except OilbirdError:
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("checksums") is not None:
        return store_fingerprint(meta)
    req = path / "requests.parquet"
    try:
        sums = {f.name: _file_sha256(f) for f in [req, *position_parts(path)]}
        n = meta.get("n_requests")
        if n is None:  # written before n_requests: the rows, from the file's footer
            import pyarrow.parquet as pq

            n = pq.read_metadata(req).num_rows
    except Exception:  # a missing or unreadable file: nothing to compare with (open_store says why)
        return None
    return store_fingerprint(dict(meta, checksums=sums, n_requests=n))


def _file_sha256(f: Path) -> str:
    regular_file(f, "trace store file")  # a device would never end, a FIFO would block
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def current_summary(summary_path: str | Path, store_path: str | Path, **expected) -> dict | None:
    """The summary.json at `summary_path` when it was computed from the store as it is now (a complete
    store with the same fingerprint: `current_fingerprint`) and its fields equal `expected`; else None
    (recompute). What `--if-missing` (census, replay, the grid) reuses."""
    summary_path, meta_path = Path(summary_path), Path(store_path) / "meta.json"
    if not summary_path.exists() or not meta_path.exists():
        return None
    try:
        summary, meta = read_json(summary_path, "summary"), read_json(meta_path, "trace store meta.json")
    except OilbirdError:  # unreadable, a device, a FIFO, too deep: not a summary to reuse
        return None
    if not isinstance(summary, dict) or not isinstance(meta, dict) or not meta.get("complete"):
        return None
    if summary.get("store_fingerprint") != current_fingerprint(store_path):
        return None
    return summary if all(summary.get(k) == v for k, v in expected.items()) else None


def read_meta(path: Path) -> dict:
    """A store's meta.json, checked: a regular file (never a device or a FIFO: data/readfile.py), bounded,
    a JSON object with META_KEYS, this `format`, and its seal intact (data/store/meta.py)."""
    meta_path = Path(path) / "meta.json"
    missing = f"no trace store at {path} (meta.json missing); run `python -m data capture` first"
    meta = read_json(meta_path, "trace store meta.json", missing=missing)
    if not isinstance(meta, dict):
        raise OilbirdError(f"{meta_path} is not a JSON object; not a trace store")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise OilbirdError(f"{meta_path} lacks {', '.join(missing)}; not a trace store of this version")
    if meta["format"] != FORMAT_VERSION:
        raise OilbirdError(f"{meta_path} has format {meta['format']}, this code reads {FORMAT_VERSION}")
    check_seal(meta, meta_path)
    for key, least in _COUNTS.items():  # an unsealed (older) meta.json can still hold a hand edit
        value = meta.get(key)
        if (value is not None or key in META_KEYS) and (
                not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise OilbirdError(f"{meta_path}: `{key}` is {value!r}, not an integer >= {least}; meta.json was edited "
                               "or damaged: restore it from a copy or recapture with --force")
    for key, (what, ok) in _COMMIT_FIELDS.items():  # not sealed (they change at every commit): checked here
        if meta.get(key) is not None and not ok(meta[key]):
            raise OilbirdError(f"{meta_path}: `{key}` is {shown(meta[key])}, not {what}; meta.json was edited or "
                               "damaged: restore it from a copy or recapture with --force")
    return meta


# meta.json counts every reader relies on, and their least value (n_requests and vocab_size may be absent)
_COUNTS = {"layer": 1, "n_layers": 1, "d_model": 1, "max_new_tokens": 1, "vocab_size": 1, "n_requests": 0}


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# meta.json fields a capture's commits write (data/capture/run.py `_Commits`) and an extension reads back: absent
# or null, else of this shape (what it must be, in words; the test)
_COMMIT_FIELDS = {
    "runs": ("a list of objects (one per capture run)",
             lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v)),
    "truncated": ("an object of request id -> the prompt's original length",
                  lambda v: isinstance(v, dict) and all(_count(n) for n in v.values())),
    "prompt_tokens_reused": ("a list of counts (or null) per request",
                             lambda v: isinstance(v, list) and all(n is None or _count(n) for n in v)),
}


def position_parts(path: Path) -> list[Path]:
    return sorted(Path(path).glob("positions-*.parquet"))


def _damaged(path: Path, what: str) -> OilbirdError:
    return OilbirdError(f"trace store {path} is damaged: {what}; recapture with --force "
                        "(or restore the store from a copy)")


@dataclass
class _Committed:
    """What a store holds as of its last commit, read and checked against meta.json's checksums."""

    requests: pa.Table
    parts: list[pa.Table]
    checksums: dict  # name -> sha256 of every committed file (computed, for a store older than checksums)
    orphans: list[Path]  # positions parts written by an interrupted commit, named by no request
    promoted: bool  # requests.parquet was committed but meta.json not yet updated (step 3 of 4)
    verified: bool  # checksums were recorded and matched
    part_names: list[str]  # the positions parts, in the order of `parts`


def _load_committed(path: Path, meta: dict, columns: list[str] | None = None) -> _Committed:
    d = int(meta["d_model"])
    req_path = path / "requests.parquet"
    sums = meta.get("checksums")
    legacy_ok = _store_format(meta) < STORE_FORMAT
    if sums is None:
        marker = written_with_checksums(meta)
        if marker:  # removed after capture: refused, or a tampered file would pass as an older store's
            raise _damaged(path, f"meta.json records no checksums, yet its {marker} shows it was written by a "
                                 "capture that records them: they were removed, so no file can be checked")
        # written before checksums: nothing to verify, only uncommitted parts to tell apart
        return _load_unverified(path, d, legacy_ok, columns)
    if not isinstance(sums, dict):
        raise _damaged(path, "meta.json `checksums` is not an object of file name -> sha256")
    expected = dict(sums)
    moving = meta.get("migrating") or {}  # an interrupted migration's new checksums (data/store/migrate.py)
    promoted = False
    if req_path.exists():
        req, h = _read_checked(req_path, request_schema(d), legacy_ok)
        if h != sums.get(req_path.name) and h == moving.get(req_path.name):
            expected[req_path.name] = h
        elif h != sums.get(req_path.name):
            pending = meta.get("pending") or {}
            if pending.get("n_requests") != req.num_rows or not pending.get("file"):
                raise _damaged(path, f"{req_path.name} does not match its checksum in meta.json")
            # killed after the commit point, before meta.json recorded it: rows are checked below
            expected.update({req_path.name: h, pending["file"]: pending["sha256"]})
            promoted = True
    elif req_path.name in sums:
        raise _damaged(path, f"{req_path.name} is missing")
    else:
        req = request_schema(d).empty_table()
    parts, names = [], sorted(n for n in expected if n != req_path.name)
    for name in names:
        if not (path / name).exists():
            raise _damaged(path, f"{name} is missing")
        table, h = _read_checked(path / name, position_schema(d), legacy_ok, columns)
        if h != expected[name] and h != moving.get(name):
            raise _damaged(path, f"{name} does not match its checksum in meta.json")
        expected[name] = h
        parts.append(table)
    orphans = [p for p in position_parts(path) if p.name not in expected]
    if promoted:
        _check_rows(path, req, parts)
    return _Committed(req, parts, expected, orphans, promoted, verified=True, part_names=names)


def _load_unverified(path: Path, d: int, legacy_ok: bool, columns: list[str] | None = None) -> _Committed:
    """A store written before checksums: parts whose requests requests.parquet names are committed."""
    req_path = path / "requests.parquet"
    req, found = request_schema(d).empty_table(), {}
    if req_path.exists():
        req, found[req_path.name] = _read_checked(req_path, request_schema(d), legacy_ok)
    done = set(req.column("request").to_pylist())
    parts, orphans, names = [], [], []
    for part in position_parts(path):
        table, h = _read_checked(part, position_schema(d), legacy_ok, columns)
        if set(table.column("request").to_pylist()) <= done:
            parts.append(table)
            names.append(part.name)
            found[part.name] = h
        else:
            orphans.append(part)
    return _Committed(req, parts, found, orphans, promoted=False, verified=False, part_names=names)


def written_with_checksums(meta: dict) -> str | None:
    """What in `meta` shows the store was written by code that records checksums (so a missing
    `checksums` is damage), or None for a store older than checksums. The rule (module docstring):
    `n_requests` (every checksumming writer sets it beside `checksums`), or `store_format` >= 2
    without `migrated_from_format` (a new store's writer sets it beside `checksums`; a migration of
    a store older than checksums sets `migrated_from_format` too)."""
    if "n_requests" in meta:
        return "`n_requests`"
    if _store_format(meta) >= STORE_FORMAT and "migrated_from_format" not in meta:
        return f"`store_format` {meta.get('store_format')}"
    return None


def _store_format(meta: dict) -> int:
    """The Parquet layout a store's meta.json declares (1 when absent: written before store formats)."""
    return int(meta.get("store_format") or 1)


def _in_order(table: pa.Table, keys: tuple[str, ...]) -> bool:
    """Rows strictly increasing by `keys` (lexicographically)."""
    cols = [table.column(k).to_numpy().astype(np.int64) for k in keys]
    if len(cols[0]) < 2:
        return True
    later = np.zeros(len(cols[0]) - 1, bool)
    tie = np.ones(len(cols[0]) - 1, bool)
    for c in cols:
        step = np.diff(c)
        later |= tie & (step > 0)
        tie &= step == 0
    return bool(later.all())


def _check_rows(path: Path, req: pa.Table, parts: list[pa.Table]):
    """requests.parquet and the position rows describe the same requests and tokens."""
    d = req.schema.field("prompt_last_hidden").type.list_size
    pos = pa.concat_tables(parts) if parts else position_schema(d).empty_table()
    if not _in_order(req, ("request",)):  # capture writes them in order; sorting copies every state
        req = req.sort_by("request")
    order = None  # the stream's row i is row order[i] of the parts' concatenation (None: i)
    if not _in_order(pos, ("request", "position")):
        order = pc.sort_indices(pos, sort_keys=[("request", "ascending"), ("position", "ascending")])
        pos = pos.take(order)
        order = order.to_numpy().astype(np.int64)
    requests = pl.from_arrow(req.drop_columns(["prompt_last_hidden", "prompt_last_topk", "prompt_last_valid"]))
    positions = pl.from_arrow(pos.select(["request", "position", "token"]))
    n_req = requests.height
    if requests["tenant"].null_count():
        raise _damaged(path, "a request's tenant is null (the default tenant is \"\")")
    if requests["request"].to_list() != list(range(n_req)):
        raise _damaged(path, f"requests.parquet does not number its requests 0..{n_req - 1}")
    lengths = requests["output_tokens"].list.len().to_numpy().astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if positions.height != int(offsets[-1]):
        raise _damaged(path, f"{positions.height} position rows for {int(offsets[-1])} generated tokens")
    expect_req = np.repeat(np.arange(n_req, dtype=np.int32), lengths)
    expect_pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if n_req else np.zeros(0, np.int32)
    if not (np.array_equal(positions["request"].to_numpy(), expect_req)
            and np.array_equal(positions["position"].to_numpy(), expect_pos)):
        raise _damaged(path, "position rows do not match requests.parquet")
    flat_out = requests["output_tokens"].explode().drop_nulls().to_numpy()
    if not np.array_equal(positions["token"].to_numpy(), flat_out.astype(np.int32)):
        raise _damaged(path, "position tokens differ from output_tokens")
    return req, pos, requests, positions, offsets, order


def _hashes_checked(meta: dict) -> bool:
    # capture writes real prompt hashes (and says so); stores older than checksums all came from capture
    return meta.get("prompt_hash_scheme") == PROMPT_HASH_SCHEME or "checksums" not in meta


def _check_prompt_hashes(path: Path, req: pa.Table) -> None:
    col = req.column("prompt_tokens").combine_chunks()
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int32)
    ends = np.cumsum(pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False))
    starts = ends - pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
    stored = req.column("prompt_hash").to_pylist()
    ids = req.column("id").to_pylist()
    for r, (a, b) in enumerate(zip(starts, ends)):
        h = hashlib.sha256(values[a:b].tobytes()).hexdigest()[:16]
        if h != stored[r]:
            raise _damaged(path, f"request {r} ({ids[r]}) has prompt_hash {stored[r]} but its prompt tokens "
                                 f"hash to {h}")


def open_store(path: str | Path, *, model_fingerprint: str | None = None, d_model: int | None = None,
               allow_incomplete: bool = False, load_hidden: bool = True, defer_hidden: bool = False) -> TraceStore:
    """Read and validate a trace store. Mismatches with the expected model are one-line errors.

    load_hidden False: no states (`hidden` is [0, d], `hidden_valid` empty). defer_hidden: the states are
    not parsed but left where they are, `state_files` saying where (data/store/statefiles.py), with
    `hidden_valid` read; a store older than format 2 or than checksums has its states loaded instead."""
    path = Path(path)
    meta = read_meta(path)
    rerun = "rerun the same capture command to resume it (nothing captured so far is lost)"
    if not meta["complete"] and not allow_incomplete:
        from data.store.lock import writer_of

        holder = writer_of(path)
        if holder is not None:
            raise OilbirdError(f"trace store {path} is being written ({holder}); wait for it to finish")
        raise OilbirdError(f"trace store {path} is incomplete (its capture was interrupted); {rerun}")
    if d_model is not None and int(meta["d_model"]) != int(d_model):
        raise OilbirdError(f"trace store {path} has d_model {meta['d_model']}, the model has {d_model}: wrong model for this store")
    if model_fingerprint is not None and meta["model_fingerprint"] != model_fingerprint:
        raise OilbirdError(f"trace store {path} was captured with {meta['model']} ({meta['model_fingerprint']}), "
                           f"not this model ({model_fingerprint}): wrong model for this store")
    d = int(meta["d_model"])
    if not (path / "requests.parquet").exists() and "requests.parquet" not in (meta.get("checksums") or {}):
        raise OilbirdError(f"trace store {path} has no requests.parquet")
    defer = defer_hidden and load_hidden and can_defer_states(meta)
    # the states' column is not parsed where it is not wanted here (format 2 only: _read_checked)
    skip = defer or not load_hidden
    got = _load_committed(path, meta, [c for c in position_schema(d).names if c != "hidden"] if skip else None)
    if meta["complete"] and (got.orphans or got.promoted):
        what = got.orphans[0].name if got.orphans else "requests.parquet"
        raise OilbirdError(f"trace store {path}: {what} was written by an interrupted capture and never "
                           f"committed; {rerun}")
    if got.requests.num_rows == 0:
        raise OilbirdError(f"trace store {path} holds no requests")
    if meta["complete"] and meta.get("n_requests") is not None and int(meta["n_requests"]) != got.requests.num_rows:
        raise OilbirdError(f"trace store {path}: meta.json says {meta['n_requests']} requests but requests.parquet "
                           f"holds {got.requests.num_rows}: an extension of the store was interrupted; {rerun}")
    req, pos, requests, positions, offsets, order = _check_rows(path, got.requests, got.parts)
    if _hashes_checked(meta):
        _check_prompt_hashes(path, req)

    valid = bools(pos.column("hidden_valid"))
    topk = zero_invalid(fixed_list_to_numpy(pos.column("topk"), TOPK, np.int32)[0], valid)
    state_files = None
    if defer:
        hidden = np.zeros((0, d), np.float16)
        state_files = StateFiles(d, [StateFile(str(path / n), got.checksums[n], t.num_rows)
                                     for n, t in zip(got.part_names, got.parts)], order)
    elif load_hidden:
        hidden = zero_invalid(fixed_list_to_numpy(pos.column("hidden"), d, np.float16)[0], valid)
    else:
        hidden, valid = np.zeros((0, d), np.float16), np.zeros(0, bool)
    prompt_valid = bools(req.column("prompt_last_valid"))
    plh = zero_invalid(fixed_list_to_numpy(req.column("prompt_last_hidden"), d, np.float16)[0], prompt_valid)
    plt = zero_invalid(fixed_list_to_numpy(req.column("prompt_last_topk"), TOPK, np.int32)[0], prompt_valid)
    return TraceStore(path=path, meta=meta, requests=requests, positions=positions, hidden=hidden,
                      hidden_valid=valid, topk=topk, prompt_last_hidden=plh, prompt_last_topk=plt,
                      offsets=offsets, verified=got.verified, file_checksums=got.checksums, state_files=state_files)


def can_defer_states(meta: dict) -> bool:
    """A store whose states `defer_hidden` leaves in their files: format 2 (a validity column, no null rows),
    with checksums (what a later reader of a part checks it against)."""
    return _store_format(meta) >= STORE_FORMAT and isinstance(meta.get("checksums"), dict)


