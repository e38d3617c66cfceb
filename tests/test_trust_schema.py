"""Issue 35, item 1: result files are data with a schema (data/results.py), and a verdict never flips silently.

Covers: a replay summary without `sole_source_share` (the probe's case: the reports read the larger share over
draft tokens instead and turned "neutral" into "enable") and one whose share is 5.0 ("500.0% ... enable") now
give "cannot decide: <file> lacks <field>" / "has <field> = <value> outside [0, 1]" on the page and in
index.html, a note per file on stderr and exit 2, while the other results' pages still decide; the same for
every range the schema states (tau >= 1, speedups > 0, ordered intervals holding their value, counts), for a
live summary that gives only the draft-token share, for decoder/verdict.py's own inputs, for a census value out
of range (shown as n/a, never 500%), for vLLM and ablation files, and for a summary nested 100,000 deep (one
line, no RecursionError). The real writers' blocks (decoder/verify/passes.py) pass the schema.

Run: /work/main/.venv/bin/python -m pytest -q tests/test_trust_schema.py
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from data.results import read_result, validate
from reports.__main__ import main as reports_main
from reports.render import render_site
from reports.results import find_results

ON, OFF = "oilbird", "oilbird-no-semantic"
COMMITTED, DRAFT = 0.0814, 0.108  # the probe's numbers: neutral on the committed share, enable on the draft one


def replay_summary(arm: str, share: float | None, draft: float | None) -> dict:
    """A replay summary.json of `arm` as decoder/replay/run.py and decoder/verify/passes.py write it
    (docs/replay.md)."""
    tokens, accepted = 10000, 7500
    s = {"kind": "replay", "arm": arm, "bench": "toy", "model": "toy-model", "pool": "past", "nodes": 60,
         "requests": 50, "generated_tokens": tokens, "passes": 2000, "accepted_draft_tokens": accepted,
         "tau": {"value": 5.0, "interval": [4.6, 5.4]}, "exact": False,
         "accepted_by_source": {"spine": 5000, "semantic": 2500}, "sole_source_share": None,
         "sole_source_share_of_draft": None,
         "estimate": {"engine": "harness", "speedup": 2.1 if share else 2.0, "speedup_interval": [1.9, 2.3],
                      "draft_fraction": 0.01}}
    if share is not None:
        s["sole_source_share"] = {"value": share, "interval": [share - 0.01, share + 0.01],
                                  "sole": round(share * tokens), "tokens": tokens, "definition": "committed"}
        s["sole_source_share_of_draft"] = {"value": draft, "interval": [draft - 0.01, draft + 0.01],
                                           "sole": round(share * tokens), "accepted": accepted, "definition": "draft"}
        s["paired_gain"] = {"versus": OFF, "tau_ratio": 1.04, "interval": [1.02, 1.06], "speedup_ratio": 1.05,
                            "speedup_interval": [1.01, 1.09]}
    return s


def write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def make_replay(runs: Path, bench: str = "toy") -> Path:
    """runs/<bench>/toy-model/replay/{oilbird, oilbird-no-semantic}/summary.json; returns oilbird's file."""
    folder = runs / bench / "toy-model" / "replay"
    write(folder / OFF / "summary.json", replay_summary(OFF, None, None))
    return write(folder / ON / "summary.json", replay_summary(ON, COMMITTED, DRAFT))


def decision(page: str) -> tuple[str, str]:
    """(css class of the decision callout, the decision section's text)."""
    block = re.search(r'<section id="decision">(.*?)</section>', page, re.S).group(1)
    cls = re.search(r'<div class="callout (\w+)">', block)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", block)).replace("&quot;", '"').replace("&#x27;", "'")
    return (cls.group(1) if cls else ""), text


def edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_missing_committed_share_cannot_decide_and_never_reads_the_draft_share(tmp_path, capsys):
    runs = tmp_path / "runs"
    make_replay(runs, "other")  # an intact result beside the damaged one: its page still decides
    on = make_replay(runs)
    pages = render_site(find_results(runs))
    assert decision(pages["toy__toy-model.html"])[0] == "neutral"  # 8.14% is below the 9% enable line
    edit(on, lambda d: d.pop("sole_source_share"))

    out = tmp_path / "html"
    assert reports_main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"note: {on} lacks sole_source_share over all committed tokens (it gives only the share over "
                      "accepted draft tokens, which is larger and not the rule's)")
    assert len(err) == 2 and err[1].startswith("error: 1 result file(s) lack a field or hold an invalid value")
    cls, text = decision((out / "toy__toy-model.html").read_text())
    assert cls == "cannot" and f"cannot decide: {on} lacks sole_source_share" in text
    callout = text.split("Rule (decoder/verdict.py)")[0]  # the arms table below may show it, labelled as such
    assert "10.8%" not in callout and "Verdict: enable" not in callout  # no verdict, no substituted share
    assert decision((out / "other__toy-model.html").read_text())[0] == "neutral"
    index = (out / "index.html").read_text()
    assert index.count("<strong>cannot decide</strong> (replay)") == 1 and "<strong>neutral</strong>" in index
    assert "<strong>cannot decide</strong> (replay)" in (out / "grid.html").read_text()


