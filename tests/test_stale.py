"""Results that no longer describe their trace store (issue 23, cases 3 and 4).

Case 3: checksums removed from a store written with them are refused as damage (data/store/reader.py
`written_with_checksums`); a store older than checksums still opens, unverified, and every result
computed on it says so (`store_verified: false`, a note, the reports' callout and row mark).
Case 4: a store extended after its census and replay makes those results stale: the reports mark
them on every page that shows them (reports/freshness.py), `--if-missing` recomputes them, and
`make census`'s census and replay (no `--if-missing`) rewrite them current.

Stores are written by the real writer from synthetic records (no model: fast); census and replay run
for real on them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from census.__main__ import main as census_main
from census.definitions import CensusConfig
from census.output import run_census
from data.__main__ import main as data_main
from data.errors import OilbirdError
from data.store.layout import census_dir, replay_dir, store_dir
from data.store.reader import current_fingerprint, current_summary, open_store
from data.store.schema import PROMPT_HASH_SCHEME, TOPK, prompt_hash
from data.store.verify import verify_store
from data.store.writer import StoreWriter, TraceRecord
from decoder.replay.run import ReplayConfig, replay_is_current, run_replay
from reports.case_viewer import id_text
from reports.freshness import freshness_callout, row_flags, shown_results
from reports.render import render_site
from reports.results import Result, find_results

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BENCH, MODEL, D = "b", "synthetic", 16
ARMS = ("oilbird", "oilbird-no-semantic")


def _records(start: int, stop: int) -> list[TraceRecord]:
    """Requests that repeat each other's text (so the census and the replay find something), states seeded."""
    rng = np.random.default_rng(0)
    base = rng.integers(3, 40, size=24)
    out = []
    for r in range(start, stop):
        rs = np.random.default_rng(r)
        tokens = [int(t) for t in np.concatenate([base[(r % 3):(r % 3) + 12], rs.integers(3, 40, size=4)])]
        n = len(tokens)
        prompt = [1, 2 + r % 2, 5]
        out.append(TraceRecord(
            request=r, id=f"r{r}", group="g", prompt_hash=prompt_hash(prompt), prompt_tokens=prompt,
            output_tokens=tokens, stop_reason="length", seconds=0.1,
            hidden=rs.standard_normal((n, D)).astype(np.float16), hidden_valid=np.arange(n) < n - 1,
            topk=rs.integers(3, 40, size=(n, TOPK)).astype(np.int32),
            prompt_last_hidden=rs.standard_normal(D).astype(np.float16),
            prompt_last_topk=rs.integers(3, 40, size=TOPK).astype(np.int32)))
    return out


META = dict(model=MODEL, model_fingerprint="fp", layer=1, n_layers=1, d_model=D, dtype="float32",
            tokenizer_hash="t", chat_template_hash="c", bench=BENCH, data_fingerprint="f", mode="generate",
            max_new_tokens=16, versions={}, created="2026-01-01T00:00:00", vocab_size=48,
            prompt_hash_scheme=PROMPT_HASH_SCHEME)


def _capture(out: Path, stop: int) -> Path:
    """Write (or extend, as a larger --limit does) the store of runs/b/synthetic with requests 0..stop-1."""
    path = store_dir(out, BENCH, MODEL)
    path.mkdir(parents=True, exist_ok=True)
    w = StoreWriter(path, META)
    w.append(_records(w.done, stop))
    w.finish()
    return path


def _census(out: Path) -> dict:
    return run_census(BENCH, MODEL, CensusConfig(bootstrap=0), out, embeddings=None, progress=False)[1]


def _replay_cfg(out: Path) -> ReplayConfig:
    return ReplayConfig(bench=BENCH, model=MODEL, arms=ARMS, out=str(out), bootstrap=0, jobs=1, progress=False)


def _meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


def _edit_meta(path: Path, drop: tuple[str, ...] = (), **set_) -> None:
    meta = {k: v for k, v in _meta(path).items() if k not in drop}
    (path / "meta.json").write_text(json.dumps({**meta, **set_}))


def _bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def _pages(out: Path) -> dict[str, str]:
    return render_site(find_results(out), token_text=id_text("ids"))


# ---------------------------------------------------------------- case 3: checksums removed

@pytest.mark.parametrize("drop", [("checksums",), ("checksums", "n_requests"), ("checksums", "store_format")],
                         ids=["checksums", "and-n_requests", "and-store_format"])
def test_removed_checksums_are_refused_and_nothing_is_written(tmp_path, capsys, drop):
    path = _capture(tmp_path, 4)
    census_before = _census(tmp_path)  # computed while the store was intact
    _edit_meta(path, drop=drop)
    before = _bytes(path)
    with pytest.raises(OilbirdError, match="no checksums.*they were removed"):
        open_store(path)
    capsys.readouterr()
    for run in (lambda: data_main(["verify", str(path)]), lambda: data_main(["show", str(path)]),
                lambda: census_main(["--bench", BENCH, "--model", MODEL, "--out", str(tmp_path), "--quiet",
                                     "--no-embeddings"])):
        assert run() == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "damaged" in err[0], err
    with pytest.raises(OilbirdError, match="they were removed"):
        run_replay(_replay_cfg(tmp_path))
    with pytest.raises(OilbirdError, match="they were removed"):  # a resume would re-record tampered files
        StoreWriter(path, META)
    assert _bytes(path) == before  # nothing rewritten, nothing recorded
    census = json.loads((census_dir(tmp_path, BENCH, MODEL, "past") / "summary.json").read_text())
    assert census["store_fingerprint"] == census_before["store_fingerprint"]  # the old census is left alone


