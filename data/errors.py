"""The one user-facing error type: every entry point prints it as a single line and exits 2."""

import sys
from functools import wraps


class OilbirdError(Exception):
    """A problem with the user's input or environment, stated in one line (no traceback)."""


def cli_entry(fn):
    """Wrap a console `main` so OilbirdError (and Ctrl-C) end in one line on stderr, exit code 2/130."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OilbirdError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapper
