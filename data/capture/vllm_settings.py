"""Every OILBIRD_VLLM_* setting of the engine's side (the recorder of data/capture/vllm_capture.py and the Oilbird
proposer of decoder/vllm/proposer.py), parsed and checked in one place, `read_vllm_settings`.

vLLM hands a custom_class proposer nothing but its own config, so the settings reach the engine's child
process through the environment. A value nobody checked would fail there, in a worker, as 130 lines of
traceback or as an engine that dies at its first finished request. So the reader is called twice with the
same rules: by the parent before the engine starts (`speculative_config`, `make_llm` for either class, `python -m
decoder vllm-check` before `vllm serve`), where a bad value is one `error: ...` line, and by the proposer's constructor in the worker (which reads the
environment itself: `vllm serve` never runs our parent code).

Rules (docs/vllm.md has the table):
  - an explicit argument wins over the environment, and a variable that is not used is not read at all
    (OILBIRD_VLLM_NODES=abc does not matter when nodes is passed; OILBIRD_VLLM_STORE_FLUSH does not matter
    without OILBIRD_VLLM_STORE);
  - unset or empty means the default;
  - every value is type- and range-checked; a failure is one OilbirdError line naming the variable (or the
    argument), its value and what is allowed;
  - paths are checked writable at start: a file's folder exists and takes a new file (a probe, as
    data/store/layout.check_writable does: root ignores permission bits), the file is not a folder, a FIFO or
    a device; a folder exists and is writable or can be made; nothing under /proc, /sys or /dev.
Serving-time write failures (a disk that fills, a folder removed after start) are the writers' business:
logged once and counted, never raised into vLLM (vllm_capture.py, decoder/vllm/proposer.py).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from data.errors import OilbirdError
from data.readfile import regular_file
from data.store.layout import check_writable

ENV_PREFIX = "OILBIRD_VLLM_"
RECORDER_CLASS = "data.capture.vllm_capture.RequestRecorder"  # capture by serving's custom_class (vllm_capture.py)
PROPOSER_CLASS = "decoder.vllm.proposer.OilbirdProposer"  # the Oilbird arms' custom_class (decoder/vllm/proposer.py)
MAX_NODES = 256  # the tree's node budget in every CLI too (decoder/draft.py imports it): the largest a profile prices
MAX_K = 256  # draft tokens per row and step: no chain is longer than the largest tree
MAX_FLUSH = 100_000  # finished requests per store commit; more only delays every commit
MAX_LAYER = 4096  # 1-based capture layer; the model's own count is checked when the tap is made
SYSTEM_ROOTS = ("/proc", "/sys", "/dev")  # kernel file systems: a "file" there is not storage
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class Variable:
    """One setting: its field in VllmSettings, its kind, its default and what is allowed (in words)."""

    field: str
    kind: str  # int | text | name | file (written) | folder (written) | input (a file read)
    default: Any
    allowed: str  # the error line's and the docs table's "allowed"
    lo: int = 0
    hi: int = 0
    needs: str = ""  # read only when this other field is set (the store's commit size: only with a store)
    env: bool = True  # False: an argument only (k comes from vLLM's num_speculative_tokens)

    @property
    def name(self) -> str:
        return ENV_PREFIX + self.field.upper()


VARIABLES: tuple[Variable, ...] = (
    Variable("arm", "text", "oilbird", "an Oilbird arm: oilbird, oilbird-no-semantic or oilbird@field=value"),
    Variable("k", "int", 8, f"draft tokens per row and step, a whole number 1..{MAX_K}", 1, MAX_K, env=False),
    Variable("nodes", "int", 60, f"the tree's node budget, a whole number 1..{MAX_NODES}", 1, MAX_NODES),
    Variable("index", "text", "auto", "an index spec: auto, exact, flat, sq8, pq64, ivf1024,pq64, hnsw32, ..."),
    Variable("stats", "file", "", "a JSON file to write, in an existing writable folder"),
    Variable("log", "file", "", "a log file to append to, in an existing writable folder"),
    Variable("profile", "input", "", "a vLLM profile JSON (python -m decoder profile --engine vllm)"),
    Variable("store", "folder", "", "a trace store folder, existing or to be made, writable"),
    Variable("store_flush", "int", 8, f"finished requests per store commit, a whole number 1..{MAX_FLUSH}", 1,
             MAX_FLUSH, needs="store"),
    Variable("bench", "name", "served", "the store's benchmark name: letters, digits, '.', '_', '-' (64 at most)",
             needs="store"),
    Variable("traces", "folder", "", "a folder for one .npz per finished request, existing or to be made, writable"),
    Variable("layer", "int", 0, f"the capture layer, 1-based, a whole number 1..{MAX_LAYER} (unset: round(0.85 L))",
             1, MAX_LAYER),
)
BY_FIELD = {v.field: v for v in VARIABLES}
RECORDER_FIELDS = ("log", "store", "store_flush", "bench", "traces", "layer")  # what the recorder alone reads
PROPOSER_FIELDS = tuple(v.field for v in VARIABLES)  # the Oilbird proposer reads them all
# what each custom_class reads: checked by whoever builds the engine before vLLM starts its workers (make_llm)
CLASS_FIELDS = {RECORDER_CLASS: RECORDER_FIELDS, PROPOSER_CLASS: PROPOSER_FIELDS}


@dataclass(frozen=True)
class VllmSettings:
    """The engine side's settings (defaults: VARIABLES'); "" = none for the paths, layer 0 = round(0.85 L)."""

    arm: str = "oilbird"  # a replay arm that interleaves requests
    k: int = 8  # draft tokens per row and step (vLLM's num_speculative_tokens)
    nodes: int = 60  # the tree's node budget before the best chain is taken (replay's --nodes)
    index: str = "auto"  # the semantic key's index spec (decoder/pools.py --index)
    stats: str = ""  # the proposer's counters, rewritten after every finished request
    log: str = ""  # log lines (the engine's child owns stdout)
    profile: str = ""  # the vLLM verification-cost profile that sizes the chains ("" = a flat cost: k tokens)
    store: str = ""  # serving writes a trace store here (data/capture/served_store.py)
    store_flush: int = 8  # finished requests per store commit
    bench: str = "served"  # the served store's benchmark name
    traces: str = ""  # one .npz per finished request (capture by serving)
    layer: int = 0  # the capture layer the taps use (0: round(0.85 L))

    def to_env(self, names: Iterable[str]) -> dict[str, str]:
        """The environment that makes the engine's child read these fields back (empty = the default)."""
        values = asdict(self)  # a default is written as "" (unset): layer's 0 is no value a variable may hold
        return {BY_FIELD[f].name: "" if values[f] == BY_FIELD[f].default else str(values[f])
                for f in names if BY_FIELD[f].env}


