"""The trace store: the Parquet format that capture writes and census and decoder read.

Layout of `runs/<bench>/<model>/traces/`:
  meta.json          model, fingerprints, layer, n_layers, d_model, dtype, bench, mode, ... and
                     `complete` (false while a capture is running or was interrupted),
                     `n_requests` (committed so far), `checksums` (sha256 of every committed file),
                     `store_format` (the Parquet layout below: 2; absent = 1, the older layout)
  requests.parquet   one row per finished request (request_schema); rewritten atomically after
                     every part, so it is the commit point of a resumable capture. Its column
                     `tenant` (string, "" = the default tenant) is absent from stores written
                     before tenants: readers fill it with "" (OPTIONAL_COLUMNS), and the
                     checksums, taken over the files' bytes, still hold
  positions-NNNNN.parquet   one row per generated token (position_schema); a part holds whole
                     requests and is renamed into place before requests.parquet names them

Position semantics: row (request r, position t) holds the generated token x_t, `hidden` = the
layer-l state computed with x_t as input (the state that predicts x_{t+1}), `topk` = the model's
top-8 next-token ids at that input. The state that predicts x_0 is the request's
`prompt_last_hidden`. The last token has no state (generation stops before feeding it back):
`hidden_valid` is false there. `prompt_hash` is the first 16 hex digits of sha256 over the
prompt's int32 token ids (`prompt_hash()`); meta.json `prompt_hash_scheme` says so, and readers
recompute it.

Store format 2: no fixed-size-list column (`hidden`, `topk`, `prompt_last_hidden`,
`prompt_last_topk`) holds a null row; a row without a state holds zeros, and a last column,
`hidden_valid` (positions) or `prompt_last_valid` (requests), bool not null, says which rows hold
one (VALIDITY). Store format 1 (stores written before it, meta.json without `store_format`) had
no validity columns and null rows instead, which pyarrow < 26 cannot read from Parquet
(apache/arrow#35692). Readers take both: null rows become zero rows marked invalid. Under
pyarrow < 26 a format-1 file is read by a fallback (data/migrate.py), and when none works the error
names `python -m data migrate STORE` (data/migrate.py), which rewrites a store in format 2 under
the commit protocol: meta.json first records the new files' checksums under `migrating`, readers
accept a file matching either checksum until meta.json moves them into `checksums`.

Commit protocol (StoreWriter.append), each step an atomic rename:
  1. positions-NNNNN.parquet is written;
  2. meta.json records it under `pending`, with the row count requests.parquet is about to have;
  3. requests.parquet is rewritten with the new rows: the commit point;
  4. meta.json moves `pending` into `checksums` and updates n_requests.
Killed before 3, requests.parquet still has its recorded checksum: the new part is named by no
one and the writer deletes it on resume. Killed between 3 and 4, requests.parquet's checksum is
not recorded yet: it is accepted (and recorded) only when it holds exactly the pending row count
and agrees row for row with the verified parts. Any other checksum mismatch is damage.
meta.json fields that describe the committed rows (capture's `runs`, `truncated`, and
`prompt_tokens_reused`: per request, the prompt tokens whose KV came from an earlier request)
travel with step 2's `pending` and land with the commit, so they stay aligned with the rows.
Readers (open_store) refuse an incomplete store, then verify every checksum (sha256 runs at about
1 GB/s: 0.07 s for a 72 MB store), the schema, the row counts and the prompt hashes. Stores
written before checksums existed (no `checksums` key) open unverified (`TraceStore.verified`).

Test hook: OILBIRD_FAULT=point[:n] kills the process (SIGKILL) the n-th time (default 1) it
reaches `point` (see fault_point), so tests can interrupt a real capture or census at a chosen
moment.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import OilbirdError

FORMAT_VERSION = 1  # meta.json's own layout (`format`)
STORE_FORMAT = 2  # the Parquet layout (meta.json `store_format`; absent = 1: null state rows)
TOPK = 8


PROMPT_HASH_SCHEME = "sha256-int32-16"  # what capture writes in prompt_hash (meta.json prompt_hash_scheme)


def prompt_hash(tokens) -> str:
    """First 16 hex digits of sha256 over the prompt's token ids as int32 (same prompt, same hash)."""
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def store_dir(out: str | Path, bench: str, model_slug: str) -> Path:
    """runs/<bench>/<model>/traces. A `jsonl:PATH` bench is named `<stem>-<8 hex of sha256 of the
    absolute path>`: the whole path as a folder name can exceed the 255-byte limit. A store made
    under the older name (the path with / and : replaced) is still found there."""
    if bench.startswith("jsonl:"):
        file = Path(bench[len("jsonl:"):]).expanduser()
        digest = hashlib.sha256(os.path.abspath(file).encode("utf-8", "surrogatepass")).hexdigest()[:8]
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file.stem).strip("._")[:64] or "jsonl"
        path = Path(out) / f"{stem}-{digest}" / model_slug / "traces"
        legacy = Path(out) / bench.replace(":", "_").replace("/", "_") / model_slug / "traces"
        if not path.exists() and os.path.isdir(legacy):  # isdir is False (no error) for a too-long name
            return legacy
        return path
    bench_dir = bench.replace(":", "_").replace("/", "_")
    return Path(out) / bench_dir / model_slug / "traces"


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
    ])


