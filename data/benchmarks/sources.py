"""Where the benchmark files come from: the data root, the download cache, pinned upstream commits.

Data location (`data_root`): `$OILBIRD_DATA`, else `../shared/benchmarks` next to the repository
when it exists, else the download cache. A file missing there is looked up in the cache
(`$OILBIRD_CACHE/benchmarks`, default `~/.cache/oilbird/benchmarks`) and otherwise downloaded
from the pinned upstream commit (raw GitHub, 10 s timeout; tau-bench's Python task and tool
files are converted to the JSON layout of the shared copy). Offline with nothing found, loading
stops with one line saying where it looked and to set OILBIRD_DATA.
"""

from __future__ import annotations

import gzip
import json
import os
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from data.errors import OilbirdError

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"
DOWNLOAD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DataFile:
    """One file under the data root, built from one or more files of a pinned upstream commit."""

    rel: str  # path under the data root, e.g. "apibank/level-1-api.json"
    repo: str
    commit: str
    paths: tuple[str, ...]  # upstream paths it is built from
    convert: Callable[[list[bytes]], bytes] | None = field(default=None, compare=False)  # None: verbatim

    @property
    def short_commit(self) -> str:  # as the shared README pins it
        return self.commit[:12] if len(self.commit) == 40 else self.commit

    def urls(self) -> list[str]:
        return [f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{p}" for p in self.paths]


def data_root() -> Path:
    """`$OILBIRD_DATA`, else `../shared/benchmarks` next to the repository if it exists, else the cache."""
    env = os.environ.get("OILBIRD_DATA")
    if env:
        return Path(env).expanduser()
    if SHARED_BENCHMARKS.is_dir():
        return SHARED_BENCHMARKS
    return cache_dir()


def cache_dir() -> Path:
    base = os.environ.get("OILBIRD_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "oilbird") / "benchmarks"


_offline_reason: str | None = None  # after one failed download, later ones fail at once (no repeated waits)


def _download(url: str) -> bytes:
    global _offline_reason
    if _offline_reason is not None:
        raise OSError(_offline_reason)
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            return resp.read()
    except Exception as e:  # urllib raises URLError, HTTPError, socket timeouts, ...
        if not getattr(e, "code", None):  # an HTTP status means the network works; anything else: offline
            _offline_reason = f"{type(e).__name__}: {e}"
        raise


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve(f: DataFile) -> Path:
    """The local path of a data file: the data root, else the cache, else downloaded into the cache."""
    root = data_root()
    local = root / f.rel
    if local.is_file():
        return local
    cached = cache_dir() / f.rel
    if cached.is_file():
        return cached
    try:
        blobs = [_download(url) for url in f.urls()]
        payload = f.convert(blobs) if f.convert else blobs[0]
    except Exception as e:
        raise OilbirdError(
            f"benchmark file {f.rel} is not under {root} nor in the cache {cache_dir()}, and fetching it from "
            f"{f.repo}@{f.short_commit} failed ({_one_line(e)}); set OILBIRD_DATA to a folder holding a copy "
            f"(layout {f.rel})") from None
    cached.parent.mkdir(parents=True, exist_ok=True)
    _clean_partial_downloads(cached)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.part")
    tmp.write_bytes(payload)
    os.replace(tmp, cached)  # atomic: a killed download never leaves a truncated file behind
    return cached


def _clean_partial_downloads(cached: Path) -> None:
    """Remove `<name>.<pid>.part` files of downloads killed midway (their pid no longer runs)."""
    for part in cached.parent.glob(f"{cached.name}.*.part"):
        pid = part.name[len(cached.name) + 1:-len(".part")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            part.unlink(missing_ok=True)
        except OSError:
            pass  # alive, someone else's


def _read_json(f: DataFile):
    path = resolve(f)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{path} is not valid JSON ({_one_line(e)})") from None


def _read_jsonl(f: DataFile) -> list[dict]:
    path = resolve(f)
    opener = gzip.open if path.name.endswith(".gz") else open
    rows, lineno = [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    rows.append(json.loads(line))
    except (ValueError, OSError) as e:
        raise OilbirdError(f"{path} line {max(lineno, 1)}: cannot read ({_one_line(e)})") from None
    return rows

