"""The "In vLLM" section of a benchmark page: vllm/summary.json (`make bench-vllm`, benchmarks/bench_vllm.py),
Oilbird's proposer inside vLLM side by side with vLLM's own methods on the same requests.

Shown only when the file exists. One row per (batch size, arm), arms in the bench's order: tok/s, the speedup
over vLLM greedy at the same batch size, vLLM's mean acceptance length, the replay's prediction of it (Oilbird
arms), and how many requests equal greedy's output (anything short of all of them is a losslessness failure
and is flagged). A summary still being written ("complete": false) is shown as far as it got; a value that is
missing or not a number shows as n/a.
"""

from __future__ import annotations

from reports import charts
from reports.htmlkit import esc, finite, not_available, number, section, table
from reports.results import VLLM_FILE, Result

GREEDY = "vllm-greedy"  # the reference every arm must equal, and the speed baseline
SUFFIX = "vllm-suffix"  # the strongest training-free peer: Oilbird's ratio to it is the bench's target
COMMAND = "make bench-vllm"
DASH = "—"


def _num(v, kind: str = "num") -> str:
    return number(v, kind) if finite(v) else "n/a"


def _rate(v) -> str:
    """tok/s, one decimal throughout the column."""
    return f"{v:,.1f}" if finite(v) else "n/a"


def _count(v) -> int | None:
    return int(v) if finite(v) and float(v).is_integer() and v >= 0 else None


def _device(device) -> str:
    """The device in words (escaped): its type, cores and any other named property."""
    if not isinstance(device, dict):
        return "an unrecorded device"
    bits = []
    for key, v in device.items():
        if key == "cores" and _count(v):
            bits.append(f"{_count(v)} cores")
        elif isinstance(v, str) and v:
            bits.append(v)
        elif finite(v):
            bits.append(f"{key} {number(v)}")
    return esc(", ".join(bits)) if bits else "an unrecorded device"


def _mode(r: dict) -> str:
    """A row's vLLM mode: compiled (vLLM's default compilation) or eager; a row written before the bench recorded
    it was run eager."""
    return r.get("mode") if r.get("mode") in ("compiled", "eager") else "eager"


def _ordered(summary: dict, settings: dict) -> tuple[list[int], list[str], dict[tuple[int, str, str], dict], int]:
    """(batch sizes, arms, {(batch, arm, mode): row}, rows dropped): the settings' order, then anything else the
    rows hold; a row that is not an object or lacks its arm or batch size is dropped."""
    batches = [b for b in settings.get("batches") or [] if _count(b)] if isinstance(settings.get("batches"),
                                                                                     list) else []
    arms = [str(a) for a in settings.get("arms") or [] if isinstance(a, str) and a] if isinstance(
        settings.get("arms"), list) else []
    rows: dict[tuple[int, str, str], dict] = {}
    dropped = 0
    for r in summary.get("rows") or []:
        arm = r.get("arm") if isinstance(r, dict) else None
        batch = _count(r.get("batch")) if isinstance(r, dict) else None
        if not (isinstance(arm, str) and arm and batch):
            dropped += 1
            continue
        rows.setdefault((batch, arm, _mode(r)), r)
        if arm not in arms:
            arms.append(arm)
        if batch not in batches:
            batches.append(batch)
    batches = sorted({int(b) for b in batches})
    return batches, arms, rows, dropped


def _identical(r: dict) -> tuple[str, bool]:
    """The cell "n/N" (flagged when n != N) and whether the row is a losslessness failure."""
    n, total = _count(r.get("identical_to_ar")), _count(r.get("requests"))
    if n is None or total is None:
        return "n/a", False
    if n != total:
        return f"<strong>{n:,}/{total:,} — NOT lossless</strong>", True
    return f"{n:,}/{total:,}", False


def _replay_cells(r: dict, oilbird: bool) -> list[str]:
    """The replay's predicted mean acceptance length and vLLM's over it; dashes for an arm the replay cannot
    predict (vLLM's own methods)."""
    if not oilbird:
        return [DASH, DASH]
    pred, got, ratio = r.get("replay_mean_acceptance_length"), r.get("mean_acceptance_length"), \
        r.get("acceptance_vs_replay")
    if not finite(ratio) and finite(pred) and finite(got) and pred > 0:
        ratio = got / pred
    return [_num(pred, "2f"), _num(ratio, "ratio")]


def _agreement(ag) -> str:
    if not isinstance(ag, dict):
        return "<p>Agreement with the store: not known yet (vLLM greedy has not finished).</p>"
    n, total = _count(ag.get("identical")), _count(ag.get("requests"))
    fd = ag.get("first_divergence")
    median = fd.get("median") if isinstance(fd, dict) else None
    text = (f"<p>Agreement with the store: vLLM greedy's output equals the store's capture (our harness's greedy) "
            f"on <strong>{_num(n)} of {_num(total)}</strong> requests")
    if n is not None and total is not None and n < total:
        text += f"; where they differ, the first differing token is at position {_num(median)} (median)"
    return text + (". The replay predicts vLLM's acceptance exactly only on requests both engines decode "
                   "alike.</p>")


