"""What each page is called, the links between pages, and the commands that make what a page lacks."""

from __future__ import annotations

from reports.htmlkit import href
from reports.results import Census, Result


def bench_name(result: Result, census: Census | None = None) -> str:
    for s in ([census.summary] if census else []) + [a.summary for a in result.arms + result.replay
                                                     + result.replay_warm]:
        if isinstance(s.get("bench"), str) and s["bench"]:
            return s["bench"]
    return result.bench


def page_name(result: Result, census: Census | None = None) -> str:
    if census is None or census is result.census:
        return f"{result.slug}.html"
    return f"{result.slug}__{census.folder.name}.html"


def has_evidence(result: Result) -> bool:
    """Whether the result gets an evidence page: it has a replay (strictly-past pool) or an ablations.json."""
    return bool(result.replay) or result.ablations is not None


def evidence_name(result: Result) -> str:
    return f"{result.slug}__evidence.html"


def evidence_link(result: Result) -> str:
    return f'<a href="{href(evidence_name(result))}">evidence</a>' if has_evidence(result) else ""


def replay_command(result: Result) -> str:
    return f"python -m decoder replay --bench {bench_name(result)} --model {result.model_name}"


def ablations_command(result: Result) -> str:
    """The command that writes ablations/ablations.json for this result."""
    return f"make ablations BENCH={bench_name(result)} MODEL={result.model_name}"
