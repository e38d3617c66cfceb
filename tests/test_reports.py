"""HTML gap reports: content against hand-built census and decoder outputs, escaping, the CLI, a browser.

The fixtures are written here (positions.parquet, summary.json in the census schema, decoder arms),
so these tests do not depend on the census or decoder code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from data.stats import wilson
from decoder.verdict import RULE, verdict
from reports.benchmark_page import audit_cell, result_page
from reports.case_viewer import (
    CATEGORIES,
    TokenText,
    categories,
    load_token_text,
    pick_cases,
)
from reports.census_sections import recall_curve
from reports.decision import DECISION_CSS, DECISION_TEXT
from reports.links import page_name
from reports.render import render_site, write_site
from reports.results import find_results, sole_source_share, sole_source_shares

SHARED = Path(os.environ.get("OILBIRD_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260k"
REPO = Path(__file__).resolve().parents[1]

NASTY = {  # token id -> text a tokenizer could return
    100: "<script>alert('x')</script>",
    101: '"quoted" & \'single\'',
    102: b"\xff\xfe\xc3",  # bytes that are not valid UTF-8
    103: "<img src=https://evil.example/x.png onerror=alert(1)>",
    104: "&amp; &lt;b&gt;",
    105: "\x00\x1b[31m",
    106: "</span></div><b>bold?</b>",
}


# ---------------------------------------------------------------- fixtures

def positions_frame(targets: dict[int, list[int]] | None = None) -> pl.DataFrame:
    """Five requests with known categories (see the comments); targets default to NASTY ids in turn."""
    rows = []

    def add(r, t, avail, prod, sem=False, cos=0.9, longest=16, novel=False):
        rows.append(dict(request=r, position=t, available=avail, producible=prod, gap=avail and not prod,
                         oracle_suffix_len=16 if prod else 0, longest_match_len=longest, sem_hit=sem,
                         sem_best_cos=cos, emb_hit=False, adj_hit=prod, novel_prev=novel))

    for t in range(25):  # request 0: all producible (gap rate 0)
        add(0, t, True, True, sem=True)
    for t in range(10):  # request 1: 10 producible, 10 gap (5 recovered), 10 not available (gap rate 1/3)
        add(1, t, True, True)
    for t, cos in zip(range(10, 15), (0.95, 0.85, 0.81, 0.79, 0.5)):
        add(1, t, True, False, sem=True, cos=cos, longest=1, novel=t == 10)
    for t in range(15, 20):
        add(1, t, True, False, sem=False, cos=0.6, longest=0, novel=t == 15)
    for t in range(20, 30):
        add(1, t, False, False, cos=None, longest=2)
    for t in range(25):  # request 2: 20 producible, 3 gap (none recovered), 2 not available (gap rate 0.12)
        add(2, t, t < 23, t < 20, longest=16 if t < 20 else 1, novel=t == 20)
    for t, (avail, prod) in enumerate(((True, False), (True, False), (True, True))):  # request 3: short
        add(3, t, avail, prod, longest=0)
    for t in range(25):  # request 4: nothing available (gap rate 0, but nothing to say about the gap)
        add(4, t, False, False, cos=None, longest=0)
    df = pl.DataFrame(rows, schema_overrides={"sem_best_cos": pl.Float64, "request": pl.Int32, "position": pl.Int32})
    if targets is None:
        ids = list(NASTY)
        target = [ids[k % len(ids)] for k in range(df.height)]
    else:
        target = [targets[r][t % len(targets[r])] for r, t in zip(df["request"], df["position"])]
    return df.with_columns(pl.Series("target", target, dtype=pl.Int32))


def proportion(num: np.ndarray, den: np.ndarray) -> dict:
    k, n = int((num & den).sum()), int(den.sum())
    lo, hi = wilson(k, n)
    return {"value": k / n, "wilson": [lo, hi], "bootstrap": [max(0, lo - 0.01), min(1, hi + 0.01)], "k": k, "n": n}


def census_summary(df: pl.DataFrame, **drop) -> dict:
    col = lambda c: df[c].fill_null(False).to_numpy().astype(bool)  # noqa: E731
    every = np.ones(df.height, bool)
    avail, prod, gap, sem = col("available"), col("producible"), col("gap"), col("sem_hit")
    summary = {
        "bench": "toy", "model": "toy-model", "layer": 4, "pool": "past", "positions": df.height, "requests": 5,
        "available": proportion(avail, every), "producible": proportion(prod, every), "gap": proportion(gap, every),
        "recall": proportion(sem, gap),
        "mechanism": {
            "median_context_at_success": {"value": 16.0, "bootstrap": [16.0, 16.0], "n": int(prod.sum())},
            "gap_rate_after_novel": proportion(gap, col("novel_prev")),
            "after_producible_relative": {"value": 0.25, "bootstrap": [0.2, 0.3]},
            "recall_static_embedding": None,
            "future_metric": {"value": 0.123, "wilson": [0.1, 0.15], "bootstrap": [0.09, 0.16], "k": 1, "n": 8},
        },
        "coverage": {
            "universe": int(avail.sum()),
            "reaches": {"exact_suffix": proportion(prod, avail), "adjacency": proportion(col("adj_hit"), avail),
                        "static_embedding": None, "semantic": proportion(sem, avail)},
            "only_it": {"exact_suffix": proportion(prod & ~sem, avail), "adjacency": proportion(avail & False, avail),
                        "static_embedding": None, "semantic": proportion(sem & ~prod, avail)},
            "unions": {"exact_suffix|adjacency": proportion(prod, avail)},
            "lift": {"exact_suffix~semantic": {"value": 1.01, "bootstrap": [0.99, 1.03]}},
        },
        "config": {"pool": "past", "max_suffix": 16},
        "notes": ["static-embedding key not computed (test)"],
    }
    for key in drop:
        summary.pop(key, None)
    return summary


def write_arm(folder: Path, arm: str, speedup: float, labels: list[str], summary_extra: dict | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    accepted: dict[str, int] = {}
    for lab in labels:
        for src in lab.split("|"):
            accepted[src] = accepted.get(src, 0) + 1
    half = len(labels) // 2
    pq.write_table(pa.table({"request": pa.array([0, 1], pa.int32()), "pass": pa.array([0, 0], pa.int32()),
                             "sources": pa.array([labels[:half], labels[half:]], pa.list_(pa.string()))}),
                   folder / "cycles.parquet")
    summary = {"arm": arm, "bench": "toy", "model": "toy-model", "requests": 4, "tau": 1 + speedup, "speedup": speedup,
               "tokens_per_s": 10 * speedup, "overhead_fraction": 0.02, "mean_nodes": 60,
               "lossless": {"matched": 4, "requests": 4}, "accepted_by_source": accepted, **(summary_extra or {})}
    (folder / "summary.json").write_text(json.dumps(summary))


SEMANTIC_LABELS = ["semantic", "sam|semantic", "semantic", "adjacency", "sam", "sam", "semantic", "adjacency|sam",
                   "sam", "sam"]  # 3 of 10 accepted tokens from the semantic source alone


def modern_oilbird(runs: Path) -> None:
    """The live oilbird arm as today's decoder writes it (`kind`, both shares): make_runs' older one gives only the
    share over draft tokens, on which the verdict cannot decide (and `python -m reports` exits 2)."""
    write_arm(runs / "toy" / "toy-model" / "decode" / "oilbird", "oilbird", 2.5, SEMANTIC_LABELS, {
        "kind": "live", "sole_source_share": {"value": 0.25, "interval": [0.2, 0.3], "sole": 3, "tokens": 12},
        "sole_source_share_of_draft": {"value": 0.3, "interval": [0.25, 0.35], "sole": 3, "accepted": 10}})


def make_runs(root: Path, *, model: str | None = None, decode: bool = True, df: pl.DataFrame | None = None,
              summary: dict | None = None, positions: bool = True) -> Path:
    runs = root / "runs"
    folder = runs / "toy" / "toy-model"
    (folder / "census").mkdir(parents=True)
    df = positions_frame() if df is None else df
    if positions:
        df.write_parquet(folder / "census" / "positions.parquet")
    (folder / "census" / "summary.json").write_text(json.dumps(summary or census_summary(df)))
    if model:
        (folder / "traces").mkdir()
        (folder / "traces" / "meta.json").write_text(json.dumps({"model": model}))
    if decode:
        write_arm(folder / "decode" / "ar", "ar", 1.0, [])
        write_arm(folder / "decode" / "lexical", "lexical", 2.0, ["sam"] * 6 + ["adjacency"] * 4)
        write_arm(folder / "decode" / "oilbird", "oilbird", 2.5, SEMANTIC_LABELS)
    return runs


def nasty_text() -> TokenText:
    return TokenText(texts=lambda ids: [NASTY.get(i, f"t{i}") for i in ids],
                     pieces=lambda ids: [NASTY.get(i, f"p{i}") for i in ids])


def render_one(runs: Path, token_text: TokenText | None = None) -> str:
    (result,) = find_results(runs)
    return result_page(result, token_text=token_text or nasty_text())


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text outside tags."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.style = ""
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.style += data
        self.text.append(data)


def parse(html_text: str) -> Tags:
    p = Tags()
    p.feed(html_text)
    p.close()
    return p


HTML_TAGS = {"html", "head", "meta", "title", "style", "body", "nav", "a", "main", "h1", "h2", "h3", "p", "section",
             "strong", "em", "code", "table", "thead", "tbody", "tr", "th", "td", "span", "ul", "li", "figure",
             "figcaption", "div", "details", "summary"}  # details: collapsed counters, no script
SVG_TAGS = {"svg", "g", "path", "defs", "clippath", "use", "text", "style", "title", "rect", "polyline", "line",
            "circle", "tspan", "lineargradient", "stop", "image"}
URL_ATTRS = {"src", "href", "xlink:href", "action", "formaction", "srcset", "poster", "data", "background", "ping"}


def assert_offline(html_text: str) -> Tags:
    """No script, no unexpected tag, every URL-bearing attribute local, no http(s) outside text."""
    tags = parse(html_text)
    names = {t for t, _ in tags.tags}
    assert "script" not in names and "iframe" not in names and "img" not in names and "link" not in names
    assert names <= HTML_TAGS | SVG_TAGS, names - HTML_TAGS - SVG_TAGS
    assert not any(t == "image" for t, _ in tags.tags)  # no SVG raster (could point anywhere)
    for tag, attrs in tags.tags:
        for k, v in attrs.items():
            assert not k.startswith("on"), (tag, k)
            if k in URL_ATTRS:
                assert v.startswith("#") or re.fullmatch(r"[\w.-]+\.html", v), (tag, k, v)
            if k == "style":
                assert "url(" not in v or re.fullmatch(r".*url\(#[\w.-]+\).*", v), v
    assert "@import" not in tags.style and "url(" not in tags.style
    # the document without its text and tooltips (where model text may mention a URL, harmlessly)
    skeleton = " ".join(f"<{t} " + " ".join(f"{k}={v}" for k, v in a.items() if k not in ("title", "aria-label"))
                        for t, a in tags.tags) + tags.style
    assert not re.search(r"(https?|ftp|wss?):|//[a-z0-9]", skeleton), "a URL outside the text"
    assert len(html_text.encode()) < 5_000_000
    return tags


# ---------------------------------------------------------------- content

@pytest.fixture(scope="module")
def toy_page(tmp_path_factory) -> str:
    """The page of the default fixture (census + three arms, nasty token text), rendered once."""
    return render_one(make_runs(tmp_path_factory.mktemp("toy")))


def test_census_page_states_the_numbers(toy_page):
    df = positions_frame()
    page = toy_page
    assert_offline(page)
    text = re.sub(r"\s+", " ", "".join(parse(page).text))
    s = census_summary(df)
    # headline: positions, requests, model, layer, pool, and the four proportions with both intervals
    for key in ("available", "producible", "gap", "recall"):
        v, (lo, hi), (blo, bhi) = s[key]["value"], s[key]["wilson"], s[key]["bootstrap"]
        fmt = lambda x: f"{100 * x:.2f}" if 100 * x < 10 else f"{100 * x:.1f}"  # noqa: E731
        assert f"{fmt(v)}%" in text and f"{fmt(lo)}–{fmt(hi)}%" in text and f"{fmt(blo)}–{fmt(bhi)}%" in text, key
    assert f"Over {df.height} generated positions in 5 requests of toy, served by toy-model (states from layer 4; " \
           "pool strictly past" in text
    # mechanism with documented labels, unknown keys generically, null entries as not computed
    assert "Median where the oracle succeeds" in text and "After a token in no past trace" in text
    assert "future metric" in text and "12.3%" in text and "not computed" in text
    # coverage per key, the chart, unions and lift
    assert "token adjacency (Token Recycling)" in text and "exact suffix ∪ token adjacency" in text
    assert "1.01×" in text
    assert page.count("<svg") >= 6  # coverage, cliff, novel, threshold, arms, sources
    ids = [a["id"] for _, a in parse(page).tags if "id" in a]
    assert len(ids) == len(set(ids))  # several inline charts, no clashing ids
    # the cliff caption: medians of longest_match_len over producible and gap positions
    assert "Median at oracle successes 16 tokens; at gap positions 1." in text
    # gap rate by the previous token: after novel 3 gap / 3 novel positions; after seen: 15 gap of 115
    novel = df["novel_prev"].to_numpy()
    gap = df["gap"].to_numpy()
    k_seen, n_seen = int((gap & ~novel).sum()), int((~novel).sum())
    assert f"{k_seen:,}/{n_seen:,}" in text and f"{int((gap & novel).sum())}/{int(novel.sum())}" in text
    # the decoder: tau and speedup per arm, per-source tokens, the sole-source share and the verdict. The fixture's
    # live oilbird (an older summary) gives only the share over accepted draft tokens: the verdict cannot decide
    # rather than read that larger share in place of the rule's (issue 35)
    assert "2.50×" in text and "30.0%" in text and "3 of 10" in text
    assert decision_of(page)[0] == "cannot" and f"Verdict: {DECISION_TEXT['cannot decide']}." in text
    assert "lacks sole_source_share over all committed tokens" in text
    assert "python -m decoder replay --bench toy --model toy-model" in text


def test_threshold_recall_matches_brute_force():
    df = positions_frame()
    thresholds = np.array([0.0, 0.5, 0.79, 0.8, 0.81, 0.85, 0.9, 0.96, 1.0])
    curve, n_gap = recall_curve(df, thresholds)
    rows = df.filter(pl.col("gap")).to_dicts()
    assert n_gap == len(rows) == 15
    for t, got in zip(thresholds, curve):
        want = sum(1 for r in rows if r["sem_hit"] and r["sem_best_cos"] is not None and r["sem_best_cos"] >= t)
        assert got == pytest.approx(100 * want / len(rows)), t
    # recall at the default 0.8 is 3 of 15 gap positions (cos 0.95, 0.85, 0.81)
    assert curve[3] == pytest.approx(20.0)


def test_threshold_table_marks_the_default(toy_page):
    text = "".join(parse(toy_page).text)
    assert "0.8 (default)20.0%" in text


def test_case_categories_and_picks():
    df = positions_frame()
    cats = categories(df)
    r1 = cats[df["request"].to_numpy() == 1]
    assert "".join(r1) == "p" * 10 + "r" * 5 + "g" * 5 + "u" * 10
    picks = pick_cases(df)
    # request 3 has the highest gap rate but only 3 tokens, request 4 no available position: not picked
    assert [(label, r) for label, r, _, _ in picks] == [("highest gap rate", 1), ("median gap rate", 2),
                                                         ("lowest gap rate", 0)]
    assert picks[0][2] == pytest.approx(1 / 3)


def test_case_viewer_spans_carry_category_and_tooltip(toy_page):
    tags = parse(toy_page)
    spans = [a for t, a in tags.tags
             if t == "span" and a.get("class") in CATEGORIES and "position" in a.get("title", "")]
    assert len(spans) == 30 + 25 + 25  # three requests shown whole
    recovered = [a["title"] for a in spans if a["class"] == "r"]
    assert len(recovered) == 5
    assert "longest match 1" in recovered[0] and "best cos 0.950" in recovered[0]
    legend = [a for t, a in tags.tags if t == "span" and "swatch" in a.get("class", "")]
    assert len(legend) == 4


def test_model_text_is_escaped(toy_page):
    page = toy_page
    tags = assert_offline(page)
    assert not any(t in ("script", "img", "b") for t, _ in tags.tags)
    text = "".join(tags.text)
    for s in ("<script>alert('x')</script>", '"quoted" & \'single\'', "<img src=https://evil.example/x.png",
              "&amp; &lt;b&gt;", "</span></div><b>bold?</b>"):
        assert s in text, s
    assert "\ufffd\ufffd\ufffd" in text  # the invalid bytes, replaced
    assert "\\x00\\x1b[31m" in text and "\x00" not in page  # control characters spelled out
    titles = [a["title"] for t, a in tags.tags if t == "span" and "title" in a]
    assert any("<script>" in t for t in titles)  # the raw piece in the tooltip, as attribute text


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260k not found at {STORIES}")
def test_tokenizer_text_from_meta(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    ids = tok.encode("Lily said \"hi\" & ü <b>", add_special_tokens=False)
    assert any(p.startswith("<0x") for p in tok.convert_ids_to_tokens(ids))  # ü is two byte tokens
    df = positions_frame(targets={r: ids + [9999] for r in range(5)})  # 9999: outside the 512-token vocabulary
    runs = make_runs(tmp_path, model=str(STORIES), df=df, decode=False)
    (result,) = find_results(runs)
    page = result_page(result)  # loads the tokenizer named by traces/meta.json
    tags = assert_offline(page)
    cases = "".join(tags.text)
    assert "Lily said \"hi\" & \ufffd\ufffd <b>⟨9999⟩" in cases and "token ids are shown" not in cases
    assert any("'<0xC3>'" in a.get("title", "") for _, a in tags.tags)
    assert not any(t == "b" for t, _ in tags.tags)
    # an unloadable tokenizer falls back to ids, and says so
    fallback = load_token_text(str(tmp_path / "no-such-model"))
    assert fallback.note and "could not be loaded" in fallback.note
    assert fallback.display([5, 7])[0] == ["⟨5⟩", "⟨7⟩"]


def test_missing_blocks_say_not_available(tmp_path):
    df = positions_frame()
    runs = make_runs(tmp_path, df=df, summary=census_summary(df, mechanism=1, coverage=1, recall=1),
                     positions=False, decode=False)
    page = render_one(runs)
    assert_offline(page)
    text = "".join(parse(page).text)
    assert "not available: the census summary has no mechanism block" in text
    assert "not available: the census summary has no coverage block" in text
    assert text.count("positions.parquet is missing") == 4  # cliff, novel, threshold, cases
    assert "recall of the semantic key is not available" in text
    assert "not available: no decoder results" in text


def test_positions_without_optional_columns(tmp_path):
    full = positions_frame()
    df = full.drop("sem_best_cos", "novel_prev")
    page = render_one(make_runs(tmp_path, df=df, summary=census_summary(full), decode=False))
    tags = parse(page)
    text = "".join(tags.text)
    assert "lacks the column(s) novel_prev" in text and "lacks the column(s) sem_best_cos" in text
    assert "The cliff" in text
    titles = [a.get("title", "") for t, a in tags.tags if t == "span" and "position" in a.get("title", "")]
    assert titles and all("best cos n/a" in t for t in titles)  # the viewer stands without cosines


def test_odd_summary_values_render_as_not_available(tmp_path):
    odd = {"positions": "many", "requests": None, "layer": [1], "pool": 5, "gap": 0.3,
           "available": {"value": "x", "wilson": "no"}, "recall": {"value": 0.5, "wilson": [0.1], "bootstrap": None},
           "mechanism": {"a": [1, 2], "b": {"c": {"value": 1}}, "median_context_at_success": "str"},
           "coverage": {"reaches": {"semantic": 0.5, "x": "y"}, "only_it": [1], "unions": 3, "lift": {"a~b": None}},
           "config": [1], "notes": "a note"}
    runs = make_runs(tmp_path, df=positions_frame().head(0), summary=odd)
    arm = runs / "toy" / "toy-model" / "decode" / "oilbird"
    (arm / "summary.json").write_text(json.dumps({"tau": "fast", "speedup": None, "lossless": "yes",
                                                  "accepted_by_source": {"semantic": "many", "sam": 3}}))
    pages = render_site(find_results(runs), token_text=nasty_text())
    text = "".join(parse(pages["toy__toy-model.html"]).text)
    assert "positions.parquet has no rows" in text and "a note" in text and "n/a" in text
    assert "50.0%" in text  # the one well-formed proportion still shows
    for page in pages.values():
        assert_offline(page)


def test_sole_source_share_and_decision_class(tmp_path):
    runs = make_runs(tmp_path)
    arm = runs / "toy" / "toy-model" / "decode" / "oilbird"
    got = sole_source_shares(json.loads((arm / "summary.json").read_text()), arm / "cycles.parquet")
    # the fixture's cycles.parquet has no `committed` column: only the share of accepted draft tokens, which the
    # verdict never reads in place of the committed one (issue 35)
    assert sole_source_share(json.loads((arm / "summary.json").read_text()), arm / "cycles.parquet") is None
    assert got["draft"] == {"share": 0.3, "interval": None, "sole": 3, "total": 10, "basis": "draft",
                            "definition": None, "from": "cycles.parquet"}
    # the decoder's own figure wins when summary.json carries it; an old one (no `tokens`) is the draft share
    old = sole_source_shares({"sole_source_share": {"value": 0.05, "sole": 5, "accepted": 100}},
                             arm / "cycles.parquet")["draft"]
    assert old["share"] == 0.05 and old["basis"] == "draft" and old["total"] == 100
    # an arm without the semantic source has no share
    lex = runs / "toy" / "toy-model" / "decode" / "lexical"
    assert sole_source_share(json.loads((lex / "summary.json").read_text()), lex / "cycles.parquet") is None
    # one rule (decoder.verdict), one callout class per decision, on the share's interval (here +-0.5 points):
    # without a paired gain interval a share alone never enables
    def callout(share, gain=None):
        return DECISION_CSS[verdict(share, [share - 0.005, share + 0.005], gain).decision]

    assert callout(0.12) == "neutral" and callout(0.05) == "neutral"
    assert callout(0.12, [1.01, 1.1]) == "enable" and callout(0.095, [1.01, 1.1]) == "enable"
    assert callout(0.09, [1.01, 1.1]) == "neutral"  # its interval straddles the 9% line
    assert callout(0.01) == "off" and callout(0.12, [0.9, 0.99]) == "off"
    write_arm(arm, "oilbird", 1.8, SEMANTIC_LABELS,
              {"sole_source_share": {"value": 0.021, "interval": [0.015, 0.027], "sole": 21, "tokens": 1000}})
    text = "".join(parse(render_one(runs)).text)
    assert "2.10%" in text and DECISION_TEXT["leave off"] in text
    assert "oilbird 1.80× over ar, against 2.00× for the best other arm (lexical)" in text


def test_pages_are_deterministic(tmp_path):
    runs = make_runs(tmp_path)
    a = render_site(find_results(runs), token_text=nasty_text())
    b = render_site(find_results(runs), token_text=nasty_text())
    assert a == b and set(a) == {"toy__toy-model.html", "grid.html", "index.html"}


# ---------------------------------------------------------------- replay and the decision

EXACT_REASON = "token recycling's top-8 at rejected nodes is not in the store; the adjacency table skips them"


def replay_summary(arm: str, tau: float, share: float | None = None, gain: list | None = None,
                   speedup: float | None = 2.0, **extra) -> dict:
    """A replay summary.json as `python -m decoder replay` writes it (docs/replay.md)."""
    tokens = 67324
    s = {"kind": "replay", "arm": arm, "bench": "toy", "model": "toy-model", "model_fingerprint": "abc",
         "pool": "past", "nodes": 60, "requests": 534, "generated_tokens": tokens, "passes": round(tokens / tau),
         "exact": arm in ("suffix", "oilbird-no-semantic-exact"), "exact_reason": None,
         "tau": {"value": tau, "interval": [round(tau - 0.3, 2), round(tau + 0.3, 2)]},
         "accepted_by_source": {"spine": 100}, "sole_source_share": None, "sole_source_share_of_draft": None,
         "nodes_per_pass": {"mean": 41.2, "p50": 44, "max": 60},
         "draft_s_per_pass": {"mean": 0.0004, "p50": 0.0003, "p99": 0.002}, "paired_gain": None, "seconds": 40.1,
         "estimate": None if speedup is None else {
             "profile": "runs/profiles/toy-model-cpu.json", "device": "cpu", "device_name": "Test CPU 9000",
             "speedup": speedup, "speedup_interval": [speedup - 0.2, speedup + 0.2], "draft_fraction": 0.01}}
    if not s["exact"]:
        s["exact_reason"] = EXACT_REASON
    if share is not None:
        sole = round(share * tokens)
        s["sole_source_share"] = {"value": share, "interval": [share - 0.01, share + 0.01], "sole": sole,
                                  "tokens": tokens, "definition": "accepted tokens only the semantic source "
                                  "proposed / all committed tokens (bonus tokens included)"}
        s["sole_source_share_of_draft"] = {"value": 2 * share, "interval": [2 * share - 0.02, 2 * share + 0.02],
                                           "sole": sole, "accepted": tokens // 2, "definition": "... / accepted "
                                           "draft tokens"}
    if gain is not None:
        s["paired_gain"] = {"versus": "oilbird-no-semantic", "tau_ratio": sum(gain) / 2, "interval": gain,
                            "speedup_ratio": 1.02, "speedup_interval": [1.0, 1.04]}
    s.update(extra)
    return s


def write_replay(folder: Path, summaries: list[dict], pool: str = "replay", nodes: int | None = None) -> Path:
    """replay/<arm>/summary.json (or replay/<arm>/nodes-<N>/summary.json) for each summary."""
    for s in summaries:
        d = folder / pool / s["arm"].replace("/", "_") / (f"nodes-{nodes}" if nodes else "")
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.json").write_text(json.dumps(s))
    return folder


def replay_arms(share: float, gain: list, on_speed: float = 2.1, off_speed: float = 2.0, nodes: int = 60) -> list:
    return [replay_summary("suffix", 4.6, speedup=1.5, nodes=nodes),
            replay_summary("lexical", 5.2, speedup=1.8, nodes=nodes),
            replay_summary("oilbird-no-semantic", 5.4, speedup=off_speed, nodes=nodes),
            replay_summary("oilbird", 5.61, share=share, gain=gain, speedup=on_speed, nodes=nodes)]


def decision_of(page: str) -> tuple[str, str]:
    """(css class of the decision callout, the decision section's text)."""
    m = re.search(r'<section id="decision">(.*?)</section>', page, re.S)
    assert m, "no decision section"
    block = m.group(1)
    cls = re.search(r'<div class="callout (\w+)">', block)
    return (cls.group(1) if cls else ""), re.sub(r"\s+", " ", "".join(parse(block).text))


def test_decision_block_enable(tmp_path):
    runs = make_runs(tmp_path)  # census + live arms ar, lexical, oilbird
    write_replay(runs / "toy" / "toy-model", replay_arms(0.12, [1.02, 1.08]))
    page = render_one(runs)
    assert_offline(page)
    # near the top: after the headline, before the census details and the live decoder
    assert page.index('class="headline"') < page.index('id="decision"') < page.index('id="mechanism"')
    assert page.index('id="decision"') < page.index('id="decoder"')
    cls, text = decision_of(page)
    assert cls == "enable"
    assert "Decision: enable the semantic source?" in text and f"Verdict: {DECISION_TEXT['enable']}." in text
    assert "strictly-past pool, 60 candidate nodes, 534 requests), in the form the Oilbird harness verifies: a token tree" in text
    # the fastest configuration the harness can run (trees and chains alike): oilbird at 2.10x
    assert "Fastest configuration the Oilbird harness can run" not in text  # no estimate_by_batch in these summaries
    assert f"Rule (decoder/verdict.py): {RULE}" in text  # the rule, with its numbers
    assert ("sole-source share 12.0% (95% interval 11.0–13.0%): its interval lies entirely at or above the 9% line"
            in text)
    # both definitions of the share, named, with intervals and counts
    assert "12.0% [11.0–13.0%] (8,079 of 67,324) of all committed tokens (bonus tokens included" in text
    assert "24.0% [22.0–26.0%] (8,079 of 33,662) of accepted draft tokens" in text
    # the paired gain and the estimate with the profile it came from
    assert "tau ×1.050 [1.020–1.080]" in text and "estimated speedup ×1.020 [1.000–1.040]" in text
    assert "runs/profiles/toy-model-cpu.json (Test CPU 9000 · cpu)" in text
    assert "oilbird 2.10× [1.90×–2.30×], oilbird-no-semantic 2.00× [1.80×–2.20×] over plain greedy" in text
    # the arms table: tau with intervals, estimated speedup, exact with its reason, shares; live beside it
    assert "5.61 [5.31–5.91]" in text and "4.60 [4.30–4.90]" in text
    assert f"[1] not exact: {EXACT_REASON}" in text
    assert "live speedup (measured)" in text and "live results are the ground truth" in text
    assert "ar (live only)" in text and "2.50×" in text
    titles = [a.get("title") for t, a in parse(page).tags if t == "span"]
    assert EXACT_REASON in titles
    assert "replay tau, 95% interval" in page  # the chart's legend
    # oilbird against the best lexical arm, and how far below the 1.25x line (5.61 / 5.2 = 1.079)
    assert "oilbird tau 5.61 vs lexical 5.20, 1.079×, short of the 1.25× line by 13.7%" in text
    # the live decoder section points up to the decision instead of deciding again
    assert "The verdict (enable, read from the replay) is at the top of the page" in "".join(parse(page).text)


def _by_batch(s1: float, s8: float) -> dict:
    return {"1": {"speedup": s1, "speedup_interval": [s1 - 0.1, s1 + 0.1]},
            "8": {"speedup": s8, "speedup_interval": [s8 - 0.1, s8 + 0.1]}}


def test_decision_in_the_form_vllm_runs(tmp_path):
    """A replay priced on vLLM decides between the chains, names the engine's form, the fastest configuration at
    each batch size (an arm sized for batch 8 competes at 8 only) and the calibration of the node probabilities."""
    runs = make_runs(tmp_path, decode=False)
    vllm = {"engine": "vllm", "profile": "runs/profiles/toy-model-cpu-vllm.json"}
    cal = {"spine": {"labels": 900, "ece": 0.021, "bins": [[900, 450.0, 430.0]] + [[0, 0, 0]] * 9},
           "node": {"labels": 1000, "ece": 0.034, "bins": [[1000, 520.0, 486.0]] + [[0, 0, 0]] * 9}}

    def arm(name, tau, s1, s8, **kw):
        s = replay_summary(name, tau, speedup=s1, estimate_by_batch=_by_batch(s1, s8), **kw)
        s["estimate"].update(vllm)
        return s

    on = arm("oilbird-chain", 5.3, 2.6, 1.4, share=0.05, gain=[1.01, 1.03],
             drafter_stats={"calibration": cal}, mean_nodes=6.5, accepted_per_node=0.62)
    on["paired_gain"]["versus"] = "oilbird-no-semantic-chain"
    write_replay(runs / "toy" / "toy-model", [
        arm("suffix-arctic", 5.2, 2.5, 1.5), arm("pld", 4.1, 2.0, 1.3), on,
        arm("oilbird-no-semantic-chain", 5.2, 2.55, 1.45),
        arm("oilbird-chain@batch=8", 5.0, 2.4, 1.6), arm("oilbird", 8.6, 3.0, 1.0)])
    cls, text = decision_of(render_one(runs))
    assert "in the form vLLM verifies: one chain per request" in text
    assert "Paired gain of oilbird-chain over oilbird-no-semantic-chain" in text
    # trees (oilbird, 3.0x) are not what vLLM runs; at batch 8 the batch-8-sized chain (1.6x) beats suffix (1.5x)
    assert ("Fastest configuration vLLM can run (estimated speedup over plain greedy at the same batch size, 95% "
            "interval): batch 1: oilbird-chain 2.60× [2.50×–2.70×]; batch 8: oilbird-chain@batch=8 1.60× "
            "[1.50×–1.70×].") in text
    assert "Calibration of oilbird-chain's node probabilities" in text
    # cells run together in the page's text: source, labelled nodes, mean predicted, mean observed, ECE
    assert "spine9000.5000.4780.021" in text and "the node (sources combined)1,0000.5200.4860.034" in text
    assert "oilbird-chain60 / 6.500.620" in text  # candidate budget, nodes verified per pass, accepted tokens per node


def test_decision_block_leave_off(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_replay(runs / "toy" / "toy-model", replay_arms(0.021, [0.97, 1.01], on_speed=1.9, off_speed=2.0))
    page = render_one(runs)
    assert_offline(page)
    cls, text = decision_of(page)
    assert cls == "off" and f"Verdict: {DECISION_TEXT['leave off']}." in text
    # off by the speed condition; the share's interval crosses the off line, and the reasons say so
    assert "the share's interval straddles the 3% line: sole-source share 2.10% (95% interval 1.10–3.10%)" in text
    assert "speedup 1.90× with the semantic source against 2.00× without: more than 2% slower" in text
    assert "tau ×0.990 [0.970–1.010]" in text
    assert "live speedup" not in text  # no decode/: no live columns
    pages = render_site(find_results(runs), token_text=nasty_text())
    index = "".join(parse(pages["index.html"]).text)
    assert "leave off (replay)" in index and "5.61 [5.31–5.91]" in index and "2.10%" in index
    assert "leave off (replay)" in "".join(parse(pages["grid.html"]).text)


def test_decision_neutral_without_paired_gain_or_profile(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    arms = replay_arms(0.12, None, on_speed=None, off_speed=None)
    arms[-1]["paired_gain_note"] = "replay oilbird-no-semantic in the same command for the paired gain"
    arms[-1]["estimate_note"] = "no profile at runs/profiles/x.json: no estimated speedup"
    write_replay(runs / "toy" / "toy-model", arms)
    cls, text = decision_of(render_one(runs))
    assert cls == "neutral" and "kept from enable: no paired tau gain interval" in text
    assert "no paired gain of oilbird over oilbird-no-semantic in the replay (replay oilbird-no-semantic" in text
    assert "not available: oilbird: no profile at runs/profiles/x.json: no estimated speedup" in text
    assert "no profile" in text.split("est. speedup")[-1]  # the arms table says it per arm


def test_no_replay_note(tmp_path):
    page = render_one(make_runs(tmp_path, decode=False))
    _, text = decision_of(page)
    assert ("not available: no replay or decoder results under toy/toy-model/ (run `python -m decoder replay "
            "--bench toy --model toy-model`") in text


def test_replay_only_result_renders(tmp_path):
    folder = tmp_path / "runs" / "toy" / "toy-model"
    write_replay(folder, replay_arms(0.12, [1.02, 1.08]))
    (result,) = find_results(tmp_path / "runs")
    assert result.census is None and result.arms == [] and [a.name for a in result.replay] == [
        "lexical", "oilbird", "oilbird-no-semantic", "suffix"]
    assert result.replay[1].sole_source["basis"] == "committed" and result.replay[1].nodes == 60
    pages = render_site([result], token_text=nasty_text())
    for page in pages.values():
        assert_offline(page)
    page = pages["toy__toy-model.html"]
    cls, text = decision_of(page)
    assert cls == "enable" and "live speedup" not in text and "(live only)" not in text
    full = "".join(parse(page).text)
    assert "no census under toy/toy-model/" in full and "the decision above reads the replay" in full
    index = "".join(parse(pages["index.html"]).text)
    assert "enable (replay)" in index and "tau oilbird (replay)" in index


def test_replay_node_budgets_warm_pool_and_temporary_folders(tmp_path):
    folder = make_runs(tmp_path, decode=False) / "toy" / "toy-model"
    write_replay(folder, replay_arms(0.02, [0.9, 0.95], nodes=16), nodes=16)
    write_replay(folder, replay_arms(0.12, [1.02, 1.08], nodes=60), nodes=60)
    write_replay(folder, replay_arms(0.05, [1.0, 1.1], nodes=128), nodes=128)
    warm = replay_arms(0.15, [1.05, 1.2])
    for s in warm:
        s["pool"] = "warm"
    write_replay(folder, warm, pool="replay-warm")
    for tmp in (folder / "replay" / ".oilbird.tmp-1", folder / "replay" / "oilbird" / ".nodes-60.old-2"):
        tmp.mkdir(parents=True)
        (tmp / "summary.json").write_text("not json at all")  # a folder being written: ignored
    (result,) = find_results(folder.parent.parent)
    assert sorted(result.replay_nodes) == [16, 60, 128] and len(result.replay_nodes[60]) == 4
    assert {a.nodes for a in result.replay} == {60} and [a.pool for a in result.replay_warm] == ["warm"] * 4
    cls, text = decision_of(render_one(folder.parent.parent))
    assert cls == "enable" and "60 nodes" in text  # nodes 60, not the largest
    assert "tau at 16 nodes" in text and "tau at 60 nodes (decision)" in text and "tau at 128 nodes" in text
    assert "Warm pool" in text and "×1.125 [1.050–1.200]" in text
    assert "the decision reads the strictly-past pool" in text
    # without nodes 60 the decision reads the largest budget
    shutil.rmtree(folder / "replay")
    write_replay(folder, replay_arms(0.02, [0.9, 0.95], nodes=16), nodes=16)
    write_replay(folder, replay_arms(0.05, [1.0, 1.1], nodes=32), nodes=32)
    cls, text = decision_of(render_one(folder.parent.parent))
    assert cls == "neutral" and "32 nodes" in text and "tau at 32 nodes (decision)" in text


def test_corrupt_replay_summary_names_the_file(tmp_path):
    from data.errors import OilbirdError

    folder = tmp_path / "runs" / "toy" / "toy-model"
    write_replay(folder, replay_arms(0.12, [1.02, 1.08]))
    bad = folder / "replay" / "oilbird" / "summary.json"
    bad.write_text("[1, 2, 3]")
    with pytest.raises(OilbirdError, match=re.escape(f"{bad} is not a JSON object")):
        find_results(tmp_path / "runs")
    bad.unlink()
    nodes = folder / "replay" / "oilbird" / "nodes-60"
    nodes.mkdir()
    (nodes / "summary.json").write_text("{not json")
    with pytest.raises(OilbirdError, match=re.escape(f"cannot read {nodes / 'summary.json'}")):
        find_results(tmp_path / "runs")
    shutil.rmtree(nodes)
    warm = write_replay(folder, [replay_summary("suffix", 4.0)], pool="replay-warm") / "replay-warm" / "suffix"
    (warm / "summary.json").write_text('"a string"')
    with pytest.raises(OilbirdError, match="replay-warm/suffix/summary.json is not a JSON object"):
        find_results(tmp_path / "runs")


def test_replay_text_is_escaped(tmp_path):
    folder = tmp_path / "runs" / "toy" / "toy-model"
    evil = "<script>alert(1)</script>"
    arms = replay_arms(0.12, [1.02, 1.08])
    arms[0]["arm"] = evil  # an arm name from the file
    arms[1]["exact_reason"] = '<img src=x onerror=alert(1)> "quoted" & more'
    arms[3]["estimate"]["profile"] = "runs/<b>profile</b>.json"
    arms[3]["estimate"]["device_name"] = "<i>GPU</i>"
    arms[1]["nodes"] = "<u>60</u>"  # on an arm the verdict does not read: it still decides
    write_replay(folder, arms)
    odd = '<b onmouseover="x">odd folder'
    (folder / "replay" / odd).mkdir()  # a folder name from the file system
    (folder / "replay" / odd / "summary.json").write_text(json.dumps({"tau": {"value": 3.0}}))
    pages = render_site(find_results(tmp_path / "runs"), token_text=nasty_text())
    for page in pages.values():
        tags = assert_offline(page)
        assert not any(t in ("script", "img", "b", "i", "u") for t, _ in tags.tags)
    text = "".join(parse(pages["toy__toy-model.html"]).text)
    for s in (evil, odd, '<img src=x onerror=alert(1)> "quoted" & more', "runs/<b>profile</b>.json",
              "<i>GPU</i>"):
        assert s in text, s


def test_missing_replay_keys_render_as_not_available(tmp_path):
    folder = tmp_path / "runs" / "toy" / "toy-model"
    write_replay(folder, [{"arm": "oilbird"}, {"arm": "oilbird-no-semantic", "tau": "fast", "estimate": "x",
                                               "sole_source_share": {"value": None}, "paired_gain": [1]}])
    (folder / "replay" / "suffix").mkdir()
    (folder / "replay" / "suffix" / "summary.json").write_text(json.dumps({"tau": {"value": 4.0, "interval": "no"},
                                                                            "estimate": {"speedup": None}}))
    pages = render_site(find_results(tmp_path / "runs"), token_text=nasty_text())
    for page in pages.values():
        assert_offline(page)
    cls, text = decision_of(pages["toy__toy-model.html"])
    # the verdict's arm lacks its share and its twin's values are invalid: it cannot decide, and never guesses
    assert cls == "cannot" and f"cannot decide: {folder / 'replay' / 'oilbird' / 'summary.json'} lacks tau" in text
    assert "oilbird-no-semantic/summary.json has tau = \"fast\" not an object {value, interval}" in text
    assert "n/a" in text and "4.00" in text


def test_live_summary_with_both_share_definitions(tmp_path):
    runs = make_runs(tmp_path)
    arm = runs / "toy" / "toy-model" / "decode" / "oilbird"
    write_arm(arm, "oilbird", 2.5, SEMANTIC_LABELS, {
        "kind": "live", "tau_interval": [3.2, 3.8],
        "sole_source_share": {"value": 0.1, "interval": [0.08, 0.12], "sole": 30, "tokens": 300},
        "sole_source_share_of_draft": {"value": 0.3, "interval": [0.25, 0.35], "sole": 30, "accepted": 100}})
    (result,) = find_results(runs)
    oil = next(a for a in result.arms if a.name == "oilbird")
    assert oil.sole_source["basis"] == "committed" and oil.shares["draft"]["share"] == 0.3
    cls, text = decision_of(result_page(result, token_text=nasty_text()))
    assert cls == "neutral"  # a live run alone has no paired gain interval
    assert "10.0% [8.00–12.0%] (30 of 300) of all committed tokens" in text
    assert "30.0% [25.0–35.0%] (30 of 100) of accepted draft tokens" in text
    assert "older decoder run" not in text
    # with a replay beside it, the live tau (and its interval) shows in the same table
    write_replay(runs / "toy" / "toy-model", replay_arms(0.12, [1.02, 1.08]))
    cls, text = decision_of(render_one(runs))
    assert cls == "enable" and "3.50 [3.20–3.80]" in text


# ---------------------------------------------------------------- sweeps (python -m census sweep-index / -budget)

def index_sweep(**override) -> dict:
    """sweeps/index.json as `python -m census sweep-index` writes it."""
    rows = [
        {"spec": "exact", "bytes_per_state": 2304.0, "gap_recall": 0.4, "gap_recall_ratio": 1.0, "sem_hit_rate": 0.3,
         "knn_recall": 1.0, "warmup_share": 0.0, "seconds": 1.5},
        {"spec": "sq8", "bytes_per_state": 576.0, "gap_recall": 0.39, "gap_recall_ratio": 0.975,
         "sem_hit_rate": 0.29, "knn_recall": 0.95, "warmup_share": 0.1, "seconds": 2.0},
        {"spec": "pq64", "bytes_per_state": 64.0, "gap_recall": 0.385, "gap_recall_ratio": 0.9625,
         "sem_hit_rate": 0.28, "knn_recall": 0.8, "warmup_share": 0.2, "seconds": 3.25},
        {"spec": "ivf256,pq32,nprobe=16", "bytes_per_state": 32.0, "gap_recall": 0.3, "gap_recall_ratio": 0.75,
         "sem_hit_rate": 0.2, "knn_recall": None, "warmup_share": 0.3, "seconds": 4.0},
    ]
    return {"bench": "toy", "model": "toy-model", "positions": 143, "gap_positions": 15, "rows": rows, **override}


def budget_sweep(**override) -> dict:
    """sweeps/budget.json as `python -m census sweep-budget` writes it (rows in any order)."""
    rows = [
        {"budget": "all", "budget_tokens": None, "availability": 0.8, "producible": 0.6, "gap": 0.2,
         "gap_recall": 0.4, "sem_hit_rate": 0.3, "mean_pool_tokens": 50000.0},
        {"budget": "10k", "budget_tokens": 10000, "availability": 0.6, "producible": 0.45, "gap": 0.15,
         "gap_recall": 0.3, "sem_hit_rate": 0.25, "mean_pool_tokens": 8000.0},
        {"budget": "100k", "budget_tokens": 100000, "availability": 0.78, "producible": 0.58, "gap": 0.2,
         "gap_recall": 0.39, "sem_hit_rate": 0.31, "mean_pool_tokens": 45000.5},
    ]
    return {"bench": "toy", "model": "toy-model", "rows": rows, **override}


def write_sweeps(runs: Path, index: dict | str | None = None, budget: dict | str | None = None) -> Path:
    folder = runs / "toy" / "toy-model" / "sweeps"
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("index.json", index), ("budget.json", budget)):
        if content is not None:
            (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


class Cells(HTMLParser):
    """The rows of every table: the text of each cell, per row (header rows included)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def sweep_block(page: str, sid: str) -> str | None:
    m = re.search(rf'<section id="{sid}">(.*?)</section>', page, re.S)
    return m.group(1) if m else None


def table_rows(block: str) -> dict[str, list[str]]:
    """{first cell: the row's cells} of the table(s) in `block`."""
    p = Cells()
    p.feed(block)
    return {row[0]: row for row in p.rows if row}


def block_text(block: str) -> str:
    return re.sub(r"\s+", " ", "".join(parse(re.sub(r"<svg.*?</svg>", "", block, flags=re.S)).text))


def test_sweep_sections_state_the_numbers(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_sweeps(runs, index_sweep(), budget_sweep())
    page = render_one(runs)
    assert_offline(page)
    ids = [a["id"] for _, a in parse(page).tags if "id" in a]
    assert len(ids) == len(set(ids))  # the two new charts clash with no other
    # after the census's threshold sweep, before the case viewer
    assert page.index('id="threshold"') < page.index('id="sweep-index"') < page.index('id="sweep-budget"') \
        < page.index('id="cases"')

    block = sweep_block(page, "sweep-index")
    assert 'aria-label="semantic gap recall against bytes per state"' in block
    rows = table_rows(block)
    assert rows["spec"][:4] == ["spec", "bytes/state", "gap recall", "vs exact"]
    assert rows["exact"] == ["exact", "2,304", "40.0%", "1.000×", "30.0%", "100.0%", "0.00%", "1.50", "–"]
    assert rows["sq8"] == ["sq8", "576", "39.0%", "0.975×", "29.0%", "95.0%", "10.0%", "2", "no"]
    assert rows["pq64"] == ["pq64", "64", "38.5%", "0.963×", "28.0%", "80.0%", "20.0%", "3.25", "yes"]
    assert rows["ivf256,pq32,nprobe=16"] == ["ivf256,pq32,nprobe=16", "32", "30.0%", "0.750×", "20.0%", "n/a",
                                             "30.0%", "4", "no"]
    assert list(rows)[1:] == ["exact", "sq8", "pq64", "ivf256,pq32,nprobe=16"]  # exact first, then by size
    text = block_text(block)
    assert "143 positions, 15 gap positions" in text
    assert ("The smallest spec within 128 B/state that keeps 95% of exact's gap recall: pq64, 64 B/state, gap recall "
            "38.5% (0.963× exact's 40.0%).") in text
    svg = re.search(r"<svg.*?</svg>", block, re.S).group(0)
    for label in ("exact", "sq8", "pq64", "ivf256,pq32,nprobe=16", "target: 128 B/state",
                  "95% of exact's recall (38.0%)", "128", "2,048"):
        assert f">{label}</text>" in svg, label  # a labelled point per spec, both lines, plain ticks
    assert "mathdefault" not in svg  # tick labels as plain numbers

    block = sweep_block(page, "sweep-budget")
    assert "What the pool&#x27;s size buys" in block and 'aria-label="what the pool&#x27;s size buys' in block
    rows = table_rows(block)
    assert list(rows)[1:] == ["10k", "100k", "all"]  # by budget, the unbounded pool last
    assert rows["10k"] == ["10k", "10,000", "8,000", "60.0%", "45.0%", "15.0%", "30.0%", "25.0%"]
    assert rows["100k"] == ["100k", "100,000", "45,000.5", "78.0%", "58.0%", "20.0%", "39.0%", "31.0%"]
    assert rows["all"] == ["all", "unbounded", "50,000", "80.0%", "60.0%", "20.0%", "40.0%", "30.0%"]
    text = block_text(block)
    assert ("Unbounded pool: availability 80.0%, gap 20.0%, semantic gap recall 40.0%. The smallest budget keeping "
            "95% of that recall: 100k.") in text
    svg = re.search(r"<svg.*?</svg>", block, re.S).group(0)
    for label in ("10k", "100k", "all", "availability", "gap", "semantic gap recall"):
        assert f">{label}</text>" in svg, label  # the budgets as ticks ('all' at the right end), three lines
    assert "not available" not in text and "n/a" not in text

    # the index and pages across results are unchanged by the sweeps; other pools' pages do not repeat them
    pages = render_site(find_results(runs), token_text=nasty_text())
    for p in pages.values():
        assert_offline(p)
    assert "sweep-index" in pages["toy__toy-model.html"] and "sweep-index" not in pages["index.html"]


def section_ids(page: str) -> list[str]:
    """The ids of the page's sections, in order."""
    return [a["id"] for t, a in parse(page).tags if t == "section" and "id" in a]


def test_sweep_sections_absent_without_their_files(tmp_path, toy_page):
    def silent(page):
        return ('id="sweep-' not in page and "Index compression" not in page and "bytes per state" not in page
                and "size buys" not in page and "sweeps/" not in page)

    assert silent(toy_page)
    runs = make_runs(tmp_path, decode=False)
    base = section_ids(render_one(runs))
    assert "threshold" in base and not {"sweep-index", "sweep-budget"} & set(base)
    (runs / "toy" / "toy-model" / "sweeps").mkdir()  # an empty sweeps/ folder says nothing either
    page = render_one(runs)
    assert silent(page) and section_ids(page) == base
    at = base.index("threshold") + 1  # the sweeps follow the threshold sweep
    write_sweeps(runs, budget=budget_sweep())  # one file: only its section
    page = render_one(runs)
    assert 'id="sweep-budget"' in page and 'id="sweep-index"' not in page
    assert section_ids(page) == base[:at] + ["sweep-budget"] + base[at:]
    write_sweeps(runs, index=index_sweep())  # the control: both files, both sections
    assert section_ids(render_one(runs)) == base[:at] + ["sweep-index", "sweep-budget"] + base[at:]


def test_sweep_text_is_escaped(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    evil = ["<script>alert(1)</script>", '<img src=x onerror=alert(1)> "q" & more', "</code></td><b>pq8</b>"]
    index = index_sweep()
    for row, spec in zip(index["rows"][1:], evil):
        row["spec"] = spec
    budget = budget_sweep()
    budget["rows"][1]["budget"] = "<i>10k</i>"
    write_sweeps(runs, index, budget)
    page = render_one(runs)
    tags = assert_offline(page)
    assert not any(t in ("script", "img", "b", "i") for t, _ in tags.tags)
    text = "".join(tags.text)
    for s in evil + ["<i>10k</i>"]:
        assert s in text, s
    rows = table_rows(sweep_block(page, "sweep-index"))
    assert rows[evil[0]][1:3] == ["576", "39.0%"] and rows[evil[2]][1] == "32"
    assert table_rows(sweep_block(page, "sweep-budget"))["<i>10k</i>"][1] == "10,000"
    svg = re.search(r"<svg.*?</svg>", sweep_block(page, "sweep-index"), re.S).group(0)
    assert ">&lt;script&gt;alert(1)&lt;/script&gt;</text>" in svg  # the chart's label, escaped too


def test_corrupt_or_odd_sweeps_give_a_note(tmp_path):
    from reports.__main__ import main

    runs = make_runs(tmp_path, decode=False)
    write_sweeps(runs, index="{not json", budget="[1, 2]")
    page = render_one(runs)
    assert_offline(page)
    text = block_text(sweep_block(page, "sweep-index"))
    assert text.startswith("Index compression") and "Traceback" not in page
    assert ("not available: sweeps/index.json could not be read (not valid JSON (Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1))); rerun `python -m census sweep-index`") in text
    assert "<svg" not in sweep_block(page, "sweep-index") and "<table" not in sweep_block(page, "sweep-index")
    text = block_text(sweep_block(page, "sweep-budget"))
    assert "not available: sweeps/budget.json could not be read (not a JSON object); rerun `python -m census " \
           "sweep-budget`" in text
    # the command line renders the page all the same
    out = tmp_path / "html"
    assert main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 0
    assert "sweeps/index.json could not be read" in (out / "toy__toy-model.html").read_text()

    # no rows, rows not a list, unreadable bytes: one line each
    for content, why in (('{"rows": []}', "holds no usable rows"), ('{"rows": {"a": 1}}', "has no list of rows"),
                         (b"\xff\xfe{", "could not be read (not valid JSON (")):
        path = runs / "toy" / "toy-model" / "sweeps" / "index.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert why in block_text(sweep_block(render_one(runs), "sweep-index")), why

    # NaN, Infinity and out-of-range numbers read as n/a with a note; the rest still shows
    index = index_sweep()
    index["rows"][1]["gap_recall"] = float("nan")  # json.dumps writes NaN
    index["rows"][2]["bytes_per_state"] = float("inf")
    index["rows"][3]["knn_recall"] = 1.7
    index["rows"].append({"bytes_per_state": 8.0})  # no spec: left out
    index["rows"].append("a string row")
    budget = budget_sweep()
    budget["rows"][1]["budget_tokens"] = float("nan")  # a bounded budget of unknown size: table only
    budget["rows"][2]["availability"] = -0.5
    write_sweeps(runs, json.dumps(index), json.dumps(budget))
    assert "NaN" in (runs / "toy" / "toy-model" / "sweeps" / "index.json").read_text()
    page = render_one(runs)
    assert_offline(page)
    block = sweep_block(page, "sweep-index")
    rows = table_rows(block)
    assert rows["sq8"][1:4] == ["576", "n/a", "0.975×"] and rows["pq64"][1:3] == ["n/a", "38.5%"]
    assert rows["ivf256,pq32,nprobe=16"][5] == "n/a"
    text = block_text(block)
    assert "3 value(s) in sweeps/index.json were missing or not finite numbers in range" in text
    assert "2 row(s) without a spec name were left out" in text
    assert "2 row(s) lack a number the chart needs and are in the table only" in text
    svg = re.search(r"<svg.*?</svg>", block, re.S).group(0)
    assert ">exact</text>" in svg and ">ivf256,pq32,nprobe=16</text>" in svg
    assert ">sq8</text>" not in svg and ">pq64</text>" not in svg  # no recall / no size: not placed
    block = sweep_block(page, "sweep-budget")
    rows = table_rows(block)
    assert list(rows)[1:] == ["100k", "10k", "all"]  # the budget of unknown size sorts after the known ones
    assert rows["10k"][1] == "n/a" and rows["100k"][3] == "n/a" and rows["all"][1] == "unbounded"
    text = block_text(block)
    assert "2 value(s) in sweeps/budget.json were missing or not finite numbers in range" in text
    assert "1 row(s) lack a number the chart needs and are in the table only" in text
    assert "<svg" in block


def test_sweeps_alone_make_a_result(tmp_path):
    runs = tmp_path / "runs"
    write_sweeps(runs, index_sweep() | {"rows": index_sweep()["rows"][:1]},
                 budget_sweep() | {"rows": budget_sweep()["rows"][:1]})
    (result,) = find_results(runs)
    assert result.census is None and not result.has_decoder and set(result.sweeps) == {"index", "budget"}
    pages = render_site([result], token_text=nasty_text())
    for page in pages.values():
        assert_offline(page)
    page = pages["toy__toy-model.html"]
    text = block_text(sweep_block(page, "sweep-index"))
    assert "Only exact was swept (gap recall 40.0%): no compressed spec to hold to it." in text
    assert table_rows(sweep_block(page, "sweep-budget"))["all"][1] == "unbounded"
    assert "<svg" in sweep_block(page, "sweep-budget")  # one point, at the right end, labelled all
    assert "no census under toy/toy-model/" in "".join(parse(page).text)


# ---------------------------------------------------------------- the command line

def test_cli_writes_site_and_fails_cleanly(tmp_path, capsys):
    from reports.__main__ import main

    out = tmp_path / "html"
    (tmp_path / "empty").mkdir()
    assert main(["--runs", str(tmp_path / "empty"), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no census or decoder results") and "\n" not in err
    assert not out.exists()
    assert main(["--runs", str(tmp_path / "missing"), "--out", str(out), "--quiet"]) == 2
    assert "no results folder" in capsys.readouterr().err and not out.exists()

    runs = make_runs(tmp_path)  # no traces/meta.json: token ids, no tokenizer
    modern_oilbird(runs)
    assert main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["grid.html", "index.html", "toy__toy-model.html"]
    assert (out / "index.html").stat().st_mode & 0o777 == 0o644
    index = (out / "index.html").read_text()
    assert_offline(index)
    assert 'href="toy__toy-model.html"' in index and 'href="grid.html"' in index
    grid = (out / "grid.html").read_text()
    assert_offline(grid)
    assert "toy" in "".join(parse(grid).text)
    page = (out / "toy__toy-model.html").read_text()
    assert "token ids are shown" in page and "⟨100⟩" in page

    # a corrupt summary: one line, nothing rewritten
    (runs / "toy" / "toy-model" / "census" / "summary.json").write_text("{not json")
    before = (out / "index.html").stat().st_mtime_ns
    assert main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot read") and "summary.json" in err and "\n" not in err
    assert (out / "index.html").stat().st_mtime_ns == before


def test_other_pool_modes_get_their_own_page(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    warm = runs / "toy" / "toy-model" / "census-warm"
    shutil.copytree(runs / "toy" / "toy-model" / "census", warm)
    s = json.loads((warm / "summary.json").read_text())
    s["pool"] = "warm"
    (warm / "summary.json").write_text(json.dumps(s))
    (result,) = find_results(runs)
    assert [c.pool for c in result.censuses] == ["past", "warm"]
    pages = render_site([result], token_text=nasty_text())
    assert page_name(result, result.censuses[1]) in pages
    assert "pool warm" in pages["toy__toy-model__census-warm.html"]


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    from reports.__main__ import main

    runs = make_runs(tmp_path)
    target = tmp_path / "taken"
    target.write_text("a file")
    assert main(["--runs", str(runs), "--out", str(target), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "is a file" in err and "\n" not in err
    assert target.read_text() == "a file"


def test_links_to_odd_file_names_are_url_encoded(tmp_path):
    from reports.__main__ import main

    runs = make_runs(tmp_path)
    modern_oilbird(runs)
    odd = runs / "a#b?c.jsonl"
    (runs / "toy").rename(odd)
    out = tmp_path / "html"
    assert main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 0
    page = "a#b?c.jsonl__toy-model.html"
    assert (out / page).exists()
    index = (out / "index.html").read_text()
    assert 'href="a%23b%3Fc.jsonl__toy-model.html"' in index and f'href="{page}"' not in index


# ---------------------------------------------------------------- a real browser

def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def browse(chromium: str, page: Path, shot: Path, tmp: Path) -> tuple[list[str], list[str]]:
    """Screenshot `page`; return its console lines and the network requests the page itself made."""
    netlog = tmp / f"{page.stem}.netlog.json"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0",
           f"--log-net-log={netlog}", f"--screenshot={shot}", "--window-size=1280,2000", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert shot.exists(), proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    text = netlog.read_text()
    try:
        log = json.loads(text)
    except json.JSONDecodeError:  # a netlog left unterminated at exit: close the event list
        log = json.loads(text.rstrip().rstrip(",") + "]}")
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    # The browser's own background fetches (updater, sign-in) have no page site; the page's carry file://.
    requests = [e["params"].get("url", "") for e in log["events"] if e["type"] == start_job
                and "file://" in str(e.get("params", {}).get("network_isolation_key", ""))]
    return console, requests


DEPTH_SOURCES = ("spine", "branch", "adjacency", "semantic", "rollout", "pool", "root")  # every source oilbird names


def browser_site(root: Path) -> Path:
    """The pages the browser tests open, written to root/site: the default census and live arms, and a replay of
    four arms whose oilbird and oilbird-no-semantic record acceptance per depth (32 depths, as the replay writes
    them) for every source, so the evidence page has its widest table (11 columns)."""
    runs = make_runs(root)
    arms = replay_arms(0.12, [1.02, 1.08])
    for arm, passes, sources in ((arms[2], 10, DEPTH_SOURCES[:3]), (arms[3], 8, DEPTH_SOURCES)):
        arm["by_depth"] = {"depths": 32, "passes": passes, "reach": [round(1 - d / 33, 6) for d in range(1, 33)],
                           "by_source": {src: [max(0, 7 - d // 5) for d in range(32)] for src in sources},
                           "sole_semantic": [max(0, 3 - d // 8) for d in range(32)]}
    write_replay(runs / "toy" / "toy-model", arms)
    out = root / "site"
    write_site(out, render_site(find_results(runs), token_text=nasty_text()))
    return out


# Laid out in the page, this writes into the title what the page measures: the document's width, the window's, and
# each table wider than the box it sits in (its right columns hidden, or past the page: cut off either way), by the
# id of its section and its width against the box's.
MEASURE = ("<script>(function(){var e=document.documentElement,cut=[];"
           "document.querySelectorAll('table').forEach(function(t){var b=t.parentElement,"
           "w=Math.round(t.getBoundingClientRect().width);if(w>b.clientWidth){var s=t.closest('section');"
           "cut.push((s?s.id:'?')+' '+w+'>'+b.clientWidth)}});"
           "document.title=JSON.stringify({page:e.scrollWidth,client:e.clientWidth,window:window.innerWidth,"
           "cut:cut})})()</script>")


def layout(chromium: str, page: Path, tmp: Path, width: int = 1300) -> dict:
    """`page` laid out by headless Chromium in a `width`-pixel window: {page, client, window, cut} (see MEASURE).
    The page forbids scripts (its Content-Security-Policy), so a copy without that one tag runs MEASURE."""
    text = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page.read_text(), count=1)
    probe = page.with_name(f"layout-{page.name}")
    probe.write_text(text.replace("</body>", MEASURE + "</body>", 1))
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'profile'}", f"--window-size={width},900", "--dump-dom", probe.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    m = re.search(r"<title>(\{.*?\})</title>", proc.stdout, re.S)
    assert m, proc.stderr[-2000:]
    return json.loads(unescape(m.group(1)))


def test_browser_renders_offline_without_errors(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH or at /usr/bin/chromium (.ci/run installs Debian's chromium)")
    site = browser_site(tmp_path)
    page = site / "toy__toy-model.html"
    assert_offline(page.read_text())
    shot = REPO / "reports" / "html" / "screenshot-test.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.unlink(missing_ok=True)
    console, requests = browse(chromium, page, shot, tmp_path)
    assert console == [] and requests == []
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    console, requests = browse(chromium, site / EVIDENCE, tmp_path / "evidence.png", tmp_path)
    assert console == [] and requests == []
    # the same check sees a page that breaks both rules (the control: the detectors work)
    bad = site / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><img src="http://127.0.0.1:9/x.png">'
                   "<script>undefinedFunction()</script></body></html>")
    console, requests = browse(chromium, bad, tmp_path / "bad.png", tmp_path)
    assert any("Uncaught" in line for line in console) and requests == ["http://127.0.0.1:9/x.png"]


def test_browser_tables_fit_a_1300_pixel_window(tmp_path):
    """Issue 37: the evidence page's per-depth table was wider than the page, its right columns cut off in a
    1300-pixel window. Every table fits there now, and no page scrolls sideways."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH or at /usr/bin/chromium (.ci/run installs Debian's chromium)")
    site = browser_site(tmp_path)
    assert len(table_rows(sweep_block((site / EVIDENCE).read_text(), "depth"))) == 1 + 10  # header, DEPTH_ROWS
    lay = layout(chromium, site / EVIDENCE, tmp_path)
    assert lay["window"] == 1300, lay  # the window is the size asked for
    assert lay["page"] <= lay["client"], lay  # the page does not scroll sideways
    assert lay["cut"] == [], lay  # and no table hides columns in its box
    for name in ("toy__toy-model.html", "index.html", "grid.html"):  # the grid may scroll in its box, not the page
        lay = layout(chromium, site / name, tmp_path)
        assert lay["page"] <= lay["client"], (name, lay)
    # the control: the same measurement sees a page wider than the window, and a table cut off in its box
    wide = site / "wide.html"
    wide.write_text('<!DOCTYPE html><html><head><title>x</title></head><body><div style="width:1600px">x</div>'
                    '<section id="s"><div class="table-scroll" style="overflow-x:auto;width:300px"><table><tr>'
                    '<td style="white-space:nowrap">' + "x " * 200 + "</td></tr></table></div></section></body></html>")
    lay = layout(chromium, wide, tmp_path)
    assert lay["page"] > lay["client"] and len(lay["cut"]) == 1 and lay["cut"][0].startswith("s "), lay


SCREENSHOT = REPO / "benchmarks" / "screenshot_report.py"


def screenshot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCREENSHOT), *args], capture_output=True, text=True, timeout=300)


def test_screenshot_of_the_decision_block(tmp_path):
    """benchmarks/screenshot_report.py (the README's picture): a PNG of the decision block only, under 300 KB."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH or at /usr/bin/chromium (.ci/run installs Debian's chromium)")
    image = pytest.importorskip("PIL.Image")
    site = browser_site(tmp_path)
    out = tmp_path / "img" / "decision.png"
    proc = screenshot("--page", str(site / "toy__toy-model.html"), "--out", str(out), "--width", "1200",
                      "--chromium", chromium)
    assert proc.returncode == 0, proc.stderr
    assert 10_000 < out.stat().st_size <= 300_000
    with image.open(out) as png:
        # the block's width (main: 1240 px at most, here the 1200-pixel window less 2 × 1.5rem of padding) and 16
        # px each side; the whole block down
        assert png.size[0] == 1200 - 48 + 2 * 16 and png.size[1] > 600, png.size
        assert png.convert("RGB").getpixel((5, 5)) == (255, 255, 255)  # the page's margin, not the nav bar


def test_screenshot_errors_are_one_line(tmp_path):
    page = tmp_path / "toy__toy-model.html"
    page.write_text('<html><body><section id="decision"><h2>Decision</h2></section></body></html>')
    for args, says in [(["--page", str(tmp_path / "none.html")], "no page at "),
                       (["--page", str(page), "--chromium", str(tmp_path / "no-chromium")], "no such program"),
                       (["--page", str(tmp_path), "--width", "x"], "invalid int value"),
                       (["--page", str(page), "--width", "10"], "give 400 to 4000 pixels")]:
        proc = screenshot(*args, "--out", str(tmp_path / "x.png"))
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------- ablations (python -m decoder ablations)

def abl_row(label: str, arm: str, tau: float, iv: list | None, vs: float | None, vs_iv: list | None,
            **extra) -> dict:
    return {"label": label, "arm": arm, "tau": tau, "tau_interval": iv, "vs_merged": vs, "vs_merged_interval": vs_iv,
            "sole_source_share": None, "exact": False, "speedup": 2.0, **extra}


def ablations_json(**override) -> dict:
    return {"bench": "toy", "model": "toy-model", "pool": "past", "nodes": 60, "requests": 12, "seconds": 3.5,
            "merged": abl_row("merged (oilbird)", "oilbird", 8.5, [8.0, 9.0], None, None),
            "ablations": [abl_row("lexical only", "oilbird-no-semantic", 7.25, [7.0, 7.5], 0.925, [0.9, 0.95]),
                          abl_row("k=8", "oilbird@k=8:x", 8.0, None, 0.94, None),
                          abl_row("one source per step (SAM-Decoding's rule)", "oilbird-one-source", 7.9,
                                  [7.5, 8.3], 0.93, [0.91, 0.95],
                                  sole_source_share={"value": 0.04, "interval": [0.03, 0.05], "sole": 40,
                                                     "tokens": 1000})],
            "ladder": [{"drafter": "pld", "rungs": [abl_row("pld", "pld", 4.36, [4.16, 4.57], 0.5, [0.49, 0.52]),
                                                    abl_row("pld+pool", "pld+pool", 5.63, [5.37, 5.88], 0.65, None),
                                                    abl_row("pld+key", "pld+key", 5.76, [5.46, 6.05], 0.67, None)]}],
            "missing": ["ring buffer <off>"], **override}


def headline_json(best_ratio: float, best_iv: list | None, target_met: bool | None = None, **override) -> dict:
    """ablations.json with the newer `headline`, `best_lexical` and `target_met` (oilbird 8.5 against five
    baselines; lexical is the best lexical arm, oilbird / lexical = best_ratio [best_iv])."""
    taus = {"suffix": 5.0, "sam": 6.0, "lexical": 8.5 / best_ratio, "recycling": 3.0, "pld": 4.0}
    rows = []
    for arm, tau in taus.items():
        ratio, iv = (best_ratio, best_iv) if arm == "lexical" else (8.5 / tau, [8.5 / tau - 0.2, 8.5 / tau + 0.2])
        rows.append(abl_row(f"baseline {arm}", arm, tau, [tau - 0.25, tau + 0.25], 1 / ratio, None,
                            oilbird_over_arm=ratio, oilbird_over_arm_interval=iv, exact=arm != "lexical"))
    extra = {"headline": rows, "best_lexical": {"arm": "lexical", "tau": taus["lexical"], "oilbird_over_arm": best_ratio,
                                                "oilbird_over_arm_interval": best_iv}}
    if target_met is not None:
        extra["target_met"] = target_met
    return ablations_json(**extra, **override)


def write_ablations(runs: Path, content: dict | str) -> None:
    folder = runs / "toy" / "toy-model" / "ablations"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ablations.json").write_text(content if isinstance(content, str) else json.dumps(content))


EVIDENCE = "toy__toy-model__evidence.html"


def site(runs: Path) -> dict[str, str]:
    """Every page of `runs`, each checked to be offline and free of duplicate element ids."""
    pages = render_site(find_results(runs), token_text=nasty_text())
    for name, page in pages.items():
        tags = assert_offline(page)
        ids = [a["id"] for _, a in tags.tags if "id" in a]
        assert len(ids) == len(set(ids)), name
    return pages


def test_ablations_section_states_the_numbers(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_sweeps(runs, budget=budget_sweep())
    write_ablations(runs, ablations_json())
    pages = site(runs)
    # the section lives on the evidence page; the main report links to it instead of repeating it
    main = pages["toy__toy-model.html"]
    assert 'id="ablations"' not in main and f'href="{EVIDENCE}"' in main
    page = pages[EVIDENCE]
    assert page.index('id="comparison"') < page.index('id="ablations"') < page.index('id="replay"')
    block = sweep_block(page, "ablations")
    assert "Ablations and the transplant ladder (replay, pool past)" in page
    rows = table_rows(block)
    assert rows["label"] == ["label", "arm", "tau [interval]", "vs merged [interval]", "est. speedup",
                             "sole-source share", "exact"]
    assert rows["merged (oilbird)"] == ["merged (oilbird)", "oilbird", "8.50 [8.00–9.00]", "n/a", "2.00×", "–", "no"]
    assert rows["lexical only"] == ["lexical only", "oilbird-no-semantic", "7.25 [7.00–7.50]",
                                    "0.93× [0.90×–0.95×]", "2.00×", "–", "no"]
    assert rows["k=8"] == ["k=8", "oilbird@k=8:x", "8.00", "0.94×", "2.00×", "–", "no"]
    # the one-source arm (SAM-Decoding's rule) is an ordinary row, its sole-source share with interval and counts
    assert rows["one source per step (SAM-Decoding's rule)"][1:] == [
        "oilbird-one-source", "7.90 [7.50–8.30]", "0.93× [0.91×–0.95×]", "2.00×", "4.00% [3.00–5.00%] (40 of 1,000)",
        "no"]
    assert rows["drafter"] == ["drafter", "base", "+pool", "+key"]  # the rungs the ablations hold (an older file: 3)
    assert rows["pld"] == ["pld", "4.36 [4.16–4.57]", "5.63 [5.37–5.88]", "5.76 [5.46–6.05]"]
    text = block_text(block)
    assert "Not measured" in text and "ring buffer <off>" in text
    svg = re.search(r"<svg.*?</svg>", block, re.S).group(0)
    for label in ("oilbird", "oilbird-no-semantic", "oilbird@k=8:x", "oilbird-one-source", "pld", "pld+pool",
                  "pld+key"):
        assert f">{label}</text>" in svg, label
    # merged first, then the ablations, then the rungs
    assert svg.index(">oilbird</text>") < svg.index(">oilbird-no-semantic</text>") < svg.index(">pld+key</text>")
    assert "n/a" not in text.replace("n/a", "", 1)  # only the merged arm's vs merged
    # an older file (no headline) and no replay: the comparison says where its numbers would come from
    comp = block_text(sweep_block(page, "comparison"))
    assert "not available: no replay of oilbird or of a baseline arm" in comp
    assert "make ablations BENCH=toy MODEL=toy-model" in comp


def test_ablations_absent_without_file(tmp_path, toy_page):
    assert 'id="ablations"' not in toy_page and "transplant ladder" not in toy_page and "evidence" not in toy_page
    runs = make_runs(tmp_path, decode=False)
    (runs / "toy" / "toy-model" / "ablations").mkdir(parents=True)
    pages = site(runs)
    assert set(pages) == {"toy__toy-model.html", "grid.html", "index.html"}  # no replay, no file: no page
    main = pages["toy__toy-model.html"]
    assert "evidence" not in main and 'id="ablations"' not in main
    # the control: the file alone makes the evidence page, with its ablations section, linked from every page
    write_ablations(runs, ablations_json())
    pages = site(runs)
    assert set(pages) == {"toy__toy-model.html", EVIDENCE, "grid.html", "index.html"}
    assert "ablations" in section_ids(pages[EVIDENCE]) and "ablations" not in section_ids(pages["toy__toy-model.html"])
    for name in ("toy__toy-model.html", "index.html", "grid.html"):
        assert f'href="{EVIDENCE}"' in pages[name], name


def test_ablation_text_is_escaped(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    abl = headline_json(1.1, [1.05, 1.15], missing=["<b>bold</b>"])
    abl["ablations"][0]["arm"] = "<script>alert(1)</script>"
    abl["ablations"][1]["label"] = '<img src=x onerror=alert(1)> "q" & more'
    abl["headline"][0]["label"] = "<i>suffix</i> & co"
    abl["best_lexical"]["arm"] = "<u>lexical</u>"
    write_ablations(runs, abl)
    page = site(runs)[EVIDENCE]
    tags = assert_offline(page)
    assert not any(t in ("script", "img", "b", "i", "u") for t, _ in tags.tags)
    text = "".join(tags.text)
    for s in ("<script>alert(1)</script>", '<img src=x onerror=alert(1)> "q" & more', "<b>bold</b>",
              "<i>suffix</i> & co", "<u>lexical</u>"):
        assert s in text, s
    svg = re.search(r"<svg.*?</svg>", sweep_block(page, "ablations"), re.S).group(0)
    assert ">&lt;script&gt;alert(1)&lt;/script&gt;</text>" in svg


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"merged": 3, "ablations": "x"}'])
def test_corrupt_ablations_give_a_note(tmp_path, content):
    runs = make_runs(tmp_path, decode=False)
    write_ablations(runs, content)
    page = site(runs)[EVIDENCE]  # an ablations.json, even unreadable, makes the evidence page
    block = sweep_block(page, "ablations")
    text = block_text(block)
    assert "not available: ablations/ablations.json" in text and "python -m decoder ablations" in text
    assert text.count("not available") == 1  # one line
    assert "Traceback" not in page and "<svg" not in block and "<table" not in block


# ---------------------------------------------------------------- the evidence page

def evidence(runs: Path) -> tuple[str, str, dict[str, list[str]]]:
    """(the evidence page, the comparison section's text, its table rows)."""
    page = site(runs)[EVIDENCE]
    block = sweep_block(page, "comparison")
    assert block is not None
    return page, block_text(block), table_rows(block)


def target_of(page: str) -> tuple[str, str]:
    """(css class, text) of the target callout."""
    m = re.search(r'<div class="callout (\w+) target">(.*?)</div>', page, re.S)
    assert m, "no target line"
    return m.group(1), block_text(m.group(2))


def test_evidence_headline_target_met(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_ablations(runs, headline_json(1.3, [1.1, 1.5], target_met=True))
    page, text, rows = evidence(runs)
    assert "From ablations/ablations.json (pool past, 60 nodes, 12 requests)" in text
    assert rows[""] == ["", "arm", "tau [95%]", "oilbird ÷ arm [paired 95%]", "est. speedup", "exact"]
    assert rows["merged (oilbird)"] == ["merged (oilbird)", "oilbird", "8.50 [8.00–9.00]", "1", "2.00×", "no"]
    assert rows["baseline suffix"] == ["baseline suffix", "suffix", "5.00 [4.75–5.25]", "×1.700 [1.500–1.900]",
                                       "2.00×", "yes"]
    assert rows["baseline lexical"][2:4] == ["6.54 [6.29–6.79]", "×1.300 [1.100–1.500]"]
    assert [r for r in rows if r.startswith("baseline ")] == [f"baseline {a}" for a in
                                                              ("suffix", "sam", "lexical", "recycling", "pld")]
    cls, line = target_of(page)
    assert cls == "enable"
    assert ("oilbird tau 8.50 vs lexical 6.54, 1.300× [paired 95% 1.100–1.500]. Target, tau(oilbird) ≥ 1.25× the best "
            "lexical arm's, with the paired 95% interval's lower end above 1: met (at or above 1.25× and the paired "
            "lower end 1.100 is above 1).") in line
    assert "target_met" not in line  # the file agrees
    svg = re.search(r"<svg.*?</svg>", sweep_block(page, "comparison"), re.S).group(0)
    assert all(f">{a}</text>" in svg for a in ("oilbird", "suffix", "sam", "lexical", "recycling", "pld"))
    assert ">baseline</text>" in svg and ">merged</text>" in svg  # the legend
    # the main report's decision section reads the same target line
    write_replay(runs / "toy" / "toy-model", replay_arms(0.12, [1.02, 1.08]))
    _, dtext = decision_of(site(runs)["toy__toy-model.html"])
    assert "1.300× [paired 95% 1.100–1.500]" in dtext and ": met (" in dtext


@pytest.mark.parametrize("ratio, iv, file_says, why", [
    (1.3, [0.95, 1.6], True, "the paired lower end 0.950 is not above 1"),  # above the line, interval crosses 1
    (1.1, [1.05, 1.15], None, "below 1.25×"),  # paired gain real, but short of the line
])
def test_evidence_headline_target_not_met(tmp_path, ratio, iv, file_says, why):
    runs = make_runs(tmp_path, decode=False)
    write_ablations(runs, headline_json(ratio, iv, target_met=file_says))
    page, _, _ = evidence(runs)
    cls, line = target_of(page)
    assert cls == "off" and f": not met ({why})." in line
    assert (", short of the 1.25× line by 12.0%" in line) == (ratio < 1.25)
    if file_says is not None:  # the file's own verdict disagrees with its numbers: said, not hidden
        assert "ablations/ablations.json itself says target_met = true" in line


def test_evidence_without_ablations_reads_the_replay(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    arms = replay_arms(0.12, [1.02, 1.08])
    arms[0]["paired_gain"] = {"versus": "oilbird", "tau_ratio": 0.8, "interval": [0.75, 0.85]}  # suffix / oilbird
    arms[-1]["drafted_by_source"] = {"spine": 400, "semantic": 200}
    arms[-1]["accepted_by_source"] = {"spine": 100, "semantic": 50}
    arms[-1]["accepted_draft_tokens"] = 125
    arms[-1]["drafter_stats"] = {"key_queries": 5812, "semantic_key": True, "note": "<not a number>"}
    write_replay(runs / "toy" / "toy-model", arms)
    pages = site(runs)
    page, text, rows = evidence(runs)
    assert "From the replay (replay/<arm>/summary.json, pool past, 60 nodes, 534 requests): ablations/ablations.json " \
           "does not exist" in text
    assert "make ablations BENCH=toy MODEL=toy-model" in text
    # a paired interval where the arm was replayed against oilbird (inverted: 1/0.8 [1/0.85, 1/0.75]), else none
    assert rows["SuffixDecoding (ours)"][1:4] == ["suffix", "4.60 [4.30–4.90]", "×1.250 [1.176–1.333]"]
    assert rows["lexical sources merged"][1:4] == ["lexical", "5.20 [4.90–5.50]", "×1.079"]
    assert "SAM-Decoding" not in rows  # not replayed: no row
    cls, line = target_of(page)
    assert cls == "off" and "oilbird tau 5.61 vs lexical 5.20, 1.079×, short of the 1.25× line by 13.7%" in line
    assert "(of lexical, suffix; from the replay)" in line
    # the rest of the page says what is missing and which command makes it
    abl = block_text(sweep_block(page, "ablations"))
    assert ("not available: no ablations/ablations.json under toy/toy-model/: `make ablations BENCH=toy "
            "MODEL=toy-model`") in abl
    assert table_rows(sweep_block(page, "replay"))["oilbird"][3] == "5.61 [5.31–5.91]"
    # per-source acceptance of the replayed oilbird, and its counters
    src = table_rows(sweep_block(page, "sources"))
    assert src["semantic"] == ["semantic", "200", "50", "25.0%", "40.0%"]
    assert src["spine"] == ["spine", "400", "100", "25.0%", "80.0%"]
    assert src["key queries"] == ["key queries", "5,812"] and src["semantic key"] == ["semantic key", "true"]
    assert "note" not in src
    stext = block_text(sweep_block(page, "sources"))
    assert "12.0% [11.0–13.0%] (8,079 of 67,324) of all committed tokens" in stext
    # linked from the main report, the index and the grid
    for name in ("toy__toy-model.html", "index.html", "grid.html"):
        assert f'href="{EVIDENCE}"' in pages[name], name
    assert 'href="toy__toy-model.html"' in page


def test_evidence_depth_table(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    arms = replay_arms(0.12, [1.02, 1.08])
    arms[2]["by_depth"] = {"depths": 3, "passes": 10, "reach": [0.7, 0.4, 0.1],
                           "by_source": {"spine": [5, 4, 1]}, "sole_semantic": [0, 0, 0]}
    write_replay(runs / "toy" / "toy-model", arms)
    assert "no per-depth acceptance" in block_text(sweep_block(site(runs)[EVIDENCE], "depth"))  # oilbird has none
    arms[3]["by_depth"] = {"depths": 3, "passes": 8, "reach": [0.75, 0.5, 0.25],
                           "by_source": {"spine": [4, 3, 1], "semantic": [2, 2, 1]}, "sole_semantic": [2, 1, 0]}
    write_replay(runs / "toy" / "toy-model", arms)
    rows = table_rows(sweep_block(site(runs)[EVIDENCE], "depth"))
    assert rows["1"] == ["1", "75.0%", "70.0%", "25.0%", "50.0%", "25.0%"]
    assert rows["3"] == ["3", "25.0%", "10.0%", "0.00%", "12.5%", "12.5%"]
    assert "4" not in rows  # past the recorded depths


def test_evidence_target_not_established_without_paired_interval(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    arms = [replay_summary("sam", 4.0, speedup=1.5), replay_summary("oilbird", 5.2, share=0.05)]
    write_replay(runs / "toy" / "toy-model", arms)
    page, _, rows = evidence(runs)
    cls, line = target_of(page)
    assert cls == "neutral" and "1.300×" in line and ": not established (no paired interval for the ratio" in line
    assert "Token Recycling" not in rows and "SAM-Decoding" in rows
    src = block_text(sweep_block(page, "sources"))  # accepted_by_source only: rates not known
    assert table_rows(sweep_block(page, "sources"))["spine"] == ["spine", "n/a", "100", "n/a", "n/a"]
    assert "not available" not in src


def test_unreadable_ablations_fall_back_to_the_replay(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_replay(runs / "toy" / "toy-model", replay_arms(0.12, [1.02, 1.08]))
    write_ablations(runs, "{not json")
    page, text, rows = evidence(runs)
    assert "ablations/ablations.json could not be read" in text and rows["lexical sources merged"][3] == "×1.079"
    assert block_text(sweep_block(page, "ablations")).count("not available") == 1


# ---------------------------------------------------------------- the cross-benchmark grid

def grid_rows(page: str) -> dict[str, list[str]]:
    return table_rows(page)


def test_grid_rows_with_intervals_limits_and_the_papers_numbers(tmp_path):
    df = positions_frame()
    summary = census_summary(df)
    summary["bench"] = "apibank"  # a benchmark the paper has
    runs = make_runs(tmp_path, df=df, summary=summary, decode=False)
    folder = runs / "toy" / "toy-model"
    (folder / "traces").mkdir()
    meta = {"model": "toy-model", "bench": "apibank", "n_requests": 100, "limit": 100, "requests_total": 534,
            "complete": True}
    (folder / "traces" / "meta.json").write_text(json.dumps(meta))
    write_replay(folder, replay_arms(0.12, [1.02, 1.08]))
    # a second benchmark with a replay but no census, one the paper has without a tau
    write_replay(runs / "gsm8k" / "toy-model", [replay_summary("oilbird", 3.0, share=0.01, bench="gsm8k")])
    pages = site(runs)
    grid = pages["grid.html"]
    rows = grid_rows(grid)
    assert rows["benchmark"][:10] == ["benchmark", "requests", "positions", "Avail [95%]", "Gap [95%]",
                                      "Recall [95%]", "tau suffix [95%]", "tau lexical [95%]", "tau oilbird [95%]",
                                      "oilbird ÷ best lexical"]
    fmt = lambda x: f"{100 * x:.2f}" if 100 * x < 10 else f"{100 * x:.1f}"  # noqa: E731
    row = rows["apibank"]
    assert row[1] == "100 of 534 (limit 100)"
    for cell, key in zip(row[3:6], ("available", "gap", "recall")):
        v, (lo, hi) = summary[key]["value"], summary[key]["bootstrap"]
        assert cell == f"{fmt(v)}% [{fmt(lo)}–{fmt(hi)}%]", key
    assert row[6:10] == ["4.60 [4.30–4.90]", "5.20 [4.90–5.50]", "5.61 [5.31–5.91]", "×1.079 over lexical: not met"]
    assert row[10] == "12.0% [11.0–13.0%]" and row[11] == "enable (replay)"
    assert "92%" not in " ".join(row)  # the paper's numbers never in our row
    row = rows["gsm8k"]
    assert row[1] == "534" and row[2] == "n/a: no census" and row[3] == "n/a: no census"
    assert row[6] == "n/a: suffix not replayed" and row[8] == "3.00 [2.70–3.30]"
    assert row[9] == "n/a: no oilbird and lexical replay"
    # the paper's table, labelled as the paper's, beside ours: both benchmarks, the main table's tau where it has one
    assert "Beside it: the paper's (Llama-3.1-8B, GPU) numbers for these benchmarks" in block_text(grid)
    assert rows["apibank (API-Bank)"] == ["apibank (API-Bank)", "92%", "6.8% [5.9–7.8%]", "81% [76.7–84.8%]", "4.87",
                                          "6.76"]
    assert rows["gsm8k (GSM8K)"] == ["gsm8k (GSM8K)", "51%", "31.6%", "55%", "not in tab:main-echo",
                                     "not in tab:main-echo"]
    assert rows["benchmark (paper's name)"][1:] == ["Avail (paper)", "Gap (paper)", "Recall (paper)",
                                                    "tau SuffixDecoding (paper)", "tau Oilbird (paper)"]
    assert "ToolAlpaca (toolalpaca)" in block_text(grid) and "4.06" not in grid  # tau-Retail: not ours, not shown
    assert "grid0" in grid and "<svg" in grid  # the census chart stays

    # a limit without the total in meta.json: the registry's count; no limit: the captured count alone
    meta.pop("requests_total")
    (folder / "traces" / "meta.json").write_text(json.dumps(meta))
    assert grid_rows(site(runs)["grid.html"])["apibank"][1] == "100 of 534 (limit 100)"
    meta.update(bench="toy", limit=50)
    (folder / "traces" / "meta.json").write_text(json.dumps(meta))
    assert grid_rows(site(runs)["grid.html"])["apibank"][1] == "100 (limit 50, total not recorded)"
    meta.update(limit=None, complete=False)
    (folder / "traces" / "meta.json").write_text(json.dumps(meta))
    cell = grid_rows(site(runs)["grid.html"])["apibank"][1]
    assert cell == "100 (incomplete)" and " of " not in cell


def test_grid_escapes_and_survives_odd_values(tmp_path):
    df = positions_frame()
    summary = census_summary(df)
    summary["bench"] = "<script>alert(1)</script>"
    summary["gap"] = {"value": "x"}
    runs = make_runs(tmp_path, df=df, summary=summary, decode=False)
    folder = runs / "toy" / "toy-model"
    (folder / "traces").mkdir()
    (folder / "traces" / "meta.json").write_text(json.dumps({"n_requests": "many", "limit": "<b>", "bench": 3}))
    grid = site(runs)["grid.html"]
    tags = assert_offline(grid)
    assert not any(t in ("script", "b") for t, _ in tags.tags)
    row = grid_rows(grid)["<script>alert(1)</script>"]
    assert row[1] == "5" and row[4] == "n/a: no gap in the census summary" and row[6] == "n/a: no replay"
    assert "None of these benchmarks is in the paper's tables." in block_text(grid)


def test_headline_without_interval_is_not_established(tmp_path):
    runs = make_runs(tmp_path, decode=False)
    write_ablations(runs, headline_json(1.3, None, target_met=False))  # --bootstrap 0: no intervals
    page, _, rows = evidence(runs)
    cls, line = target_of(page)
    assert cls == "neutral" and ": not established (no paired interval for the ratio" in line
    assert "(ablations/ablations.json says target_met = false.)" in line
    assert rows["baseline lexical"][3] == "×1.300"


def test_decoder_table_shows_mismatch_kinds():
    """The lossless cell names the audit's numeric and algorithmic counts and the dtype (decoder/verify/audit.py)."""
    exact = {"matched": 8, "requests": 8, "numeric": 0, "algorithmic": 0, "dtype": "float32", "mismatches": []}
    assert audit_cell(exact) == "8/8"
    mixed = {**exact, "matched": 5, "numeric": 3, "dtype": "bfloat16", "mismatches": [{}, {}, {}]}
    assert audit_cell(mixed) == "5/8 (3 numeric, 0 algorithmic, bfloat16)"
    assert audit_cell({"matched": 4, "requests": 4}) == "4/4" and audit_cell(None) == "n/a"


def test_replay_table_drafting_and_key_index_cells():
    """The replay table prices drafting per pass (mean, median) and names the key's index and recall, escaped."""
    from types import SimpleNamespace

    from reports.arms import drafting_cell, key_index_text

    assert drafting_cell({"draft_s_per_pass": {"mean": 0.000279, "p50": 0.000262}}) == "0.279 (0.262)"
    assert drafting_cell({}) == "–"
    on = SimpleNamespace(name="oilbird", summary={"active_index": "auto:pca128,ivf256,sq8<x>",
                                                 "knn_recall": {"value": 0.9812, "k": 8, "queries": 612}})
    off = SimpleNamespace(name="suffix", summary={"active_index": None})
    text = key_index_text([on, off, None])
    assert "key: auto:pca128,ivf256,sq8&lt;x&gt;, tie-aware recall@8 against exact 0.981 on 612" in text
    assert "suffix" not in text and key_index_text([off]) == ""
