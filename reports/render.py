"""HTML pages: one per (benchmark, model), an evidence page per (benchmark, model) with a replay or an
ablations.json, the index, and the cross-benchmark grid.

Each page is one self-contained file: inline CSS, charts as inline SVG (reports/charts.py), no
script, and a Content-Security-Policy that forbids every fetch, so a page makes no network request
even if something slipped in. Model text is escaped everywhere (reports/case_viewer.py). A block the
results do not hold (an older census, a decoder run without the semantic source, a missing
positions.parquet) is shown as "not available" with the reason, never guessed.

The cliff histogram measures both populations by `longest_match_len` (the longest context suffix
found in the pool, capped at the oracle's maximum), the quantity behind the mechanism table's
medians, so the chart and the table agree. The threshold sweep: recall at cosine threshold t is
the share of gap positions where sem_hit holds and sem_best_cos >= t.

The decision block (right after the headline): whether to enable the semantic draft source, by the one
rule in decoder/verdict.py, read from the replay's strictly-past pool (`oilbird`'s sole-source share,
its paired tau gain over `oilbird-no-semantic`, the two arms' estimated speedups; nodes 60 when several
budgets were replayed, else the largest); without a replay of `oilbird`, from the live decoder's share
with the gain unknown (so never "enable"). Live decoder results are shown beside the replay as the
ground truth; the warm-pool replay and other node budgets are secondary tables.

The sweeps (after the threshold sweep, main page only), each drawn only when its file exists under
sweeps/: index.json (`python -m census sweep-index`): semantic gap recall against bytes per state, one
point per index spec, with the 128 B/state target and 95% of exact's recall marked; budget.json
(`python -m census sweep-budget`): availability, gap and semantic gap recall against the pool's budget,
the unbounded pool at the right end as "all". An unreadable sweep file is one "not available" line.

The evidence page (<bench>__<model>__evidence.html, linked from the main page, the index and the grid):
oilbird against each baseline arm (suffix, sam, lexical, recycling, pld): tau with its interval and
oilbird ÷ arm with its paired interval, from ablations.json's `headline` (`python -m decoder ablations`),
else from the replay (paired only where an arm was replayed against oilbird); the target line
(oilbird ≥ 1.25× the best lexical arm, paired lower end above 1: met, not met, or not established
without an interval); a tau chart with intervals; the replayed oilbird's per-source acceptance; the
ablations and the transplant ladder (or the command that makes them); and every replayed arm.

The grid: one row per (benchmark, model): requests captured ("N of M (limit L)" when traces/meta.json
says the capture was limited), Avail / Gap / Recall with their request-bootstrap intervals, the replayed
tau of suffix, lexical and oilbird, oilbird over the best lexical arm, the sole-source share and the
verdict; a missing piece is "n/a: <why>". Beside it, the paper's Llama-3.1-8B numbers (PAPER_LLAMA_8B),
in their own labelled table, never in our columns.
"""

from __future__ import annotations

import math
import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from data.benchmarks import EXPECTED_COUNTS, GRID_BENCHES
from data.errors import OilbirdError
from decoder.passes import DEPTH_ROWS
from decoder.reference import REFERENCE_ARM, STATIC_ARM
from decoder.verdict import ENABLE_SHARE, OFF_SHARE, Verdict, verdict
from reports import charts
from reports.case_viewer import MIN_CASE_POSITIONS, TokenText, esc, load_token_text, render_cases
from reports.results import (ABLATIONS_COMMAND, DECISION_NODES, SEMANTIC_SOURCE, SWEEP_COMMANDS, Ablations, Arm, Census,
                             Result, Sweep, wilson)

DEFAULT_THETA = 0.8  # the semantic key's default cosine threshold (decoder, paper section 4)
SOLE_ENABLE = ENABLE_SHARE  # sole-source share at or above which the semantic source pays (decoder/verdict.py)
SOLE_OFF = OFF_SHARE  # ... below which it does not
ON_ARM, OFF_ARM = "oilbird", "oilbird-no-semantic"  # the paired comparison the verdict reads
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

KEY_LABELS = {
    "exact_suffix": "exact suffix (oracle; PLD, SuffixDecoding, SAM)",
    "adjacency": "token adjacency (Token Recycling)",
    "static_embedding": "static token embedding",
    "semantic": "per-position hidden state (semantic key)",
    "all": "all keys",
}
# (group, key, label, kind): the census mechanism block (census/summary.py), in the paper's order.
MECHANISM_ROWS = [
    ("Why it fails: context still matched", "median_context_at_success", "Median where the oracle succeeds", "tokens"),
    ("Why it fails: context still matched", "median_context_at_recovered_gap", "Median at recovered gap positions",
     "tokens"),
    ("When it fails: gap rate by preceding token", "gap_rate_after_novel", "After a token in no past trace", "pct"),
    ("When it fails: gap rate by preceding token", "gap_rate_base", "Base rate (after a token seen before)", "pct"),
    ("When it fails: gap rate by preceding token", "gap_rate_after_producible", "After a producible token", "pct"),
    ("When it fails: gap rate by preceding token", "after_producible_relative", "After a producible token, relative",
     "ratio"),
    ("Recovery: gap recall by key", "recall_semantic", "Semantic key (hidden state)", "pct"),
    ("Recovery: gap recall by key", "recall_static_embedding", "Static token-embedding key", "pct"),
    ("Recovery: gap recall by key", "recall_adjacency", "Token-adjacency key", "pct"),
    ("What one gap is worth", "payload_tokens", "Verbatim payload behind a recovered gap", "tokens"),
    ("What one gap is worth", "payload_matched_by_neighbour_tokens", "… matched by the neighbour", "tokens"),
    ("What one gap is worth", "blind_lexical", "Blind at the lexical keys (suffix ∪ adjacency)", "pct"),
    ("What one gap is worth", "blind_with_semantic", "… after adding the semantic key", "pct"),
    ("What one gap is worth", "mean_run_lexical", "Mean uninterrupted run, lexical keys", "tokens"),
    ("What one gap is worth", "mean_run_with_semantic", "… with the semantic key", "tokens"),
    ("What one gap is worth", "blind_after_blind", "Blind-after-blind rate", "pct"),
]

CSS = """
:root{--fg:#1b1b1b;--muted:#5f6368;--line:#dadce0;--soft:#f4f6f9}
*{box-sizing:border-box}
body{margin:0;color:var(--fg);background:#fff;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,"Liberation Sans",sans-serif}
nav{background:var(--soft);border-bottom:1px solid var(--line);padding:.5rem 1.5rem;font-size:.9rem}
nav a{margin-right:1rem}
main{max-width:1100px;margin:0 auto;padding:1rem 1.5rem 3rem}
main.wide{max-width:1900px}
h1{font-size:1.55rem;margin:.6rem 0 .2rem}
h2{font-size:1.2rem;margin:2rem 0 .5rem;padding-bottom:.2rem;border-bottom:1px solid var(--line)}
h3{font-size:1rem;margin:1.2rem 0 .3rem}
.sub{color:var(--muted);margin:0 0 1rem}
.headline{font-size:1.05rem;background:#eef4fb;border-left:4px solid #0072B2;padding:.7rem 1rem;margin:1rem 0}
.callout{background:var(--soft);border-left:4px solid #888;padding:.6rem 1rem;margin:.8rem 0}
.callout.enable{border-left-color:#009E73;background:#eaf6f0}
.callout.off{border-left-color:#D55E00;background:#fcefe9}
.callout.neutral{border-left-color:#E69F00;background:#fdf5e6}
.scroll{overflow-x:auto}
table{border-collapse:collapse;margin:.5rem 0 1rem;font-size:.88rem}
th,td{padding:.25rem .65rem;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
thead th{border-bottom:2px solid #bbb}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.group th{background:var(--soft);font-weight:600}
.na{color:var(--muted);font-style:italic}
.note,.caption,figcaption{color:var(--muted);font-size:.88rem}
svg.chart{display:block;width:100%;height:auto;margin:.4rem 0}
.legend{list-style:none;padding:0;margin:.5rem 0;display:flex;flex-wrap:wrap;gap:.6rem}
.swatch{padding:.1rem .5rem;border-radius:3px;font-size:.88rem}
figure.case{margin:1rem 0}
figure.case figcaption{margin-bottom:.3rem}
.tokens{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono","Liberation Mono",monospace;
font-size:.82rem;line-height:1.75;white-space:pre-wrap;overflow-wrap:anywhere;border:1px solid var(--line);
border-radius:4px;padding:.6rem .7rem;max-height:30rem;overflow:auto}
.tokens span{border-radius:2px}
.p{background:#d6e6f5}
.r{background:#9fdfbf;text-decoration:underline 2px #009E73}
.g{background:#f6bfae;text-decoration:underline wavy #D55E00}
.u{background:#ececec;color:#555}
.more{color:var(--muted);font-size:.85rem}
code{font-size:.88em}
@media print{
  nav{display:none}
  main{max-width:none;padding:0}
  body{font-size:11pt}
  *{-webkit-print-color-adjust:exact;print-color-adjust:exact}
  svg.chart,table,.headline,.callout{break-inside:avoid}
  h2,h3{break-after:avoid}
  .tokens,.scroll{max-height:none;overflow:visible}
  a{color:inherit;text-decoration:none}
}
"""


# ---------------------------------------------------------------- formatting

def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pct(v) -> str:
    if not _finite(v):
        return "n/a"
    x = 100 * v
    return f"{x:.2f}%" if abs(x) < 10 else f"{x:.1f}%"


def interval(iv, kind: str = "pct") -> str:
    if not (isinstance(iv, (list, tuple)) and len(iv) == 2 and all(_finite(x) for x in iv)):
        return "n/a"
    if kind == "pct":
        return f"{pct(iv[0]).rstrip('%')}–{pct(iv[1])}"
    return f"{number(iv[0], kind)}–{number(iv[1], kind)}"


def number(v, kind: str = "num") -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if not _finite(v):
        return "n/a" if v is None or isinstance(v, (int, float)) else esc(v)
    if kind == "pct":
        return pct(v)
    if kind == "ratio":
        return f"{v:.2f}×"
    if kind == "2f":  # tau: always two decimals
        return f"{v:.2f}"
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:,.1f}"


def table(head: list[str], rows: list[list[str]], num_cols: set[int] = frozenset(), caption: str = "") -> str:
    """A table from already-escaped cells; columns in num_cols are right-aligned."""
    cap = f'<p class="caption">{caption}</p>' if caption else ""
    th = "".join(f'<th{" class=num" if i in num_cols else ""}>{h}</th>' for i, h in enumerate(head))
    body = []
    for row in rows:
        if len(row) == 1:  # a group header spanning the table
            body.append(f'<tr class="group"><th colspan="{len(head)}">{row[0]}</th></tr>')
            continue
        body.append("<tr>" + "".join(f'<td{" class=num" if i in num_cols else ""}>{c}</td>'
                                     for i, c in enumerate(row)) + "</tr>")
    return f'{cap}<div class="scroll"><table><thead><tr>{th}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def not_available(why: str) -> str:
    return f'<p class="na">not available: {esc(why)}</p>'


def entry_row(label: str, entry, kind: str | None = None) -> list[str]:
    """[label, value, Wilson, bootstrap, n] for a census entry: {value, wilson?, bootstrap?, n?} or a number."""
    if entry is None:
        return [esc(label), '<span class="na">not computed</span>', "", "", ""]
    if not isinstance(entry, dict):
        return [esc(label), number(entry, kind or "num"), "", "", ""]
    kind = kind or ("pct" if "wilson" in entry else "num")
    n = entry.get("n")
    k = entry.get("k")
    n_txt = f"{number(k)}/{number(n)}" if _finite(k) and _finite(n) else (number(n) if _finite(n) else "")
    return [esc(label), number(entry.get("value"), kind),
            interval(entry.get("wilson"), kind) if "wilson" in entry else "",
            interval(entry.get("bootstrap"), kind) if "bootstrap" in entry else "", n_txt]


