"""Store sets: several trace stores (one per serving replica or capture shard) read as ONE serving stream.

A set is given as a folder holding stores (each a subfolder with meta.json; members in name order) or
as a comma-separated list of store folders (members in the order given). Every reader that takes a
store takes a set through the functions here (`open_store_or_set`, `current_fingerprint`,
`current_summary`, `read_store_meta`, `verify_store_or_set`); a single store goes to the single-store
reader unchanged, so its results stay what they were.

`open_store_or_set` returns one `TraceStore` (a `StoreSet`): the members' requests merged into one
stream and numbered 0..N-1, their positions, states and top-k rows in the same order, so the census,
replay and their rules (a request's pool leaves out earlier requests with the same prompt_hash; one
pool per tenant) work across stores with no code of their own.

Order. Requests in the order they finished: by `finished_at` (Unix seconds the writer committed the
request, data/store/writer.py; the served store stamps when serving finished it), ties by member order,
then by the member's own request index. When a member lacks `finished_at` (a store written before it
was recorded: a null in the column), the set orders whole stores instead, by their first request's
`finished_at` or else meta.json `created`, ties by member order, and keeps each store's own order; the
set's `order_note` says so (the census and replay record it among their notes).

Fingerprint: sha256 over the members' fingerprints in member order (`set_fingerprint`); results record
it as `store_fingerprint`, so a member extended, recaptured or edited makes them stale like a store's.

Combining is refused, in one line, for members of another model (weight fingerprint), layer, n_layers,
d_model, vocab size, dtype, tokenizer or chat template, prompt-hash scheme, capture mode or store format,
and for an empty set, a member that is not a store, and the same store given twice (by path, or a copy:
the same fingerprint). The set's meta is the members' common meta (COMBINED must agree; the token cap is
the largest, `created` the earliest) plus `store_set` (members, their fingerprints, the order rule).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from data.errors import OilbirdError
from data.store import reader
from data.store.reader import TraceStore, _store_format, open_store, read_meta
from data.store.statefiles import StateFiles

SEPARATOR = ","
# meta.json fields every member must share: states, token ids or prompt hashes of two settings in one stream
# would be compared as if they were one (the census's pools, replay's drafters)
COMBINED = {"model_fingerprint": "model (weight fingerprint)", "layer": "layer", "n_layers": "n_layers",
            "d_model": "d_model", "vocab_size": "vocab size", "dtype": "dtype", "tokenizer_hash": "tokenizer",
            "chat_template_hash": "chat template", "prompt_hash_scheme": "prompt-hash scheme", "mode": "capture mode"}
# meta.json fields that describe one store's capture, not the set's: left out of the set's meta
PER_STORE = ("checksums", "pending", "migrating", "meta_sha256", "runs", "limit", "requests_total", "truncated",
             "seconds_total", "agreement", "migrated_from_format")
ORDER_FINISHED, ORDER_STORES = "finished_at", "stores"


@dataclass
class StoreSet(TraceStore):
    """A set of stores as one TraceStore (module docstring): rows merged in finishing order."""

    members: list[Path] = field(default_factory=list)
    member_fingerprints: list[str] = field(default_factory=list)
    member_of: np.ndarray | None = None  # [n_requests] the member each merged request came from
    member_request: np.ndarray | None = None  # [n_requests] its index in that member
    order: str = ORDER_FINISHED
    order_note: str | None = None
    members_sealed: bool = True

    @property
    def fingerprint(self) -> str:
        return set_fingerprint(self.member_fingerprints)

    @property
    def meta_sealed(self) -> bool:
        return self.members_sealed


def set_fingerprint(member_fingerprints: list[str]) -> str:
    """The set's `store_fingerprint`: sha256 over its members' fingerprints in member order."""
    blob = json.dumps({"store_set": list(member_fingerprints)})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def set_members(spec: str | Path) -> list[Path] | None:
    """The member folders of the set `spec` names, or None when it names one store (or nothing: the
    single-store reader then says what is missing). Refuses an empty set, a member that is not a store, a
    store named twice."""
    text = str(spec)
    if SEPARATOR in text:
        members = [Path(p.strip()) for p in text.split(SEPARATOR) if p.strip()]
        if not members:
            raise OilbirdError(f"store set {text!r} names no store folder; give e.g. runs/a/traces,runs/b/traces")
        for m in members:
            if not (m / "meta.json").is_file():
                raise OilbirdError(f"store set member {m} is not a trace store (no meta.json there); give store "
                                   "folders, each holding meta.json")
    else:
        folder = Path(text)
        if not folder.is_dir() or (folder / "meta.json").exists():
            return None
        subs = _subfolders(folder)
        if not subs:
            raise OilbirdError(f"no trace store at {folder}: no meta.json, and no store folders in it (a store set is "
                               "a folder of stores, each a subfolder with meta.json); run `python -m data capture` first")
        for m in subs:
            if not (m / "meta.json").is_file():
                raise OilbirdError(f"store set {folder}: {m.name}/ is not a trace store (no meta.json); a store set "
                                   "folder holds only store folders: move it out")
        members = subs
    seen: dict[Path, Path] = {}
    for m in members:
        key = m.resolve()
        if key in seen:
            raise OilbirdError(f"store set {text} names the store {key} twice; name each store once")
        seen[key] = m
    return members


def _subfolders(folder: Path) -> list[Path]:
    """A set folder's member candidates: its subfolders but dot-named ones, in name order."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_stores(folder: str | Path) -> list[Path]:
    """The stores a folder holds as a set (the subfolders `set_members` would read, those with meta.json),
    never raising: [] for a folder that is one store itself (meta.json), holds no store, or is no folder.
    What a writer asks before it puts a store there (data/capture/run.py: a folder is one store or one set)."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / "meta.json").exists():
        return []
    return [m for m in _subfolders(folder) if (m / "meta.json").is_file()]


def is_store_set(spec: str | Path) -> bool:
    return set_members(spec) is not None


def holds_traces(spec: str | Path) -> bool:
    """A store or a readable store set is there (never raises: a reader then says what is wrong)."""
    if (Path(spec) / "meta.json").exists():
        return True
    try:
        return is_store_set(spec)
    except OilbirdError:
        return False


def _check_combinable(spec, members: list[Path], metas: list[dict], fingerprints: list[str | None]) -> None:
    """One line for members that cannot be read as one stream (module docstring)."""
    first, m0 = members[0], metas[0]
    for path, meta in zip(members[1:], metas[1:]):
        for key, what in COMBINED.items():
            if meta.get(key) != m0.get(key):
                raise OilbirdError(f"store set {spec}: {path} has {what} {meta.get(key)!r}, {first} has "
                                   f"{m0.get(key)!r}: stores of another {what} cannot be read as one stream; "
                                   "give stores captured with the same model and settings")
        if _store_format(meta) != _store_format(m0):
            raise OilbirdError(f"store set {spec}: {path} has store format {_store_format(meta)}, {first} has "
                               f"{_store_format(m0)}: run `python -m data migrate` on the older one first")
    seen: dict[str, Path] = {}
    for path, fp in zip(members, fingerprints):
        if fp is not None and fp in seen:
            raise OilbirdError(f"store set {spec}: {path} and {seen[fp]} are the same store (fingerprint {fp}): "
                               "a copy would count its requests twice; name each store once")
        if fp is not None:
            seen[fp] = path


def _created(meta: dict) -> float:
    """meta.json `created` as Unix seconds (inf when absent or unreadable: such a store goes last)."""
    try:
        t = datetime.datetime.fromisoformat(str(meta.get("created")))
    except ValueError:
        return float("inf")
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def _set_meta(metas: list[dict], members: list[Path], fingerprints: list[str], order: str,
              note: str | None, n_requests: int) -> dict:
    """The members' common meta (module docstring), with `store_set` describing the set."""
    meta = {k: v for k, v in metas[0].items() if k not in PER_STORE}
    benches = list(dict.fromkeys(str(m.get("bench")) for m in metas))
    meta.update(bench=benches[0] if len(benches) == 1 else "+".join(benches),
                max_new_tokens=max(int(m["max_new_tokens"]) for m in metas),
                created=min((m.get("created") for m in metas), key=lambda c: _created({"created": c})),
                data_fingerprint=hashlib.sha256(json.dumps([m.get("data_fingerprint") for m in metas]).encode())
                .hexdigest()[:16],
                complete=all(m.get("complete") for m in metas), n_requests=n_requests,
                store_format=_store_format(metas[0]))
    meta["store_set"] = {"members": [str(m) for m in members], "fingerprints": list(fingerprints),
                         "fingerprint": set_fingerprint(fingerprints), "order": order, "note": note}
    return meta