def test_store_older_than_checksums_opens_unverified_and_its_results_say_so(tmp_path, capsys):
    path = _capture(tmp_path, 4)
    # what code before checksums wrote: no checksums, no n_requests, no store_format
    _edit_meta(path, drop=("checksums", "n_requests", "store_format"))
    st = open_store(path)
    assert not st.verified
    assert "unverified" in verify_store(path)
    summary = _census(tmp_path)
    assert summary["store_verified"] is False
    assert any("unverified" in n for n in summary["notes"])
    replayed = run_replay(_replay_cfg(tmp_path))
    assert all(s["store_verified"] is False and "unverified" in s["store_note"] for s in replayed.values())
    pages = _pages(tmp_path)
    main, evidence = pages[f"{BENCH}__{MODEL}.html"], pages[f"{BENCH}__{MODEL}__evidence.html"]
    for page in (main, evidence):
        assert 'id="unverified"' in page and "Unverified store." in page
    for page in (pages["index.html"], pages["grid.html"]):
        assert ">unverified</span>" in page
    # the results of an unverified store still go stale: their fingerprint hashes its files
    assert current_summary(census_dir(tmp_path, BENCH, MODEL, "past") / "summary.json", path) is not None
    (path / "requests.parquet").write_bytes((path / "requests.parquet").read_bytes() + b"\0")
    assert current_fingerprint(path) != summary["store_fingerprint"]
    assert current_summary(census_dir(tmp_path, BENCH, MODEL, "past") / "summary.json", path) is None


def test_a_verified_store_marks_nothing(tmp_path):
    path = _capture(tmp_path, 4)
    summary = _census(tmp_path)
    assert summary["store_verified"] is True and not any("unverified" in n for n in summary["notes"])
    assert summary["store_fingerprint"] == current_fingerprint(path)
    run_replay(_replay_cfg(tmp_path))
    pages = _pages(tmp_path)
    assert not any('class="flag"' in p or "callout stale" in p for p in pages.values())


def test_migrated_store_older_than_checksums_still_opens(tmp_path):
    """`data migrate` of a store older than checksums sets store_format 2 and migrated_from_format, no
    checksums and no n_requests: a store that never had checksums, not one that lost them."""
    path = _capture(tmp_path, 3)
    _edit_meta(path, drop=("checksums", "n_requests"), migrated_from_format=1)
    assert not open_store(path).verified


# ---------------------------------------------------------------- case 4: the store changed since

def test_results_of_an_extended_store_are_stale_until_recomputed(tmp_path):
    path = _capture(tmp_path, 4)
    census = _census(tmp_path)
    run_replay(_replay_cfg(tmp_path))
    assert replay_is_current(_replay_cfg(tmp_path))
    assert not any("callout stale" in p for p in _pages(tmp_path).values())

    _capture(tmp_path, 6)  # extended, as a larger --limit does
    assert _meta(path)["n_requests"] == 6 and current_fingerprint(path) != census["store_fingerprint"]
    pages = _pages(tmp_path)
    main, evidence = pages[f"{BENCH}__{MODEL}.html"], pages[f"{BENCH}__{MODEL}__evidence.html"]
    assert 'id="stale"' in main and "the census (4 requests)" in main and "it now holds 6 requests" in main
    assert "Stale verdict:" in main  # the decision block reads the stale replay
    assert 'id="stale"' in evidence and "the replay (pool past, 60 nodes) of oilbird, oilbird-no-semantic" in evidence
    assert "the census (4 requests)" not in evidence  # that page shows no census
    for page in (pages["index.html"], pages["grid.html"]):
        assert ">stale</span>" in page
    # --if-missing recomputes them (the fingerprint is part of the decision)
    assert not replay_is_current(_replay_cfg(tmp_path))
    assert current_summary(census_dir(tmp_path, BENCH, MODEL, "past") / "summary.json", path) is None

    # what `make census` runs after the capture: the census and the replay, then the reports
    assert _census(tmp_path)["requests"] == 6
    run_replay(_replay_cfg(tmp_path))
    summary = json.loads((replay_dir(tmp_path, BENCH, MODEL, "past") / "oilbird" / "summary.json").read_text())
    assert summary["requests"] == 6 and summary["store_fingerprint"] == current_fingerprint(path)
    assert not any('class="flag"' in p or "callout stale" in p for p in _pages(tmp_path).values())


def test_the_stale_mark_escapes_what_it_quotes(tmp_path):
    """The callout quotes names from files (the benchmark, the model, arms): escaped like every cell."""
    evil = "<img src=x onerror=alert(1)>"
    path = _capture(tmp_path, 4)
    _census(tmp_path)
    _capture(tmp_path, 5)
    result = find_results(tmp_path)[0]
    result.meta = dict(result.meta, model=evil)
    result.census.summary["bench"] = evil
    items = shown_results(result, result.census)
    for html in (freshness_callout(result, items), row_flags(result, items)):
        assert "stale" in html and "<img" not in html and "&lt;img" in html
    assert isinstance(result, Result) and path.exists()


def test_a_store_that_is_gone_marks_nothing(tmp_path):
    """Results copied without their store cannot be compared: not marked (nor an error)."""
    path = _capture(tmp_path, 4)
    _census(tmp_path)
    shutil.rmtree(path)
    assert current_fingerprint(path) is None
    assert not any("callout stale" in p for p in _pages(tmp_path).values())