def humanize(key: str) -> str:
    return key.replace("_", " ").replace("|", " ∪ ").replace("~", " ~ ")


def key_label(key: str) -> str:
    if "|" in key:
        return " ∪ ".join(KEY_LABELS.get(k, humanize(k)).split(" (")[0] for k in key.split("|"))
    if "~" in key:
        return " ~ ".join(KEY_LABELS.get(k, humanize(k)).split(" (")[0] for k in key.split("~"))
    return KEY_LABELS.get(key, humanize(key))


def _is_entry(v) -> bool:
    return v is None or _finite(v) or (isinstance(v, dict) and "value" in v)


def generic_rows(block: dict) -> list[list[str]]:
    """Rows for any nested block of entries (blocks and keys this renderer has no labels for)."""
    rows = []
    for key, v in block.items():
        label = key_label(key)
        if _is_entry(v):
            rows.append(entry_row(label, v))
        elif isinstance(v, dict):
            rows.append([esc(label)])  # a sub-block: its name as a group header, then its entries
            rows += generic_rows(v)
        else:
            rows.append([esc(label), esc(v) if not isinstance(v, (list, tuple)) else esc(", ".join(map(str, v))),
                         "", "", ""])
    return rows


ENTRY_HEAD = ["quantity", "value", "Wilson 95%", "bootstrap 95%", "n"]
ENTRY_NUM = {1, 2, 3, 4}


WIDE = ' class="wide"'  # a page whose tables are wider than the reading column (the grid)


def page(title: str, body: str, wide: bool = False) -> str:
    links = '<nav><a href="index.html">All results</a><a href="grid.html">Cross-benchmark grid</a></nav>'
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<meta name="referrer" content="no-referrer">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head>\n"
            f"<body>{links}<main{WIDE if wide else ''}>\n{body}\n</main></body></html>\n")


def section(sid: str, title: str, *parts: str) -> str:
    return f'<section id="{esc(sid)}"><h2>{esc(title)}</h2>\n' + "\n".join(p for p in parts if p) + "</section>\n"


# ---------------------------------------------------------------- census sections

def pool_phrase(pool: str) -> str:
    return {"past": "strictly past: requests served before",
            "warm": "warm: every other request"}.get(pool, pool)


def headline(result: Result, census: Census) -> str:
    s = census.summary
    parts = []
    names = (("available", f"of positions are available (the next {horizon(census)} tokens occur verbatim in the "
                           "pool)"),
             ("producible", "are producible by the exact-match oracle"),
             ("gap", "fall in the identifiability gap (available, not producible)"))
    for key, words in names:
        e = s.get(key)
        if isinstance(e, dict) and _finite(e.get("value")):
            parts.append(f"<strong>{pct(e['value'])}</strong> {esc(words)} (Wilson 95% {interval(e.get('wilson'))}, "
                         f"request bootstrap {interval(e.get('bootstrap'))})")
        else:
            parts.append(f"{esc(key)} is not available")
    rec = s.get("recall")
    if isinstance(rec, dict) and _finite(rec.get("value")):
        recall = (f"the semantic key recovers <strong>{pct(rec['value'])}</strong> of the gap positions "
                  f"(Wilson {interval(rec.get('wilson'))}, bootstrap {interval(rec.get('bootstrap'))})")
    else:
        recall = "recall of the semantic key is not available"
    positions, requests = s.get("positions"), s.get("requests")
    layer = s.get("layer")
    return (f'<p class="headline">Over <strong>{number(positions)}</strong> generated positions in '
            f"<strong>{number(requests)}</strong> requests of <strong>{esc(bench_name(result, census))}</strong>, "
            f"served by <strong>{esc(result.model_name)}</strong> (states from layer {number(layer)}; pool "
            f"{esc(pool_phrase(census.pool))}): {parts[0]}; {parts[1]}; {parts[2]}; and {recall}.</p>")


def bench_name(result: Result, census: Census | None = None) -> str:
    for s in ([census.summary] if census else []) + [a.summary for a in result.arms + result.replay
                                                     + result.replay_warm]:
        if isinstance(s.get("bench"), str) and s["bench"]:
            return s["bench"]
    return result.bench


def horizon(census: Census) -> str:
    """Tokens of future that `available` asks for (census --horizon; two unless the summary says otherwise)."""
    config = census.summary.get("config")
    h = config.get("horizon") if isinstance(config, dict) else None
    h = int(h) if _finite(h) else 2
    return {1: "one", 2: "two", 3: "three", 4: "four"}.get(h, str(h))


def proportions_table(census: Census) -> str:
    s = census.summary
    rows = [entry_row(label, s.get(key), "pct") for key, label in (
        ("available", f"Avail: next {horizon(census)} tokens verbatim in the pool"),
        ("producible", "Producible by the exact-match oracle"),
        ("gap", "Gap: available, not producible"),
        ("recall", "Recall: semantic key, over gap positions"))]
    return table(ENTRY_HEAD, rows, ENTRY_NUM)


def mechanism_section(census: Census) -> str:
    block = census.summary.get("mechanism")
    if not isinstance(block, dict):
        return section("mechanism", "Mechanism", not_available("the census summary has no mechanism block"))
    rows, group = [], None
    for g, key, label, kind in MECHANISM_ROWS:
        if key not in block:
            continue
        if g != group:
            rows.append([esc(g)])
            group = g
        rows.append(entry_row(label, block[key], kind))
    extra = {k: v for k, v in block.items() if k not in {r[1] for r in MECHANISM_ROWS}}
    if extra:
        rows.append(["Other"])
        rows += generic_rows(extra)
    intro = ('<p class="caption">Why the exact key fails (context it was still matching), when (gap rate by the '
             "preceding token), how much each key recovers, and what a recovered position is worth. Medians and "
             "means carry a request-bootstrap interval only.</p>")
    return section("mechanism", "Mechanism", intro, table(ENTRY_HEAD, rows, ENTRY_NUM))


def coverage_section(census: Census) -> str:
    block = census.summary.get("coverage")
    if not isinstance(block, dict):
        return section("coverage", "Key coverage", not_available("the census summary has no coverage block"))
    reaches = block.get("reaches") if isinstance(block.get("reaches"), dict) else {}
    only = block.get("only_it") if isinstance(block.get("only_it"), dict) else {}
    rows = []
    keys, r_vals, o_vals = [], [], []
    for key in list(reaches) + [k for k in only if k not in reaches]:
        r, o = reaches.get(key), only.get(key)
        rv = r.get("value") if isinstance(r, dict) else r
        ov = o.get("value") if isinstance(o, dict) else o
        if r is None:
            rows.append([esc(key_label(key)), '<span class="na">not computed</span>', "", "", ""])
            continue
        rows.append([esc(key_label(key)), number(rv, "pct"), interval(r.get("wilson")) if isinstance(r, dict) else "",
                     number(ov, "pct"), interval(o.get("wilson")) if isinstance(o, dict) else ""])
        if _finite(rv):
            keys.append(KEY_LABELS.get(key, humanize(key)).split(" (")[0])
            r_vals.append(100 * rv)
            o_vals.append(100 * ov if _finite(ov) else None)
    parts = [f'<p class="caption">The universe: the {number(block.get("universe"))} available positions (a copying '
             "drafter could in principle reach them). <em>reaches</em>: share where the key has the true next "
             "token among its 8 candidates; <em>only it</em>: share no other computed key reaches.</p>"]
    if rows:
        parts.append(table(["key", "reaches", "Wilson 95%", "only it", "Wilson 95%"], rows, {1, 2, 3, 4}))
    else:
        parts.append(not_available("the coverage block has no per-key reaches"))
    if keys:
        parts.append(charts.coverage_chart(keys, r_vals, o_vals))
    for sub, title in (("unions", "Unions of keys"), ("lift", "Pairwise lift (1 = independent)"),
                       ("semantic_recovers_missed_by", "What the semantic key recovers of what each key misses")):
        v = block.get(sub)
        if isinstance(v, dict) and v:
            kind = "ratio" if sub == "lift" else "pct"
            parts.append(f"<h3>{esc(title)}</h3>" + table(
                ENTRY_HEAD, [entry_row(key_label(k), e, kind) for k, e in v.items()], ENTRY_NUM))
    extra = {k: v for k, v in block.items()
             if k not in ("universe", "reaches", "only_it", "unions", "lift", "semantic_recovers_missed_by")}
    if extra:
        parts.append("<h3>Other</h3>" + table(ENTRY_HEAD, generic_rows(extra), ENTRY_NUM))
    return section("coverage", "Key coverage", *parts)


def _need(census: Census, columns: tuple[str, ...]) -> str | None:
    """Why a positions-based section cannot be drawn, or None."""
    if census.positions is None:
        return f"{census.folder.name}/positions.parquet is missing"
    missing = [c for c in columns if c not in census.positions.columns]
    if missing:
        return f"positions.parquet lacks the column(s) {', '.join(missing)}"
    if census.positions.height == 0:
        return "positions.parquet has no rows"
    return None


def _flag(df: pl.DataFrame, col: str) -> np.ndarray:
    return df[col].fill_null(False).to_numpy().astype(bool)


def cliff_section(census: Census) -> str:
    why = _need(census, ("producible", "gap", "longest_match_len"))
    if why:
        return section("cliff", "The cliff: matched context at successes and at gap positions", not_available(why))
    df = census.positions
    lengths = df["longest_match_len"].fill_null(0).to_numpy()
    success, gap = lengths[_flag(df, "producible")], lengths[_flag(df, "gap")]
    config = census.summary.get("config")
    cap = config.get("max_suffix", 16) if isinstance(config, dict) else 16
    cap = int(cap) if _finite(cap) and cap > 0 else 16
    med = lambda x: number(float(np.median(x))) if len(x) else "n/a"  # noqa: E731
    caption = (f'<p class="caption">Both populations measured by <code>longest_match_len</code>: the longest suffix '
               f"of the context that occurs anywhere in the pool (capped at {cap}, the oracle's longest suffix), the "
               f"quantity behind the mechanism table's medians. Median at oracle successes "
               f"<strong>{med(success)}</strong> tokens; at gap positions <strong>{med(gap)}</strong>. Bars are shares "
               "of each population. A cliff (successes at the cap, gap positions near zero) says one new token in "
               "the context cut every suffix the exact key could match.</p>")
    return section("cliff", "The cliff: matched context at successes and at gap positions",
                   charts.cliff_chart(success, gap, cap), caption)


