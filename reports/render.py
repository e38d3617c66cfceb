"""The site: every page of every result under runs/, and writing them to a folder.

Pages: one per (benchmark, model) (reports/benchmark_page.py), one per other census pool mode, an
evidence page per (benchmark, model) with a replay or an ablations.json (reports/evidence_page.py),
the index (reports/index_page.py) and the cross-benchmark grid (reports/grid_page.py). Each page is
one self-contained file: inline CSS, charts as inline SVG (reports/charts.py), no script, and a
Content-Security-Policy that forbids every fetch, so a page makes no network request even if
something slipped in (reports/htmlkit.py). Model text is escaped everywhere. A block the results do
not hold (an older census, a decoder run without the semantic source, a missing positions.parquet)
is shown as "not available" with the reason, never guessed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from data.errors import OilbirdError
from reports.benchmark_page import result_page
from reports.case_viewer import TokenText, load_token_text
from reports.evidence_page import evidence_page
from reports.grid_page import grid_page
from reports.index_page import index_page
from reports.links import evidence_name, has_evidence, page_name
from reports.results import Result


def render_site(results: list[Result], token_text: TokenText | None = None, progress: bool = False) -> dict[str, str]:
    """{file name: html} for every page; index.html last. `token_text` overrides the tokenizers (tests)."""
    from tqdm import tqdm

    texts: dict[str, TokenText] = {}
    pages: dict[str, str] = {}
    for r in tqdm(results, desc="reports", unit="result", disable=not progress):
        tt = token_text
        if tt is None and r.census is not None:
            model = r.meta.get("model") if r.meta else None
            tt = texts[model] if model in texts else texts.setdefault(model, load_token_text(model))
        links = [(page_name(r, c), f"pool {c.pool} census") for c in r.censuses[1:]]
        pages[page_name(r)] = result_page(r, token_text=tt, others=links)
        for c in r.censuses[1:]:
            pages[page_name(r, c)] = result_page(r, c, token_text=tt, others=[(page_name(r), "main report")])
        if has_evidence(r):
            pages[evidence_name(r)] = evidence_page(r)
    pages["grid.html"] = grid_page(results)
    pages["index.html"] = index_page(results)
    return pages


def write_site(out: Path, pages: dict[str, str]) -> list[Path]:
    """Write every page atomically, in order (the index last, so it never lists a page not yet there).

    Pages are made world-readable (0644), like any file a web server or a colleague may open."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OilbirdError(f"--out {out} is a file, not a folder: name a folder for the pages")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in pages.items():
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
            os.chmod(tmp, 0o644)
            os.replace(tmp, out / name)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            if e.filename is not None:
                raise
            # a write's OSError names no file ("No space left on device"): name the page it was for
            raise OSError(e.errno, e.strerror or str(e), os.fspath(out / name)) from e
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(out / name)
    return written
