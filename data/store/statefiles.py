"""Where each position's state lies in a store's files, so that a reader far from the driver reads only its rows.

A store opened with `defer_hidden=True` (data/store/reader.py `open_store`) holds every column but the
states: tokens, top-k, validity and the per-request rows are read and checked as always, and
`TraceStore.state_files` says where the states are (`StateFiles`: each positions part's path, its
sha256 as the driver verified it, its row count, and the permutation from the stream's rows to the
parts' concatenated rows when the parts were not already in order, or when a store set interleaves its
members). The census on Ray (census/ray_census.py) sends that to each shard, which reads the states of
its own rows (`read_rows`): the driver never holds 1,152 bytes per position (d = 576, float16) nor
ships them, which is most of its serial cost at scale (docs/scale.md).

A part a shard reads is checked against the sha256 the driver verified: a store rewritten while the
census runs is refused in one line, not mixed with the rows the driver read.

pyarrow's dataset API would read row ranges across files too, but it neither checks each file's
checksum nor keeps the stream's order across a store set's members; reading whole parts (a part holds
whole requests, ~1k rows) is one `pq.read_table(columns=[...])` per part.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.errors import OilbirdError
from data.readfile import regular_file
from data.store.parquetfile import _corrupt, _file_bytes
from data.store.schema import bools, fixed_list_to_numpy, zero_invalid

STATE_COLUMNS = ["hidden", "hidden_valid"]


@dataclass(frozen=True)
class StateFile:
    path: str
    sha256: str  # as the driver read and verified it
    rows: int


@dataclass
class StateFiles:
    """The states of a stream's rows: row i lies at row `take[i]` of the files' concatenation (take None: i)."""

    d: int
    files: list[StateFile]
    take: np.ndarray | None = None  # [n_rows] int64, or None when the stream's rows are the files' in order

    @property
    def n_rows(self) -> int:
        return sum(f.rows for f in self.files)

    def permuted(self, take: np.ndarray | None) -> "StateFiles":
        """These states in another row order: new row i is this object's row `take[i]`."""
        if take is None:
            return self
        take = np.asarray(take, np.int64)
        return StateFiles(self.d, self.files, take if self.take is None else self.take[take])

    @staticmethod
    def concat(parts: list["StateFiles"]) -> "StateFiles":
        """Several stores' states, one after the other."""
        files = [f for p in parts for f in p.files]
        if all(p.take is None for p in parts):
            return StateFiles(parts[0].d, files)
        takes, base = [], 0
        for p in parts:
            takes.append(base + (np.arange(p.n_rows, dtype=np.int64) if p.take is None else p.take))
            base += p.n_rows
        return StateFiles(parts[0].d, files, np.concatenate(takes))

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(states [len(rows), d] float16, zeros where invalid; valid [len(rows)] bool) of the stream's rows."""
        rows = np.asarray(rows, np.int64)
        where = rows if self.take is None else self.take[rows]
        bounds = np.concatenate([[0], np.cumsum([f.rows for f in self.files])]).astype(np.int64)
        file_of = np.searchsorted(bounds, where, side="right") - 1
        states = np.zeros((len(rows), self.d), np.float16)
        valid = np.zeros(len(rows), bool)
        for j in np.unique(file_of):
            mine = np.nonzero(file_of == j)[0]
            hidden, ok = read_part_states(self.files[j], self.d)
            local = where[mine] - bounds[j]
            states[mine], valid[mine] = hidden[local], ok[local]
        return states, valid


def read_part_states(f: StateFile, d: int) -> tuple[np.ndarray, np.ndarray]:
    """One positions part's states (zeros where its validity is false) and validity, checked against its sha256."""
    path = Path(f.path)
    if not path.exists():
        raise OilbirdError(f"{path} is not there on host {socket.gethostname()}: a reader on another machine (a "
                           "Ray worker on another node) needs the store at the same path, on a filesystem every "
                           "node mounts")
    regular_file(path, "trace store file")  # a FIFO or device swapped in would block or never end
    blob = _file_bytes(path)
    if hashlib.sha256(blob).hexdigest() != f.sha256:
        raise OilbirdError(f"{path} changed after the census read its store (its sha256 differs): the store was "
                           "rewritten while the census ran; rerun it")
    try:
        table = pq.read_table(pa.BufferReader(blob), columns=STATE_COLUMNS)
    except (pa.ArrowException, OSError) as e:
        raise _corrupt(path, e) from None
    want = pa.list_(pa.float16(), d)
    if table.num_rows != f.rows or table.schema.field("hidden").type != want:
        raise OilbirdError(f"{path} holds {table.num_rows} rows of {table.schema.field('hidden').type}, not the "
                           f"{f.rows} rows of {want} its store recorded")
    valid = bools(table.column("hidden_valid"))
    return zero_invalid(fixed_list_to_numpy(table.column("hidden"), d, np.float16)[0], valid), valid
