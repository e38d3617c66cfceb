"""Store format 1 -> 2: reading a format-1 store under pyarrow < 26, and `python -m data migrate`.

Store format 1 (data/schema.py docstring) wrote a state-less row as a null row of a fixed-size-list
column, which pyarrow < 26 cannot read from Parquet (apache/arrow#35692: "Expected all lists to be
of size=576 but index 54 had size=0"). data/storefile.py's reader tries FALLBACKS, in order, on such a
file: the first reads it with pyarrow itself, the second with polars; when neither can, it names
the migration.

migrate_store rewrites a complete store in format 2 (zeros plus a validity column), refusing a
damaged one (`verify_store` first). It keeps the writer's discipline: every file is renamed into
place, and meta.json records the new files' checksums under `migrating` before the first rename,
so a reader accepts each file under its old or its new checksum until the last step moves them
into `checksums` (with `store_format` 2 and `migrated_from_format`), all under the store's write
lock (data/storelock.py), so no capture writes the store meanwhile. A migration killed midway
leaves a store that opens and verifies; running it again finishes it. A store without checksums
(older than them) is rewritten the same way and stays without checksums.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import OilbirdError
from data.files import atomic_write_bytes, atomic_write_json, fault_point, parquet_bytes
from data.schema import STORE_FORMAT, fill_zero, fixed_list_to_numpy, numpy_dtype, position_schema, request_schema
from data.store import _load_committed, _store_format, read_meta
from data.storelock import StoreLock
from data.verify import verify_store


# ---------------------------------------------------------------- reading format 1 under pyarrow < 26

def _read_without_arrow_schema(data: bytes) -> pa.Table:
    """Fallback for pyarrow < 26: the Arrow schema that pyarrow stores in the footer (key
    "ARROW:schema") is what makes `hidden` a fixed-size list; with the key renamed, in a copy in
    memory, the same columns read as variable-size lists, whose null rows every pyarrow reads.
    The types are then put back from that schema (pq.read_schema reads only the footer)."""
    want = pq.read_schema(pa.BufferReader(data))
    size = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - size
    key = b"\x0cARROW:schema"  # the key as Thrift writes it: its length, then its bytes
    if data[-4:] != b"PAR1" or start < 4 or data.count(key, start) != 1:
        raise ValueError("no single Arrow schema in the footer")
    at = data.index(key, start)
    plain = data[:at] + b"\x0cARROW:ignore" + data[at + len(key):]
    return _conform(pq.read_table(pa.BufferReader(plain)), want)


def _read_with_polars(data: bytes) -> pa.Table:
    """Fallback for pyarrow < 26: polars' own Parquet reader (polars >= 1.x with Float16; 1.0 fails
    on float16 columns, and _read_without_arrow_schema serves it)."""
    want = pq.read_schema(pa.BufferReader(data))
    return _conform(pl.read_parquet(io.BytesIO(data)).to_arrow(), want)


FALLBACKS = (_read_without_arrow_schema, _read_with_polars)


def _conform(table: pa.Table, want: pa.Schema) -> pa.Table:
    """`table` with the column types of `want`, null rows of fixed-size lists kept null."""
    cols = []
    for f in want:
        col = table.column(f.name)
        cols.append(_as_fixed(col, f.type) if pa.types.is_fixed_size_list(f.type) else col.cast(f.type))
    return pa.Table.from_arrays(cols, schema=pa.schema(list(want)))


def _as_fixed(col: pa.ChunkedArray, t: pa.FixedSizeListType) -> pa.Array:
    """A list column, fixed- or variable-size, whose non-null rows all hold t.list_size values, as t."""
    col = col.combine_chunks()
    width, dtype = t.list_size, numpy_dtype(t.value_type)
    if pa.types.is_fixed_size_list(col.type):
        mat, valid = fixed_list_to_numpy(col, width, dtype)
    else:
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        lengths = pc.list_value_length(col).fill_null(width).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != width).any():
            raise ValueError(f"a row of {col.type} does not hold {width} values")
        values = fill_zero(pc.list_flatten(col)).to_numpy(zero_copy_only=False).astype(dtype)
        mat = np.zeros((len(col), width), dtype)
        mat[valid] = values.reshape(-1, width)
    values = pa.array(mat.reshape(-1), type=t.value_type)
    return pa.FixedSizeListArray.from_arrays(values, width, mask=pa.array(~valid))


# ---------------------------------------------------------------- migration

def migrate_store(path: str | Path) -> str:
    """Rewrite the store at `path` in store format 2; returns the line to print."""
    path = Path(path)
    if not path.exists():
        raise OilbirdError(f"no such path: {path}")
    if not path.is_dir() or not (path / "meta.json").exists():
        raise OilbirdError(f"{path} is not a trace store (no meta.json); give a store folder, "
                           "runs/<bench>/<model>/traces")
    with StoreLock(path):  # a capture writing the store at the same time would interleave its commits
        return _migrate(path)


def _migrate(path: Path) -> str:
    meta = read_meta(path)
    old = _store_format(meta)
    if old >= STORE_FORMAT and "migrating" not in meta:
        return f"{path}: already in store format {old}; nothing to migrate"
    verify_store(path)  # a damaged (or incomplete) store is refused, never rewritten
    got = _load_committed(path, meta)
    names = sorted(n for n in got.checksums if n != "requests.parquet")
    d = int(meta["d_model"])
    tables = {"requests.parquet": got.requests.cast(request_schema(d)),  # the writer's types, field names too
              **{name: t.cast(position_schema(d)) for name, t in zip(names, got.parts)}}
    blobs = {name: parquet_bytes(t) for name, t in tables.items()}  # all in memory, as open_store holds them
    sums = {name: hashlib.sha256(b).hexdigest() for name, b in blobs.items()}
    checked = meta.get("checksums") is not None
    if checked:
        meta["migrating"] = sums  # step 1: readers accept either checksum from here on
        atomic_write_json(path / "meta.json", meta)
    fault_point("migrate_after_pending")
    for name, blob in blobs.items():
        atomic_write_bytes(path / name, blob)  # step 2: each file renamed into place
        fault_point("migrate_after_file")
    if checked:
        meta["checksums"].update(sums)
    meta.pop("migrating", None)
    meta.update(store_format=STORE_FORMAT, migrated_from_format=old)
    atomic_write_json(path / "meta.json", meta)  # step 3: the new checksums are the recorded ones
    kept = "checksums recorded" if checked else "no checksums (a store older than them)"
    return (f"migrated {path}: store format {old} -> {STORE_FORMAT}, {len(blobs)} files rewritten "
            f"({got.requests.num_rows} requests, {sum(t.num_rows for t in got.parts)} positions); {kept}")