# Columns a store written by older code may lack: name -> the value every row then takes.
OPTIONAL_COLUMNS = {"tenant": ""}


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


# ---------------------------------------------------------------- atomic writes, leftovers, faults

def _tmp_prefix(name: str) -> str:
    # the writer's pid is in every temporary name, so a cleaner can tell a dead writer's leftovers
    return f".{name}.{os.getpid()}."


def _umask_mode(mode: int) -> int:
    # mkstemp/mkdtemp create 0600/0700; the renamed result should look like any other file or folder
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def atomic_write_bytes(path: Path, data) -> str:
    """Write through a temporary file renamed into place; returns the sha256 of the bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path.name), suffix=".tmp")
    try:
        os.fchmod(fd, _umask_mode(0o666))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return hashlib.sha256(data).hexdigest()


def atomic_write_json(path: Path, obj) -> str:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def parquet_bytes(table: pa.Table) -> memoryview:
    """A table as the bytes of a Parquet file, as every writer here writes it."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return memoryview(sink.getvalue())


def atomic_write_table(path: Path, table: pa.Table) -> str:
    """Write a Parquet file atomically; returns the sha256 of its bytes (what meta.json records)."""
    return atomic_write_bytes(path, parquet_bytes(table))


def make_tmp_dir(folder: Path) -> Path:
    """A fresh temporary folder beside `folder`, named so clean_leftovers can tell when it is stale."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_tmp_prefix(folder.name), suffix=".tmp"))
    tmp.chmod(_umask_mode(0o777))
    return tmp


_PID_IN_NAME = re.compile(r"\.(\d+)\.[^.]*\.(?:tmp|old)$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def is_stale(p: Path) -> bool:
    """A temporary name whose writer no longer runs (or that carries no pid: older code's)."""
    m = _PID_IN_NAME.search(p.name)
    return not (m and _pid_alive(int(m.group(1))))


def clean_leftovers(folder: Path, pattern: str = ".*.tmp") -> list[Path]:
    """Delete temporary files and folders a killed writer left in `folder`, keeping those of a
    writer still running. Returns what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.glob(pattern):
        if not is_stale(p):
            continue  # another live writer's work in progress
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


FAULT_ENV = "OILBIRD_FAULT"
_fault_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Test hook: with OILBIRD_FAULT=name[:n], SIGKILL this process the n-th time (default 1) it
    gets here, as a kill -9 would, nothing flushed or cleaned. Points: after_part_write,
    after_pending_meta, after_requests_write, after_commit (StoreWriter.append),
    census_after_positions, census_mid_swap (census/run.py), migrate_after_pending,
    migrate_after_file (data/migrate.py)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or spec.partition(":")[0] != name:
        return
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] == int(spec.partition(":")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)


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


# ---------------------------------------------------------------- reading

@dataclass
class TraceStore:
    """A validated trace store in memory. Rows of `positions`, `hidden`, `topk` are aligned and
    sorted by (request, position); `offsets[r]:offsets[r+1]` are request r's rows."""

    path: Path
    meta: dict
    requests: pl.DataFrame  # request, id, group, prompt_hash, prompt_tokens, output_tokens, stop_reason, seconds,
    #                         tenant ("" in a store written before tenants)
    positions: pl.DataFrame  # request, position, token
    hidden: np.ndarray  # [n_positions, d_model] float16 (zeros where null)
    hidden_valid: np.ndarray  # [n_positions] bool
    topk: np.ndarray  # [n_positions, 8] int32 (zeros where null)
    prompt_last_hidden: np.ndarray  # [n_requests, d_model] float16
    prompt_last_topk: np.ndarray  # [n_requests, 8] int32
    offsets: np.ndarray  # [n_requests + 1] int64
    verified: bool = False  # every file matched its checksum in meta.json (False: a store older than checksums)

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


META_KEYS = ("format", "model", "model_fingerprint", "layer", "n_layers", "d_model", "dtype",
             "tokenizer_hash", "chat_template_hash", "bench", "data_fingerprint", "mode",
             "max_new_tokens", "versions", "created", "complete")


def store_fingerprint(meta: dict) -> str:
    """What a result computed from a store depends on: its committed files (their sha256s) and request
    count. Results record it, and `--if-missing` reuses a result only when the store still has it."""
    blob = json.dumps({"checksums": meta.get("checksums") or {}, "n_requests": meta.get("n_requests"),
                       "model_fingerprint": meta.get("model_fingerprint")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def current_summary(summary_path: str | Path, store_path: str | Path, **expected) -> dict | None:
    """The summary.json at `summary_path` when it was computed from the store as it is now (a complete
    store with the same `store_fingerprint`) and its fields equal `expected`; else None (recompute)."""
    summary_path, meta_path = Path(summary_path), Path(store_path) / "meta.json"
    if not summary_path.exists() or not meta_path.exists():
        return None
    try:
        summary, meta = json.loads(summary_path.read_text()), json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(summary, dict) or not isinstance(meta, dict) or not meta.get("complete"):
        return None
    if summary.get("store_fingerprint") != store_fingerprint(meta):
        return None
    return summary if all(summary.get(k) == v for k, v in expected.items()) else None


def read_meta(path: Path) -> dict:
    meta_path = Path(path) / "meta.json"
    if not meta_path.exists():
        raise OilbirdError(f"no trace store at {path} (meta.json missing); run `python -m data capture` first")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{meta_path} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(meta, dict):
        raise OilbirdError(f"{meta_path} is not a JSON object; not a trace store")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise OilbirdError(f"{meta_path} lacks {', '.join(missing)}; not a trace store of this version")
    if meta["format"] != FORMAT_VERSION:
        raise OilbirdError(f"{meta_path} has format {meta['format']}, this code reads {FORMAT_VERSION}")
    return meta


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
    data = bytes(blob) if blob is not None else None
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


def _file_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OilbirdError(f"cannot read {path}: {e.strerror or e}") from None


def _footer_counts_null_rows(data: bytes) -> bool:
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


def _read_format1(path: Path, data: bytes) -> pa.Table:
    """A store-format-1 file through the fallbacks (data/migrate.py), or one line saying what to do."""
    from data.migrate import FALLBACKS  # the format-1 readers live beside the migration

    for fallback in FALLBACKS:
        try:
            return fallback(data)
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
        valid = _bools(table.column(name)) if have else np.ones(table.num_rows, bool)
        if any(table.column(c).null_count for c in cols):
            for c in cols:
                valid = valid & _bools(pc.is_valid(table.column(c)))
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


def _read_parquet(path: Path, schema: pa.Schema) -> pa.Table:
    return _parse_parquet(path, None, schema)


def _read_checked(path: Path, schema: pa.Schema, legacy_ok: bool = True) -> tuple[pa.Table, str]:
    """A Parquet file and the sha256 of its bytes (read once for both)."""
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise OilbirdError(f"cannot read {path}: {e.strerror or e}") from None
    return _parse_parquet(path, blob, schema, legacy_ok), hashlib.sha256(blob).hexdigest()


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


def _load_committed(path: Path, meta: dict) -> _Committed:
    d = int(meta["d_model"])
    req_path = path / "requests.parquet"
    sums = meta.get("checksums")
    legacy_ok = _store_format(meta) < STORE_FORMAT
    if sums is None:  # written before checksums: nothing to verify, only uncommitted parts to tell apart
        return _load_unverified(path, d, legacy_ok)
    expected = dict(sums)
    moving = meta.get("migrating") or {}  # an interrupted migration's new checksums (data/migrate.py)
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
    parts = []
    for name in sorted(n for n in expected if n != req_path.name):
        if not (path / name).exists():
            raise _damaged(path, f"{name} is missing")
        table, h = _read_checked(path / name, position_schema(d), legacy_ok)
        if h != expected[name] and h != moving.get(name):
            raise _damaged(path, f"{name} does not match its checksum in meta.json")
        expected[name] = h
        parts.append(table)
    orphans = [p for p in position_parts(path) if p.name not in expected]
    if promoted:
        _check_rows(path, req, parts)
    return _Committed(req, parts, expected, orphans, promoted, verified=True)


def _load_unverified(path: Path, d: int, legacy_ok: bool) -> _Committed:
    """A store written before checksums: parts whose requests requests.parquet names are committed."""
    req_path = path / "requests.parquet"
    req, found = request_schema(d).empty_table(), {}
    if req_path.exists():
        req, found[req_path.name] = _read_checked(req_path, request_schema(d), legacy_ok)
    done = set(req.column("request").to_pylist())
    parts, orphans = [], []
    for part in position_parts(path):
        table, h = _read_checked(part, position_schema(d), legacy_ok)
        if set(table.column("request").to_pylist()) <= done:
            parts.append(table)
            found[part.name] = h
        else:
            orphans.append(part)
    return _Committed(req, parts, found, orphans, promoted=False, verified=False)


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
    if not _in_order(pos, ("request", "position")):
        pos = pos.sort_by([("request", "ascending"), ("position", "ascending")])
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
    return req, pos, requests, positions, offsets


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
               allow_incomplete: bool = False, load_hidden: bool = True) -> TraceStore:
    """Read and validate a trace store. Mismatches with the expected model are one-line errors."""
    path = Path(path)
    meta = read_meta(path)
    rerun = "rerun the same capture command to resume it (nothing captured so far is lost)"
    if not meta["complete"] and not allow_incomplete:
        raise OilbirdError(f"trace store {path} is incomplete (its capture was interrupted, or is still running); "
                           f"{rerun}")
    if d_model is not None and int(meta["d_model"]) != int(d_model):
        raise OilbirdError(f"trace store {path} has d_model {meta['d_model']}, the model has {d_model}: wrong model for this store")
    if model_fingerprint is not None and meta["model_fingerprint"] != model_fingerprint:
        raise OilbirdError(f"trace store {path} was captured with {meta['model']} ({meta['model_fingerprint']}), "
                           f"not this model ({model_fingerprint}): wrong model for this store")
    d = int(meta["d_model"])
    if not (path / "requests.parquet").exists() and "requests.parquet" not in (meta.get("checksums") or {}):
        raise OilbirdError(f"trace store {path} has no requests.parquet")
    got = _load_committed(path, meta)
    if meta["complete"] and (got.orphans or got.promoted):
        what = got.orphans[0].name if got.orphans else "requests.parquet"
        raise OilbirdError(f"trace store {path}: {what} was written by an interrupted capture and never "
                           f"committed; {rerun}")
    if got.requests.num_rows == 0:
        raise OilbirdError(f"trace store {path} holds no requests")
    if meta["complete"] and meta.get("n_requests") is not None and int(meta["n_requests"]) != got.requests.num_rows:
        raise OilbirdError(f"trace store {path}: meta.json says {meta['n_requests']} requests but requests.parquet "
                           f"holds {got.requests.num_rows}: an extension of the store was interrupted; {rerun}")
    req, pos, requests, positions, offsets = _check_rows(path, got.requests, got.parts)
    if _hashes_checked(meta):
        _check_prompt_hashes(path, req)

    valid = _bools(pos.column("hidden_valid"))
    topk = _zero_invalid(fixed_list_to_numpy(pos.column("topk"), TOPK, np.int32)[0], valid)
    if load_hidden:
        hidden = _zero_invalid(fixed_list_to_numpy(pos.column("hidden"), d, np.float16)[0], valid)
    else:
        hidden, valid = np.zeros((0, d), np.float16), np.zeros(0, bool)
    prompt_valid = _bools(req.column("prompt_last_valid"))
    plh = _zero_invalid(fixed_list_to_numpy(req.column("prompt_last_hidden"), d, np.float16)[0], prompt_valid)
    plt = _zero_invalid(fixed_list_to_numpy(req.column("prompt_last_topk"), TOPK, np.int32)[0], prompt_valid)
    return TraceStore(path=path, meta=meta, requests=requests, positions=positions, hidden=hidden,
                      hidden_valid=valid, topk=topk, prompt_last_hidden=plh, prompt_last_topk=plt,
                      offsets=offsets, verified=got.verified)


def _bools(col: pa.ChunkedArray) -> np.ndarray:
    return np.asarray(col.to_numpy(), dtype=bool)


def _zero_invalid(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Rows whose validity is false read as zeros (what format 2 writes there; a hand edit may not)."""
    if valid.all() or not rows[~valid].any():
        return rows
    rows = rows.copy()
    rows[~valid] = 0
    return rows


def record_checksums(path: str | Path) -> dict:
    """Record the checksums of a store's files as they are now, for a deliberate hand edit (a test
    that builds an unusual store); never a way to silence a damaged one."""
    path = Path(path)
    meta = read_meta(path)
    files = [f for f in [path / "requests.parquet", *position_parts(path)] if f.exists()]
    meta["checksums"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    meta.pop("pending", None)
    atomic_write_json(path / "meta.json", meta)
    return meta["checksums"]


STOP_REASONS = ("eos", "stop_string", "length", "reference")


def verify_store(path: str | Path) -> str:
    """The full check behind `python -m data verify`: everything open_store checks (checksums,
    schema, row counts, prompt hashes), then the values: states finite, token and top-k ids inside
    the vocabulary, stop reasons known, ids unique. Returns the OK line; raises on the first problem."""
    st = open_store(path)
    p = st.path
    meta = st.meta
    vocab = int(meta.get("vocab_size") or 0)
    req = st.requests
    if meta.get("n_requests") is not None and int(meta["n_requests"]) != st.n_requests:
        raise _damaged(p, f"meta.json says {meta['n_requests']} requests, requests.parquet holds {st.n_requests}")
    if not np.isfinite(st.hidden[st.hidden_valid].astype(np.float32)).all():
        raise _damaged(p, "a stored hidden state is not finite")
    if not np.isfinite(st.prompt_last_hidden.astype(np.float32)).all():
        raise _damaged(p, "a stored prompt_last_hidden is not finite")
    if vocab:
        checks = {"generated token": st.positions["token"].to_numpy(), "top-k id": st.topk[st.hidden_valid],
                  "prompt token": req["prompt_tokens"].explode().drop_nulls().to_numpy(),
                  "prompt top-k id": st.prompt_last_topk}
        for what, ids in checks.items():
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
                raise _damaged(p, f"a {what} lies outside the vocabulary of {vocab}")
    bad = set(req["stop_reason"].to_list()) - set(STOP_REASONS)
    if bad:
        raise _damaged(p, f"unknown stop reason {sorted(bad)[0]!r}")
    if req["id"].n_unique() != st.n_requests:
        raise _damaged(p, "request ids repeat")
    reused = meta.get("prompt_tokens_reused")  # per request; absent in stores captured before it was recorded
    if reused is not None:
        if not isinstance(reused, list) or len(reused) != st.n_requests:
            raise _damaged(p, f"meta.json prompt_tokens_reused does not hold one entry per request "
                              f"({len(reused) if isinstance(reused, list) else type(reused).__name__} for {st.n_requests})")
        lens = req["prompt_tokens"].list.len().to_list()
        for r, (v, n) in enumerate(zip(reused, lens)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < max(1, n)):
                raise _damaged(p, f"meta.json prompt_tokens_reused[{r}] = {v!r} is not a count below the prompt's "
                                  f"{n} tokens")
    if meta.get("mode") == "generate" and meta.get("max_new_tokens"):
        longest = int(req["output_tokens"].list.len().max())
        if longest > int(meta["max_new_tokens"]):
            raise _damaged(p, f"a request holds {longest} generated tokens, over max_new_tokens "
                              f"{meta['max_new_tokens']}")
    files = 1 + len(position_parts(p))
    line = f"OK: {p}: {st.n_requests} requests, {st.positions.height} generated tokens"
    if not st.verified:
        return line + "; unverified: no checksums recorded (written before checksums), contents checked"
    hashes = "prompt hashes, " if _hashes_checked(meta) else ""
    return line + f"; {files} files match their checksums; {hashes}states, ids and counts checked"


# ---------------------------------------------------------------- writing

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


def records_to_tables(records: list[TraceRecord], d_model: int) -> tuple[pa.Table, pa.Table]:
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
    open, the store is brought back to its last commit: parts no request names are deleted, a
    requests.parquet committed just before a kill is recorded, temporary files are removed.
    """

    SETTINGS = ("model_fingerprint", "layer", "d_model", "dtype", "tokenizer_hash", "chat_template_hash",
                "bench", "data_fingerprint", "mode", "max_new_tokens", "truncate")

    def __init__(self, path: str | Path, meta: dict, *, force: bool = False):
        self.path = Path(path)
        self.d_model = int(meta["d_model"])
        if force and self.path.exists():
            for p in list(self.path.glob("*.parquet")) + [self.path / "meta.json"]:
                p.unlink(missing_ok=True)
        clean_leftovers(self.path)  # temporary files of a killed write
        if (self.path / "meta.json").exists():
            old = read_meta(self.path)
            diff = [k for k in self.SETTINGS if old.get(k) != meta.get(k)]
            if diff:
                raise OilbirdError(f"trace store {self.path} was made with other settings ({', '.join(diff)} differ); "
                                   "pass --force to overwrite it or --out for another folder")
            self.meta = old
        else:
            self.meta = dict(meta, complete=False, format=FORMAT_VERSION, store_format=STORE_FORMAT, n_requests=0,
                             checksums={})
            self.meta.pop("migrated_from_format", None)  # a new store was never migrated
            atomic_write_json(self.path / "meta.json", self.meta)
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
                or self.meta.get("n_requests") != n):
            self.meta.update(checksums=got.checksums, n_requests=n)
            self.meta.pop("pending", None)
            self.meta.pop("migrating", None)  # the files it rewrote are recorded now; migrate converts the rest
            atomic_write_json(self.path / "meta.json", self.meta)

    @property
    def done(self) -> int:
        """Requests committed so far: capture resumes at this index (serving order)."""
        return self.requests.num_rows

    def reopen(self) -> None:
        """About to add requests to a finished store (a larger --limit): say so on disk first, so a
        kill from here on leaves a store that readers refuse as incomplete, not a short one."""
        if self.meta.get("complete"):
            self.meta["complete"] = False
            atomic_write_json(self.path / "meta.json", self.meta)

    def append(self, records: list[TraceRecord], meta: dict | None = None) -> None:
        """Commit `records`; `meta` (fields describing the store with them, e.g. capture runs) is
        written into meta.json with the commit, and is lost with it when a kill comes first."""
        if not records:
            return
        expect = list(range(self.done, self.done + len(records)))
        if [r.request for r in records] != expect:
            raise ValueError(f"records must continue the store in order: expected {expect[:3]}...")
        if self.meta.get("complete"):
            self.reopen()
        req, pos = records_to_tables(records, self.d_model)
        name = f"positions-{len(position_parts(self.path)):05d}.parquet"
        part_sha = atomic_write_table(self.path / name, pos)
        fault_point("after_part_write")
        table = pa.concat_tables([self.requests, req])
        self.meta["pending"] = {"file": name, "sha256": part_sha, "n_requests": table.num_rows, "meta": meta or {}}
        atomic_write_json(self.path / "meta.json", self.meta)
        fault_point("after_pending_meta")
        req_sha = atomic_write_table(self.path / "requests.parquet", table)  # the commit point
        self.requests = table
        fault_point("after_requests_write")
        self.meta.pop("pending")
        self.meta.update(meta or {})
        self.meta["checksums"].update({name: part_sha, "requests.parquet": req_sha})
        self.meta["n_requests"] = table.num_rows
        atomic_write_json(self.path / "meta.json", self.meta)
        fault_point("after_commit")

    def finish(self, **extra) -> None:
        self.meta.update(extra, complete=True, n_requests=self.done)
        self.meta.pop("pending", None)
        atomic_write_json(self.path / "meta.json", self.meta)