def read_store_meta(spec: str | Path) -> dict:
    """A store's checked meta.json (reader.read_meta), or a set's common meta (members checked to combine;
    the fingerprints in it are the members' as they are now)."""
    members = set_members(spec)
    if members is None:
        return read_meta(Path(spec))
    metas = [read_meta(m) for m in members]
    fps = [reader.current_fingerprint(m) for m in members]
    _check_combinable(spec, members, metas, fps)
    n = sum(int(m.get("n_requests") or 0) for m in metas)
    return _set_meta(metas, members, [f or "" for f in fps], ORDER_FINISHED, None, n)


def current_fingerprint(spec: str | Path) -> str | None:
    """reader.current_fingerprint for a store; for a set, the set's fingerprint from its members' as they are
    now (None when one has none: it cannot be compared)."""
    try:
        members = set_members(spec)
    except OilbirdError:
        return None
    if members is None:
        return reader.current_fingerprint(spec)
    fps = [reader.current_fingerprint(m) for m in members]
    return None if any(f is None for f in fps) else set_fingerprint(fps)


def current_summary(summary_path: str | Path, spec: str | Path, **expected) -> dict | None:
    """reader.current_summary for a store; for a set, the same test against every member being complete and
    the set's fingerprint now (what `--if-missing` reuses)."""
    try:
        members = set_members(spec)
    except OilbirdError:
        return None
    if members is None:
        return reader.current_summary(summary_path, spec, **expected)
    from data.readfile import read_json

    summary_path = Path(summary_path)
    if not summary_path.exists():
        return None
    try:
        summary = read_json(summary_path, "summary")
        if not all(read_json(m / "meta.json", "trace store meta.json").get("complete") for m in members):
            return None
    except (OilbirdError, AttributeError):
        return None
    if not isinstance(summary, dict) or summary.get("store_fingerprint") != current_fingerprint(spec):
        return None
    return summary if all(summary.get(k) == v for k, v in expected.items()) else None


