"""grid.html: the census's three questions and what the replay makes of them, across benchmarks.

One row per (benchmark, model): requests captured ("N of M (limit L)" when traces/meta.json says the
capture was limited), Avail / Gap / Recall with their request-bootstrap intervals, the replayed tau of
suffix, lexical and oilbird, oilbird over the best lexical arm, the sole-source share and the verdict;
a missing piece is "n/a: <why>". Beside it, the paper's Llama-3.1-8B numbers (PAPER_LLAMA_8B), in their
own labelled table, never in our columns.
"""

from __future__ import annotations

from data.benchmarks.registry import EXPECTED_COUNTS, GRID_BENCHES
from decoder.policy import ON_ARM, TARGET_RATIO
from reports import charts
from reports.arms import BASIS_TEXT, named, tau_of
from reports.census_sections import entry_value
from reports.decision import Decision, decide, verdict_cell
from reports.freshness import row_flags, shown_results
from reports.htmlkit import (
    esc,
    finite,
    gain_text,
    href,
    interval,
    na,
    number,
    page,
    table,
    with_iv,
)
from reports.links import bench_name, evidence_link, page_name
from reports.results import Result
from reports.target import target

# The paper's numbers, Llama-3.1-8B on a GPU (/work/shared/paper/oilbird.tex), never mixed into our columns:
#   avail, gap, recall: Table tab:census-grid ("The same three questions, across ten benchmarks"), Llama-3.1-8B
#     columns, percent of generated positions (Recall: of gap positions), strictly-past pools; the API-Bank row's
#     request-bootstrap intervals are from that table's caption.
#   tau_suffix, tau_oilbird: Table tab:main-echo ("The three repetitive workloads"), Llama-3.1-8B block, tau of
#     SuffixDecoding and of Oilbird (Ours); only these three benchmarks are in it.
# Keys are this toolkit's benchmark names (data/benchmarks/registry.py); `name` is the paper's.
PAPER_LLAMA_8B = {
    "apibank": {"name": "API-Bank", "avail": 92, "gap": 6.8, "recall": 81, "gap_bootstrap": (5.9, 7.8),
                "recall_bootstrap": (76.7, 84.8), "tau_suffix": 4.87, "tau_oilbird": 6.76},
    "taubench-retail": {"name": "tau-bench retail", "avail": 81, "gap": 13.4, "recall": 42, "tau_suffix": 2.67,
                        "tau_oilbird": 4.06},
    "toolalpaca": {"name": "ToolAlpaca", "avail": 65, "gap": 24.8, "recall": 47, "tau_suffix": 2.35,
                   "tau_oilbird": 3.44},
    "humaneval": {"name": "HumanEval", "avail": 63, "gap": 27.8, "recall": 42},
    "classeval": {"name": "ClassEval", "avail": 47, "gap": 25.7, "recall": 45},
    "gsm8k": {"name": "GSM8K", "avail": 51, "gap": 31.6, "recall": 55},
    "specbench-math": {"name": "SpecBench-math", "avail": 46, "gap": 30.6, "recall": 58},
    "mtbench": {"name": "MT-Bench", "avail": 26, "gap": 21.5, "recall": 9},
}
PAPER_LABEL = "the paper's (Llama-3.1-8B, GPU)"


def _expected_requests(bench: str) -> int | None:
    """The benchmark's full request count from the registry, when it has one (for a capture whose meta.json
    records a limit but not the total)."""
    n = EXPECTED_COUNTS.get(bench)
    return n if finite(n) else None


def captured_requests(result: Result) -> tuple[int | None, int | None, int | None, bool]:
    """(requests captured, the benchmark's total when known, the capture's limit, complete) from traces/meta.json
    (`n_requests`, `requests_total`, `limit`, `complete`), else the census's or the replay's request count."""
    meta = result.meta or {}
    n = meta.get("n_requests")
    for s in ([result.census.summary] if result.census else []) + [a.summary for a in result.replay]:
        if not finite(n):
            n = s.get("requests")
    n = int(n) if finite(n) else None
    limit = meta.get("limit")
    limit = int(limit) if finite(limit) and limit > 0 else None
    total = meta.get("requests_total")
    if not finite(total) and limit is not None:
        bench = meta.get("bench") if isinstance(meta.get("bench"), str) else bench_name(result)
        total = _expected_requests(bench)
    total = int(total) if finite(total) else None
    return n, total, limit, meta.get("complete") is not False


