"""`python -m reports [--runs runs] [--out reports/html]`: render every census, replay and decoder result as HTML."""

from __future__ import annotations

from data.versions import require_dependencies

require_dependencies()  # before the stage imports what it checks: one line, never a traceback

import argparse
import sys
from pathlib import Path

from data.errors import OilbirdError, cli_entry
from data.store.layout import REPORTS_HTML


@cli_entry
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m reports",
        description="Render every census, replay and decoder result under RUNS into self-contained HTML pages: "
                    "index.html, one page per (benchmark, model), and grid.html across benchmarks.")
    p.add_argument("--runs", default="runs", help="results root (default runs/)")
    p.add_argument("--out", default=REPORTS_HTML, help=f"output folder (default {REPORTS_HTML}/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from data.store.layout import check_writable
    from reports.render import render_site, write_site
    from reports.results import find_results

    results = find_results(Path(args.runs))
    if not results:
        raise OilbirdError(f"no census or decoder results under {args.runs}/: run `make census BENCH=apibank` "
                           "(or `python -m census` / `python -m decoder`) first")
    check_writable(args.out)  # before rendering: a file, /proc or an immutable folder is one line, not a traceback
    pages = render_site(results, progress=not args.quiet)
    write_site(Path(args.out), pages)
    print(f"wrote {len(pages)} pages to {args.out}/: open {Path(args.out) / 'index.html'}")
    # Result files that break their schema (data/results.py): every page is still written, the values are shown
    # as not known and a verdict that reads one says "cannot decide"; one note per file, then exit 2, so that
    # `make census` and scripts do not take a site with undecidable pages for a clean one.
    from reports.decision import decision_problems

    by_file: dict[str, list[str]] = {}
    for r in results:
        for problem in r.problems + decision_problems(r):
            lines = by_file.setdefault(problem.file, [])
            if str(problem) not in lines:
                lines.append(str(problem))
    for lines in by_file.values():
        more = f" (and {len(lines) - 1} more problem(s) in that file)" if len(lines) > 1 else ""
        print(f"note: {lines[0]}{more}", file=sys.stderr)
    if by_file:
        raise OilbirdError(f"{len(by_file)} result file(s) lack a field or hold an invalid value (the notes above; "
                           "docs/reports.md, \"Result files\"): their values read as not known and a verdict that "
                           "reads one says \"cannot decide\"; rewrite them with the command that made them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