BAD_VALUES = [  # (what to change in oilbird's summary, the problem line after "<file> has ")
    (lambda d: d["sole_source_share"].update(value=5.0), "sole_source_share.value = 5.0 outside [0, 1]"),
    (lambda d: d["sole_source_share"].update(value=-0.1), "sole_source_share.value = -0.1 outside [0, 1]"),
    (lambda d: d["sole_source_share"].update(value=math.nan), "sole_source_share.value = NaN outside [0, 1]"),
    (lambda d: d["sole_source_share"].update(value="0.08"), 'sole_source_share.value = "0.08" outside [0, 1]'),
    (lambda d: d["sole_source_share"].update(interval=[0.2, 0.3]),
     "sole_source_share.interval = [0.2, 0.3] an interval that does not hold its value 0.0814"),
    (lambda d: d["sole_source_share"].update(tokens=-5), "sole_source_share.tokens = -5 not a count"),
    (lambda d: d["sole_source_share"].update(sole=12.5), "sole_source_share.sole = 12.5 not a count"),
    (lambda d: d["tau"].update(value=0.5), "tau.value = 0.5 below 1"),
    (lambda d: d.update(tau=5.0), "tau = 5.0 not an object {value, interval}"),
    (lambda d: d["paired_gain"].update(interval=[1.06, 1.02]), "paired_gain.interval = [1.06, 1.02] not an ordered"),
    (lambda d: d["paired_gain"].update(tau_ratio=-1.04), "paired_gain.tau_ratio = -1.04 not above 0"),
    (lambda d: d["estimate"].update(speedup=0), "estimate.speedup = 0 not above 0"),
    (lambda d: d["estimate"].update(speedup=math.inf), "estimate.speedup = Infinity not above 0"),
    (lambda d: d.update(requests=True), "requests = true not a count"),
]


@pytest.mark.parametrize("change,line", BAD_VALUES, ids=[b for _, b in BAD_VALUES])
def test_an_invalid_field_cannot_decide(tmp_path, change, line):
    runs = tmp_path / "runs"
    on = make_replay(runs)
    edit(on, change)
    (result,) = find_results(runs)
    pages = render_site([result])
    cls, text = decision(pages["toy__toy-model.html"])
    assert cls == "cannot" and f"cannot decide: {on} has {line}" in text
    assert "500.0%" not in "".join(pages.values())
    assert "<strong>cannot decide</strong>" in pages["index.html"]
    assert [str(p) for p in result.problems if p.file == str(on)][0].startswith(f"{on} has {line}")


def test_an_invalid_twin_cannot_decide_and_a_null_share_is_not_a_share(tmp_path):
    runs = tmp_path / "runs"
    on = make_replay(runs)
    off = on.parent.parent / OFF / "summary.json"
    edit(off, lambda d: d["estimate"].update(speedup=-2.0))  # the speed condition reads the twin's speedup
    cls, text = decision(render_site(find_results(runs))["toy__toy-model.html"])
    assert cls == "cannot" and f"{off} has estimate.speedup = -2.0 not above 0" in text
    edit(off, lambda d: d["estimate"].update(speedup=2.0))
    edit(on, lambda d: d["sole_source_share"].update(value=None))
    cls, text = decision(render_site(find_results(runs))["toy__toy-model.html"])
    assert cls == "cannot" and f"{on} has sole_source_share.value = null (no share computed)" in text


def test_live_summary_with_only_the_draft_share_cannot_decide(tmp_path):
    arm = tmp_path / "runs" / "toy" / "toy-model" / "decode" / ON / "summary.json"
    live = {"kind": "live", "arm": ON, "requests": 4, "tau": 3.5, "tau_interval": [3.2, 3.8], "speedup": 2.5,
            "accepted_by_source": {"semantic": 3},
            "sole_source_share_of_draft": {"value": 0.3, "interval": [0.25, 0.35], "sole": 30, "accepted": 100}}
    write(arm, live)
    cls, text = decision(render_site(find_results(tmp_path / "runs"))["toy__toy-model.html"])
    assert cls == "cannot" and f"cannot decide: {arm} lacks sole_source_share over all committed tokens" in text
    live["sole_source_share"] = {"value": 0.02, "interval": [0.01, 0.029], "sole": 30, "tokens": 1500}
    write(arm, live)
    assert decision(render_site(find_results(tmp_path / "runs"))["toy__toy-model.html"])[0] == "off"


