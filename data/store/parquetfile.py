"""One store file read as a table of store format 2, whatever wrote it (data/store/schema.py).

A file goes through pyarrow; under pyarrow < 26 a format-1 file (null state rows,
apache/arrow#35692) goes to the fallbacks of data/store/legacy.py instead. The table then gets the
columns older writers lacked (OPTIONAL_COLUMNS, VALIDITY) and must equal the schema; a
difference is one line naming the real differences before the dialect ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import OilbirdError
from data.readfile import regular_file
from data.store import legacy
from data.store.arrowmem import arrow_owned, read_file_buffer
from data.store.schema import (
    OPTIONAL_COLUMNS,
    VALIDITY,
    bools,
    fixed_list,
    fixed_list_to_numpy,
    numpy_dtype,
)


def _kind(t: pa.DataType):
    """A type with the Parquet dialect taken out (list item names, 32/64-bit offsets)."""
    if pa.types.is_fixed_size_list(t):
        return ("fixed_size_list", t.list_size, _kind(t.value_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", _kind(t.value_type))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return str(t)


def _schema_difference(have: pa.Schema, want: pa.Schema) -> str:
    """The differences, real ones (missing or extra columns, other value types) before dialect ones
    (nullability, list item names, large types, column order)."""
    real, dialect = [], []
    got = {f.name: f for f in have}
    want = pa.schema([f for f in want if f.name in got or f.name not in OPTIONAL_COLUMNS])  # absence is no difference
    for f in want:
        g = got.get(f.name)
        if g is None:
            real.append(f"{f.name}: missing (expected {f.type})")
        elif _kind(g.type) != _kind(f.type):
            real.append(f"{f.name}: {g.type} (expected {f.type})")
        elif not g.equals(f):
            dialect.append(f"{f.name}: {g.type}{'' if g.nullable else ' not null'} (expected {f.type})")
    real += [f"{name}: unexpected column" for name in got if name not in want.names]
    if not real and not dialect and have.names != want.names:
        dialect.append("columns in another order")
    text = "; ".join(real[:3])
    if dialect:
        text += ("; " if text else "") + "dialect only: " + "; ".join(dialect[:2])
    return text


def _parse_parquet(path: Path, blob, schema: pa.Schema, legacy_ok: bool = True) -> pa.Table:
    """A store file as a table of `schema` (store format 2). `legacy_ok`: a format-1 file (no
    validity column) is accepted too; a store whose meta.json says format 2 requires the column."""
    table = _read_table(path, blob)
    table = _fill_optional(table, schema)
    table = _fill_validity(table, schema, legacy_ok)
    table = _fill_optional(table, schema)  # again: a column after a validity one (finished_at) fits only now
    if not table.schema.equals(schema, check_metadata=False):
        raise OilbirdError(f"{path} does not match the trace schema ({_schema_difference(table.schema, schema)})")
    return table


# What pyarrow < 26 says reading a null row of a fixed-size-list column (apache/arrow#35692); 26 reads them.
NULL_ROW_ERROR = "Expected all lists to be of size="
PYARROW_READS_NULL_ROWS = int(pa.__version__.split(".")[0]) >= 26


def _read_table(path: Path, blob) -> pa.Table:
    """The file's table as pyarrow reads it (null rows and all). Under pyarrow < 26 a file whose
    footer counts null rows goes to the fallbacks without a try: the failed read
    (apache/arrow#35692) can leave pyarrow 25 to abort at exit ("terminate called without an
    active exception"), which would make the one-line error two lines and exit code 134."""
    # in memory Arrow owns (data/store/arrowmem.py: else an exit right after the read can abort, rc 134)
    data = (blob if isinstance(blob, pa.Buffer) else arrow_owned(blob)) if blob is not None else None
    if not PYARROW_READS_NULL_ROWS:
        data = data if data is not None else _file_bytes(path)
        if _footer_counts_null_rows(data):
            return _read_format1(path, data)
    try:
        return _read_arrow(pa.BufferReader(data) if data is not None else path)
    except pa.ArrowInvalid as e:
        if NULL_ROW_ERROR not in str(e):
            raise _corrupt(path, e) from None
    except OSError as e:
        raise _corrupt(path, e) from None
    return _read_format1(path, data if data is not None else _file_bytes(path))


def _file_bytes(path: Path) -> pa.Buffer:
    try:
        return read_file_buffer(path)
    except OSError as e:
        raise OilbirdError(f"cannot read {path}: {e.strerror or e}") from None


def _footer_counts_null_rows(data: pa.Buffer) -> bool:
    """A fixed-size-list column whose statistics in the footer count nulls, or keep no count (the
    writer's files carry them; a footer that does not parse is left to the read to report)."""
    try:
        file = pq.ParquetFile(pa.BufferReader(data))
        fixed = {f.name for f in file.schema_arrow if pa.types.is_fixed_size_list(f.type)}
    except (pa.ArrowException, OSError):
        return False
    md = file.metadata
    for rg in range(md.num_row_groups):
        for i in range(md.num_columns):
            col = md.row_group(rg).column(i)
            if col.path_in_schema.split(".")[0] in fixed:
                stats = col.statistics
                if stats is None or not stats.has_null_count or stats.null_count:
                    return True
    return False


def _read_format1(path: Path, data: pa.Buffer) -> pa.Table:
    """A store-format-1 file through the fallbacks (data/store/legacy.py), or one line saying what to do."""
    raw = bytes(data)  # the fallbacks edit the bytes
    for fallback in legacy.FALLBACKS:  # read at call time: the tests swap them
        try:
            return fallback(raw)
        except Exception:  # noqa: BLE001 -- whatever stops a fallback, the next one (or the error) follows
            continue
    store = path.parent
    raise OilbirdError(f"trace store {store} was written with null state rows ({path.name}), which pyarrow "
                       f"{pa.__version__} cannot read (apache/arrow#35692): run `python -m data migrate {store}` "
                       "with pyarrow>=26, or upgrade pyarrow")


def _corrupt(path: Path, e: Exception) -> OilbirdError:
    return OilbirdError(f"corrupt Parquet file {path}: {str(e).splitlines()[0] if str(e) else e!r} "
                        "(the store is damaged; recapture with --force)")


def _read_arrow(source) -> pa.Table:
    return pq.read_table(source)


def _fill_validity(table: pa.Table, schema: pa.Schema, legacy_ok: bool) -> pa.Table:
    """Store format 2 from any file: null rows of the fixed-size-list columns (store format 1, or a
    hand edit) become zero rows, false in their validity column, which a format-1 file gets here."""
    for name, cols in VALIDITY.items():
        i, have = schema.get_field_index(name), name in table.column_names
        if i < 0 or not all(c in table.column_names for c in cols) or not (have or legacy_ok):
            continue  # not this file's columns; or a format-2 store's file without it (the schema check says so)
        valid = bools(table.column(name)) if have else np.ones(table.num_rows, bool)
        if any(table.column(c).null_count for c in cols):
            for c in cols:
                valid = valid & bools(pc.is_valid(table.column(c)))
            table = _zero_rows(table, cols, valid)
        column = pa.array(valid, pa.bool_())
        if have:
            table = table.set_column(table.schema.get_field_index(name), schema.field(name), column)
        else:
            table = table.add_column(min(i, table.num_columns), schema.field(name), column)
    return table


def _zero_rows(table: pa.Table, cols: tuple[str, ...], valid: np.ndarray) -> pa.Table:
    """The fixed-size-list columns `cols` without nulls: zeros in every row where `valid` is false."""
    for c in cols:
        t = table.schema.field(c).type
        mat, _ = fixed_list_to_numpy(table.column(c), t.list_size, numpy_dtype(t.value_type))
        table = table.set_column(table.schema.get_field_index(c), c,
                                 fixed_list(mat, table.num_rows, t.list_size, t.value_type, valid))
    return table


def _fill_optional(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A table written before an optional column existed (OPTIONAL_COLUMNS) gets it, with its default in
    every row, where the schema puts it; anything else is left for the schema check to report."""
    for name, default in OPTIONAL_COLUMNS.items():
        i = schema.get_field_index(name)
        if i < 0 or name in table.column_names or i > table.num_columns:
            continue
        f = schema.field(name)
        table = table.add_column(i, f, pa.array([default] * table.num_rows, f.type))
    return table


def _read_checked(path: Path, schema: pa.Schema, legacy_ok: bool = True,
                  columns: list[str] | None = None) -> tuple[pa.Table, str]:
    """A Parquet file and the sha256 of its bytes (read once for both, into memory Arrow owns). Anything but
    a regular file is refused before it is opened: a device (/dev/zero) would be read without end, a FIFO
    would block. columns: only these of a store-format-2 file (legacy_ok False) are parsed (the census's
    driver leaves the states to its shards: data/store/statefiles.py); the sha256 still covers every byte."""
    regular_file(path, "trace store file")
    try:
        blob = read_file_buffer(path)
    except OSError as e:
        raise OilbirdError(f"cannot read {path}: {e.strerror or e}") from None
    digest = hashlib.sha256(blob).hexdigest()
    if columns is None or legacy_ok:
        table = _parse_parquet(path, blob, schema, legacy_ok)
        return (table if columns is None else table.select(columns)), digest
    return _parse_columns(path, blob, schema, columns), digest


def _parse_columns(path: Path, blob: pa.Buffer, schema: pa.Schema, columns: list[str]) -> pa.Table:
    """`columns` of a store-format-2 file, the others left unparsed (no null rows in format 2; a file whose
    footer counts some goes the whole way, as _read_table says why)."""
    if not PYARROW_READS_NULL_ROWS and _footer_counts_null_rows(blob):
        return _parse_parquet(path, blob, schema, False).select(columns)
    want = pa.schema([schema.field(c) for c in columns])
    try:
        have = pq.read_schema(pa.BufferReader(blob))
        if all(c in have.names for c in columns):
            table = pq.read_table(pa.BufferReader(blob), columns=columns)
        else:
            table = have.empty_table()
    except (pa.ArrowInvalid, OSError) as e:
        raise _corrupt(path, e) from None
    if not table.schema.equals(want, check_metadata=False):
        raise OilbirdError(f"{path} does not match the trace schema ({_schema_difference(table.schema, want)})")
    return table