def requests_cell(result: Result) -> str:
    """Requests captured; "N of M (limit L)" when the capture was limited, "(incomplete)" when meta.json says so."""
    n, total, limit, complete = captured_requests(result)
    if n is None:
        return na("no trace store meta.json, census or replay")
    text = f"{n:,}"
    if total is not None and (limit is not None or total != n):
        text += f" of {total:,}"
    bits = ([f"limit {limit:,}"] if limit is not None else []) + ([] if complete else ["incomplete"])
    if limit is not None and total is None:
        bits.append("total not recorded")
    return text + (f" ({', '.join(bits)})" if bits else "")


def census_cell(result: Result, key: str) -> str:
    """A census share with its request-bootstrap interval (Wilson in the tooltip), or n/a with the reason."""
    if result.census is None:
        return na("no census")
    e = result.census.summary.get(key)
    if entry_value(e) is None:
        return na(f"no {key} in the census summary")
    tip = f"Wilson 95% {interval(e.get('wilson'))}; request bootstrap 95% {interval(e.get('bootstrap'))}"
    return f'<span title="{esc(tip)}">{with_iv(e["value"], e.get("bootstrap"), "pct")}</span>'


def arm_tau_cell(result: Result, name: str) -> str:
    """tau of a replayed arm (strictly-past pool) with its interval, or n/a with the reason."""
    if not result.replay:
        return na("no replay")
    a = named(result.replay, name)
    if a is None:
        return na(f"{name} not replayed")
    tau, iv = tau_of(a.summary)
    if not finite(tau):
        return na("no tau in its summary")
    return f'<span title="{esc(f"{name}, {number(a.nodes)} nodes")}">{with_iv(tau, iv)}</span>'


def target_cell(result: Result) -> str:
    t = target(result)
    if t is None:
        return na(f"no {ON_ARM} and lexical replay")
    return f"{gain_text(t.ratio, t.interval)} over {esc(t.arm)}: <strong>{esc(t.status)}</strong>"


def grid_share_cell(d: Decision | None) -> str:
    e = d.arm.sole_source if d is not None else None
    if not e or not finite(e.get("share")):
        return na(f"no sole-source share of {ON_ARM}")
    tip = f"{d.arm.name} ({d.source}): {BASIS_TEXT[e['basis']]}"
    return (f'<span title="{esc(tip)}">{with_iv(e["share"], e.get("interval"), "pct")}</span>'
            + ("" if e["basis"] == "committed" else " (draft)"))


def paper_key(result: Result) -> str | None:
    for name in (bench_name(result, result.census), result.bench):
        if name in PAPER_LLAMA_8B:
            return name
    return None


