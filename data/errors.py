"""The one user-facing error type: every entry point prints it as a single line and exits 2."""

import errno
import os
import select
import sys
from functools import wraps


class OilbirdError(Exception):
    """A problem with the user's input or environment, stated in one line (no traceback)."""


def _say(line: str) -> None:
    # stderr may be the broken pipe itself (`2>&1 | head -1`): the message is then lost, never a traceback
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


def os_error_line(e: OSError) -> str:
    """An OSError (a folder that cannot be written, a full disk, a file that vanished) as one line naming
    the path: `<path>: <reason>`. Library OSErrors without an errno (transformers' "can't load ...")
    keep their text, joined into one line."""
    if e.strerror and e.filename is not None:
        line = f"{os.fsdecode(e.filename)}: {e.strerror}"
        line += f" (and {os.fsdecode(e.filename2)})" if e.filename2 is not None else ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # what to do: the file is named, the old one intact
            line += "; free space on that disk (or write elsewhere, e.g. --out) and rerun"
        return line
    text = " ".join(str(e.strerror or e).split())
    return text if len(text) <= 500 else text[:497] + "..."


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed (`python -m data list | head -1`): a pipe's
    write end polls POLLERR then. A BrokenPipeError from anything else (a worker's pipe, a socket) is a
    real failure and must not pass for a quiet exit."""
    try:
        fd = sys.__stdout__.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _quiet_stdout() -> None:
    # What Python's docs advise for SIGPIPE: point stdout at /dev/null, so the interpreter's flush of
    # what is still buffered at exit raises no second BrokenPipeError ("Exception ignored ...", exit 120).
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def cli_entry(fn):
    """Wrap a console `main` so that it ends in one line on stderr, never a traceback:

    - OilbirdError: `error: ...`, exit code 2;
    - an OSError (a folder that cannot be written, a full disk, a file under /proc): `error: PATH: reason`,
      exit code 2: the stages write atomically, so what was there before is intact;
    - stdout closed by its reader (`| head -1`): nothing more is printed, exit code 0 (the reader has
      what it asked for);
    - Ctrl-C: `interrupted`, exit code 130."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
            # flushed here, not at interpreter exit: a reader that has gone shows up now, in the handler below
            sys.stdout.flush()
            return code
        except OilbirdError as e:
            _say(f"error: {e}")
            return 2
        except KeyboardInterrupt:
            _say("interrupted")
            return 130
        except OSError as e:
            if isinstance(e, BrokenPipeError) and _stdout_gone():
                _quiet_stdout()
                return 0
            _say(f"error: {os_error_line(e)}")
            return 2

    return wrapper
