"""Whether a result still describes its trace store: stale and unverified results, marked on every page.

Stale: the result's summary.json records the `store_fingerprint` of the store it was computed on
(census, replay, the vLLM bench), and the store's fingerprint now (data/store/reader.py
`current_fingerprint`, read into `Result.store_fingerprint`) differs: the store was extended,
recaptured or edited since, so the numbers describe another store than the one beside them.
Unverified: the summary records `"store_verified": false`: the store had no checksums, so its files
could not be checked against what capture wrote.

A page shows a callout listing the stale and the unverified results among those it shows (with the
command that recomputes them); the index and the grid mark the row. A result without a fingerprint
(made before results recorded one) or a store that is gone cannot be compared and is not marked.
"""

from __future__ import annotations

from pathlib import Path

from reports.htmlkit import esc, finite
from reports.links import bench_name
from reports.results import Arm, Census, Result


def is_stale(summary: dict, result: Result) -> bool:
    """The summary was computed on the store as it was before it changed."""
    then, now = summary.get("store_fingerprint"), result.store_fingerprint
    return isinstance(then, str) and isinstance(now, str) and then != now


def is_unverified(summary: dict) -> bool:
    """The summary was computed on a store without checksums (older summaries do not say: not marked)."""
    return summary.get("store_verified") is False


def _census_label(c: Census) -> str:
    return "the census" if c.pool == "past" else f"the census (pool {c.pool})"


def _replay_groups(arms: list[Arm]) -> list[tuple[str, list[dict]]]:
    """(label, summaries) per replay pool and node budget: 'the replay (pool past, 60 nodes) of a, b'."""
    groups: dict[tuple[str, object], list[Arm]] = {}
    for a in arms:
        groups.setdefault((a.pool, a.nodes), []).append(a)
    out = []
    for (pool, nodes), group in groups.items():
        where = f"pool {pool}" + (f", {nodes} nodes" if nodes is not None else "")
        out.append((f"the replay ({where}) of {', '.join(a.name for a in group)}", [a.summary for a in group]))
    return out


def shown_results(result: Result, census: Census | None = None, *, replay: bool = True, warm: bool = True,
                  vllm: bool = True) -> list[tuple[str, list[dict]]]:
    """(label, summaries) of the results a page shows that record their store: `census` (default: none),
    the replay (strictly-past pool, every node budget), the warm-pool replay and the vLLM bench."""
    items: list[tuple[str, list[dict]]] = []
    if census is not None:
        items.append((_census_label(census), [census.summary]))
    arms: list[Arm] = []
    seen: set[Path] = set()
    pools = ([result.replay, *result.replay_nodes.values()] if replay else []) + (
        [result.replay_warm, *result.replay_warm_nodes.values()] if warm else [])
    for group in pools:
        for a in group:
            if a.folder not in seen:
                seen.add(a.folder)
                arms.append(a)
    items += _replay_groups(arms)
    if vllm and isinstance(result.vllm, dict):
        items.append(("the vLLM bench", [result.vllm]))
    return items


def _requests(summaries: list[dict]) -> int | None:
    counts = {int(s["requests"]) for s in summaries if finite(s.get("requests"))}
    return counts.pop() if len(counts) == 1 else None


def _store_requests(result: Result) -> int | None:
    n = (result.meta or {}).get("n_requests")
    return int(n) if finite(n) else None


def recompute_command(result: Result) -> str:
    """What recomputes the census and the decision's replay of this (benchmark, model)."""
    return f"make census BENCH={bench_name(result)} MODEL={result.model_name}"


def freshness_callout(result: Result, items: list[tuple[str, list[dict]]]) -> str:
    """The callout naming the stale and the unverified results among `items` ("" when there are none)."""
    stale = [(label, ss) for label, ss in items if any(is_stale(s, result) for s in ss)]
    unverified = [label for label, ss in items if any(is_unverified(s) for s in ss)]
    parts = []
    if stale:
        now = _store_requests(result)
        counts = []
        for label, ss in stale:
            then = _requests(ss)
            counts.append(label + (f" ({then:,} requests)" if then is not None else ""))
        parts.append(
            '<p class="callout stale" id="stale"><strong>Stale results.</strong> '
            + esc("; ".join(counts)) + esc(
                f": computed on the trace store as it was before it changed (it has been extended, recaptured "
                f"or edited since{f'; it now holds {now:,} requests' if now is not None else ''}). Their numbers "
                "do not describe the store as it is now. ")
            + f"<code>{esc(recompute_command(result))}</code> recomputes the census and the decision's replay "
            "(other pools and node budgets: rerun the command that made them).</p>")
    if unverified:
        parts.append(
            '<p class="callout stale" id="unverified"><strong>Unverified store.</strong> '
            + esc("; ".join(unverified)) + esc(
                ": computed on a trace store without checksums (as a store written before checksums existed "
                "is), so its files could not be checked against what capture wrote. Recapture the store to make "
                "its results verifiable.") + "</p>")
    return "\n".join(parts)


def row_flags(result: Result, items: list[tuple[str, list[dict]]]) -> str:
    """Short marks for a row of the index or the grid: 'stale' and/or 'unverified', with the why as a tooltip."""
    marks = []
    stale = [label for label, ss in items if any(is_stale(s, result) for s in ss)]
    if stale:
        tip = (f"{'; '.join(stale)}: computed on the store before it changed; "
               f"`{recompute_command(result)}` recomputes them")
        marks.append(f'<span class="flag" title="{esc(tip)}">stale</span>')
    unverified = [label for label, ss in items if any(is_unverified(s) for s in ss)]
    if unverified:
        tip = f"{'; '.join(unverified)}: computed on a store without checksums"
        marks.append(f'<span class="flag" title="{esc(tip)}">unverified</span>')
    return (" " + " ".join(marks)) if marks else ""
