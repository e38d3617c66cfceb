"""Bytes that pyarrow reads in memory Arrow owns, never in a Python object: the cause of the exit code 134
of issue 35 ("terminate called without an active exception" after the right `error:` line, under load).

`pa.BufferReader(some_bytes)` wraps the Python object (arrow::py::PyBuffer). pq.read_table decodes
columns on Arrow's CPU thread pool, and a worker drops its finished task (column reader -> page
reader -> BufferReader -> PyBuffer) just after the read has returned to Python. The PyBuffer's
destructor takes the GIL; when the main thread is by then finalizing the interpreter (an error exit
right after a read), CPython ends that worker with pthread_exit, whose forced unwind crosses a
noexcept C++ destructor: std::terminate, abort, exit code 134. Shown with gdb on `python -m data
verify` of a store whose meta.json `n_requests` was edited, under three busy loops: the aborting
thread is an arrow::internal::ThreadPool worker in ~PyBuffer <- ~BufferReader <-
~SerializedPageReader <- ~FixedSizeListReader, inside PyGILState_Ensure -> take_gil ->
PyThread_exit_thread. A buffer Arrow allocated is freed without the GIL, so a late release in a
worker is harmless, and nothing has to be waited for at exit.
"""

from __future__ import annotations

import os

import pyarrow as pa


def arrow_owned(data) -> pa.Buffer:
    """A copy of `data` (bytes or any buffer) in a buffer Arrow allocated."""
    view = memoryview(data).cast("B")
    buf = pa.allocate_buffer(view.nbytes)
    memoryview(buf).cast("B")[:] = view
    return buf


def read_file_buffer(path: str | os.PathLike) -> pa.Buffer:
    """A file's bytes read straight into a buffer Arrow allocated (no Python bytes in between).
    OSErrors are Python's own (with the path and errno), as from Path.read_bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = pa.allocate_buffer(size)
        got = f.readinto(memoryview(buf)) if size else 0
        if got < size:  # shrank since the stat: what there is
            return arrow_owned(memoryview(buf)[:got])
        rest = f.read()  # grew since the stat (or a file whose size stat does not tell)
    return arrow_owned(memoryview(buf).tobytes() + rest) if rest else buf
