"""The tested dependency range: one table (data/versions.py) equal to pyproject's, checked before a command runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data.versions import CEILINGS, FLOORS, dependency_problems, release

REPO = Path(__file__).resolve().parents[1]


def _pyproject_bounds() -> dict[str, tuple[str | None, str | None]]:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {}
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
        lo = re.search(r">=\s*([0-9][^,\s]*)", dep)
        hi = re.search(r"<\s*([0-9][^,\s]*)", dep)
        bounds[name] = (lo.group(1) if lo else None, hi.group(1) if hi else None)
    return bounds


def test_floors_equal_pyproject():
    declared = {name: b for name, b in _pyproject_bounds().items() if b[0] is not None}
    assert {name: lo for name, (lo, _) in declared.items()} == FLOORS
    assert {name: hi for name, (_, hi) in declared.items() if hi is not None} == CEILINGS


def test_floor_constraints_pin_every_floor():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / ".ci/constraints-floor.txt").read_text(), re.M))
    for name, floor in FLOORS.items():
        assert name in pins, f"{name} is not pinned in .ci/constraints-floor.txt"
        if name != "torch":  # the registry serves one CPU torch (2.13.0): its floor is tested there
            assert release(pins[name]) == release(floor), (name, pins[name], floor)


@pytest.mark.parametrize("text,expected", [("2.13.0+cpu", (2, 13)), ("5.0.0rc1", (5,)), ("15", (15,)),
                                           ("1.26.4", (1, 26, 4)), ("v0.10.0", (0, 10)), ("2.11", (2, 11))])
def test_release(text, expected):
    assert release(text) == expected


def test_dependency_problems_against_brute_force():
    # every dependency at its floor, just below it, missing, and (with a ceiling) at the ceiling
    at_floor = dict(FLOORS)
    assert dependency_problems(at_floor) == []
    for name, floor in FLOORS.items():
        parts = list(release(floor))  # trailing zeros stripped: the last part is positive
        below = ".".join(map(str, parts[:-1] + [parts[-1] - 1, 99]))  # 2.11 -> 2.10.99, 1.0 -> 0.99
        assert release(below) < release(floor)
        problems = dependency_problems({**at_floor, name: below})
        assert len(problems) == 1 and problems[0].startswith(f"{name} {below} is older"), problems
        problems = dependency_problems({**at_floor, name: None})
        assert len(problems) == 1 and problems[0].startswith(f"{name} is not installed"), problems
    for name, ceiling in CEILINGS.items():
        problems = dependency_problems({**at_floor, name: ceiling + ".0.1"})
        assert len(problems) == 1 and "newer than the tested range" in problems[0]


def test_installed_environment_is_in_range():
    assert dependency_problems() == []


def test_old_dependency_is_one_line(tmp_path):
    """A distribution below its floor, found first on the path: every stage stops with one line naming it."""
    fake = tmp_path / "polars-0.19.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: polars\nVersion: 0.19.0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    for stage in ("data", "census", "decoder", "reports"):
        r = subprocess.run([sys.executable, "-m", stage, "--help"], cwd=REPO, env=env, capture_output=True, text=True)
        assert r.returncode == 2, (stage, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: polars 0.19.0 is older than the tested floor 1.0"), r.stderr
