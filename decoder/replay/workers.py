"""Replay's worker processes (the ablations replay through it): how many there may be, and that they
die with the process that started them.

--jobs: 0 picks min(arm runs, cores); otherwise 1..max_jobs(). Each worker replays one arm run with
torch at one thread and holds its own copy of the store's traces, so a worker beyond the cores this
process may use only time-slices with its siblings while adding a copy of the traces to memory
(`--jobs 1000` started 1,000 processes, issue 35). The bound is the usable cores, and never below 2, so
the parallel path can run on a one-core machine too.

A worker dies with its parent: `kill -9` of a replay left its pool workers replaying for minutes, and
the multiprocessing Manager (the progress queue's server), which never watches its parent, running
for good. On Linux each one asks the kernel for SIGKILL when its parent ends (prctl
PR_SET_PDEATHSIG, which fires when the thread that started it ends: the main thread starts the pool
and the Manager); elsewhere a daemon thread polls os.getppid(). Either way a parent that ended before
the request took effect is caught by comparing os.getppid() with the pid the parent passed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from data.errors import OilbirdError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_SECONDS = 0.5  # the polling fallback's period


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_jobs() -> int:
    return max(2, usable_cores())


def check_jobs(jobs: int) -> None:
    """--jobs: 0 (one worker per arm run, at most one per core) or 1..max_jobs(); one line otherwise."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 0 <= jobs <= max_jobs():
        raise OilbirdError(f"--jobs must be 0 (one worker per arm run, at most one per core) or 1..{max_jobs()}, "
                           f"the cores this machine lets replay use (got {jobs}); a worker beyond them only "
                           "time-slices and holds another copy of the traces")


def _parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent ends; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_SECONDS)
    os._exit(1)  # the parent is gone: nobody reads what this worker would still compute


def die_with_parent(parent_pid: int) -> None:
    """Initializer of every replay worker and of the Manager's server: end when `parent_pid` ends."""
    if not _parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # the parent ended before the request took effect
        os._exit(1)
