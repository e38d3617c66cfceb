"""Store format 1 -> 2: `python -m data migrate` (the format-1 readers are data/store/legacy.py, beside the reader).

migrate_store rewrites a complete store in format 2 (zeros plus a validity column), refusing a
damaged one (`verify_store` first). It keeps the writer's discipline: every file is renamed into
place, and meta.json records the new files' checksums under `migrating` before the first rename,
so a reader accepts each file under its old or its new checksum until the last step moves them
into `checksums` (with `store_format` 2 and `migrated_from_format`), all under the store's write
lock (data/store/lock.py), so no capture writes the store meanwhile. A migration killed midway
leaves a store that opens and verifies; running it again finishes it. A store without checksums
(older than them) is rewritten the same way and stays without checksums. Every meta.json it writes
is sealed (data/store/meta.py); a format-2 store whose meta.json is not sealed yet (written before
the seal) is verified and sealed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from data.errors import OilbirdError
from data.store.files import (
    atomic_write_bytes,
    fault_point,
    parquet_bytes,
)
from data.store.lock import StoreLock
from data.store.meta import META_SEAL, is_sealed, write_meta
from data.store.reader import _load_committed, _store_format, read_meta
from data.store.schema import STORE_FORMAT, position_schema, request_schema
from data.store.verify import verify_store


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
        if is_sealed(meta):
            return f"{path}: already in store format {old}; nothing to migrate"
        verify_store(path)  # a seal vouches for meta.json from now on: a damaged store is never sealed
        write_meta(path, meta)
        return (f"sealed {path}/meta.json ({META_SEAL} recorded: it was written before meta.json was sealed); "
                f"already in store format {old}")
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
        write_meta(path, meta)
    fault_point("migrate_after_pending")
    for name, blob in blobs.items():
        atomic_write_bytes(path / name, blob)  # step 2: each file renamed into place
        fault_point("migrate_after_file")
    if checked:
        meta["checksums"].update(sums)
    meta.pop("migrating", None)
    meta.update(store_format=STORE_FORMAT, migrated_from_format=old)
    write_meta(path, meta)  # step 3: the new checksums are the recorded ones
    kept = "checksums recorded" if checked else "no checksums (a store older than them)"
    return (f"migrated {path}: store format {old} -> {STORE_FORMAT}, {len(blobs)} files rewritten "
            f"({got.requests.num_rows} requests, {sum(t.num_rows for t in got.parts)} positions); {kept}")
