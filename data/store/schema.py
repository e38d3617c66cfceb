"""The trace store's format: its Parquet schemas, its constants and the prompt hash.

Position semantics: row (request r, position t) holds the generated token x_t, `hidden` = the
layer-l state computed with x_t as input (the state that predicts x_{t+1}), `topk` = the model's
top-8 next-token ids at that input. The state that predicts x_0 is the request's
`prompt_last_hidden`. The last token has no state (generation stops before feeding it back):
`hidden_valid` is false there. `prompt_hash` is the first 16 hex digits of sha256 over the
prompt's int32 token ids (`prompt_hash()`); meta.json `prompt_hash_scheme` says so, and readers
recompute it. This module imports no model code (no torch, no transformers): drafters take
`prompt_hash` from here.

Store format 2: no fixed-size-list column (`hidden`, `topk`, `prompt_last_hidden`,
`prompt_last_topk`) holds a null row; a row without a state holds zeros, and a last column,
`hidden_valid` (positions) or `prompt_last_valid` (requests), bool not null, says which rows hold
one (VALIDITY). Store format 1 (stores written before it, meta.json without `store_format`) had
no validity columns and null rows instead, which pyarrow < 26 cannot read from Parquet
(apache/arrow#35692). Readers take both: null rows become zero rows marked invalid
(data/store/parquetfile.py). Under pyarrow < 26 a format-1 file is read by a fallback (data/store/migrate.py),
and when none works the error names `python -m data migrate STORE` (data/store/migrate.py), which
rewrites a store in format 2 under the commit protocol (data/store/writer.py): meta.json first records
the new files' checksums under `migrating`, readers accept a file matching either checksum until
meta.json moves them into `checksums`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FORMAT_VERSION = 1  # meta.json's own layout (`format`)
STORE_FORMAT = 2  # the Parquet layout (meta.json `store_format`; absent = 1: null state rows)
TOPK = 8


PROMPT_HASH_SCHEME = "sha256-int32-16"  # what capture writes in prompt_hash (meta.json prompt_hash_scheme)


def prompt_hash(tokens) -> str:
    """First 16 hex digits of sha256 over the prompt's token ids as int32 (same prompt, same hash)."""
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:16]



def request_schema(d_model: int) -> pa.Schema:
    return pa.schema([
        ("request", pa.int32()),
        ("id", pa.string()),
        ("group", pa.string()),
        ("prompt_hash", pa.string()),
        ("prompt_tokens", pa.list_(pa.int32())),
        ("output_tokens", pa.list_(pa.int32())),
        ("stop_reason", pa.string()),
        ("seconds", pa.float64()),
        ("prompt_last_hidden", pa.list_(pa.float16(), d_model)),
        ("prompt_last_topk", pa.list_(pa.int32(), TOPK)),
        ("tenant", pa.string()),  # after the others: older stores lack it (OPTIONAL_COLUMNS), indices stay put
        pa.field("prompt_last_valid", pa.bool_(), nullable=False),  # store format 2 (VALIDITY)
        # Unix seconds when the writer committed the request (data/store/writer.py); null in stores written
        # before it was recorded. A store set orders its members' requests by it (data/store/storeset.py).
        ("finished_at", pa.float64()),
        # How the request's tokens were chosen (SAMPLINGS, data/store/sampling.py) and how many of them were not the
        # model's top-1 where they were chosen; null in stores written before they were recorded (unknown).
        ("sampling", pa.string()),
        ("off_argmax", pa.int32()),
    ])


# Columns a store written by older code may lack: name -> the value every row then takes (in schema order).
OPTIONAL_COLUMNS = {"tenant": "", "finished_at": None, "sampling": None, "off_argmax": None}


def position_schema(d_model: int) -> pa.Schema:
    return pa.schema([
        ("request", pa.int32()),
        ("position", pa.int32()),
        ("token", pa.int32()),
        ("hidden", pa.list_(pa.float16(), d_model)),
        ("topk", pa.list_(pa.int32(), TOPK)),
        pa.field("hidden_valid", pa.bool_(), nullable=False),  # store format 2 (VALIDITY)
    ])


# Store format 2: validity column -> the fixed-size-list columns whose rows it marks (zeros where false).
VALIDITY = {"hidden_valid": ("hidden", "topk"), "prompt_last_valid": ("prompt_last_hidden", "prompt_last_topk")}

META_KEYS = ("format", "model", "model_fingerprint", "layer", "n_layers", "d_model", "dtype",
             "tokenizer_hash", "chat_template_hash", "bench", "data_fingerprint", "mode",
             "max_new_tokens", "versions", "created", "complete")

def numpy_dtype(t: pa.DataType) -> np.dtype:
    """The numpy dtype of a value type (DataType.to_pandas_dtype imports pandas before pyarrow 26)."""
    known = {pa.float16(): np.float16, pa.int32(): np.int32}  # the store's
    return np.dtype(known[t]) if t in known else pa.array([], t).to_numpy(zero_copy_only=False).dtype


def fixed_list(rows: np.ndarray | None, n: int, width: int, value_type: pa.DataType,
               valid: np.ndarray | None = None) -> pa.FixedSizeListArray:
    """[n, width] numpy -> fixed_size_list array without nulls (store format 2); rows where valid
    is False become zeros."""
    if rows is None:
        rows = np.zeros((n, width), dtype=numpy_dtype(value_type))
    rows = np.asarray(rows).reshape(n, width)
    if valid is not None and not np.all(valid):
        rows = rows.copy()
        rows[~np.asarray(valid, dtype=bool)] = 0
    values = pa.array(np.ascontiguousarray(rows).reshape(-1), type=value_type)
    return pa.FixedSizeListArray.from_arrays(values, width)


def fill_zero(values: pa.Array) -> pa.Array:
    """Nulls as zeros (a zero of the array's own type: pyarrow < 16 takes no int 0 for float16)."""
    if not values.null_count:
        return values
    return pc.fill_null(values, pa.array(np.zeros(1, numpy_dtype(values.type)), values.type)[0])


def fixed_list_to_numpy(col: pa.ChunkedArray | pa.Array, width: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """fixed_size_list column -> ([n, width] array with zeros for nulls, valid mask [n])."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    mats, valids = [], []
    for ch in chunks:
        n = len(ch)
        flat = fill_zero(ch.values.slice(ch.offset * width, n * width))  # parquet stores no values under a null slot
        mat = flat.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(n, width)
        valid = ch.is_valid().to_numpy(zero_copy_only=False) if ch.null_count else np.ones(n, dtype=bool)
        if ch.null_count:
            mat = mat.copy()
            mat[~valid] = 0
        mats.append(mat)
        valids.append(valid)
    if not mats:
        return np.zeros((0, width), dtype=dtype), np.zeros(0, dtype=bool)
    return np.concatenate(mats), np.concatenate(valids)



def bools(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(col.to_numpy(), dtype=bool)


def zero_invalid(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rows whose validity is false read as zeros (what format 2 writes there; a hand edit may not)."""
    if valid.all() or not rows[~valid].any():
        return rows
    rows = rows.copy()
    rows[~valid] = 0
    return rows
