"""The dependency range Oilbird is tested on, checked before any command runs.

FLOORS and CEILINGS are the bounds pyproject.toml declares (a test keeps the two equal). CI tests
both ends: `make test` on the newest versions the registry serves inside the bounds, and
`make test-floor` on `.ci/constraints-floor.txt`, which pins every floor below (torch excepted:
the only CPU wheel this project's registry serves is 2.13.0, so torch's floor is tested at 2.13.0;
2.11 is the CUDA image the GPU runs used). Every `python -m data|census|decoder|reports` calls
`require_dependencies()` first, so a dependency outside its range is one line naming it, not a
traceback from deep inside a stage.

This module imports the standard library only: it must run before the dependencies it checks.
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata

# distribution name -> lowest version tested (inclusive)
FLOORS: dict[str, str] = {
    "torch": "2.11",
    "transformers": "5.14",
    "accelerate": "1.0",
    "gguf": "0.10",
    "numpy": "1.26",
    "polars": "1.0",
    "pyarrow": "15",
    "matplotlib": "3.8",
}
# distribution name -> first version not allowed (exclusive)
CEILINGS: dict[str, str] = {"transformers": "6"}


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0), '5.0.0rc1' -> (5, 0, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    parts = tuple(int(p) for p in m.group(1).split("."))
    while len(parts) > 1 and parts[-1] == 0:  # 2.13 == 2.13.0
        parts = parts[:-1]
    return parts


def dependency_problems(installed: dict[str, str | None] | None = None) -> list[str]:
    """One phrase per dependency that is missing or outside its tested range. `installed` maps a
    distribution to its version (None = not installed); by default it is read from the environment."""
    if installed is None:
        installed = {}
        for name in FLOORS:
            try:
                installed[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                installed[name] = None
    problems = []
    for name, floor in FLOORS.items():
        have = installed.get(name)
        ceiling = CEILINGS.get(name)
        bounds = f">={floor}" + (f",<{ceiling}" if ceiling else "")
        if have is None:
            problems.append(f"{name} is not installed (Oilbird needs {name}{bounds})")
        elif release(have) < release(floor):
            problems.append(f"{name} {have} is older than the tested floor {floor} (needs {name}{bounds})")
        elif ceiling and release(have) >= release(ceiling):
            problems.append(f"{name} {have} is newer than the tested range (needs {name}{bounds})")
    return problems


def require_dependencies() -> None:
    """Exit with one `error: ...` line (code 2) when a dependency is missing or outside its range."""
    problems = dependency_problems()
    if problems:
        print(f"error: {'; '.join(problems)}; `make install` (or `pip install -e .`) installs a tested set",
              file=sys.stderr)
        sys.exit(2)


def library_versions() -> dict:
    """The versions a result was computed with (recorded in every store's and run's meta). The libraries
    are imported here, not at the top: this module runs before the dependencies are checked."""
    import numpy
    import polars
    import pyarrow
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "polars": polars.__version__,
            "pyarrow": pyarrow.__version__, "numpy": numpy.__version__}
