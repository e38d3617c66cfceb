"""Reading files the user or a past run handed us, with bounds: every reader of a JSON document or a
store part goes through here, so a device (`/dev/zero`), a FIFO, a folder, a huge file or a document
nested 100,000 deep is one `error: ...` line (OilbirdError), never a hang, a MemoryError or a
RecursionError.

- `regular_file(path, what)`: the path is a regular file (symlinks followed), checked with `os.stat`
  before anything opens it: opening a FIFO for reading blocks until a writer comes, forever.
- `read_json(path, what)`: `regular_file`, then at most `max_bytes`, parsed, then its nesting bounded;
- `read_text(path, what)`: `regular_file`, at most `max_bytes`, UTF-8.

Python's json parses nesting up to the interpreter's recursion limit and raises RecursionError past
it; a document nested less deep than that still breaks any code that walks it recursively, so the
depth is bounded after parsing (iteratively) as well. The json library has no depth option, hence
this module.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from data.errors import OilbirdError

MAX_JSON_BYTES = 256 << 20  # a profile or a summary is kilobytes to a few MiB; a file larger is not ours
MAX_JSON_DEPTH = 64  # our documents nest at most about 8 deep


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def regular_file(path: str | os.PathLike, what: str = "file", missing: str | None = None) -> os.stat_result:
    """Stat `path` and refuse anything but a regular file, in one line naming `what` and the path.
    `missing` replaces the default message for a path that does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise OilbirdError(missing or f"{what} {os.fsdecode(path)} not found") from None
    except OSError as e:
        raise OilbirdError(f"{what} {os.fsdecode(path)} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise OilbirdError(f"{what} {os.fsdecode(path)} is {_kind(st.st_mode)}, not a regular file")
    return st


def json_depth(obj) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((c, depth + 1) for c in children)
    return deepest


def parse_json(text: str | bytes, what: str):
    """Parse a JSON document, its nesting bounded; `what` names it in the one-line error."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise OilbirdError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels: not a file Oilbird wrote") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{what} is not valid JSON ({e})") from None
    if json_depth(obj) > MAX_JSON_DEPTH:
        raise OilbirdError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels: not a file Oilbird wrote")
    return obj


def read_json(path: str | os.PathLike, what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES,
              missing: str | None = None):
    """Read and parse a JSON file: a regular file, at most `max_bytes`, nesting bounded. Every failure
    is an OilbirdError naming `what` and the path."""
    label = f"{what} {os.fsdecode(path)}"
    st = regular_file(path, what, missing)
    if st.st_size > max_bytes:
        raise OilbirdError(f"{label} is {st.st_size} bytes, more than the {max_bytes} a JSON file here may hold")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise OilbirdError(f"{label} cannot be read: {e.strerror or e}") from None
    if len(data) > max_bytes:  # grew between the stat and the read
        raise OilbirdError(f"{label} is more than the {max_bytes} bytes a JSON file here may hold")
    return parse_json(data, label)


def read_text(path: str | os.PathLike, what: str = "file", max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a small file that must be a regular file of at most `max_bytes`."""
    st = regular_file(path, what)
    if st.st_size > max_bytes:
        raise OilbirdError(f"{what} {os.fsdecode(path)} is {st.st_size} bytes, more than {max_bytes}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{what} {os.fsdecode(path)} cannot be read: {getattr(e, 'strerror', None) or e}") from None
