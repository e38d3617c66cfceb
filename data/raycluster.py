"""Joining or starting a Ray cluster for one command (`--ray auto|local:N|ADDRESS`), in one line when it cannot.

- `local:N`: a Ray instance on this machine with N CPUs (`ray.init(num_cpus=N)`), shut down after the command.
- `auto`: the cluster running here (`ray start --head`, or RAY_ADDRESS), else a local one on this machine's CPUs.
  An address taken from RAY_ADDRESS is probed and bounded as `HOST:PORT` is (a stale one is one line naming
  the variable, never Ray's minutes of retries); `local:N` ignores RAY_ADDRESS (Ray would join it instead).
- `HOST:PORT` (on a node of the cluster) or `ray://HOST:PORT` (Ray Client, from outside it): that cluster.
  It is probed first (a TCP connect, CONNECT_TIMEOUT_S) and `ray.init` itself gets the same bound: an
  address that does not answer is one line, never a wait (ray.init alone retries for minutes).
A process already connected to Ray (a notebook, a test's `ray.init(num_cpus=2)`) uses that connection and
leaves it running. Nothing here schedules, transports or retries: Ray does (ray.get / ray.wait on tasks and actors).

Used by the census (census/ray_census.py, census/grid.py), capture (data/capture/ray_capture.py) and replay
(decoder/replay/arms.py: replay and the ablations); it sits at the top of data because every room uses it and
data may import neither census nor decoder. `gather` is the tasks' side of it: their results in order, a
progress bar, a failed task in one line.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from data.errors import OilbirdError

RAY_SPEC = "ray==2.60.0"  # what `make install` puts in the environment
CONNECT_TIMEOUT_S = 10.0  # an ADDRESS that does not answer within this is refused, never waited on
ROOT = Path(__file__).resolve().parents[1]  # this checkout: the workers import its packages
# a CPU task's worker runs on one thread: Ray gives it one CPU, and a library's own thread pool would take the
# CPUs of the tasks beside it
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class RayTarget:
    """Where `--ray` runs (module docstring)."""

    text: str  # as the user wrote it (named in errors)
    kind: str  # auto | local | address
    cpus: int | None = None  # local:N
    address: str | None = None  # HOST:PORT or ray://HOST:PORT


@dataclass(frozen=True)
class ClusterSize:
    """What the cluster holds, read once it is joined (ray.cluster_resources)."""

    cpus: int
    gpus: int


def _whole_number(text: str) -> bool:
    """ASCII digits only: `str.isdigit()` also takes '²' or '٣', which `int()` then refuses with a traceback."""
    return text.isascii() and text.isdigit()


def _is_address(text: str) -> bool:
    """HOST:PORT or ray://HOST:PORT, the port in ASCII digits."""
    host, sep, port = text.removeprefix("ray://").rpartition(":")
    return bool(sep and host and _whole_number(port))


def parse_ray(text: str) -> RayTarget:
    """`--ray`'s value, or one line saying what it takes."""
    t = (text or "").strip()
    if t == "auto":
        return RayTarget(t, "auto")
    if t.startswith("local:"):
        n = t[len("local:"):]
        if not _whole_number(n) or int(n) < 1:
            raise OilbirdError(f"--ray {text}: local:N needs a whole number of CPUs >= 1 (e.g. local:2)")
        return RayTarget(t, "local", cpus=int(n))
    if not _is_address(t):
        raise OilbirdError(f"--ray {text!r}: use auto, local:N (N CPUs on this machine) or a cluster's HOST:PORT "
                           "(ray://HOST:PORT for Ray Client)")
    return RayTarget(t, "address", address=t)


def import_ray():
    """The ray module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise OilbirdError(f"--ray needs the ray package, which this environment lacks: `make install` "
                           f"(or `pip install '{RAY_SPEC}'`), or run without --ray") from None
    return ray


def probe(address: str, timeout: float, label: str | None = None, hint: str | None = None) -> None:
    """A TCP connect to the address: refused or silent within `timeout` is one line (`label` names where the
    address came from; default `--ray ADDRESS`)."""
    host, port = address.removeprefix("ray://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise OilbirdError(f"{label or f'--ray {address}'}: no Ray cluster answers there within {timeout:g} s "
                           f"({e.strerror or e}); {hint or 'start one (`ray start --head`) or use --ray local:N'}") from None


def environment_address() -> str | None:
    """The cluster address RAY_ADDRESS names (what `ray.init` would join for `--ray auto`), None when unset
    (or `auto` / `local`, which name no address)."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    return env if env and env not in ("auto", "local") else None


