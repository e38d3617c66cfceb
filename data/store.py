"""The trace store: the Parquet format that capture writes and census and decoder read.

Layout of `runs/<bench>/<model>/traces/`:
  meta.json          model, fingerprints, layer, n_layers, d_model, dtype, bench, mode, ... and
                     `complete` (false while a capture is running or was interrupted)
  requests.parquet   one row per finished request (REQUEST_SCHEMA); rewritten atomically after
                     every part, so it is the commit point of a resumable capture
  positions-NNNNN.parquet   one row per generated token (POSITION_SCHEMA); a part holds whole
                     requests and is renamed into place before requests.parquet names them

Position semantics: row (request r, position t) holds the generated token x_t, `hidden` = the
layer-l state computed with x_t as input (the state that predicts x_{t+1}), `topk` = the model's
top-8 next-token ids at that input. The state that predicts x_0 is the request's
`prompt_last_hidden`. `hidden`/`topk` of the last token may be null (generation stops before
feeding it back).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.errors import OilbirdError

FORMAT_VERSION = 1
TOPK = 8


def store_dir(out: str | Path, bench: str, model_slug: str) -> Path:
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
    ])


def position_schema(d_model: int) -> pa.Schema:
    return pa.schema([
        ("request", pa.int32()),
        ("position", pa.int32()),
        ("token", pa.int32()),
        ("hidden", pa.list_(pa.float16(), d_model)),
        ("topk", pa.list_(pa.int32(), TOPK)),
    ])


# ---------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_write_table(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fixed_list(rows: np.ndarray | None, n: int, width: int, value_type: pa.DataType,
               valid: np.ndarray | None = None) -> pa.FixedSizeListArray:
    """[n, width] numpy -> fixed_size_list array; rows where valid is False become null."""
    if rows is None:
        rows = np.zeros((n, width), dtype=value_type.to_pandas_dtype())
    values = pa.array(np.ascontiguousarray(rows).reshape(-1), type=value_type)
    mask = None if valid is None else pa.array(~np.asarray(valid, dtype=bool))
    return pa.FixedSizeListArray.from_arrays(values, width, mask=mask)


def fixed_list_to_numpy(col: pa.ChunkedArray | pa.Array, width: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """fixed_size_list column -> ([n, width] array with zeros for nulls, valid mask [n])."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    mats, valids = [], []
    for ch in chunks:
        n = len(ch)
        flat = ch.values.slice(ch.offset * width, n * width)
        if flat.null_count:  # parquet stores no values under a null slot
            flat = pc.fill_null(flat, 0)
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
    requests: pl.DataFrame  # request, id, group, prompt_hash, prompt_tokens, output_tokens, stop_reason, seconds
    positions: pl.DataFrame  # request, position, token
    hidden: np.ndarray  # [n_positions, d_model] float16 (zeros where null)
    hidden_valid: np.ndarray  # [n_positions] bool
    topk: np.ndarray  # [n_positions, 8] int32 (zeros where null)
    prompt_last_hidden: np.ndarray  # [n_requests, d_model] float16
    prompt_last_topk: np.ndarray  # [n_requests, 8] int32
    offsets: np.ndarray  # [n_requests + 1] int64

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


def read_meta(path: Path) -> dict:
    meta_path = Path(path) / "meta.json"
    if not meta_path.exists():
        raise OilbirdError(f"no trace store at {path} (meta.json missing); run `python -m data capture` first")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{meta_path} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise OilbirdError(f"{meta_path} lacks {', '.join(missing)}; not a trace store of this version")
    if meta["format"] != FORMAT_VERSION:
        raise OilbirdError(f"{meta_path} has format {meta['format']}, this code reads {FORMAT_VERSION}")
    return meta


