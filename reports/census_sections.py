"""The census sections of a benchmark page: the headline, the proportions, the mechanism and coverage
blocks, the cliff, the gap rate by the preceding token, the threshold sweep and the case viewer.

The cliff histogram measures both populations by `longest_match_len` (the longest context suffix
found in the pool, capped at the oracle's maximum), the quantity behind the mechanism table's
medians, so the chart and the table agree. The threshold sweep: recall at cosine threshold t is
the share of gap positions where sem_hit holds and sem_best_cos >= t. A block the census does not
hold (an older summary, a missing positions.parquet or column) is one "not available" line with
the reason.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from data.stats import wilson
from data.store.layout import TRACES
from reports import charts
from reports.case_viewer import (
    MIN_CASE_POSITIONS,
    TokenText,
    load_token_text,
    render_cases,
)
from reports.htmlkit import (
    esc,
    finite,
    humanize,
    interval,
    not_available,
    number,
    pct,
    section,
    table,
)
from reports.links import bench_name
from reports.results import Census, Result

DEFAULT_THETA = 0.8  # the semantic key's default cosine threshold (decoder, paper section 4)
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
ENTRY_HEAD = ["quantity", "value", "Wilson 95%", "bootstrap 95%", "n"]
ENTRY_NUM = {1, 2, 3, 4}


def entry_value(entry):
    """The finite value of a census entry {value, ...}, else None."""
    return entry["value"] if isinstance(entry, dict) and finite(entry.get("value")) else None


def entry_row(label: str, entry, kind: str | None = None) -> list[str]:
    """[label, value, Wilson, bootstrap, n] for a census entry: {value, wilson?, bootstrap?, n?} or a number."""
    if entry is None:
        return [esc(label), '<span class="na">not computed</span>', "", "", ""]
    if not isinstance(entry, dict):
        return [esc(label), number(entry, kind or "num"), "", "", ""]
    kind = kind or ("pct" if "wilson" in entry else "num")
    n = entry.get("n")
    k = entry.get("k")
    n_txt = f"{number(k)}/{number(n)}" if finite(k) and finite(n) else (number(n) if finite(n) else "")
    return [esc(label), number(entry.get("value"), kind),
            interval(entry.get("wilson"), kind) if "wilson" in entry else "",
            interval(entry.get("bootstrap"), kind) if "bootstrap" in entry else "", n_txt]


def key_label(key: str) -> str:
    if "|" in key:
        return " ∪ ".join(KEY_LABELS.get(k, humanize(k)).split(" (")[0] for k in key.split("|"))
    if "~" in key:
        return " ~ ".join(KEY_LABELS.get(k, humanize(k)).split(" (")[0] for k in key.split("~"))
    return KEY_LABELS.get(key, humanize(key))


def _is_entry(v) -> bool:
    return v is None or finite(v) or (isinstance(v, dict) and "value" in v)


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
        if isinstance(e, dict) and finite(e.get("value")):
            parts.append(f"<strong>{pct(e['value'])}</strong> {esc(words)} (Wilson 95% {interval(e.get('wilson'))}, "
                         f"request bootstrap {interval(e.get('bootstrap'))})")
        else:
            parts.append(f"{esc(key)} is not available")
    rec = s.get("recall")
    if isinstance(rec, dict) and finite(rec.get("value")):
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


def horizon(census: Census) -> str:
    """Tokens of future that `available` asks for (census --horizon; two unless the summary says otherwise)."""
    config = census.summary.get("config")
    h = config.get("horizon") if isinstance(config, dict) else None
    h = int(h) if finite(h) else 2
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
        if finite(rv):
            keys.append(KEY_LABELS.get(key, humanize(key)).split(" (")[0])
            r_vals.append(100 * rv)
            o_vals.append(100 * ov if finite(ov) else None)
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
    cap = int(cap) if finite(cap) and cap > 0 else 16
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
    req_path = result.folder / TRACES / "requests.parquet"
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


def notes_section(census: Census) -> str:
    """The census's own notes, its settings, and the positions columns it lacks."""
    notes = census.summary.get("notes")
    notes = notes if isinstance(notes, list) else [notes] if notes else []
    config = census.summary.get("config") if isinstance(census.summary.get("config"), dict) else {}
    items = "".join(f"<li>{esc(n)}</li>" for n in notes)
    cfg = ", ".join(f"{esc(k)} = {esc(v)}" for k, v in config.items())
    members = census.summary.get("store_set") if isinstance(census.summary.get("store_set"), dict) else None
    store_set = (f'<p class="note">Trace store: a store set of {esc(members.get("members"))} stores read as one stream '
                 f'(fingerprint {esc(census.summary.get("store_fingerprint"))}; docs/store.md "Store sets").</p>'
                 if members else "")
    return section("notes", "Notes and settings", store_set,
                   f"<ul>{items}</ul>" if items else "",
                   f'<p class="note">Census settings: {cfg}.</p>' if cfg else "",
                   f'<p class="note">Positions columns not present: {esc(", ".join(census.missing_columns))}.'
                   "</p>" if census.missing_columns and census.positions is not None else "")
