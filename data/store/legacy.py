"""Reading a store-format-1 file under pyarrow < 26: the fallback readers beside the reader.

Store format 1 (data/store/schema.py docstring) wrote a state-less row as a null row of a fixed-size-list
column, which pyarrow < 26 cannot read from Parquet (apache/arrow#35692: "Expected all lists to be
of size=576 but index 54 had size=0"). data/store/parquetfile.py's reader tries FALLBACKS, in order, on such a
file: the first reads it with pyarrow itself, the second with polars; when neither can, it names
the migration (data/store/migrate.py).
"""

from __future__ import annotations

import io

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.store.arrowmem import arrow_owned
from data.store.schema import fill_zero, fixed_list_to_numpy, numpy_dtype


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
    return _conform(pq.read_table(pa.BufferReader(arrow_owned(plain))), want)  # arrowmem.py: why not bytes


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
