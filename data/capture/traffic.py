"""Traffic that grows: a store captured from a JSONL file extends when the file only gained requests at its end.

meta.json already records what recognising that needs: `data_fingerprint` is the fingerprint of the whole
traffic the store was captured from (data/benchmarks/request.py) and `requests_total` its number of requests.
The old traffic is the new one's first `requests_total` requests exactly when
`data_fingerprint(new[:requests_total]) == data_fingerprint`, so no other field is kept. Capture then keeps the
store, decodes only the requests it does not hold (their indices continue the store's, each with its own
tenant and prompt hash, so the census's same-prompt and tenant rules see them as a capture of the whole
file would), and the store's `data_fingerprint` and `requests_total` become the grown traffic's: they are
written with the store's next meta.json write, before any new request is committed, so a capture killed
midway resumes as an ordinary one.

Anything else (an edited, removed or reordered line, or lines removed at the end) is refused in one line
naming the first request that differs, found by comparing the rows the store holds (id, group, tenant,
prompt hash) with the traffic; `--force` recaptures the store from the traffic as it is now.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data.benchmarks.request import Request, data_fingerprint
from data.errors import OilbirdError
from data.store.reader import read_meta
from data.store.schema import prompt_hash


@dataclass(frozen=True)
class TrafficChange:
    """The traffic differs from the one a store was captured from (meta.json `data_fingerprint`)."""

    store_fingerprint: str  # meta.json data_fingerprint: the traffic the store was captured from
    store_total: int  # meta.json requests_total: that traffic's number of requests
    fingerprint: str  # the traffic given now
    total: int
    extends: bool  # the store's traffic is the first `store_total` requests of this one, unchanged


def traffic_change(store: Path, every_request: list[Request], force: bool) -> TrafficChange | None:
    """How the traffic given now differs from the store's; None where it does not, where there is no
    store yet, with --force (the store is recaptured), or for a store that does not record `requests_total`
    (the writer's settings check refuses a changed fingerprint there, as before)."""
    if force or not (Path(store) / "meta.json").exists():
        return None
    meta = read_meta(Path(store))
    old, old_total = meta.get("data_fingerprint"), meta.get("requests_total")
    new = data_fingerprint(every_request)
    if old == new or not isinstance(old, str) or isinstance(old_total, bool) or not isinstance(old_total, int) \
            or old_total < 1:
        return None
    extends = old_total < len(every_request) and data_fingerprint(every_request[:old_total]) == old
    return TrafficChange(old, old_total, new, len(every_request), extends)


def _where(req: Request, index: int, source: str | None) -> str:
    """A request as the user finds it: its line of the JSONL file, else its index and id."""
    if req.line is not None and source:
        return f"line {req.line} of {source} (request {index}, id {req.id!r})"
    return f"request {index} (id {req.id!r})"


def refuse_changed(store: Path, change: TrafficChange, held: pa.Table, every_request: list[Request],
                   prompts: list[list[int]], source: str | None, references: list[list[int]] | None = None) -> None:
    """Raise the one-line refusal of traffic that is not the store's grown by lines at its end, naming the
    first held request that differs from the traffic (`prompts`: the traffic's first prompts, as captured;
    `references`: in reference mode, their reference tokens, which a teacher-forced store holds as outputs)."""
    way_out = "pass --force to recapture the store from the traffic as it is now, or --out for another folder"
    head = f"trace store {store} was captured from other traffic"
    columns = {name: held.column(name).to_pylist() for name in ("id", "group", "tenant", "prompt_hash")}
    outputs = held.column("output_tokens").to_pylist() if references is not None else None
    for r in range(held.num_rows):
        if r >= len(every_request):
            raise OilbirdError(f"{head}: it holds {held.num_rows} requests but the traffic now has "
                               f"{len(every_request)} (request {r}, id {columns['id'][r]!r}, is gone); only lines "
                               f"added at the end extend a store; {way_out}")
        req = every_request[r]
        was = {"id": columns["id"][r], "group": columns["group"][r], "tenant": columns["tenant"][r]}
        now = {"id": req.id, "group": req.group, "tenant": req.tenant}
        diff = [f"{k} {was[k]!r} -> {now[k]!r}" for k in was if was[k] != now[k]]
        if not diff and r < len(prompts) and columns["prompt_hash"][r] != prompt_hash(prompts[r]):
            diff = ["its prompt changed"]
        if not diff and outputs is not None and r < len(references) and outputs[r] != references[r]:
            diff = ["its \"reference\" changed"]
        if diff:
            raise OilbirdError(f"{head}: {_where(req, r, source)} differs ({', '.join(diff)}); an edited, removed or "
                               f"reordered line cannot extend a store, only lines added at the end; {way_out}")
    raise OilbirdError(f"{head}: the traffic's first {change.store_total} requests are not those the store was "
                       f"captured from (meta.json data_fingerprint), though the {held.num_rows} it holds are unchanged: a "
                       "line after them, or a \"reference\", was edited, removed or reordered; only lines added at "
                       f"the end extend a store; {way_out}")


def note_extension(store: Path, change: TrafficChange, held: int) -> None:
    print(f"note: the traffic gained {change.total - change.store_total} request(s) at its end since {store} was "
          f"captured (its first {change.store_total} unchanged): extending the store from request {held}",
          file=sys.stderr)