def _order(stores: list[TraceStore]) -> tuple[np.ndarray, np.ndarray, str, str | None]:
    """(member of each merged request, its index there, the order rule, the note when stores are ordered whole)."""
    member = np.concatenate([np.full(s.n_requests, i, np.int64) for i, s in enumerate(stores)])
    index = np.concatenate([np.arange(s.n_requests, dtype=np.int64) for s in stores])
    finished = [s.requests["finished_at"] for s in stores]
    lacking = [i for i, f in enumerate(finished) if f.null_count()]
    if not lacking:
        t = np.concatenate([f.to_numpy().astype(np.float64) for f in finished])
        perm = np.lexsort((index, member, t))  # by finish time, then member order, then the member's own order
        return member[perm], index[perm], ORDER_FINISHED, None
    def start(i: int) -> float:
        first = finished[i][0] if len(finished[i]) else None
        return float(first) if first is not None else _created(stores[i].meta)
    ranked = sorted(range(len(stores)), key=lambda i: (start(i), i))
    names = ", ".join(str(stores[i].path) for i in lacking[:3]) + (" ..." if len(lacking) > 3 else "")
    note = (f"store set ordered store by store (by each store's first finish time, else its meta.json `created`), "
            f"each store in its own order: {names} lack finished_at (written before it was recorded)")
    perm = np.concatenate([np.flatnonzero(member == i) for i in ranked])
    return member[perm], index[perm], ORDER_STORES, note