def vllm_section(result: Result) -> str:
    sid, title = "vllm", "In vLLM"
    if result.vllm is None:
        return section(sid, title, not_available(f"{result.vllm_note}; rerun `{COMMAND}`")) if result.vllm_note \
            else ""
    s = result.vllm
    settings = s.get("settings") if isinstance(s.get("settings"), dict) else {}
    batches, arms, rows, dropped = _ordered(s, settings)
    replayed = s.get("replay") if isinstance(s.get("replay"), dict) else {}
    modes = [m for m in ("compiled", "eager") if any(key[2] == m for key in rows)]
    declared = settings.get("modes") if isinstance(settings.get("modes"), list) else None  # older benches: one mode
    expected = len(batches) * len(arms) * max(1, len(declared or [None]))
    if s.get("complete") is True:
        state = "complete"
    else:
        state = (f"incomplete: the bench was still running or was stopped ({len(rows)} of {expected} "
                 "(batch, arm, mode) runs written)")
    batch_text = ", ".join(str(b) for b in batches) or "n/a"
    intro = (f"<p>vLLM decoded the store's first {_num(settings.get('limit'))} requests, at most "
             f"{_num(settings.get('max_new'))} new tokens each, greedy, every speculative arm drafting "
             f"{_num(settings.get('k'))} tokens per step, at batch size(s) {batch_text}, on {_device(s.get('device'))} "
             f"(<code>{esc(VLLM_FILE)}</code>, {esc(state)}).</p>")
    if not rows:
        return section(sid, title, intro, not_available("no (batch, arm) run has finished yet"))
    table_rows, failures = [], []
    for batch in batches:
        for arm in arms:
            for mode in modes:
                r = rows.get((batch, arm, mode))
                if r is None:
                    continue
                ident, bad = _identical(r)
                if bad:
                    failures.append(f"{arm} at batch {batch} ({mode})")
                oilbird = arm in replayed or "replay_mean_acceptance_length" in r
                acc = r.get("mean_acceptance_length")
                table_rows.append([f"<code>{esc(arm)}</code>", _num(batch), esc(mode), _rate(r.get("tok_s")),
                                   _num(r.get("speedup_vs_ar"), "ratio"),
                                   DASH if arm in (GREEDY, SUFFIX) else _num(r.get("vs_suffix"), "ratio"),
                                   DASH if arm == GREEDY and not finite(acc) else _num(acc, "2f"),
                                   *_replay_cells(r, oilbird), ident])
    tbl = table(["arm", "batch", "vLLM mode", "tok/s", "speedup over greedy", "over vLLM suffix",
                 "mean acceptance length", "replay predicts", "vLLM / replay", "identical to greedy"], table_rows,
                {1, 3, 4, 5, 6, 7, 8, 9},
                caption="vLLM mode: compiled (vLLM's default compilation, what it serves with) or eager "
                        "(enforce_eager); speedup: tok/s over vLLM greedy's at the same batch size in the same mode "
                        "(median over the rounds); over vLLM suffix: the same against vLLM's suffix method; mean "
                        "acceptance length: vLLM's counters, 1 + accepted / drafts; replay predicts: Oilbird's "
                        "replay of the same chain arm over the same requests, counted as vLLM counts (Oilbird arms "
                        f"only, {DASH} otherwise); identical to greedy: requests whose tokens equal vLLM greedy's.")
    parts = [intro, tbl]
    if failures:
        parts.append('<p class="callout off">Not lossless: ' + esc("; ".join(failures)) + " produced output that "
                     "differs from vLLM greedy's. A speculative method must reproduce greedy decoding token for "
                     "token.</p>")
    if dropped:
        parts.append(f'<p class="note">{dropped} row(s) without an arm or a batch size were left out.</p>')
    parts.append(_agreement(s.get("agreement_with_store")))
    ran = sorted({b for b, _, _ in rows})  # batch sizes with at least one finished run
    main_mode = modes[0] if modes else "compiled"  # the chart: the first mode (compiled when it ran)
    if len(ran) >= 2:
        series = {arm: [rows[(b, arm, main_mode)].get("speedup_vs_ar") if (b, arm, main_mode) in rows
                        and finite(rows[(b, arm, main_mode)].get("speedup_vs_ar")) else None for b in ran]
                  for arm in arms if arm != GREEDY}
        series = {arm: v for arm, v in series.items() if any(x is not None for x in v)}
        if series:
            parts.append(charts.batch_chart(ran, series, name="vllm-batch"))
            parts.append('<p class="caption">Speedup over vLLM greedy at each batch size; dashed: parity '
                         "(1.0).</p>")
    return section(sid, title, *parts)