def novel_section(census: Census) -> str:
    why = _need(census, ("gap", "novel_prev"))
    if why:
        return section("novel", "Gap rate by the preceding token", not_available(why))
    df = census.positions
    gap = _flag(df, "gap")
    known_prev = df["novel_prev"].is_not_null().to_numpy()
    novel = _flag(df, "novel_prev")
    groups = [("after a token in no past trace", novel & known_prev),
              ("after a token seen in a past trace", ~novel & known_prev),
              ("all positions", np.ones(len(gap), bool))]
    if "producible" in df.columns and "request" in df.columns:
        prev_prod = (df.select(pl.col("producible").fill_null(False).shift(1).over("request"))
                     .to_series().fill_null(False).to_numpy().astype(bool))
        groups.append(("after a producible token", prev_prod))
    rows, labels, rates, lows, highs, rate_of = [], [], [], [], [], {}
    for label, mask in groups:
        n, k = int(mask.sum()), int((gap & mask).sum())
        iv = wilson(k, n)
        rate_of[label] = k / n if n else None
        rows.append([esc(label), number(rate_of[label], "pct"), interval(iv), f"{k:,}/{n:,}"])
        if n:
            labels.append(label)
            rates.append(100 * k / n)
            lows.append(100 * iv[0])
            highs.append(100 * iv[1])
    after_novel, after_seen = rate_of[groups[0][0]], rate_of[groups[1][0]]
    ratio = (f" After a novel token the gap rate is <strong>{after_novel / after_seen:.1f}×</strong> the rate after a "
             "token seen before." if after_novel is not None and after_seen else "")
    caption = ('<p class="caption">Gap rate (available, not producible) by what the previous token was; a novel '
               f"token (in no past trace) ends every suffix the exact key could match.{ratio} Wilson 95% "
               "intervals (positions treated as independent, so optimistic).</p>")
    chart = charts.rate_bars(labels, rates, lows, highs, "gap rate, % of positions", "novel") if labels else ""
    return section("novel", "Gap rate by the preceding token", caption, chart,
                   table(["previous token", "gap rate", "Wilson 95%", "gap/positions"], rows, {1, 2, 3}))


def recall_curve(df: pl.DataFrame, thresholds: np.ndarray) -> tuple[np.ndarray, int]:
    """Recall (%) at each threshold: share of gap positions with sem_hit and sem_best_cos >= t."""
    gap = _flag(df, "gap")
    hit = _flag(df, "sem_hit") & gap
    cos = df["sem_best_cos"].fill_null(float("-inf")).fill_nan(float("-inf")).to_numpy()[hit]
    n_gap = int(gap.sum())
    cos.sort()
    hits_at = len(cos) - np.searchsorted(cos, thresholds, side="left")
    return 100.0 * hits_at / max(1, n_gap), n_gap


def threshold_section(census: Census) -> str:
    title = "Semantic-key recall against the cosine threshold"
    why = _need(census, ("gap", "sem_hit", "sem_best_cos"))
    if why:
        return section("threshold", title, not_available(why))
    thresholds = np.round(np.linspace(0.0, 1.0, 201), 3)
    curve, n_gap = recall_curve(census.positions, thresholds)
    if n_gap == 0:
        return section("threshold", title, not_available("no gap positions"))
    marks = [0.5, 0.7, 0.75, DEFAULT_THETA, 0.85, 0.9, 0.95]
    at, _ = recall_curve(census.positions, np.array([-np.inf] + marks))
    unthresholded, at = at[0], at[1:]
    rows = [[f"{t:g}" + (" (default)" if t == DEFAULT_THETA else ""), f"{v:.1f}%"] for t, v in zip(marks, at)]
    caption = (f'<p class="caption">Recall at threshold t: the share of the {n_gap:,} gap positions where the '
               "semantic key has the true next token among its 8 candidates <em>and</em> its best neighbour's "
               f"cosine is at least t (the decoder queries the key only then; default {DEFAULT_THETA:g}). Without a "
               f"threshold it is the census recall, {unthresholded:.1f}%.</p>")
    return section("threshold", title, charts.threshold_chart(thresholds, curve, DEFAULT_THETA), caption,
                   table(["threshold", "recall"], rows, {1}))


def cases_section(result: Result, census: Census, token_text: TokenText | None) -> str:
    title = "Case viewer"
    why = _need(census, ("request", "position", "target", "available", "producible"))
    if why:
        return section("cases", title, not_available(why))
    if token_text is None:
        token_text = load_token_text(result.meta.get("model") if result.meta else None)
    request_ids = None
    req_path = result.folder / "traces" / "requests.parquet"
    if req_path.exists():
        try:
            # pyarrow, not polars: polars before 1.3x cannot parse the store's float16 columns at all
            import pyarrow.parquet as pq

            r = pq.read_table(req_path, columns=["request", "id"])
            request_ids = dict(zip(r["request"].to_pylist(), r["id"].to_pylist()))
        except Exception:  # the ids are a courtesy; the viewer stands without them
            request_ids = None
    intro = ('<p class="caption">The generated text of three requests (highest, median and lowest gap rate among '
             f"requests with at least {MIN_CASE_POSITIONS} tokens and at least one available position), each token "
             "coloured by what covers it. Hover a token for its matched context and best cosine.</p>")
    return section("cases", title, intro, render_cases(census.positions, token_text, request_ids))


# ---------------------------------------------------------------- sweeps (python -m census sweep-index / -budget)

INDEX_TARGET_BYTES = 128  # bytes per state the compressed semantic key aims for
INDEX_KEEP = 0.95  # ... keeping this share of exact's gap recall
KEEP_TEXT = f"{100 * INDEX_KEEP:g}%"


def _sweep_note(sweep: Sweep) -> str:
    """The one line shown in place of an unreadable sweep."""
    return not_available(f"{sweep.note}; rerun `{SWEEP_COMMANDS[sweep.kind]}`")


def _sweep_caveats(sweep: Sweep, off_chart: int) -> str:
    """A note on values read as unknown, rows dropped, and rows the chart could not place; "" when none."""
    name = f"sweeps/{sweep.path.name}"
    bits = []
    if sweep.bad_values:
        bits.append(f"{sweep.bad_values} value(s) in {name} were missing or not finite numbers in range (NaN, "
                    "Infinity, a share outside 0–1, a negative count) and show as n/a")
    if sweep.dropped_rows:
        bits.append(f"{sweep.dropped_rows} row(s) without a {'spec' if sweep.kind == 'index' else 'budget'} "
                    "name were left out")
    if off_chart:
        bits.append(f"{off_chart} row(s) lack a number the chart needs and are in the table only")
    return f'<p class="note">{esc("; ".join(bits))}.</p>' if bits else ""


def exact_recall(rows: list[dict]) -> float | None:
    """Exact's gap recall: the `exact` row's, else one implied by any row's gap_recall / gap_recall_ratio."""
    for r in rows:
        if r["spec"] == "exact" and r["gap_recall"] is not None:
            return r["gap_recall"]
    for r in rows:
        if r["gap_recall"] is not None and r["gap_recall_ratio"]:
            return r["gap_recall"] / r["gap_recall_ratio"]
    return None


def _ratio_to_exact(row: dict, exact: float | None) -> float | None:
    if row["gap_recall_ratio"] is not None:
        return row["gap_recall_ratio"]
    if row["gap_recall"] is not None and exact:
        return row["gap_recall"] / exact
    return None


def index_section(sweep: Sweep) -> str:
    sid, title = "sweep-index", "Index compression: semantic gap recall against bytes per state"
    if sweep.note:
        return section(sid, title, _sweep_note(sweep))
    rows = sweep.rows
    exact = exact_recall(rows)
    meets = lambda r: (r["bytes_per_state"] is not None and r["bytes_per_state"] <= INDEX_TARGET_BYTES  # noqa: E731
                       and (_ratio_to_exact(r, exact) or 0) >= INDEX_KEEP)
    fits = sorted((r for r in rows if r["spec"] != "exact" and meets(r)),
                  key=lambda r: (r["bytes_per_state"], -(r["gap_recall"] or 0)))
    if not any(r["spec"] != "exact" for r in rows):
        verdict_line = f"Only exact was swept (gap recall {pct(exact)}): no compressed spec to hold to it."
    elif exact is None:
        verdict_line = "Exact's gap recall is not known (no <code>exact</code> row), so no spec can be held to it."
    elif fits:
        best = fits[0]
        verdict_line = (f"The smallest spec within {INDEX_TARGET_BYTES} B/state that keeps {KEEP_TEXT} of "
                        f"exact's gap recall: <strong>{esc(best['spec'])}</strong>, {number(best['bytes_per_state'])} "
                        f"B/state, gap recall <strong>{pct(best['gap_recall'])}</strong> "
                        f"({_ratio_to_exact(best, exact):.3f}× exact's {pct(exact)}).")
    else:
        verdict_line = (f"No spec within {INDEX_TARGET_BYTES} B/state keeps {KEEP_TEXT} of exact's gap recall "
                        f"({pct(exact)}).")
    counts = []
    if "positions" in sweep.meta:
        counts.append(f"{number(sweep.meta['positions'])} positions")
    if "gap_positions" in sweep.meta:
        counts.append(f"{number(sweep.meta['gap_positions'])} gap positions")
    intro = (f'<p class="caption">The semantic key with its index compressed (<code>{esc(SWEEP_COMMANDS["index"])}'
             f"</code>{', ' + ', '.join(counts) if counts else ''}): the share of gap positions it still recovers, "
             "against the bytes each stored state costs. Dashed: the "
             f"{INDEX_TARGET_BYTES} B/state target and {KEEP_TEXT} of exact's recall; a point inside both is "
             f"green.</p><p>{verdict_line}</p>")
    plotted = [r for r in rows if r["bytes_per_state"] is not None and r["gap_recall"] is not None]
    chart = charts.index_chart([r["spec"] for r in plotted], [r["bytes_per_state"] for r in plotted],
                               [100 * r["gap_recall"] for r in plotted],
                               100 * exact if exact is not None else None, INDEX_TARGET_BYTES) if plotted else ""
    order = sorted(rows, key=lambda r: (r["spec"] != "exact", -(r["bytes_per_state"] or 0)))
    table_rows = []
    for r in order:
        ratio = _ratio_to_exact(r, exact)
        table_rows.append([
            f"<code>{esc(r['spec'])}</code>", number(r["bytes_per_state"]), pct(r["gap_recall"]),
            f"{ratio:.3f}×" if ratio is not None else "n/a", pct(r["sem_hit_rate"]),
            pct(r["knn_recall"]) if r["knn_recall"] is not None else '<span class="na">n/a</span>',
            pct(r["warmup_share"]), number(r["seconds"]),
            "–" if r["spec"] == "exact" else ("yes" if meets(r) else "no")])
    tbl = table(["spec", "bytes/state", "gap recall", "vs exact", "semantic hit rate", "kNN recall@8",
                 "warm-up share", "seconds", "meets target"],
                table_rows, {1, 2, 3, 4, 5, 6, 7},
                caption="gap recall: share of gap positions the semantic key recovers; vs exact: that over exact's; "
                        "kNN recall@8: the ids found against exact's; warm-up share: queries answered exactly "
                        f"before the index was trained; meets target: at most {INDEX_TARGET_BYTES} B/state and at "
                        f"least {KEEP_TEXT} of exact's gap recall.")
    return section(sid, title, intro, chart, _sweep_caveats(sweep, len(rows) - len(plotted)), tbl)


def budget_positions(rows: list[dict]) -> list[float | None]:
    """Where each row sits on the chart's token axis: its budget, or for the unbounded pool the right end (4x the
    largest budget, 1 without one); None for a row whose budget is not known."""
    finite = [r["budget_tokens"] for r in rows if r["budget_tokens"] is not None]
    right = 4 * max(finite) if finite else 1.0
    return [r["budget_tokens"] if r["budget_tokens"] is not None else (right if r["unbounded"] else None)
            for r in rows]