def _read_parquet(path: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise OilbirdError(f"corrupt Parquet file {path}: {str(e).splitlines()[0]}") from None
    if not table.schema.equals(schema, check_metadata=False):
        want = {f.name: str(f.type) for f in schema}
        have = {f.name: str(f.type) for f in table.schema}
        diff = [f"{k}: {have.get(k, 'missing')} (expected {v})" for k, v in want.items() if have.get(k) != v]
        raise OilbirdError(f"{path} does not match the trace schema ({'; '.join(diff[:3]) or 'extra columns'})")
    return table


def position_parts(path: Path) -> list[Path]:
    return sorted(Path(path).glob("positions-*.parquet"))


def open_store(path: str | Path, *, model_fingerprint: str | None = None, d_model: int | None = None,
               allow_incomplete: bool = False, load_hidden: bool = True) -> TraceStore:
    """Read and validate a trace store. Mismatches with the expected model are one-line errors."""
    path = Path(path)
    meta = read_meta(path)
    if not meta["complete"] and not allow_incomplete:
        raise OilbirdError(f"trace store {path} is incomplete (capture was interrupted); rerun the capture to resume it")
    if d_model is not None and int(meta["d_model"]) != int(d_model):
        raise OilbirdError(f"trace store {path} has d_model {meta['d_model']}, the model has {d_model}: wrong model for this store")
    if model_fingerprint is not None and meta["model_fingerprint"] != model_fingerprint:
        raise OilbirdError(f"trace store {path} was captured with {meta['model']} ({meta['model_fingerprint']}), "
                           f"not this model ({model_fingerprint}): wrong model for this store")
    d = int(meta["d_model"])
    req_path = path / "requests.parquet"
    if not req_path.exists():
        raise OilbirdError(f"trace store {path} has no requests.parquet")
    req = _read_parquet(req_path, request_schema(d)).sort_by("request")
    parts = [_read_parquet(p, position_schema(d)) for p in position_parts(path)]
    pos = pa.concat_tables(parts) if parts else position_schema(d).empty_table()
    pos = pos.sort_by([("request", "ascending"), ("position", "ascending")])

    requests = pl.from_arrow(req.drop_columns(["prompt_last_hidden", "prompt_last_topk"]))
    positions = pl.from_arrow(pos.select(["request", "position", "token"]))
    n_req = requests.height
    if n_req == 0:
        raise OilbirdError(f"trace store {path} holds no requests")
    if requests["request"].to_list() != list(range(n_req)):
        raise OilbirdError(f"trace store {path}: requests.parquet does not number requests 0..{n_req - 1}")
    lengths = requests["output_tokens"].list.len().to_numpy().astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if positions.height != int(offsets[-1]):
        raise OilbirdError(f"trace store {path}: {positions.height} position rows for {int(offsets[-1])} "
                           "generated tokens; the store is damaged, recapture with --force")
    expect_req = np.repeat(np.arange(n_req, dtype=np.int32), lengths)
    expect_pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if n_req else np.zeros(0, np.int32)
    if not (np.array_equal(positions["request"].to_numpy(), expect_req)
            and np.array_equal(positions["position"].to_numpy(), expect_pos)):
        raise OilbirdError(f"trace store {path}: position rows do not match requests.parquet; recapture with --force")
    flat_out = requests["output_tokens"].explode().drop_nulls().to_numpy()
    if not np.array_equal(positions["token"].to_numpy(), flat_out.astype(np.int32)):
        raise OilbirdError(f"trace store {path}: position tokens differ from output_tokens; recapture with --force")

    if load_hidden:
        hidden, valid = fixed_list_to_numpy(pos.column("hidden"), d, np.float16)
    else:
        hidden, valid = np.zeros((0, d), np.float16), np.zeros(0, bool)
    topk, _ = fixed_list_to_numpy(pos.column("topk"), TOPK, np.int32)
    plh, _ = fixed_list_to_numpy(req.column("prompt_last_hidden"), d, np.float16)
    plt, _ = fixed_list_to_numpy(req.column("prompt_last_topk"), TOPK, np.int32)
    return TraceStore(path=path, meta=meta, requests=requests, positions=positions, hidden=hidden,
                      hidden_valid=valid, topk=topk, prompt_last_hidden=plh, prompt_last_topk=plt,
                      offsets=offsets)


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
        fixed_list(hid, total, d_model, pa.float16(), valid),
        fixed_list(topk, total, TOPK, pa.int32(), valid),
    ], schema=position_schema(d_model))
    return req, pos


class StoreWriter:
    """Appends whole requests to a store, atomically, so an interrupted capture resumes cleanly.

    Commit protocol: the positions part is renamed into place first, then requests.parquet is
    rewritten with the new rows. On open, parts holding requests that requests.parquet does not
    name are leftovers of a crash between the two and are deleted.
    """

    def __init__(self, path: str | Path, meta: dict, *, force: bool = False):
        self.path = Path(path)
        self.d_model = int(meta["d_model"])
        if force and self.path.exists():
            for p in list(self.path.glob("*.parquet")) + [self.path / "meta.json"]:
                p.unlink(missing_ok=True)
        if (self.path / "meta.json").exists():
            old = read_meta(self.path)
            keys = ("model_fingerprint", "layer", "d_model", "dtype", "tokenizer_hash", "chat_template_hash",
                    "bench", "data_fingerprint", "mode", "max_new_tokens")
            diff = [k for k in keys if old.get(k) != meta.get(k)]
            if diff:
                raise OilbirdError(f"trace store {self.path} was made with other settings ({', '.join(diff)} differ); "
                                   "pass --force to overwrite it or --out for another folder")
            self.meta = old
        else:
            self.meta = dict(meta, complete=False, format=FORMAT_VERSION)
            atomic_write_json(self.path / "meta.json", self.meta)
        self.requests = self._load_requests()
        done = set(self.requests.column("request").to_pylist())
        for part in position_parts(self.path):
            try:
                reqs = set(pq.read_table(part, columns=["request"]).column("request").to_pylist())
            except (pa.ArrowInvalid, OSError) as e:
                raise OilbirdError(f"corrupt Parquet file {part}: {str(e).splitlines()[0]}; "
                                   "pass --force to recapture") from None
            if not reqs <= done:
                part.unlink()  # written before a crash, never committed
        for tmp in self.path.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def _load_requests(self) -> pa.Table:
        p = self.path / "requests.parquet"
        if p.exists():
            return _read_parquet(p, request_schema(self.d_model))
        return request_schema(self.d_model).empty_table()

    @property
    def done(self) -> int:
        """Requests committed so far: capture resumes at this index (serving order)."""
        return self.requests.num_rows

    def append(self, records: list[TraceRecord]) -> None:
        if not records:
            return
        expect = list(range(self.done, self.done + len(records)))
        if [r.request for r in records] != expect:
            raise ValueError(f"records must continue the store in order: expected {expect[:3]}...")
        req, pos = records_to_tables(records, self.d_model)
        part_index = len(position_parts(self.path))
        atomic_write_table(self.path / f"positions-{part_index:05d}.parquet", pos)
        self.requests = pa.concat_tables([self.requests, req])
        atomic_write_table(self.path / "requests.parquet", self.requests)

    def finish(self, **extra) -> None:
        self.meta.update(extra, complete=True, n_requests=self.done)
        atomic_write_json(self.path / "meta.json", self.meta)