def read_vllm_settings(names: Iterable[str], explicit: Mapping[str, Any] | None = None,
                       environ: Mapping[str, str] | None = None) -> VllmSettings:
    """The settings `names` (fields of VllmSettings), each from `explicit` (when given and not None), else its
    OILBIRD_VLLM_* variable (when set and not empty), else its default; every one checked (module docstring).
    Fields not in `names` keep their defaults and their variables are not read."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in (explicit or {}).items() if v is not None}
    unknown = sorted(set(given) - set(BY_FIELD))
    if unknown:
        raise OilbirdError(f"unknown vLLM setting {unknown[0]!r}; known: {', '.join(BY_FIELD)}")
    wanted = set(names)
    values: dict[str, Any] = {}
    for var in VARIABLES:  # in order: a field's `needs` comes before it
        if var.field not in wanted or (var.needs and not values.get(var.needs)):
            continue
        if var.field in given:
            value = given[var.field]
            values[var.field] = check_value(var, value, f"{var.field}={value!r}")
            continue
        raw = environ.get(var.name, "") if var.env else ""
        if raw.strip():
            values[var.field] = check_value(var, parse_env(var, raw), f"{var.name}={raw!r}")
    return VllmSettings(**values)


def parse_env(var: Variable, raw: str) -> Any:
    """The variable's text as its kind's type (a whole number stays text when it is not one: check_value says so)."""
    text = raw.strip()
    if var.kind == "int" and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    return text if var.kind in ("int", "text", "name") else raw


def check_value(var: Variable, value: Any, label: str) -> Any:
    """`value` if it is one `var` allows, else one OilbirdError line: `label: what is wrong; allowed: ...`."""
    def bad(why: str) -> OilbirdError:
        return OilbirdError(f"{label}: {why}; allowed: {var.allowed}")

    if var.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"{_kind_of(value)}, not a whole number")
        if not var.lo <= value <= var.hi:
            raise bad(f"{value} is outside {var.lo}..{var.hi}")
        return value
    if var.kind in ("file", "folder", "input") and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise bad(f"{_kind_of(value)}, not text")
    if var.kind in ("text", "name"):
        if not value.strip() or value != value.strip() or any(c.isspace() or not c.isprintable() for c in value):
            raise bad("empty, or holds spaces or control characters")
        if var.kind == "name" and not NAME.fullmatch(value):
            raise bad("not a plain name")
        return value
    if not value:  # a path argument given as "": none (no stats, no log, no store...)
        return value
    if "\0" in value:
        raise bad("holds a NUL character")
    root = system_root(value)
    if root:
        raise bad(f"{value} is under {root}, a kernel file system, not storage")
    try:
        if var.kind == "input":
            regular_file(value, "file")  # a FIFO or a device is refused before anything opens it
        elif var.kind == "folder":
            check_writable(value, label)  # exists and writable, or can be made (a probe in its deepest folder)
        else:
            check_writable_file(value, label)
    except OilbirdError as e:
        raise bad(str(e).replace(f" (check {label})", "")) from None
    return value


def check_writable_file(path: str, label: str) -> None:
    """A file that can be (re)written at `path`: not a folder, a FIFO or a device; its folder exists and takes
    a new file (the stats are written through a temporary file renamed into place)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OilbirdError(f"{path} cannot be reached ({e.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        what = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, a device or a socket)"
        raise OilbirdError(f"{path} is {what}")
    folder = Path(os.path.abspath(path)).parent
    if not folder.is_dir():
        raise OilbirdError(f"its folder {folder} does not exist (create it first)")
    check_writable(folder, label)
    if st is not None and not os.access(path, os.W_OK):
        raise OilbirdError(f"{path} is not writable")


def system_root(path: str) -> str:
    """The kernel file system `path` lies under ("" if none), as written and with its links resolved."""
    for p in (os.path.abspath(path), os.path.realpath(path)):
        for root in SYSTEM_ROOTS:
            if p == root or p.startswith(root + "/"):
                return root
    return ""


def _kind_of(value: Any) -> str:
    return "text" if isinstance(value, str) else f"a {type(value).__name__}"


def settings_table() -> list[tuple[str, str, str]]:
    """(variable, default, allowed) of every environment variable: docs/vllm.md's table is checked against it."""
    return [(v.name, str(v.default), v.allowed) for v in VARIABLES if v.env]