def budget_section(sweep: Sweep) -> str:
    sid, title = "sweep-budget", "What the pool's size buys"
    if sweep.note:
        return section(sid, title, _sweep_note(sweep))
    rows = sorted(sweep.rows, key=lambda r: (r["unbounded"], r["budget_tokens"] is None, r["budget_tokens"] or 0))
    xs = budget_positions(rows)
    plotted = [(r, x) for r, x in zip(rows, xs) if x is not None]
    series = {label: [100 * r[key] if r[key] is not None else None for r, _ in plotted]
              for label, key in (("availability", "availability"), ("gap", "gap"),
                                 ("semantic gap recall", "gap_recall"))}
    drawable = any(v is not None for vals in series.values() for v in vals)
    chart = charts.budget_chart(["all" if r["unbounded"] else r["budget"] for r, _ in plotted],
                                [x for _, x in plotted], series) if plotted and drawable else ""
    unbounded = next((r for r in rows if r["unbounded"]), None)
    lead = ""
    if unbounded is not None and unbounded["gap_recall"]:
        enough = [r for r in rows if not r["unbounded"] and r["gap_recall"] is not None
                  and r["gap_recall"] >= INDEX_KEEP * unbounded["gap_recall"]]
        lead = (f"<p>Unbounded pool: availability <strong>{pct(unbounded['availability'])}</strong>, gap "
                f"<strong>{pct(unbounded['gap'])}</strong>, semantic gap recall "
                f"<strong>{pct(unbounded['gap_recall'])}</strong>. "
                + (f"The smallest budget keeping {KEEP_TEXT} of that recall: <strong>{esc(enough[0]['budget'])}"
                   "</strong>." if enough else f"No bounded budget keeps {KEEP_TEXT} of that recall.") + "</p>")
    intro = (f'<p class="caption">The census rerun with the pool bounded to a number of generated tokens '
             f"(<code>{esc(SWEEP_COMMANDS['budget'])}</code>; the oldest traces leave first). <em>all</em> is the "
             "unbounded pool, drawn at the right end (not to scale).</p>")
    table_rows = [[esc(r["budget"]), "unbounded" if r["unbounded"] else number(r["budget_tokens"]),
                   number(r["mean_pool_tokens"]), pct(r["availability"]), pct(r["producible"]), pct(r["gap"]),
                   pct(r["gap_recall"]), pct(r["sem_hit_rate"])] for r in rows]
    tbl = table(["budget", "budget tokens", "mean pool tokens", "availability", "producible", "gap",
                 "semantic gap recall", "semantic hit rate"], table_rows, {1, 2, 3, 4, 5, 6, 7},
                caption="Shares of generated positions, except semantic gap recall (of gap positions); mean pool "
                        "tokens: the pool's mean size over the requests.")
    return section(sid, title, intro, lead, chart, _sweep_caveats(sweep, len(rows) - len(plotted)), tbl)


def sweep_sections(result: Result) -> list[str]:
    """The sweep sections whose files exist (index, then budget); none without them."""
    out = []
    if "index" in result.sweeps:
        out.append(index_section(result.sweeps["index"]))
    if "budget" in result.sweeps:
        out.append(budget_section(result.sweeps["budget"]))
    return out


# ---------------------------------------------------------------- ablations (python -m decoder ablations)

LADDER_RUNGS = ("base", "+pool", "+key")


def _tau_iv(row: dict | None, key: str = "tau", kind: str = "2f") -> str:
    if row is None:
        return "n/a"
    v = row.get(key)
    iv = row.get(f"{key}_interval")
    return number(v, kind) + (f" [{interval(iv, kind)}]" if iv is not None else "")


def _exact_text(v) -> str:
    return "yes" if v is True else "no" if v is False else "n/a"


def ablations_command(result: Result) -> str:
    """The command that writes ablations/ablations.json for this result."""
    return f"make ablations BENCH={bench_name(result)} MODEL={result.model_name}"


def _abl_caveats(abl: Ablations) -> str:
    bits = []
    if abl.bad_values:
        bits.append(f"{abl.bad_values} value(s) in {ABLATIONS_FILE_NAME} were missing or not finite numbers in range "
                    "and show as n/a")
    if abl.dropped_rows:
        bits.append(f"{abl.dropped_rows} row(s) without an arm name were left out")
    return f'<p class="note">{esc("; ".join(bits))}.</p>' if bits else ""


def _interval_ends(rows: list[dict], key: str = "tau") -> tuple[list, list]:
    ivs = [r.get(f"{key}_interval") or [None, None] for r in rows]
    return [i[0] for i in ivs], [i[1] for i in ivs]


def ablations_section(result: Result) -> str:
    """The ablations and transplant-ladder section (evidence page); "" when ablations/ablations.json does not
    exist."""
    abl: Ablations | None = result.ablations
    if abl is None:
        return ""
    sid, title = "ablations", "Ablations and the transplant ladder (replay, pool past)"
    if abl.note:
        return section(sid, title, not_available(f"{abl.note}; rerun `{ABLATIONS_COMMAND}` "
                                                 f"(`{ablations_command(result)}`)"))
    meta = abl.meta
    facts = ", ".join(f"{esc(k)} {esc(number(meta[k]) if not isinstance(meta[k], str) else meta[k])}"
                      for k in ("pool", "nodes", "requests") if k in meta)
    intro = (f'<p class="caption">Replayed arms against the merged decoder (<code>{esc(ABLATIONS_COMMAND)}</code>'
             + (f"; {facts}" if facts else "") + "). tau: tokens per verification pass, 95% interval in brackets; "
             "vs merged: the arm's tau over the merged arm's, paired; est. speedup: estimated from the "
             "verification-cost profile, when the replay had one; sole-source share: of all committed tokens.</p>")
    main_rows = ([abl.merged] if abl.merged else []) + abl.ablations
    rows = [[esc(r["label"]), f"<code>{esc(r['arm'])}</code>", _tau_iv(r), _tau_iv(r, "vs_merged", "ratio"),
             number(r.get("speedup"), "ratio"), share_text(r.get("sole_source")), _exact_text(r.get("exact"))]
            for r in main_rows]
    tbl = table(["label", "arm", "tau [interval]", "vs merged [interval]", "est. speedup", "sole-source share",
                 "exact"], rows, {2, 3, 4, 5}) if rows else ""
    plotted = main_rows + [r for _, rungs in abl.ladder for r in rungs if r is not None]
    groups = (["merged"] if abl.merged else []) + ["ablation"] * len(abl.ablations) + [
        "ladder" for _, rungs in abl.ladder for r in rungs if r is not None]
    chart = ""
    if any(r["tau"] is not None for r in plotted):
        chart = charts.ablation_chart([r["arm"] for r in plotted], [r["tau"] for r in plotted],
                                      *_interval_ends(plotted), groups)
    ladder = ""
    if abl.ladder:
        lrows = [[esc(d)] + [_tau_iv(rungs[i] if i < len(rungs) else None) for i in range(3)]
                 for d, rungs in abl.ladder]
        ladder = table(["drafter", *LADDER_RUNGS], lrows, {1, 2, 3},
                       caption="The transplant ladder: each drafter alone, with the pool, with the semantic key; "
                               "tau [95% interval].")
    missing = ("<h3>Not measured</h3><ul>" + "".join(f"<li>{esc(m)}</li>" for m in abl.missing) + "</ul>"
               if abl.missing else "")
    return section(sid, title, intro, chart, _abl_caveats(abl), tbl, ladder, missing)


ABLATIONS_FILE_NAME = "ablations/ablations.json"


# ---------------------------------------------------------------- the decision (decoder/verdict.py)

DECISION_CSS = {"enable": "enable", "neutral": "neutral", "leave off": "off"}
DECISION_TEXT = {
    "enable": "enable the semantic source",
    "neutral": "neutral: the semantic source neither clearly pays nor clearly costs on these numbers",
    "leave off": "leave the semantic source off",
}
BASIS_TEXT = {
    "committed": "of all committed tokens (bonus tokens included; the paper's definition)",
    "draft": "of accepted draft tokens (bonus tokens left out)",
}


def recommendation(share, gain_interval=None, speedup_on=None, speedup_off=None) -> tuple[str, str]:
    """(css class, verdict text) of decoder.verdict.verdict on these numbers (None: not known)."""
    v = verdict(share, None, gain_interval, speedup_on, speedup_off)
    return DECISION_CSS[v.decision], DECISION_TEXT[v.decision]


@dataclass
class Decision:
    """The verdict a page shows, and what it was read from."""

    source: str  # "replay" (replay/, strictly-past pool) or "live" (decode/)
    verdict: Verdict
    arm: Arm  # the arm whose sole-source share was read (oilbird)
    off: Arm | None  # oilbird-no-semantic from the same source, if run
    gain: dict  # the replay's paired_gain block ({} when absent)


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _named(arms: list[Arm], name: str) -> Arm | None:
    return next((a for a in arms if a.name == name), None)


def _estimate(arm: Arm | None) -> dict:
    return _dict(arm.summary.get("estimate")) if arm is not None else {}


def _est_speedup(arm: Arm | None):
    v = _estimate(arm).get("speedup")
    return v if _finite(v) else None


def _live_speedup(arm: Arm | None):
    v = arm.summary.get("speedup") if arm is not None else None
    return v if _finite(v) else None


def decide(result: Result) -> Decision | None:
    """The verdict from the replay (strictly-past pool) when it ran `oilbird`, else from the live decoder's
    sole-source share (no paired gain: never "enable"), else None."""
    on = _named(result.replay, ON_ARM)
    if on is not None:
        peers = result.replay_nodes.get(on.nodes, []) if on.nodes is not None else []
        off = _named(peers, OFF_ARM) or _named(result.replay, OFF_ARM)
        if off is not None and None not in (off.nodes, on.nodes) and off.nodes != on.nodes:
            off = None  # another node budget: not a paired comparison
        share = on.sole_source or {}
        gain = _dict(on.summary.get("paired_gain"))
        if gain.get("versus", OFF_ARM) != OFF_ARM:
            gain = {}
        v = verdict(share.get("share"), share.get("interval"), gain.get("interval"), _est_speedup(on),
                    _est_speedup(off) if off is not None else None)
        return Decision("replay", v, on, off, gain)
    arms = share_arms(result)
    if not arms:
        return None
    main = arms[0]
    off = _named(result.arms, OFF_ARM) if main.name == ON_ARM else None
    both = off is not None and _live_speedup(main) is not None and _live_speedup(off) is not None
    v = verdict(main.sole_source["share"], main.sole_source.get("interval"), None,
                _live_speedup(main) if both else None, _live_speedup(off) if both else None)
    return Decision("live", v, main, off, {})


def with_iv(v, iv, kind: str = "2f") -> str:
    """A number and, when known, its 95% interval in brackets."""
    s, i = number(v, kind), interval(iv, kind)
    return s if s == "n/a" or i == "n/a" else f"{s} [{i}]"


def gain_text(v, iv) -> str:
    """A paired ratio as ×1.040 [1.010–1.070]."""
    if not _finite(v):
        return "n/a"
    i = iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(_finite(x) for x in iv) else None
    return f"×{v:.3f}" + (f" [{i[0]:.3f}–{i[1]:.3f}]" if i else "")


def share_text(entry: dict | None) -> str:
    """A sole-source share with its interval and counts, e.g. 3.10% [2.00–4.00%] (2,100 of 67,324)."""
    if not entry or not _finite(entry.get("share")):
        return "–"
    counts = _sole_counts(entry)
    return with_iv(entry["share"], entry.get("interval"), "pct") + (f" ({counts})" if counts else "")


def _sole_counts(ss: dict) -> str:
    sole, total = ss.get("sole"), ss.get("total")
    return f"{int(sole):,} of {int(total):,}" if _finite(sole) and _finite(total) else ""


def replay_command(result: Result) -> str:
    return f"python -m decoder replay --bench {bench_name(result)} --model {result.model_name}"