def _init_within(ray, timeout: float, text: str, **kwargs) -> None:
    """ray.init with a bound: a port that takes the connection but is no Ray head would hold ray.init for
    minutes. The attempt runs in a daemon thread, which the process leaves behind when it ends in the error."""
    box: dict = {}

    def attempt() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    quiet = logging.getLogger("ray._private.worker")  # its "SIGTERM handler is not set" note: not our thread's fault
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        thread = threading.Thread(target=attempt, name="oilbird-ray-init", daemon=True)
        thread.start()
        thread.join(timeout)
    finally:
        quiet.setLevel(level)
    if thread.is_alive():
        raise OilbirdError(f"--ray {text}: the address takes connections but no Ray cluster answered within "
                           f"{timeout:g} s; check the address (ray://HOST:10001 from outside the cluster, HOST:6379 on "
                           "one of its nodes)")
    if "error" in box:
        raise box["error"]


def start_ray(target: RayTarget, timeout: float | None = None):
    """ray.init for the target; what Ray raises becomes one line."""
    ray = import_ray()
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    # the workers' own output (vLLM's logs, progress bars) stays in Ray's log files: the driver prints a line
    # per shard instead
    quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        env = environment_address() if target.kind == "auto" else None
        if target.kind == "local":  # address "local": a new instance, whatever RAY_ADDRESS says
            ray.init(address="local", num_cpus=target.cpus, **quiet)
        elif target.kind == "address" or env:
            address = target.address or env
            label = f"--ray {target.text}" if target.kind == "address" else \
                f"--ray {target.text}: RAY_ADDRESS={env} (from the environment)"
            if not _is_address(address):
                raise OilbirdError(f"{label} is not HOST:PORT or ray://HOST:PORT; set RAY_ADDRESS to a cluster's "
                                   "address, or unset it to run on this machine")
            probe(address, timeout, label,
                  "unset RAY_ADDRESS (or point it at a running cluster), or use --ray local:N" if env else None)
            # the driver's core worker logs each failed connect attempt (C++, on stderr) while it waits: the
            # outcome is our one line
            os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
            _init_within(ray, timeout, label.removeprefix("--ray "), address=address, log_to_driver=False,
                         logging_level=logging.ERROR)
        else:
            try:
                ray.init(address="auto", **quiet)
            except ConnectionError:  # no cluster running here: a local one on this machine's CPUs
                ray.init(**quiet)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OilbirdError(f"--ray {target.text}: could not start or join a Ray cluster ({first})") from None
    return ray


@contextmanager
def ray_session(target: RayTarget) -> Iterator:
    """Ray for one command: joined or started here and shut down after; one this process already holds is
    used as it is and left running (module docstring)."""
    ray = import_ray()
    if target.kind == "address":  # asked for that cluster: it answers, or one line, whatever runs here
        probe(target.address, CONNECT_TIMEOUT_S)
    if ray.is_initialized():
        yield ray
        return
    start_ray(target)
    try:
        yield ray
    finally:
        ray.shutdown()


def cluster_size(ray) -> ClusterSize:
    have = ray.cluster_resources()
    return ClusterSize(int(have.get("CPU", 0)), int(have.get("GPU", 0)))


def worker_env(extra: dict[str, str] | None = None) -> dict:
    """An actor's runtime_env: this checkout's packages first on its path (a local cluster's workers start
    wherever Ray starts them), plus `extra`."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"env_vars": {"PYTHONPATH": path, **(extra or {})}}


def gather(ray, refs: list, labels: list[str], desc: str, unit: str, progress: bool) -> list:
    """The tasks' results in submission order, a bar counting tasks done (ray.wait); a task that failed
    is one line naming it (an OilbirdError raised in the worker keeps its text)."""
    from tqdm import tqdm

    pending = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    with tqdm(total=len(refs), desc=desc, unit=unit, disable=not progress) as bar:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, OilbirdError):
                        raise OilbirdError(str(cause)) from None
                    why = str(cause or e).strip().splitlines()
                    raise OilbirdError(f"{labels[i]} failed on a Ray worker: "
                                       f"{why[-1] if why else type(e).__name__}") from None
                except ray.exceptions.RayError as e:  # a worker lost more often than max_retries, a node gone
                    why = str(e).strip().splitlines()
                    raise OilbirdError(f"{labels[i]} was lost on the Ray cluster after retries: "
                                       f"{why[0] if why else type(e).__name__}") from None
                bar.update()
    return results
