"""One writer per trace store: an advisory lock held for the whole write.

Every writer of a store (data/store/writer.py StoreWriter: capture by the harness or by vLLM, a --force
rewrite; data/store/migrate.py) takes `<store>/.lock` with flock(LOCK_EX | LOCK_NB) before it touches a
file, and holds it until it finishes or its process exits. Without it, a second capture's start
took the first one's uncommitted part for a killed writer's orphan, deleted it and reused its name:
the store was damaged beyond repair.

A second writer does not wait: it stops at once with one line naming the holder's pid (the holder
writes it into the file). A capture runs for minutes to hours, so waiting would look like a hang,
and once the first one finished the second would find nothing left to do (or other settings).

A stale lock needs no pid test: the kernel drops a flock when its process exits, kill -9 included,
so a dead writer's `.lock` is a file whose flock is free, and the next writer takes it over. The
holder removes the file on release while it still holds the flock; a writer that locked the old
file in between sees it is no longer the one at the path and locks the new one (`_ATTEMPTS`).
A forked child (vLLM's workers fork from a capture) closes its copy of the descriptor at once, so
it never keeps a dead capture's lock held.
"""

from __future__ import annotations

import fcntl
import os
import time
import weakref
from pathlib import Path

from data.errors import OilbirdError

LOCK_NAME = ".lock"
_ATTEMPTS = 8  # each retry means the holder released between our open and our flock
_HELD: "weakref.WeakSet[StoreLock]" = weakref.WeakSet()  # the locks this process holds


def _close_in_child() -> None:
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None  # the child holds nothing: its release must not touch the parent's file
        if fd is not None:
            try:
                os.close(fd)  # the parent's lock stays the parent's: the child drops its reference
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder(fd: int) -> str:
    """The pid the holder wrote, read through our descriptor (the same file the holder locked)."""
    for _ in range(5):  # the holder writes its pid right after taking the lock: give it a moment
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return f"pid {text}" + (" (this process)" if text == str(os.getpid()) else "")
        time.sleep(0.02)
    return "a process whose pid it has not written yet"


def _is_at_path(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _flock_exclusive(fd: int, tries: int = 5) -> None:
    """flock(LOCK_EX | LOCK_NB), tried a few times 10 ms apart: a reader's `writer_of` probe holds a shared
    lock for microseconds, and must not make a writer stop. BlockingIOError when a writer holds it."""
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(0.01)


def writer_of(store: str | Path) -> str | None:
    """Who holds the write lock of `store` ("pid N"), or None when no live writer does (readers use it
    to tell a store being written from one whose capture was interrupted)."""
    path = Path(store) / LOCK_NAME
    if any(lock.path.resolve() == path.resolve() for lock in list(_HELD)):
        return None  # this process writes it (data migrate reads the store it holds): not someone else's write
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:  # flock has no query: a shared lock, dropped at once (a writer meeting it retries: _flock_exclusive)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a shared lock we may have taken
    return None


class StoreLock:
    """The write lock of the store folder `store` (module docstring). `acquire` refuses, in one line,
    while another writer holds it; `release` (or the process's exit) frees it."""

    def __init__(self, store: str | Path):
        self.store = Path(store)
        self.path = self.store / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "StoreLock":
        if self._fd is not None:
            return self
        self.store.mkdir(parents=True, exist_ok=True)
        for _ in range(_ATTEMPTS):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                _flock_exclusive(fd)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise OilbirdError(f"trace store {self.store} is being written by another process ({holder}); "
                                   "wait for it to finish (two writers at once would damage the store)") from None
            except BaseException:
                os.close(fd)
                raise
            if _is_at_path(fd, self.path):
                break
            os.close(fd)  # we locked a file its holder has just removed: lock the one at the path now
        else:
            raise OilbirdError(f"trace store {self.store}: could not take its write lock {self.path} "
                               f"({_ATTEMPTS} tries, each time released and removed by another writer)")
        self._fd = fd
        _HELD.add(self)
        try:
            os.ftruncate(fd, 0)  # a dead holder's pid goes: the file names the live one
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        try:
            if _is_at_path(fd, self.path):  # never another writer's file (someone removed ours by hand)
                os.unlink(self.path)  # while still locked: see the module docstring
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a writer dropped without finish or close: free the lock all the same
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel frees it at exit anyway
            pass
