"""The "In vLLM" section of a benchmark page, against a hand-built vllm/summary.json (benchmarks/bench_vllm.py's
shape): the table's figures, the losslessness flag, the batch chart, escaping, and unreadable or lone files."""

from __future__ import annotations

import json
import re
from pathlib import Path

from reports.benchmark_page import result_page
from reports.render import render_site
from reports.results import find_results, load_result
from reports.vllm_section import vllm_section

EVIL = "<b>x"  # an arm name that must never reach the page as markup


def row(arm: str, batch: int, tok_s: float, speedup: float | None, acc: float | None, identical: int = 4,
        **extra) -> dict:
    return {"arm": arm, "batch": batch, "mode": "compiled", "requests": 4, "generated_tokens": 512,
            "wall_s": 512 / tok_s, "tok_s": tok_s, "speedup_vs_ar": speedup, "mean_acceptance_length": acc,
            "identical_to_ar": identical, "rounds": 1, "load_s": 3.0, **extra}


def summary(complete: bool = True) -> dict:
    rows = []
    for batch, base in ((1, 100.0), (8, 400.0)):
        rows.append(row("vllm-greedy", batch, base, 1.0, None))
        rows.append(row(EVIL, batch, base * 1.1, 1.1, 1.5))
        rows.append(row("oilbird", batch, base * (1.8 if batch == 1 else 1.25), 1.8 if batch == 1 else 1.25, 2.4,
                        identical=3 if batch == 8 else 4, replay_mean_acceptance_length=3.0,
                        acceptance_vs_replay=0.8, proposer={"steps": 10}, vs_suffix=1.12))
    # the same arm eager, one round (make bench-vllm EAGER=1)
    rows.append(row("oilbird", 1, 150.0, 1.6, 2.4, mode="eager", vs_suffix=1.05))
    return {"kind": "bench-vllm", "bench": "apibank", "model": "smollm2-135m", "store": "runs/x/traces",
            "store_fingerprint": "abc", "device": {"type": "cpu", "cores": 2, "machine": "x86_64"},
            "settings": {"limit": 4, "max_new": 128, "batches": [1, 8], "k": 8, "nodes": 60,
                         "arms": ["vllm-greedy", EVIL, "oilbird"], "rounds": 1, "dtype": "float32",
                         "prefix_caching": True},
            "started": "2025-01-01T00:00:00+00:00", "finished": "2025-01-01T01:00:00+00:00", "complete": complete,
            "rows": rows,
            "replay": {"oilbird": {"arm": "oilbird@chain=8", "passes": 100, "passes_with_draft": 90, "tau": 2.5,
                                   "mean_acceptance_length": 3.0}},
            "agreement_with_store": {"requests": 4, "identical": 3,
                                     "first_divergence": {"median": 17.0, "positions": [17]}}}


def write(tmp_path: Path, obj, raw: str | None = None) -> Path:
    folder = tmp_path / "runs" / "apibank" / "smollm2-135m"
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "summary.json").write_text(raw if raw is not None else json.dumps(obj))
    return folder


def section_html(page: str) -> str:
    m = re.search(r'<section id="vllm">.*?</section>', page, re.S)
    assert m, "no vLLM section on the page"
    return m.group(0)


def table_rows(html: str) -> list[list[str]]:
    body = re.search(r"<tbody>(.*?)</tbody>", html, re.S).group(1)
    return [re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S) for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def test_vllm_section_table_chart_and_escaping(tmp_path):
    result = load_result(write(tmp_path, summary()))
    assert result is not None and result.vllm is not None and result.vllm_note is None
    sec = section_html(result_page(result))
    assert "In vLLM" in sec and "complete" in sec and "incomplete" not in sec
    assert "2 cores" in sec and "batch size(s) 1, 8" in sec
    rows = table_rows(sec)
    names = ["<code>vllm-greedy</code>", "<code>&lt;b&gt;x</code>", "<code>oilbird</code>"]
    assert [r[0] for r in rows] == names + ["<code>oilbird</code>"] + names
    assert [r[1] for r in rows] == ["1"] * 4 + ["8"] * 3
    assert [r[2] for r in rows] == ["compiled"] * 3 + ["eager"] + ["compiled"] * 3  # each arm in both modes
    greedy, evil, oil1, oil1_eager = rows[:4]
    assert greedy[3:10] == ["100.0", "1.00×", "—", "—", "—", "—", "4/4"]
    assert evil[3:10] == ["110.0", "1.10×", "n/a", "1.50", "—", "—", "4/4"]
    assert oil1[3:10] == ["180.0", "1.80×", "1.12×", "2.40", "3.00", "0.80×", "4/4"]
    assert oil1_eager[3:6] == ["150.0", "1.60×", "1.05×"]
    oil8 = rows[6]
    assert oil8[3] == "500.0" and oil8[4] == "1.25×"
    assert "3/4 — NOT lossless" in oil8[9] and sec.count("NOT lossless") == 1
    assert "oilbird at batch 8 (compiled)" in sec  # the callout names the failing run
    assert "3 of 4</strong> requests" in sec and "position 17 (median)" in sec
    assert '<svg class="chart"' in sec and "vllm-batch" in sec
    assert "tok/s over vLLM greedy at the same batch" in sec
    assert EVIL not in sec  # escaped in the table, the callout and the chart's legend
    assert "&lt;b&gt;x" in sec


def test_vllm_section_incomplete_and_missing_values(tmp_path):
    s = summary(complete=False)
    s["rows"] = s["rows"][:2] + [{"arm": "oilbird", "batch": 1, "tok_s": "fast", "speedup_vs_ar": None,
                                  "identical_to_ar": None, "requests": 4}, "not a row"]
    s["agreement_with_store"] = None
    result = load_result(write(tmp_path, s))
    sec = vllm_section(result)
    assert "incomplete: the bench was still running or was stopped" in sec
    assert "3 of 6 (batch, arm, mode) runs written" in sec
    oil = table_rows(sec)[2]  # a row that says no mode: written before the bench recorded it, so eager
    assert oil[2] == "eager" and oil[3] == "n/a" and oil[4] == "n/a" and oil[9] == "n/a" and "fast" not in sec
    assert "1 row(s) without an arm" in sec and "not known yet" in sec
    assert "<svg" not in sec  # one batch size: no chart


def test_vllm_unreadable_summary_is_a_note(tmp_path):
    for raw, why in (("{not json", "could not be read"), ("[1, 2]", "not a JSON object"),
                     ('{"rows": 3}', "has no list of rows")):
        folder = tmp_path / why.replace(" ", "-")
        folder.mkdir()
        result = load_result(write(folder, None, raw=raw))
        assert result is not None and result.vllm is None and why in result.vllm_note
        sec = section_html(result_page(result))
        assert "not available" in sec and "make bench-vllm" in sec


def test_vllm_only_runs_folder_is_a_result(tmp_path):
    write(tmp_path, summary())
    results = find_results(tmp_path / "runs")
    assert len(results) == 1 and results[0].vllm is not None
    assert results[0].model_name == "smollm2-135m"
    pages = render_site(results)
    main = next(p for name, p in pages.items() if 'id="vllm"' in p)
    assert "NOT lossless" in main


def test_no_vllm_summary_no_section(tmp_path):
    folder = write(tmp_path, summary())
    (folder / "vllm" / "summary.json").unlink()
    assert load_result(folder) is None