def verdict_callout(d: Decision, lead: str) -> str:
    v = d.verdict
    reasons = "".join(f"<li>{esc(r)}</li>" for r in v.reasons)
    return (f'<div class="callout {DECISION_CSS[v.decision]}"><p>{lead}Verdict: '
            f"<strong>{esc(DECISION_TEXT[v.decision])}</strong>.</p>"
            f"<ul>{reasons}</ul>"
            f'<p class="note">Rule (decoder/verdict.py): {esc(v.rule)}</p></div>')


def shares_paragraph(arm: Arm, where: str) -> str:
    parts = []
    for basis in ("committed", "draft"):
        e = arm.shares.get(basis)
        if e and _finite(e.get("share")):
            parts.append(f"<strong>{share_text(e)}</strong> {esc(BASIS_TEXT[basis])}")
    if not parts:
        return f'<p>Sole-source share of <strong>{esc(arm.name)}</strong> ({esc(where)}): not available.</p>'
    older = ("" if "committed" in arm.shares else
             " This summary gives only the draft-token share (an older decoder run); the paper's 3% / 9% lines "
             "are drawn for the share of all committed tokens, which is lower.")
    return (f"<p>Sole-source share of <strong>{esc(arm.name)}</strong> ({esc(where)}), the accepted tokens that only "
            f"the semantic source proposed: {'; '.join(parts)}.{esc(older)}</p>")


def _exact_cell(summary: dict, notes: list[str]) -> str:
    exact = summary.get("exact")
    if exact is True:
        return "yes"
    if exact is False:
        reason = summary.get("exact_reason")
        if isinstance(reason, str) and reason:
            if reason not in notes:
                notes.append(reason)
            k = notes.index(reason) + 1
            return f'<span title="{esc(reason)}">no [{k}]</span>'
        return "no"
    return "n/a"


def _speed_cell(arm: Arm) -> str:
    est = arm.summary.get("estimate")
    if isinstance(est, dict):
        return with_iv(est.get("speedup"), est.get("speedup_interval"), "ratio")
    note = arm.summary.get("estimate_note")
    tip = f' title="{esc(note)}"' if isinstance(note, str) and note else ""
    return f'<span class="na"{tip}>no profile</span>'


def _tau(summary: dict):
    """(tau, interval) of a replay ({value, interval}) or live (a number, tau_interval) summary."""
    t = summary.get("tau")
    if isinstance(t, dict):
        return t.get("value"), t.get("interval")
    return t, summary.get("tau_interval")


def replay_table(result: Result, notes: list[str]) -> str:
    """Replay arms (strictly-past pool) beside the live decoder's, one row per arm."""
    live = {a.name: a for a in result.arms}
    names = [a.name for a in result.replay] + [a.name for a in result.arms if _named(result.replay, a.name) is None]
    head = ["arm", "nodes", "tau [95%]", "est. speedup [95%]", "exact", "sole-source share, committed tokens",
            "… of accepted draft tokens"]
    if live:
        head += ["live tau", "live speedup (measured)"]
    rows = []
    for name in names:
        r, lv = _named(result.replay, name), live.get(name)
        if r is not None:
            tau, iv = _tau(r.summary)
            row = [esc(name), number(r.nodes), with_iv(tau, iv), _speed_cell(r), _exact_cell(r.summary, notes),
                   share_text(r.shares.get("committed")), share_text(r.shares.get("draft"))]
        else:
            row = [esc(name) + " (live only)", "–", "–", "–", "–", "–", "–"]
        if live:
            if lv is not None:
                ltau, liv = _tau(lv.summary)
                row += [with_iv(ltau, liv), _speed(lv)]
            else:
                row += ["–", "–"]
        rows.append(row)
    caption = ("Replay over the captured traces, strictly-past pool. tau = committed tokens per verification pass "
               "(request-bootstrap 95% interval); est. speedup = estimated from a verification-cost profile "
               "(none: no profile); exact = the replay makes the same passes as live decoding (see the notes).")
    if live:
        caption += (" Live columns: the decoder run on the model (decode/); live results are the ground truth, "
                    "measured where the replay estimates.")
    return table(head, rows, {1, 2, 3} | ({7, 8} if live else set()), caption=caption)


def nodes_table(by_nodes: dict[int, list[Arm]], chosen: int | None) -> str:
    budgets = sorted(by_nodes)
    names = list(dict.fromkeys(a.name for n in budgets for a in by_nodes[n]))
    rows = []
    for name in names:
        row = [esc(name)]
        for n in budgets:
            a = _named(by_nodes[n], name)
            row.append(with_iv(*_tau(a.summary)) if a is not None else "–")
        rows.append(row)
    head = ["arm"] + [f"tau at {n} nodes" + (" (decision)" if n == chosen else "") for n in budgets]
    return table(head, rows, set(range(1, len(budgets) + 1)),
                 caption="tau [95%] per node budget (replay/&lt;arm&gt;/nodes-&lt;N&gt;/). The decision reads "
                         f"{DECISION_NODES} nodes when replayed, else the largest budget.")


def warm_table(arms: list[Arm]) -> str:
    rows = []
    for a in arms:
        gain = _dict(a.summary.get("paired_gain"))
        rows.append([esc(a.name), number(a.nodes), with_iv(*_tau(a.summary)), _speed_cell(a),
                     share_text(a.shares.get("committed")),
                     gain_text(gain.get("tau_ratio"), gain.get("interval")) if gain else "–"])
    return table(["arm", "nodes", "tau [95%]", "est. speedup [95%]", "sole-source share, committed tokens",
                  "paired tau gain"], rows, {1, 2, 3},
                 caption="Warm pool: every other request's trace is in the pool from the start (what a long-running "
                         "deployment approaches). For comparison only: the decision reads the strictly-past pool.")


BASELINE_ARMS = ("suffix", "sam", "lexical", "recycling", "pld")  # the headline's baselines (decoder ablations)
LEXICAL_ARMS = BASELINE_ARMS  # the best lexical arm is chosen among these, as decoder/ablations.py chooses it
BASELINE_LABELS = {"suffix": "SuffixDecoding", "sam": "SAM-Decoding", "lexical": "lexical sources merged",
                   "recycling": "Token Recycling", "pld": "prompt lookup (PLD)"}
TARGET_OVER_LEXICAL = 1.25  # the gain over the best of them that would make the key clearly worth its cost
TARGET_LOWER = 1.0  # ... with the paired interval's lower end above this
TARGET_TEXT = (f"tau({ON_ARM}) ≥ {TARGET_OVER_LEXICAL:g}× the best lexical arm's, with the paired 95% interval's "
               f"lower end above {TARGET_LOWER:g}")


def _paired_over(arm: Arm) -> tuple[float | None, list | None]:
    """oilbird's tau over `arm`'s, paired, from the arm's paired_gain when it was paired against oilbird (its
    tau_ratio is arm / oilbird: inverted, the percentile interval's ends swap)."""
    g = _dict(arm.summary.get("paired_gain"))
    r, iv = g.get("tau_ratio"), g.get("interval")
    if g.get("versus") != ON_ARM or not _finite(r) or r <= 0:
        return None, None
    ok = isinstance(iv, (list, tuple)) and len(iv) == 2 and all(_finite(x) and x > 0 for x in iv)
    return 1 / r, ([1 / iv[1], 1 / iv[0]] if ok else None)


def _replay_row(arm: Arm, label: str) -> dict:
    tau, iv = _tau(arm.summary)
    return {"arm": arm.name, "label": label, "tau": tau if _finite(tau) else None,
            "tau_interval": list(iv) if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(map(_finite, iv))
            else None, "speedup": _est_speedup(arm), "exact": arm.summary.get("exact")
            if isinstance(arm.summary.get("exact"), bool) else None, "sole_source": arm.sole_source}


@dataclass
class Comparison:
    """oilbird against each baseline arm: from ablations.json's `headline` when it has one, else from the replay."""

    source: str  # "ablations.json" or "replay"
    on: dict | None  # oilbird's row (tau, tau_interval, ...)
    rows: list[dict]  # one per baseline arm: ... plus oilbird_over_arm, oilbird_over_arm_interval
    nodes: int | None
    requests: int | None


def comparison(result: Result) -> Comparison | None:
    abl = result.ablations
    if abl is not None and not abl.note and abl.headline:
        nodes, requests = abl.meta.get("nodes"), abl.meta.get("requests")
        return Comparison("ablations.json", abl.merged, abl.headline, nodes if _finite(nodes) else None,
                        requests if _finite(requests) else None)
    on = _named(result.replay, ON_ARM)
    arms = [a for a in result.replay if a.name in BASELINE_ARMS and (on is None or a.nodes == on.nodes)]
    if on is None and not arms:
        return None
    on_row = _replay_row(on, f"merged ({ON_ARM})") if on is not None else None
    rows = []
    for a in sorted(arms, key=lambda a: BASELINE_ARMS.index(a.name)):
        row = _replay_row(a, BASELINE_LABELS[a.name])
        ratio, iv = _paired_over(a)
        if ratio is None and on_row is not None and on_row["tau"] is not None and row["tau"]:
            ratio = on_row["tau"] / row["tau"]
        row.update(oilbird_over_arm=ratio, oilbird_over_arm_interval=iv)
        rows.append(row)
    ref = on or arms[0]
    req = ref.summary.get("requests")
    return Comparison("replay", on_row, rows, ref.nodes, req if _finite(req) else None)


@dataclass
class Target:
    """The target line: oilbird over the best lexical arm against 1.25x, paired lower end above 1."""

    arm: str  # the best lexical arm
    arm_tau: float | None
    on_tau: float | None
    ratio: float
    interval: list | None  # paired 95% interval of the ratio, when known
    status: str  # "met", "not met" or "not established" (at or above the line, but no paired interval)
    considered: list[str]  # the lexical arms compared
    source: str  # as Comparison.source
    file_says: bool | None  # ablations.json's own target_met, when the numbers came from it


def target(result: Result, h: Comparison | None = None) -> Target | None:
    h = h if h is not None else comparison(result)
    if h is None:
        return None
    lex = [r for r in h.rows if r["arm"] in LEXICAL_ARMS and _finite(r.get("tau"))]
    on_tau = h.on.get("tau") if h.on else None
    on_tau = on_tau if _finite(on_tau) else None
    abl = result.ablations
    best = abl.best_lexical if h.source == "ablations.json" and abl is not None else None
    if best is None:
        if not lex:
            return None
        best = max(lex, key=lambda r: r["tau"])
    ratio, iv = best.get("oilbird_over_arm"), best.get("oilbird_over_arm_interval")
    if not _finite(ratio):
        row = next((r for r in h.rows if r["arm"] == best["arm"]), {})
        ratio, iv = row.get("oilbird_over_arm"), iv or row.get("oilbird_over_arm_interval")
    arm_tau = best.get("tau") if _finite(best.get("tau")) else None
    if not _finite(ratio) and on_tau is not None and arm_tau:
        ratio = on_tau / arm_tau
    if not _finite(ratio):
        return None
    iv = iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(map(_finite, iv)) else None
    if ratio < TARGET_OVER_LEXICAL or (iv is not None and iv[0] <= TARGET_LOWER):
        status = "not met"
    else:
        status = "met" if iv is not None else "not established"
    return Target(best["arm"], arm_tau, on_tau, float(ratio), iv, status, sorted(r["arm"] for r in lex),
                  h.source, abl.target_met if h.source == "ablations.json" and abl is not None else None)


TARGET_CSS = {"met": "enable", "not met": "off", "not established": "neutral"}


