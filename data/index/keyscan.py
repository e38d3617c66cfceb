"""The semantic key's compiled query path (data/index/keyscan.c): built on first use, loaded with ctypes.

The kernel does a whole query of the auto index in one call, so a query costs microseconds instead of
a faiss search plus the Python glue around it (the reasons and the measurements: docs/decoder.md,
"The semantic key at serving speed"). data/index/pruner.py owns the index it reads and keeps a numpy
implementation of the same steps: the reference the tests hold the kernel to, and the path taken
where the kernel cannot be built.

Build: the machine's C compiler (`$CC`, else `cc`) compiles keyscan.c once into
`$OILBIRD_CACHE/kernels` (default `~/.cache/oilbird/kernels`), named by the source's hash and the
flags, written atomically (concurrent first uses race harmlessly). On x86-64 with AVX2, FMA and F16C
the build uses them (the float16 rows are widened by F16C); elsewhere plain -O3 C. No compiler, a
failed build or `OILBIRD_KEYSCAN=numpy` select the numpy path; `status()` says which path runs and why,
and the first query on the numpy path prints one note on stderr.

`keyscan_submit` / `keyscan_collect` run the key's pass on one worker thread per process (the drafter
overlaps it with its lexical tree: decoder/drafters/oilbird.py `key_overlap`); `worker_stats()` says how
long the worker worked.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("keyscan.c")
BUILD_TIMEOUT_S = 120


class KeyScan(ctypes.Structure):
    """keyscan.c's `KeyScan`: the index's arrays as raw pointers (data/index/pruner.py keeps the arrays alive)."""

    _fields_ = [("d", ctypes.c_int32), ("dims", ctypes.c_int32), ("nlist", ctypes.c_int32),
                ("nprobe", ctypes.c_int32), ("width", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("mean", ctypes.c_void_p), ("proj", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("cent", ctypes.c_void_p), ("codes_ptr", ctypes.c_void_p), ("ids_ptr", ctypes.c_void_p),
                ("groups_ptr", ctypes.c_void_p), ("sizes", ctypes.c_void_p), ("matrix", ctypes.c_void_p),
                ("row_base", ctypes.c_int64), ("n", ctypes.c_int64), ("fwork", ctypes.c_void_p),
                ("iwork", ctypes.c_void_p), ("lwork", ctypes.c_void_p), ("wq", ctypes.c_void_p)]


class ChainSpec(ctypes.Structure):
    """keyscan.c's `ChainSpec`: the depth schedule, the pool's token arrays and the output buffers."""

    _fields_ = [("thresholds", ctypes.c_void_p), ("depths", ctypes.c_void_p), ("n_sched", ctypes.c_int32),
                ("n_rank", ctypes.c_int32), ("rank_depths", ctypes.c_void_p), ("offset", ctypes.c_int32),
                ("min_len", ctypes.c_int32), ("max_len", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("row_flat", ctypes.c_void_p), ("row_end", ctypes.c_void_p), ("tokens", ctypes.c_void_p),
                ("out_tokens", ctypes.c_void_p), ("out_lens", ctypes.c_void_p)]


class KeyJob(ctypes.Structure):
    """keyscan.c's `KeyJob`: keyscan_key's arguments, passed by one pointer (keyscan_run here, keyscan_submit to
    the worker thread)."""

    _fields_ = [("ks", ctypes.c_void_p), ("cs", ctypes.c_void_p), ("state", ctypes.c_void_p),
                ("out_scores", ctypes.c_void_p), ("out_rows", ctypes.c_void_p), ("n_chains", ctypes.c_void_p),
                ("excluded", ctypes.c_int32), ("k", ctypes.c_int32), ("theta", ctypes.c_double)]


_state: dict = {}  # "lib": the loaded library or None, "why": the reason for the numpy path, "noted"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flags() -> list[str]:
    # no FMA (-ffp-contract=off): the numpy reference's rounding; -pthread: the key's worker thread
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def kernel_dir() -> Path:
    base = os.environ.get("OILBIRD_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "oilbird") / "kernels"


def _build() -> tuple[Path | None, str]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler found (set CC, or install gcc)"
    flags = build_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = kernel_dir() / f"keyscan-{digest}.so"
    if out.exists():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        proc = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = (proc.stderr.strip().splitlines() or ["no output"])[0]
            return None, f"{Path(cc).name} failed on keyscan.c: {first}"
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build keyscan.c: {e}"
    return out, ""


def library():
    """The loaded kernel, or None (the numpy path; `status()` says why). Built on the first call."""
    if "lib" in _state:
        return _state["lib"]
    lib, why = None, ""
    if os.environ.get("OILBIRD_KEYSCAN", "").lower() in ("numpy", "off", "0"):
        why = "OILBIRD_KEYSCAN=numpy"
    else:
        path, why = _build()
        if path is not None:
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                lib, why = None, f"could not load {path.name}: {e}"
    if lib is not None:
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        lib.keyscan_query.argtypes = [vp, vp, i32, i32, vp, vp]
        lib.keyscan_query.restype = i64
        lib.keyscan_chains.argtypes = [vp, vp, vp, i32]
        lib.keyscan_chains.restype = i32
        lib.keyscan_encode.argtypes = [vp, vp, i64, vp, vp]
        lib.keyscan_encode.restype = None
        lib.keyscan_simd.restype = i32
        lib.keyscan_run.argtypes = [vp]
        lib.keyscan_run.restype = i64
        lib.keyscan_submit.argtypes = [vp]
        lib.keyscan_submit.restype = i32
        lib.keyscan_collect.argtypes = []
        lib.keyscan_collect.restype = i64
        lib.keyscan_drain.argtypes = []
        lib.keyscan_drain.restype = None
        lib.keyscan_worker_stats.argtypes = [vp]
        lib.keyscan_worker_stats.restype = None
    _state.update(lib=lib, why=why, noted=False)
    return lib


def loaded():
    """The kernel if it was loaded already (None otherwise): never builds it."""
    return _state.get("lib")


def worker_stats() -> dict:
    """The kernel's worker thread in this process (data/index/keyscan.c keyscan_submit): seconds it spent answering,
    queries answered, and the queries whose submit found it asleep and woke it (zeros when it never ran)."""
    lib = loaded()
    if lib is None:
        return {"worker_s": 0.0, "worker_queries": 0, "worker_wakes": 0}
    out = (ctypes.c_double * 3)()
    lib.keyscan_worker_stats(out)
    return {"worker_s": out[0], "worker_queries": int(out[1]), "worker_wakes": int(out[2])}


def status() -> dict:
    """Which query path runs: {"path": "c" | "numpy", "simd": bool, "why": reason for numpy}."""
    lib = library()
    return {"path": "c" if lib is not None else "numpy", "simd": bool(lib is not None and lib.keyscan_simd()),
            "why": _state.get("why", "")}


def note_numpy_path() -> None:
    """One stderr line, the first time a query takes the numpy path for want of the kernel."""
    if _state.get("noted") or _state.get("why") == "OILBIRD_KEYSCAN=numpy":
        return
    _state["noted"] = True
    print(f"note: the semantic key's C kernel is unavailable ({_state.get('why')}); queries take the slower "
          "numpy path", file=sys.stderr)


def address(a) -> int:
    """The data pointer of a numpy array or a torch tensor."""
    return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]