def _merge(spec: str, members: list[Path], stores: list[TraceStore]) -> StoreSet:
    """The members' rows as one store, in the set's order (module docstring)."""
    member, index, order, note = _order(stores)
    n = len(member)
    lengths = np.concatenate([np.diff(s.offsets) for s in stores]).astype(np.int64)
    req_base = np.concatenate([[0], np.cumsum([s.n_requests for s in stores])[:-1]]).astype(np.int64)
    row_base = np.concatenate([[0], np.cumsum([int(s.offsets[-1]) for s in stores])[:-1]]).astype(np.int64)
    flat = req_base[member] + index  # each merged request's place in the members' concatenation
    starts = np.concatenate([row_base[i] + s.offsets[:-1] for i, s in enumerate(stores)]).astype(np.int64)[flat]
    lens = lengths[flat]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rows = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
    identity = np.array_equal(flat, np.arange(n))  # stores one after the other: concatenation is the order

    def gather(arrays: list[np.ndarray], take: np.ndarray) -> np.ndarray:
        joined = np.concatenate(arrays)
        return joined if identity or not len(joined) else joined[take]

    requests = pl.concat([s.requests for s in stores], how="vertical")
    positions = pl.concat([s.positions for s in stores], how="vertical")
    if not identity:
        requests, positions = requests[flat], positions[rows]
    requests = requests.with_columns(pl.Series("request", np.arange(n, dtype=np.int32)))
    positions = positions.with_columns(pl.Series("request", np.repeat(np.arange(n, dtype=np.int32), lens)))
    # load_hidden=False: no states nor validity; defer_hidden: validity, and the states where they lie
    loaded = all(len(s.hidden) == int(s.offsets[-1]) for s in stores)
    hidden = gather([s.hidden for s in stores], rows) if loaded else stores[0].hidden
    known = all(len(s.hidden_valid) == int(s.offsets[-1]) for s in stores)
    valid = gather([s.hidden_valid for s in stores], rows) if known else stores[0].hidden_valid
    state_files = None
    if not loaded and all(s.state_files is not None for s in stores):
        state_files = StateFiles.concat([s.state_files for s in stores]).permuted(None if identity else rows)
    fps = [s.fingerprint for s in stores]
    meta = _set_meta([s.meta for s in stores], members, fps, order, note, n)
    reused = [s.meta.get("prompt_tokens_reused") for s in stores]
    if all(isinstance(r, list) and len(r) == s.n_requests for r, s in zip(reused, stores)):
        meta["prompt_tokens_reused"] = [x for r in reused for x in r] if identity else \
            [reused[m][i] for m, i in zip(member, index)]
    return StoreSet(path=Path(spec), meta=meta, requests=requests, positions=positions, hidden=hidden,
                    hidden_valid=valid, topk=gather([s.topk for s in stores], rows),
                    prompt_last_hidden=gather([s.prompt_last_hidden for s in stores], flat),
                    prompt_last_topk=gather([s.prompt_last_topk for s in stores], flat), offsets=offsets,
                    verified=all(s.verified for s in stores), file_checksums=None, state_files=state_files,
                    members=list(members),
                    member_fingerprints=fps, member_of=member, member_request=index, order=order,
                    order_note=note, members_sealed=all(s.meta_sealed for s in stores))


def open_store_or_set(spec: str | Path, **kwargs) -> TraceStore:
    """reader.open_store for a store; for a set, every member opened (and checked) the same way, then
    merged into one StoreSet (module docstring). `kwargs` go to open_store."""
    members = set_members(spec)
    if members is None:
        return open_store(spec, **kwargs)
    _check_combinable(spec, members, [read_meta(m) for m in members], [None] * len(members))  # before any read
    if kwargs.get("defer_hidden") and not all(reader.can_defer_states(read_meta(m)) for m in members):
        kwargs = dict(kwargs, defer_hidden=False)  # one member's states in memory: every member's (one array)
    stores = [open_store(m, **kwargs) for m in members]
    _check_combinable(spec, members, [s.meta for s in stores], [s.fingerprint for s in stores])
    return _merge(str(spec), members, stores)


def set_provenance(store: TraceStore) -> dict:
    """What a result records about a set beside its `store_fingerprint` (the set's): `store_set` with the
    member count, the members and the order rule; {} for a single store."""
    if not isinstance(store, StoreSet):
        return {}
    return {"store_set": {"members": len(store.members), "paths": [str(m) for m in store.members],
                          "order": store.order, "note": store.order_note}}


def verify_store_or_set(spec: str | Path) -> str:
    """`python -m data verify` of a store (data/store/verify.py), or of a set: every member's full check
    (one OK line each), then the set's own (members combine, no store twice) and its OK line."""
    from data.store.verify import verify_store

    members = set_members(spec)
    if members is None:
        return verify_store(spec)
    metas = [read_meta(m) for m in members]
    _check_combinable(spec, members, metas, [None] * len(members))  # the set's own refusal before any long check
    lines = [verify_store(m) for m in members]
    fps = [reader.current_fingerprint(m) for m in members]
    _check_combinable(spec, members, metas, fps)
    n = sum(int(m.get("n_requests") or 0) for m in metas)
    lacking = [str(m) for m in members if _lacks_finish_times(m)]
    order = ("in the order requests finished (finished_at)" if not lacking else
             f"store by store ({', '.join(lacking[:3])} lack finished_at)")
    lines.append(f"OK: store set {spec}: {len(members)} stores, {n} requests, fingerprint {set_fingerprint(fps)}; "
                 f"one stream {order}")
    return "\n".join(lines)


def _lacks_finish_times(path: Path) -> bool:
    import pyarrow.parquet as pq

    file = path / "requests.parquet"  # verified just before (verify_store): its checksum holds
    if "finished_at" not in pq.read_schema(file).names:
        return True
    return bool(pq.read_table(file, columns=["finished_at"]).column("finished_at").null_count)