def target_text(t: Target) -> str:
    """One paragraph: oilbird against the best lexical arm, the ratio with its paired interval, and the verdict
    on the 1.25x target with the reason."""
    iv = f" [paired 95% {t.interval[0]:.3f}–{t.interval[1]:.3f}]" if t.interval else ""
    short = ("" if t.ratio >= TARGET_OVER_LEXICAL else
             f", short of the {TARGET_OVER_LEXICAL:g}× line by "
             f"{100 * (TARGET_OVER_LEXICAL - t.ratio) / TARGET_OVER_LEXICAL:.1f}%")
    if t.status == "met":
        why = f"at or above {TARGET_OVER_LEXICAL:g}× and the paired lower end {t.interval[0]:.3f} is above 1"
    elif t.ratio < TARGET_OVER_LEXICAL:
        why = f"below {TARGET_OVER_LEXICAL:g}×"
    elif t.interval is not None:
        why = f"the paired lower end {t.interval[0]:.3f} is not above 1"
    else:
        why = ("no paired interval for the ratio (replay the arms paired against oilbird: "
               "`python -m decoder ablations`)")
    among = ", ".join(t.considered) if t.considered else t.arm
    where = "ablations/ablations.json" if t.source == "ablations.json" else "the replay"
    disagree = ""
    if t.file_says is not None and t.status != "not established" and t.file_says != (t.status == "met"):
        disagree = (f" ({ABLATIONS_FILE_NAME} itself says target_met = {str(t.file_says).lower()}; the numbers "
                    "shown give the verdict above.)")
    elif t.file_says is not None and t.status == "not established":
        disagree = f" ({ABLATIONS_FILE_NAME} says target_met = {str(t.file_says).lower()}.)"
    return (f'<div class="callout {TARGET_CSS[t.status]} target"><p>Against the best lexical arm (of '
            f"{esc(among)}; from {esc(where)}): <strong>{ON_ARM}</strong> tau {number(t.on_tau, '2f')} vs "
            f"<strong>{esc(t.arm)}</strong> {number(t.arm_tau, '2f')}, <strong>{t.ratio:.3f}×</strong>{iv}{short}."
            f"</p>\n<p>Target, {esc(TARGET_TEXT)}: <strong>{esc(t.status)}</strong> ({esc(why)}).{esc(disagree)}</p>"
            "</div>")


def lexical_comparison(result: Result, on: Arm) -> str:
    """oilbird's tau against the best lexical arm (ablations.json's headline, else the replay at the same node
    budget), and the 1.25x target line."""
    t = target(result)
    if t is None:
        return not_available(f"no lexical arm ({', '.join(LEXICAL_ARMS)}) replayed beside {ON_ARM} to compare with")
    return target_text(t)


def decision_section(result: Result) -> str:
    """The decision block: the verdict with its rule and numbers, read from the replay (else the live decoder)."""
    sid, title = "decision", "Decision: enable the semantic source?"
    d = decide(result)
    command = replay_command(result)
    if not result.has_decoder:
        return section(sid, title, not_available(
            f"no replay or decoder results under {result.bench}/{result.model}/ (run `{command}`; it needs only "
            "the trace store)"))
    parts = []
    if d is not None and d.source == "replay":
        on, off = d.arm, d.off
        lead = (f"From the replay of the captured traces (strictly-past pool, {number(on.nodes)} nodes, "
                f"{number(on.summary.get('requests'))} requests). ")
        parts.append(verdict_callout(d, lead))
        parts.append(shares_paragraph(on, "replay"))
        g = d.gain
        if g:
            speed = (f"; estimated speedup {gain_text(g.get('speedup_ratio'), g.get('speedup_interval'))}"
                     if _finite(g.get("speedup_ratio")) else "")
            parts.append(f"<p>Paired gain of <strong>{ON_ARM}</strong> over <strong>{OFF_ARM}</strong> (the same "
                         f"requests, resampled jointly): tau <strong>{gain_text(g.get('tau_ratio'), g.get('interval'))}"
                         f"</strong>{speed}.</p>")
        else:
            note = on.summary.get("paired_gain_note")
            parts.append(not_available("no paired gain of oilbird over oilbird-no-semantic in the replay"
                                       + (f" ({note})" if isinstance(note, str) and note else
                                          f" (replay both arms in one command: `{command} --arms oilbird,"
                                          "oilbird-no-semantic`)")))
        parts.append(lexical_comparison(result, on))
        est = _estimate(on)
        if est:
            device = " · ".join(esc(x) for x in (est.get("device_name"), est.get("device"))
                                if isinstance(x, str) and x)
            off_est = _estimate(off)
            speeds = (f" {ON_ARM} {with_iv(est.get('speedup'), est.get('speedup_interval'), 'ratio')}"
                      + (f", {OFF_ARM} {with_iv(off_est.get('speedup'), off_est.get('speedup_interval'), 'ratio')}"
                         if off_est else "") + " over plain greedy.")
            parts.append(f"<p>Estimated speedups (not measured): verification cost from the profile "
                         f"<code>{esc(est.get('profile', 'n/a'))}</code>" + (f" ({device})" if device else "")
                         + f", plus the drafting and update time measured in the replay:{speeds}</p>")
        else:
            note = on.summary.get("estimate_note")
            parts.append(not_available(
                f"{ON_ARM}: {note}" if isinstance(note, str) and note else
                f"no estimated speedup for {ON_ARM}: the replay had no verification-cost profile "
                "(`python -m decoder profile`)"))
    elif d is not None:  # live decoder only
        parts.append(verdict_callout(d, "From the live decoder (no replay with oilbird). "))
        parts.append(shares_paragraph(d.arm, "live decoder"))
        best = fastest_arm(result, exclude=d.arm)
        parts.append(f"<p>Measured: <strong>{esc(d.arm.name)}</strong> {_speed(d.arm)} over ar, against "
                     f"{_speed(best)} for the best other arm (<strong>{esc(best.name)}</strong>).</p>" if best else
                     f"<p>Measured speedup of {esc(d.arm.name)}: {_speed(d.arm)}.</p>")
        parts.append(not_available(f"no replay with oilbird: run `{command}` for the paired gain over "
                                   "oilbird-no-semantic with its interval, which an \"enable\" needs"))
    else:
        parts.append(not_available(
            "no arm reports a sole-source share: replay or decode the semantic arm `oilbird` with "
            f"`oilbird-no-semantic` (`{command}`)"))
    notes: list[str] = []
    if result.replay:
        parts.append("<h3>Arms</h3>" + replay_table(result, notes))
        tau = [_tau(a.summary) for a in result.replay]
        ivs = [iv if isinstance(iv, (list, tuple)) and len(iv) == 2 and all(_finite(x) for x in iv) else (None, None)
               for _, iv in tau]
        live = [_tau(_named(result.arms, a.name).summary)[0] if _named(result.arms, a.name) else None
                for a in result.replay]
        value = lambda v: v if _finite(v) else None  # noqa: E731
        if any(value(t) is not None for t, _ in tau):
            parts.append(charts.tau_chart([a.name for a in result.replay], [value(t) for t, _ in tau],
                                          [value(i[0]) for i in ivs], [value(i[1]) for i in ivs],
                                          [value(v) for v in live] if result.arms else None))
        if notes:
            parts.append("".join(f'<p class="note">[{k}] not exact: {esc(n)}</p>' for k, n in enumerate(notes, 1)))
    if result.arms and result.replay:
        parts.append('<p class="note">Live decoder results (decode/, the section below) are the ground truth: '
                     "measured on the model, where the replay simulates the drafters over the traces and estimates "
                     "time. Where they disagree, trust the live run.</p>")
    if result.replay_nodes:
        chosen = d.arm.nodes if d is not None and d.source == "replay" else None
        parts.append("<h3>Node budgets</h3>" + nodes_table(result.replay_nodes, chosen))
    if result.replay_warm:
        parts.append("<h3>Warm pool</h3>" + warm_table(result.replay_warm))
    if has_evidence(result):
        parts.append(f'<p class="note">{ON_ARM} against every baseline with paired intervals, where its tokens come '
                     f'from, the ablations and the transplant ladder: <a href="{href(evidence_name(result))}">the '
                     "evidence page</a>.</p>")
    return section(sid, title, *parts)


# ---------------------------------------------------------------- decoder section

def _speed(arm) -> str:
    return f"{arm.summary['speedup']:.2f}×" if arm is not None and _finite(arm.summary.get("speedup")) else "n/a"


def _audit_cell(audit: dict | None) -> str:
    """matched/requests, with the mismatches' kinds (decoder/audit.py) when there are any."""
    if not audit:
        return "n/a"
    cell = f"{number(audit.get('matched'))}/{number(audit.get('requests'))}"
    if audit.get("mismatches") and "numeric" in audit:
        cell += (f" ({number(audit.get('numeric'))} numeric, {number(audit.get('algorithmic'))} algorithmic, "
                 f"{esc(str(audit.get('dtype')))})")
    return cell


def decoder_section(result: Result) -> str:
    title = "Decoder: what the draft sources deliver"
    if not result.arms:
        return section("decoder", title, not_available(
            f"no decoder results under {result.bench}/{result.model}/decode/ (run `python -m decoder`)"
            + ("; the decision above reads the replay" if result.replay else "")))
    arms = result.arms
    rows = []
    for a in arms:
        s = a.summary
        audit = s.get("lossless") if isinstance(s.get("lossless"), dict) else None
        lossless = _audit_cell(audit)
        rows.append([esc(a.name), number(_tau(s)[0]), number(s.get("tokens_per_s")), _speed(a),
                     number(s.get("overhead_fraction"), "pct"), number(s.get("mean_nodes")), lossless,
                     number(s.get("requests"))])
    parts = [table(["arm", "tau", "tokens/s", "speedup", "draft+update share", "mean nodes", "lossless",
                    "requests"], rows, {1, 2, 3, 4, 5, 6, 7},
                   caption="tau = committed tokens per verification pass; speedup = tokens/s over the same "
                           "invocation's ar; lossless = requests whose output equals ar's token for token. A "
                           "mismatch is numeric when the arm committed its own forward's argmax and both logit "
                           "gaps at the first difference are within the dtype's rounding (bfloat16: tree and "
                           "one-token scoring round differently), algorithmic otherwise (a decoder bug); "
                           "float32 must match exactly (docs/lossless.md).")]
    value = lambda v: v if _finite(v) else None  # noqa: E731
    parts.append(charts.arm_chart([a.name for a in arms], [value(_tau(a.summary)[0]) for a in arms],
                                  [value(a.summary.get("speedup")) for a in arms]))
    by_source = [_dict(a.summary.get("accepted_by_source")) for a in arms]
    sources = sorted({src for d in by_source for src in d})
    if sources:
        acc = [[int(d[src]) if _finite(d.get(src)) else 0 for src in sources] for d in by_source]
        rate = [_dict(a.summary.get("acceptance_rate_by_source")) for a in arms]
        src_rows = [[esc(a.name)] + [f"{acc[i][j]:,}" + (f" ({pct(rate[i][src])})" if _finite(rate[i].get(src))
                                                         else "") for j, src in enumerate(sources)]
                    for i, a in enumerate(arms) if any(acc[i])]
        parts.append("<h3>Accepted tokens per source</h3>" + table(
            ["arm"] + [esc(s) for s in sources], src_rows, set(range(1, len(sources) + 1)),
            caption="A token proposed by several sources is credited to each; in brackets the share of that "
                    "source's drafted nodes that were accepted."))
        shown = [i for i, a in enumerate(arms) if any(acc[i])]
        if shown:
            parts.append(charts.source_chart([arms[i].name for i in shown], sources, [acc[i] for i in shown]))
    else:
        parts.append(not_available("no per-source accepted tokens in the decoder summaries"))
    parts.append("<h3>Sole-source share</h3>" + sole_source_block(result))
    return section("decoder", title, *parts)


