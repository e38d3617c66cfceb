"""The store's write lock (data/store/lock.py), on synthetic stores (no model): one writer at a time,
a second one stops at once naming the holder's pid, a dead holder's lock is taken over, a forked
child does not keep it, every writer takes it (StoreWriter, migrate, record_checksums) and gives
it back however it ends. Two real captures into one store: tests/test_writer_faults.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.errors import OilbirdError
from data.store.lock import LOCK_NAME, StoreLock
from data.store.migrate import migrate_store
from data.store.writer import StoreWriter, record_checksums
from tests.test_store_format import golden_records, write_store

REPO = Path(__file__).resolve().parents[1]


def _meta(path: Path) -> dict:
    meta = json.loads((path / "meta.json").read_text())
    return {k: meta[k] for k in StoreWriter.SETTINGS + ("d_model",) if k in meta}


def _holder(store: Path, script: str = "") -> subprocess.Popen:
    """Another process that takes the store's lock, says so, then runs `script` (default: sleeps)."""
    code = (f"import sys, time; from data.store.lock import StoreLock; "
            f"lock = StoreLock({str(store)!r}).acquire(); print('held', flush=True); "
            + (script or "time.sleep(120)"))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.stdout.readline().strip() == "held"
    return proc


def _refused(fn, pid: int) -> str:
    with pytest.raises(OilbirdError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and f"being written by another process (pid {pid}" in msg, msg
    return msg


@pytest.fixture
def store(tmp_path):
    return write_store(tmp_path / "traces", golden_records())


def test_a_second_writer_stops_at_once_and_a_dead_holders_lock_is_taken_over(store):
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    holder = _holder(store)
    try:
        t0 = time.perf_counter()
        _refused(lambda: StoreWriter(store, _meta(store)), holder.pid)
        _refused(lambda: StoreWriter(store, _meta(store), force=True), holder.pid)  # --force deletes nothing
        assert time.perf_counter() - t0 < 5  # at once, not after a wait
        assert {p.name: p.read_bytes() for p in store.iterdir() if p.name != LOCK_NAME} == before
    finally:
        holder.send_signal(signal.SIGKILL)  # kill -9: the holder cleans nothing up
        holder.wait()
    lock = store / LOCK_NAME
    assert lock.read_text().strip() == str(holder.pid)  # stale: the dead holder's file is still there
    w = StoreWriter(store, _meta(store))  # the kernel freed the flock: taken over, no pid test needed
    assert lock.read_text().strip() == str(os.getpid())
    w.finish()
    assert not lock.exists() and w.done == 5


def test_a_forked_child_does_not_keep_a_dead_writers_lock(store):
    """vLLM's workers fork from a capture: a child that outlives its killed parent must not hold the lock."""
    parent = _holder(store, "import os; pid = os.fork()\n"
                            "if pid == 0: print('child', flush=True); time.sleep(120)\n"
                            "else: print(pid, flush=True); os._exit(0)")
    # the child prints once its at-fork handler has run (it runs before any of the child's Python code): on a
    # busy machine the parent can exit before the child is first scheduled
    # ... and the two processes' lines may interleave on the shared pipe ("9691child\n\n"): the pid is the digits
    text = "".join(parent.stdout.readline() for _ in range(2)).replace("child", "")
    child = int(re.search(r"\d+", text).group())
    parent.wait()
    try:
        os.kill(child, 0)  # still running
        with StoreLock(store) as lock:
            assert lock.held
    finally:
        os.kill(child, signal.SIGKILL)
        parent.stdout.close()


def test_every_writer_takes_the_lock(store):
    """migrate and record_checksums write a store too: they are refused while a writer holds it."""
    with StoreLock(store):
        _refused(lambda: migrate_store(store), os.getpid())
        _refused(lambda: record_checksums(store), os.getpid())
        _refused(lambda: StoreWriter(store, _meta(store)), os.getpid())
    assert migrate_store(store).endswith("nothing to migrate")
    assert not (store / LOCK_NAME).exists()


def test_the_writer_gives_the_lock_back_however_it_ends(store):
    meta = _meta(store)
    w = StoreWriter(store, meta)
    _refused(lambda: StoreWriter(store, meta), os.getpid())  # two writers in one process would damage it too
    w.finish()
    with pytest.raises(RuntimeError, match="after finish"):  # its view of the store may be stale by now
        w.append(golden_records()[:1])
    with pytest.raises(ZeroDivisionError):
        with StoreWriter(store, meta):
            1 / 0
    with pytest.raises(OilbirdError, match="other settings"):  # refused on open: nothing held after
        StoreWriter(store, dict(meta, max_new_tokens=meta["max_new_tokens"] + 1))
    with StoreWriter(store, meta) as again:
        assert again.done == 5
    assert not (store / LOCK_NAME).exists()


def test_a_reader_tells_a_store_being_written_from_an_interrupted_one(store):
    """open_store on an incomplete store: "being written (pid N)" while another process holds its lock,
    "interrupted; rerun the same capture command" once none does."""
    from data.store.reader import open_store

    w = StoreWriter(store, _meta(store))
    w.reopen()  # incomplete on disk, as while a capture extends it
    w.close()
    holder = _holder(store)
    try:
        with pytest.raises(OilbirdError, match=f"is being written \\(pid {holder.pid}\\)"):
            open_store(store)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    with pytest.raises(OilbirdError, match=r"interrupted\); rerun the same capture command"):
        open_store(store)
