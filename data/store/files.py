"""Files written so that no reader ever sees half of one: atomic writes, temporary folders, the
leftovers of a killed writer, and the fault hook the tests kill writers with.

Every temporary name carries its writer's pid, so a cleaner can tell a dead writer's leftovers
from a live one's work in progress (`clean_leftovers`).

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
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


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
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is not None:
            raise
        # a write's OSError names no file ("No space left on device"): name the file it was for
        raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e
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
    after_pending_meta, after_requests_write, after_commit (data/store/writer.py StoreWriter.append),
    census_after_positions, census_mid_swap (census/output.py), migrate_after_pending,
    migrate_after_file (data/store/migrate.py)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or spec.partition(":")[0] != name:
        return
    _fault_hits[name] = _fault_hits.get(name, 0) + 1
    if _fault_hits[name] == int(spec.partition(":")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)