def share_arms(result: Result) -> list:
    """Live arms with a sole-source share, the one the live verdict reads first (`oilbird` if run)."""
    arms = [a for a in result.arms if a.sole_source and _finite(a.sole_source.get("share"))]
    return sorted(arms, key=lambda a: a.name != ON_ARM)


def main_share(result: Result) -> float | None:
    """The sole-source share the verdict reads (replay oilbird, else the live arm), or None."""
    d = decide(result)
    share = d.arm.sole_source if d is not None and d.arm.sole_source else {}
    return share.get("share") if _finite(share.get("share")) else None


def fastest_arm(result: Result, exclude=None):
    """The drafting arm (not a greedy reference, not `exclude`) with the highest speedup, or None."""
    arms = [a for a in result.arms if a is not exclude and a.name not in (REFERENCE_ARM, STATIC_ARM)
            and _finite(a.summary.get("speedup"))]
    return max(arms, key=lambda a: a.summary["speedup"], default=None)


def sole_source_block(result: Result) -> str:
    """The live arms' sole-source shares (both definitions); the verdict itself is in the decision block."""
    with_share = share_arms(result)
    if not with_share:
        return not_available("no arm reports a sole-source share (run the decoder's semantic arm, `oilbird`)")
    rows = [[esc(a.name), share_text(a.shares.get("committed")), share_text(a.shares.get("draft")),
             esc(", ".join(dict.fromkeys(e.get("from", "") for e in a.shares.values())))]
            for a in with_share]
    d = decide(result)
    where = "the replay" if d is not None and d.source == "replay" else "these live figures"
    pointer = (f'<p class="note">The verdict ({esc(d.verdict.decision)}, read from {where}) is at the top of '
               'the page: <a href="#decision">Decision</a>.</p>' if d is not None else "")
    return pointer + table(["arm", "share of committed tokens (paper)", "share of accepted draft tokens",
                            "read from"], rows, {1, 2},
                           caption="Sole-source share: accepted tokens that only the semantic source proposed.")


# ---------------------------------------------------------------- the evidence page (replay and ablations)

def has_evidence(result: Result) -> bool:
    """Whether the result gets an evidence page: it has a replay (strictly-past pool) or an ablations.json."""
    return bool(result.replay) or result.ablations is not None


def evidence_name(result: Result) -> str:
    return f"{result.slug}__evidence.html"


def evidence_link(result: Result) -> str:
    return f'<a href="{href(evidence_name(result))}">evidence</a>' if has_evidence(result) else ""


def comparison_section(result: Result) -> str:
    """oilbird against each baseline arm (tau, oilbird ÷ arm paired), the 1.25x target line and a tau chart."""
    sid, title = "comparison", f"{ON_ARM} against the baselines"
    h = comparison(result)
    abl = result.ablations
    if h is None:
        return section(sid, title, not_available(
            f"no replay of {ON_ARM} or of a baseline arm ({', '.join(BASELINE_ARMS)}) and no headline in "
            f"{ABLATIONS_FILE_NAME}: run `{ablations_command(result)}`"))
    facts = ", ".join(bit for bit in (f"{number(h.nodes)} nodes" if h.nodes is not None else "",
                                      f"{number(h.requests)} requests" if h.requests is not None else "") if bit)
    if h.source == "ablations.json":
        intro = (f'<p class="caption">From <code>{ABLATIONS_FILE_NAME}</code> (pool past'
                 + (f", {facts}" if facts else "") + f"): {ON_ARM} and each baseline replayed over the same requests. "
                 f"tau: tokens per verification pass, request-bootstrap 95% interval; {ON_ARM} ÷ arm: the ratio of "
                 "the two taus with its paired interval (the same requests resampled jointly).</p>")
        older = ""
    else:
        why = ("has no headline (an older file)" if abl is not None and not abl.note else
               "could not be read" if abl is not None else "does not exist")
        intro = ('<p class="caption">From the replay (<code>replay/&lt;arm&gt;/summary.json</code>, pool past'
                 + (f", {facts}" if facts else "") + f"): {ABLATIONS_FILE_NAME} {esc(why)}. tau: tokens per "
                 f"verification pass, request-bootstrap 95% interval; {ON_ARM} ÷ arm: the ratio of the two taus, "
                 "paired only where the arm was replayed paired against oilbird.</p>")
        older = (f'<p class="note">The paired intervals, the ablations and the transplant ladder come from '
                 f"<code>{esc(ablations_command(result))}</code>.</p>")
    t = target(result, h)
    line = target_text(t) if t is not None else not_available(
        f"no lexical arm ({', '.join(LEXICAL_ARMS)}) beside {ON_ARM} to hold to the target ({TARGET_TEXT})")
    rows = []
    if h.on is not None:
        rows.append([esc(h.on.get("label") or ON_ARM), f"<code>{esc(h.on['arm'])}</code>", _tau_iv(h.on), "1",
                     number(h.on.get("speedup"), "ratio"), _exact_text(h.on.get("exact"))])
    for r in h.rows:
        rows.append([esc(r["label"]), f"<code>{esc(r['arm'])}</code>", _tau_iv(r),
                     gain_text(r.get("oilbird_over_arm"), r.get("oilbird_over_arm_interval")),
                     number(r.get("speedup"), "ratio"), _exact_text(r.get("exact"))])
    tbl = table(["", "arm", "tau [95%]", f"{ON_ARM} ÷ arm [paired 95%]", "est. speedup", "exact"], rows,
                {2, 3, 4}, caption="est. speedup: estimated from a verification-cost profile (n/a without one); "
                                   "exact: the replay makes the same passes as live decoding.")
    plotted = ([h.on] if h.on is not None else []) + h.rows
    chart = ""
    if any(_finite(r.get("tau")) for r in plotted):
        chart = charts.ablation_chart([r["arm"] for r in plotted], [r.get("tau") for r in plotted],
                                      *_interval_ends(plotted),
                                      (["merged"] if h.on is not None else []) + ["baseline"] * len(h.rows),
                                      name="comparison", title=f"tau of {ON_ARM} and each baseline arm, replay "
                                                               "with 95% intervals")
    caveats = _abl_caveats(abl) if h.source == "ablations.json" and abl is not None else ""
    return section(sid, title, intro, line, tbl, chart, caveats, older)


def sources_section(result: Result) -> str:
    """Per-source acceptance of the replayed oilbird: drafted nodes, accepted tokens, acceptance rate; its
    sole-source shares; the drafter's counters."""
    sid, title = "sources", f"Where {ON_ARM}'s accepted tokens come from (replay)"
    on = _named(result.replay, ON_ARM)
    if on is None:
        return section(sid, title, not_available(f"no replay of {ON_ARM} (run `{replay_command(result)}`)"))
    s = on.summary
    acc, drafted, rate = (_dict(s.get(k)) for k in ("accepted_by_source", "drafted_by_source",
                                                     "acceptance_rate_by_source"))
    sources = list(dict.fromkeys([*acc, *drafted, *rate]))
    parts = [shares_paragraph(on, "replay")]
    total = s.get("accepted_draft_tokens")
    if sources:
        rows = []
        for src in sources:
            a, d, r = acc.get(src), drafted.get(src), rate.get(src)
            if not _finite(r) and _finite(a) and _finite(d) and d > 0:
                r = a / d
            rows.append([esc(src), number(d), number(a), number(r, "pct"),
                         number(a / total, "pct") if _finite(a) and _finite(total) and total > 0 else "n/a"])
        parts.append(table(["source", "drafted nodes", "accepted tokens", "acceptance rate",
                            "of accepted draft tokens"], rows, {1, 2, 3, 4},
                           caption="A token proposed by several sources is credited to each, so the last column "
                                   f"can sum above 100% (accepted draft tokens: {number(total)}). Acceptance "
                                   "rate: accepted over drafted nodes of that source."))
    else:
        parts.append(not_available(f"the replay summary of {ON_ARM} has no per-source attribution "
                                   "(accepted_by_source)"))
    stats = {k: v for k, v in _dict(s.get("drafter_stats")).items() if _finite(v) or isinstance(v, bool)}
    if stats:
        parts.append(f"<details><summary>Drafter counters ({len(stats)})</summary>" + table(
            ["counter", "value"], [[esc(humanize(k)), number(v)] for k, v in stats.items()], {1},
            caption=f"As the replay of {ON_ARM} reports them (summary.json `drafter_stats`).") + "</details>")
    return section(sid, title, *parts)


def _depth(arm: Arm | None) -> dict | None:
    d = _dict(arm.summary.get("by_depth")) if arm is not None else {}
    ok = d and isinstance(d.get("reach"), list) and isinstance(d.get("by_source"), dict) and _finite(d.get("passes"))
    return d if ok else None


def depth_section(result: Result) -> str:
    """Per depth of the accepted path (summary.json `by_depth`): how many passes reach it with the key and
    without, and which source proposed the tokens accepted there: where the key's tau gain lands."""
    sid, title = "depth", f"Where the key's gain lands: acceptance per depth ({ON_ARM} against {OFF_ARM}, replay)"
    on, off = _depth(_named(result.replay, ON_ARM)), _depth(_named(result.replay, OFF_ARM))
    if on is None or off is None:
        return section(sid, title, not_available(
            f"no per-depth acceptance (summary.json `by_depth`) in the replays of {ON_ARM} and {OFF_ARM}; a replay "
            f"made before it was recorded: rerun `{replay_command(result)}`"))
    n = max(on["passes"], 1)
    src = on["by_source"]
    names = [k for k in ("spine", "branch", "adjacency", SEMANTIC_SOURCE, "rollout") if k in src]
    names += sorted(k for k in src if k not in names)
    rows = []
    for d in DEPTH_ROWS:
        if d > min(len(on["reach"]), len(off["reach"])):
            break
        sole = on.get("sole_semantic") or []
        rows.append([str(d), number(on["reach"][d - 1], "pct"), number(off["reach"][d - 1], "pct"),
                     number(sole[d - 1] / n, "pct") if len(sole) >= d else "n/a",
                     *[number(src[k][d - 1] / n, "pct") if len(src[k]) >= d else "n/a" for k in names]])
    head = ["depth d", f"passes reaching d ({ON_ARM})", f"passes reaching d ({OFF_ARM})",
            "semantic alone", *[f"{esc(k)}" for k in names]]
    caption = (f"Passes reaching d: share of verification passes accepting at least d draft tokens ({number(on['passes'])} "
               f"passes with the key, {number(off['passes'])} without: the same tokens in fewer passes is the tau gain). "
               "The other columns: accepted tokens at depth d per pass of the arm with the key, by the source that "
               "proposed them (a token several sources proposed counts for each); semantic alone: proposed by no "
               "other source, the sole-source share by depth.")
    return section(sid, title, table(head, rows, set(range(1, len(head))), caption=caption))