def test_verdict_refuses_inputs_out_of_their_range():
    from decoder.verdict import CANNOT_DECIDE, verdict

    for args, why in (((5.0, None, [1.01, 1.1]), "share of oilbird is 5, outside [0, 1]"),
                      ((0.12, None, [-0.5, 1.1]), "gain interval -0.5–1.1 is not above 0"),
                      ((0.12, None, [1.01, 1.1], -2.0, 2.0), "speedup of oilbird is -2, not above 0")):
        v = verdict(*args)
        assert v.decision == CANNOT_DECIDE and any(why in r for r in v.reasons), (args, v.reasons)


def census_summary() -> dict:
    p = {"value": 0.5, "wilson": [0.4, 0.6], "bootstrap": [0.41, 0.59], "k": 5, "n": 10}
    return {"bench": "toy", "model": "toy-model", "pool": "past", "layer": 4, "positions": 10, "requests": 2,
            "available": dict(p), "producible": dict(p), "gap": dict(p), "recall": dict(p), "mechanism": {},
            "coverage": {}, "config": {}, "notes": []}


def test_census_value_out_of_range_is_not_shown_and_is_noted(tmp_path, capsys):
    runs = tmp_path / "runs"
    summary = census_summary()
    summary["available"]["value"] = 5.0
    path = write(runs / "toy" / "toy-model" / "census" / "summary.json", summary)
    out = tmp_path / "html"
    assert reports_main(["--runs", str(runs), "--out", str(out), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"note: {path} has available.value = 5.0 outside [0, 1]"
    page, index = (out / "toy__toy-model.html").read_text(), (out / "index.html").read_text()
    assert "500.0%" not in page + index and "Invalid result files" in page
    assert f"{path} has available.value = 5.0 outside [0, 1]" in page


def test_vllm_and_ablation_values_out_of_range_are_noted(tmp_path, capsys):
    runs = tmp_path / "runs"
    make_replay(runs)
    folder = runs / "toy" / "toy-model"
    vllm = write(folder / "vllm" / "summary.json", {"kind": "bench-vllm", "complete": True, "rows": [
        {"arm": "oilbird", "batch": 1, "requests": 8, "speedup_vs_ar": -2.7, "tok_s": 40.0,
         "proposer": {"steps": 167, "draft_s": -0.25}}]})
    abl = write(folder / "ablations" / "ablations.json", {"merged": {"arm": ON, "tau": 0.2}, "ablations": []})
    assert reports_main(["--runs", str(runs), "--out", str(tmp_path / "html"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"note: {vllm} has rows[0].speedup_vs_ar = -2.7 not above 0" in err
    assert "(and 1 more problem(s) in that file)" in err  # the proposer's draft_s, one line per file
    assert f"note: {abl} has merged.tau = 0.2 below 1" in err
    assert "-2.70" not in (tmp_path / "html" / "toy__toy-model.html").read_text()


def test_a_summary_nested_deep_is_one_line(tmp_path, capsys):
    runs = tmp_path / "runs"
    path = write(runs / "toy" / "toy-model" / "census" / "summary.json", '{"a":' * 100_000 + "1" + "}" * 100_000)
    assert reports_main(["--runs", str(runs), "--out", str(tmp_path / "html"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: cannot read {path}: is nested deeper than 64 levels: not a file Oilbird wrote"


def test_the_writers_blocks_pass_the_schema(tmp_path):
    """decoder/verify/passes.py's block (every live and replay summary holds it), degenerate requests included: an
    interval of equal draws must still hold its point."""
    from data.stats import RequestBootstrap
    from decoder.loop import Cycle
    from decoder.verify.passes import pass_statistics

    def cycle(committed: int, sources: list[str]) -> Cycle:
        return Cycle(nodes=8, accepted=len(sources), committed=committed, sources=sources,
                     node_sources={"spine": 6, "semantic": 2}, draft_s=1e-4, verify_s=1e-3, update_s=1e-5)

    same = [[cycle(3, ["spine", "semantic"])] * 3 for _ in range(4)]  # every request alike: intervals collapse
    mixed = [[cycle(1 + r % 3, ["spine|semantic"] * (r % 3))] * (r + 1) for r in range(5)]
    for per_request in (same, mixed):
        block = pass_statistics(per_request, True, RequestBootstrap(len(per_request), 200, 0))
        summary = {"kind": "replay", "arm": ON, **block, "tau": {"value": block["tau"],
                                                                  "interval": block["tau_interval"]}}
        assert validate(summary, "replay", "x") == []
        write(tmp_path / "s.json", summary)
        assert read_result(tmp_path / "s.json", "replay").problems == []