def _paper_pct(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return '<span class="na">not in the table</span>'
    iv = row.get(f"{key}_bootstrap")
    return f"{v:g}%" + (f" [{iv[0]:g}–{iv[1]:g}%]" if iv else "")


def paper_table(keys: list[str]) -> str:
    """The paper's Llama-3.1-8B numbers for these benchmarks (keys of PAPER_LLAMA_8B), labelled as the paper's."""
    rows = []
    for k in keys:
        row = PAPER_LLAMA_8B[k]
        tau = lambda key: (f"{row[key]:.2f}" if key in row  # noqa: E731
                           else '<span class="na">not in tab:main-echo</span>')
        rows.append([f"{esc(k)} <span class=\"note\">({esc(row['name'])})</span>", _paper_pct(row, "avail"),
                     _paper_pct(row, "gap"), _paper_pct(row, "recall"), tau("tau_suffix"), tau("tau_oilbird")])
    return table(["benchmark (paper's name)", "Avail (paper)", "Gap (paper)", "Recall (paper)",
                  "tau SuffixDecoding (paper)", "tau Oilbird (paper)"], rows, {1, 2, 3, 4, 5},
                 caption=f"<strong>{esc(PAPER_LABEL)}</strong> numbers, quoted for comparison and not computed here: "
                         "Avail, Gap and Recall from the paper's Table tab:census-grid (Llama-3.1-8B columns, "
                         "rounded as printed; request-bootstrap intervals where its caption gives them); tau from its "
                         "Table tab:main-echo (Llama-3.1-8B, entire benchmark, greedy), which covers only the three "
                         "repetitive workloads. Other model, other hardware: compare shapes, not digits.")


def grid_order(result: Result) -> tuple:
    """The grid's benchmarks in the grid's order (data/benchmarks/registry.py GRID_BENCHES), any other after them."""
    order = {b: k for k, b in enumerate(GRID_BENCHES)}
    return (order.get(result.bench, len(order)), result.bench)


def grid_page(results: list[Result]) -> str:
    models = sorted({r.model_name for r in results})
    parts = ["<h1>Across benchmarks</h1>",
             '<p class="sub">The census\'s three questions per benchmark, and what the replay makes of them. '
             "<em>Avail</em>: the next two tokens occur verbatim in an earlier trace; <em>Gap</em>: available yet not "
             "produced by the exact-match oracle (the two differ in horizon, so the columns do not subtract); "
             "<em>Recall</em>: gap positions where the semantic key surfaces the true next token; request-bootstrap "
             "95% intervals in brackets (hover for Wilson). tau: tokens per verification pass of the replayed arm, "
             f"strictly-past pool; {ON_ARM} ÷ best lexical: against the {TARGET_RATIO:g}× target (paired "
             "interval where the ablations ran). Requests: the captured ones, \"of\" the benchmark's total when "
             f"the capture was limited. Our runs only: {esc(PAPER_LABEL)} numbers are in their own table below "
             "each. A benchmark marked <em>stale</em> has results computed on its trace store before the store "
             "changed (the requests column is the store's count now); <em>unverified</em>, on a store without "
             "checksums (hover for which).</p>"]
    for model in models:
        rows_r = sorted((r for r in results if r.model_name == model), key=grid_order)
        with_census = [r for r in rows_r if r.census]
        rows = []
        for r in rows_r:
            d = decide(r)
            pool = f" (pool {r.census.pool})" if r.census and r.census.pool != "past" else ""
            links = " · ".join(x for x in (f'<a href="{href(page_name(r))}">report</a>', evidence_link(r)) if x)
            flags = row_flags(r, shown_results(r, r.census, replay=True, warm=False, vllm=False))
            rows.append([f'<a href="{href(page_name(r))}">{esc(bench_name(r, r.census))}</a>{esc(pool)}{flags}',
                         requests_cell(r), number(r.census.summary.get("positions")) if r.census else na("no census"),
                         census_cell(r, "available"), census_cell(r, "gap"), census_cell(r, "recall"),
                         arm_tau_cell(r, "suffix"), arm_tau_cell(r, "lexical"), arm_tau_cell(r, ON_ARM),
                         target_cell(r), grid_share_cell(d),
                         verdict_cell(d) if d is not None else na("no sole-source share"), links])
        parts.append(f"<h2>{esc(model)}</h2>" + table(
            ["benchmark", "requests", "positions", "Avail [95%]", "Gap [95%]", "Recall [95%]", "tau suffix [95%]",
             "tau lexical [95%]", f"tau {ON_ARM} [95%]", f"{ON_ARM} ÷ best lexical", "sole-source share [95%]",
             "verdict", "pages"], rows, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}))
        if with_census:
            series = {label: [100 * v if (v := entry_value(r.census.summary.get(key))) is not None else None
                              for r in with_census]
                      for label, key in (("Avail", "available"), ("Gap", "gap"), ("Recall", "recall"))}
            parts.append(charts.grid_chart([bench_name(r, r.census) for r in with_census], series,
                                           name=f"grid{models.index(model)}"))
        keys = list(dict.fromkeys(k for r in rows_r if (k := paper_key(r)) is not None))
        absent = [f"{PAPER_LLAMA_8B[k]['name']} ({k})" for k in PAPER_LLAMA_8B if k not in keys]
        paper = (f"<h3>Beside it: {esc(PAPER_LABEL)} numbers for these benchmarks</h3>"
                 + (paper_table(keys) if keys else
                    '<p class="note">None of these benchmarks is in the paper\'s tables.</p>')
                 + (f'<p class="note">The paper also reports (no results here for {esc(model)}): '
                    f"{esc(', '.join(absent))}.</p>" if absent else ""))
        parts.append(paper)
    return page("Oilbird: across benchmarks", "\n".join(parts), wide=True)