def evidence_page(result: Result) -> str:
    """The evidence of one (benchmark, model): oilbird against the baselines with the target line, where its
    tokens come from, the ablations and transplant ladder, and every replayed arm."""
    bench = bench_name(result)
    title = f"Evidence: {bench} · {result.model_name}"
    parts = [f"<h1>{esc(title)}</h1>",
             f'<p class="sub">Replay and ablation results from <code>{esc(result.bench)}/{esc(result.model)}/</code>'
             f' (strictly-past pool). <a href="{href(page_name(result))}">Main report</a> (census, decision, live '
             "decoder).</p>",
             comparison_section(result), sources_section(result), depth_section(result)]
    if result.ablations is not None:
        parts.append(ablations_section(result))
    else:
        parts.append(section("ablations", "Ablations and the transplant ladder (replay, pool past)", not_available(
            f"no {ABLATIONS_FILE_NAME} under {result.bench}/{result.model}/: `{ablations_command(result)}` "
            f"(`{ABLATIONS_COMMAND}`) replays the ablations, the transplant ladder and the paired headline")))
    if result.replay:
        notes: list[str] = []
        tbl = replay_table(result, notes)
        parts.append(section("replay", "Every replayed arm (pool past)", tbl,
                             "".join(f'<p class="note">[{k}] not exact: {esc(n)}</p>' for k, n in enumerate(notes, 1))))
    else:
        parts.append(section("replay", "Every replayed arm (pool past)", not_available(
            f"no replay under {result.bench}/{result.model}/replay/ (run `{replay_command(result)}`)")))
    return page(title, "\n".join(parts))


# ---------------------------------------------------------------- pages

def result_page(result: Result, census: Census | None = None, token_text: TokenText | None = None,
                others: list[tuple[str, str]] = ()) -> str:
    """The page of one (benchmark, model): the headline, the decision (replay / decoder), its census (the given
    one, default the first) and the live decoder. Pages of another census pool show that census only."""
    census = census or result.census
    bench = bench_name(result, census)
    title = f"Gap report: {bench} · {result.model_name}" + (f" · pool {census.pool}" if census and
                                                             census.pool != "past" else "")
    main_page = census is None or census is result.census
    links = [f'<a href="{href(name)}">{esc(label)}</a>' for name, label in others]
    if main_page and has_evidence(result):
        links.append(f'<a href="{href(evidence_name(result))}">evidence: {ON_ARM} against the baselines, '
                     "ablations</a>")
    parts = [f"<h1>{esc(title)}</h1>",
             f'<p class="sub">Results from <code>{esc(result.bench)}/{esc(result.model)}/</code>. '
             + " ".join(links) + "</p>"]
    if census is None:
        parts.append(decision_section(result))
        parts.append(section("census", "Census", not_available(
            f"no census under {result.bench}/{result.model}/ (run `python -m census --bench ...`)")))
        parts += sweep_sections(result)
    else:
        parts += [headline(result, census), decision_section(result) if main_page else "",
                  proportions_table(census), mechanism_section(census),
                  coverage_section(census), cliff_section(census), novel_section(census), threshold_section(census),
                  *(sweep_sections(result) if main_page else []),
                  cases_section(result, census, token_text)]
    if main_page:
        parts.append(decoder_section(result))
    if census is not None:
        notes = census.summary.get("notes")
        notes = notes if isinstance(notes, list) else [notes] if notes else []
        config = census.summary.get("config") if isinstance(census.summary.get("config"), dict) else {}
        items = "".join(f"<li>{esc(n)}</li>" for n in notes)
        cfg = ", ".join(f"{esc(k)} = {esc(v)}" for k, v in config.items())
        parts.append(section("notes", "Notes and settings",
                             f"<ul>{items}</ul>" if items else "",
                             f'<p class="note">Census settings: {cfg}.</p>' if cfg else "",
                             f'<p class="note">Positions columns not present: {esc(", ".join(census.missing_columns))}.'
                             "</p>" if census.missing_columns and census.positions is not None else ""))
    return page(title, "\n".join(parts))


def page_name(result: Result, census: Census | None = None) -> str:
    if census is None or census is result.census:
        return f"{result.slug}.html"
    return f"{result.slug}__{census.folder.name}.html"


def _value(entry):
    """The finite value of a census entry {value, ...}, else None."""
    return entry["value"] if isinstance(entry, dict) and _finite(entry.get("value")) else None


def _cell(e) -> str:
    """A percentage with its intervals in the tooltip."""
    if _value(e) is None:
        return '<span class="na">n/a</span>'
    tip = f"Wilson 95% {interval(e.get('wilson'))}; bootstrap {interval(e.get('bootstrap'))}"
    return f'<span title="{esc(tip)}">{pct(e["value"])}</span>'


def verdict_cell(d: Decision | None) -> str:
    """The verdict in one cell, its reasons in the tooltip."""
    if d is None:
        return "–"
    tip = f"read from the {d.source} results: " + "; ".join(d.verdict.reasons)
    return f'<span title="{esc(tip)}"><strong>{esc(d.verdict.decision)}</strong> ({esc(d.source)})</span>'


def replay_tau_cell(result: Result) -> str:
    """tau of oilbird in the replay (strictly-past pool) with its interval, or –."""
    on = _named(result.replay, ON_ARM)
    return with_iv(*_tau(on.summary)) if on is not None else "–"


def share_cell(d: Decision | None) -> str:
    e = d.arm.sole_source if d is not None else None
    if not e or not _finite(e.get("share")):
        return "–"
    tip = f"{d.arm.name} ({d.source}): {BASIS_TEXT[e['basis']]}; 95% interval {interval(e.get('interval'))}"
    return f'<span title="{esc(tip)}">{pct(e["share"])}</span>' + ("" if e["basis"] == "committed" else " (draft)")


def index_page(results: list[Result]) -> str:
    rows = []
    for r in results:
        c = r.census
        s = c.summary if c else {}
        best = fastest_arm(r)
        d = decide(r)
        links = [f'<a href="{href(page_name(r))}">report</a>'] + [
            f'<a href="{href(page_name(r, o))}">pool {esc(o.pool)}</a>' for o in r.censuses[1:]] + (
            [evidence_link(r)] if has_evidence(r) else [])
        rows.append([esc(bench_name(r, c)), esc(r.model_name), number(s.get("positions")) if c else "–",
                     _cell(s.get("available")) if c else "–", _cell(s.get("gap")) if c else "–",
                     _cell(s.get("recall")) if c else "–",
                     esc(", ".join(a.name for a in r.arms)) or "–",
                     f"{best.summary['speedup']:.2f}× ({esc(best.name)})" if best else "–",
                     share_cell(d), replay_tau_cell(r), verdict_cell(d), " · ".join(links)])
    body = ("<h1>Oilbird gap reports</h1>"
            f'<p class="sub">{len(results)} result(s). <a href="grid.html">Cross-benchmark grid</a>. Percentages of '
            "generated positions (Recall: of gap positions); hover for intervals. Verdict: should the semantic draft "
            "source be enabled (decoder/verdict.py), read from the replay when it ran oilbird, else from the live "
            "decoder; hover for its numbers.</p>"
            + table(["benchmark", "model", "positions", "Avail", "Gap", "Recall", "decoder arms", "best speedup",
                     "sole-source share", "tau oilbird (replay)", "verdict", "pages"], rows, {2, 3, 4, 5, 7, 8, 9}))
    return page("Oilbird gap reports", body)


# The paper's numbers, Llama-3.1-8B on a GPU (/work/shared/paper/oilbird.tex), never mixed into our columns:
#   avail, gap, recall: Table tab:census-grid ("The same three questions, across ten benchmarks"), Llama-3.1-8B
#     columns, percent of generated positions (Recall: of gap positions), strictly-past pools; the API-Bank row's
#     request-bootstrap intervals are from that table's caption.
#   tau_suffix, tau_oilbird: Table tab:main-echo ("The three repetitive workloads"), Llama-3.1-8B block, tau of
#     SuffixDecoding and of Oilbird (Ours); only these three benchmarks are in it.
# Keys are this toolkit's benchmark names (data/benchmarks.py); `name` is the paper's.
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


def na(why: str) -> str:
    """A table cell that is not known, with the reason."""
    return f'<span class="na">n/a: {esc(why)}</span>'


def _expected_requests(bench: str) -> int | None:
    """The benchmark's full request count from the registry, when it has one (for a capture whose meta.json
    records a limit but not the total)."""
    n = EXPECTED_COUNTS.get(bench)
    return n if _finite(n) else None


def captured_requests(result: Result) -> tuple[int | None, int | None, int | None, bool]:
    """(requests captured, the benchmark's total when known, the capture's limit, complete) from traces/meta.json
    (`n_requests`, `requests_total`, `limit`, `complete`), else the census's or the replay's request count."""
    meta = result.meta or {}
    n = meta.get("n_requests")
    for s in ([result.census.summary] if result.census else []) + [a.summary for a in result.replay]:
        if not _finite(n):
            n = s.get("requests")
    n = int(n) if _finite(n) else None
    limit = meta.get("limit")
    limit = int(limit) if _finite(limit) and limit > 0 else None
    total = meta.get("requests_total")
    if not _finite(total) and limit is not None:
        bench = meta.get("bench") if isinstance(meta.get("bench"), str) else bench_name(result)
        total = _expected_requests(bench)
    total = int(total) if _finite(total) else None
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
    if _value(e) is None:
        return na(f"no {key} in the census summary")
    tip = f"Wilson 95% {interval(e.get('wilson'))}; request bootstrap 95% {interval(e.get('bootstrap'))}"
    return f'<span title="{esc(tip)}">{with_iv(e["value"], e.get("bootstrap"), "pct")}</span>'


def arm_tau_cell(result: Result, name: str) -> str:
    """tau of a replayed arm (strictly-past pool) with its interval, or n/a with the reason."""
    if not result.replay:
        return na("no replay")
    a = _named(result.replay, name)
    if a is None:
        return na(f"{name} not replayed")
    tau, iv = _tau(a.summary)
    if not _finite(tau):
        return na("no tau in its summary")
    return f'<span title="{esc(f"{name}, {number(a.nodes)} nodes")}">{with_iv(tau, iv)}</span>'


def target_cell(result: Result) -> str:
    t = target(result)
    if t is None:
        return na(f"no {ON_ARM} and lexical replay")
    return f"{gain_text(t.ratio, t.interval)} over {esc(t.arm)}: <strong>{esc(t.status)}</strong>"


def grid_share_cell(d: Decision | None) -> str:
    e = d.arm.sole_source if d is not None else None
    if not e or not _finite(e.get("share")):
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
    """The grid's benchmarks in the grid's order (data/benchmarks.py GRID_BENCHES), any other after them."""
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
             f"strictly-past pool; {ON_ARM} ÷ best lexical: against the {TARGET_OVER_LEXICAL:g}× target (paired "
             "interval where the ablations ran). Requests: the captured ones, \"of\" the benchmark's total when "
             f"the capture was limited. Our runs only: {esc(PAPER_LABEL)} numbers are in their own table below "
             "each.</p>"]
    for model in models:
        rows_r = sorted((r for r in results if r.model_name == model), key=grid_order)
        with_census = [r for r in rows_r if r.census]
        rows = []
        for r in rows_r:
            d = decide(r)
            pool = f" (pool {r.census.pool})" if r.census and r.census.pool != "past" else ""
            links = " · ".join(x for x in (f'<a href="{href(page_name(r))}">report</a>', evidence_link(r)) if x)
            rows.append([f'<a href="{href(page_name(r))}">{esc(bench_name(r, r.census))}</a>{esc(pool)}',
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
            series = {label: [100 * v if (v := _value(r.census.summary.get(key))) is not None else None
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


def href(name: str) -> str:
    """A link to a generated page: the name percent-encoded (a '#' or '?' in a benchmark's file name would
    otherwise cut the link), then escaped for the attribute."""
    return esc(urllib.parse.quote(name, safe=""))


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
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(out / name)
    return written
