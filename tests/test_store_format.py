"""Store format 2 (data/store/schema.py docstring): no null row in a fixed-size-list column, a validity
column instead; stores of format 1 (null rows) still open, under pyarrow < 26 through a fallback or
one line naming `python -m data migrate`, which rewrites them in format 2.

Format-1 stores are made here by turning a format-2 store's files back into the null layout
(`to_format1`), or taken from tests/golden/store-format1 (written that way by pyarrow 26, from
`golden_records()`): the copy every pyarrow can open, including those that cannot write null rows
in the middle of a column (pyarrow 15: "Lists with non-zero length null components are not
supported"), so the floor environment (make test-floor) reads a real format-1 file too. Remade
(only if the writer's tables change) with pyarrow >= 26:
    rm -r tests/golden/store-format1; python -c "from pathlib import Path; from tests.test_store_format import *; \
               to_format1(write_store(Path('tests/golden/store-format1'), golden_records()))"
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.store.legacy as legacy_mod
import data.store.migrate as migrate_mod
import data.store.parquetfile as storefile_mod
from data.__main__ import main as data_main
from data.errors import OilbirdError
from data.store.parquetfile import NULL_ROW_ERROR
from data.store.reader import open_store, position_parts
from data.store.schema import (
    PROMPT_HASH_SCHEME,
    STORE_FORMAT,
    TOPK,
    VALIDITY,
    prompt_hash,
)
from data.store.verify import verify_store
from data.store.writer import StoreWriter, TraceRecord, record_checksums

GOLDEN = Path(__file__).parent / "golden" / "store-format1"
D = 16


# ---------------------------------------------------------------- stores to compare

def golden_records(d: int = D) -> list[TraceRecord]:
    """Five requests of 1..5 generated tokens, values from formulas (no RNG: the same on every numpy).
    The last token of each has no state; its rows hold junk, which the store must not keep."""
    records = []
    for r in range(5):
        n = r + 1
        rows = np.arange(n * d, dtype=np.float64).reshape(n, d)
        hidden = np.sin(rows + 10 * r).astype(np.float16)
        topk = ((rows[:, :TOPK] * 7 + r) % 97 + 3).astype(np.int32)
        valid = np.arange(n) < n - 1
        prompt = [1 + r, 5, 9 + r]
        records.append(TraceRecord(
            request=r, id=f"r{r}", group="g", prompt_hash=prompt_hash(prompt), prompt_tokens=prompt,
            output_tokens=[int(t) for t in (np.arange(n) * 3 + r) % 90 + 3], stop_reason="length", seconds=0.5,
            hidden=hidden, hidden_valid=valid, topk=topk,
            prompt_last_hidden=np.cos(np.arange(d) + r).astype(np.float16),
            prompt_last_topk=(np.arange(TOPK) * 5 + r) % 90 + 3))
    return records


def write_store(path: Path, records: list[TraceRecord], d: int = D, per_part: int = 2) -> Path:
    meta = dict(model="synthetic", model_fingerprint="fp", layer=1, n_layers=1, d_model=d, dtype="float32",
                tokenizer_hash="t", chat_template_hash="c", bench="b", data_fingerprint="f", mode="generate",
                max_new_tokens=8, versions={}, created="2026-01-01T00:00:00", vocab_size=100,
                prompt_hash_scheme=PROMPT_HASH_SCHEME)
    w = StoreWriter(path, meta)
    for i in range(0, len(records), per_part):
        w.append(records[i:i + per_part])
    w.finish()
    return path


def to_format1(path: Path) -> None:
    """Rewrite a format-2 store as code before store formats wrote it: null rows where the validity
    column is false, no validity column, no `store_format` in meta.json; checksums re-recorded (the
    bytes are what that code would have written and recorded)."""
    for f in [path / "requests.parquet", *position_parts(path)]:
        table = pq.read_table(f)
        for name, cols in VALIDITY.items():
            if name not in table.column_names:
                continue
            invalid = pa.array(~table.column(name).to_numpy().astype(bool))
            for c in cols:
                col = table.column(c).combine_chunks()
                nulled = pa.FixedSizeListArray.from_arrays(col.values, col.type.list_size, mask=invalid)
                table = table.set_column(table.schema.get_field_index(c), table.schema.field(c), nulled)
            table = table.drop_columns([name])
        # recorded since store sets (finished_at) and since sampled requests: format-1 writers never wrote them
        table = table.drop_columns([c for c in ("finished_at", "sampling", "off_argmax") if c in table.column_names])
        pq.write_table(table, f, compression="zstd")
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("store_format", None)
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    record_checksums(path)


def _can_write_null_rows() -> bool:
    mask = pa.array([False, True, False])
    col = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(6, np.float16)), 2, mask=mask)
    try:
        pq.write_table(pa.table({"h": col}), pa.BufferOutputStream())
    except pa.ArrowNotImplementedError:
        return False
    return True


needs_null_writer = pytest.mark.skipif(
    not _can_write_null_rows(),
    reason=f"pyarrow {pa.__version__} cannot write null rows inside a fixed-size-list column (the format-1 "
           "layout these tests rebuild); tests/golden/store-format1 covers reading one here")


def _pyarrow_reads_null_rows() -> bool:
    col = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(6, np.float16)), 2, mask=pa.array([False, True, False]))
    sink = pa.BufferOutputStream()
    try:
        pq.write_table(pa.table({"h": col}), sink)
        pq.read_table(pa.BufferReader(sink.getvalue()))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def assert_same_store(a, b) -> None:
    assert a.n_requests == b.n_requests
    assert a.positions.equals(b.positions)
    # finished_at is a commit time: null in a format-1 store (written before it), another time in each new one
    assert a.requests.drop("finished_at").equals(b.requests.drop("finished_at"))
    np.testing.assert_array_equal(a.offsets, b.offsets)
    for name in ("hidden", "hidden_valid", "topk", "prompt_last_hidden", "prompt_last_topk"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def _fixed_size_columns(f: Path) -> list[str]:
    return [fld.name for fld in pq.read_schema(f) if pa.types.is_fixed_size_list(fld.type)]


def _sha(f: Path) -> str:
    return hashlib.sha256(f.read_bytes()).hexdigest()


@pytest.fixture
def new_store(tmp_path):
    return write_store(tmp_path / "new" / "traces", golden_records())


@pytest.fixture
def old_store(tmp_path):
    """A format-1 store with the same content as new_store."""
    path = tmp_path / "old" / "traces"
    if _can_write_null_rows():
        to_format1(write_store(path, golden_records()))
    else:
        shutil.copytree(GOLDEN, path)
    return path


def _cli(argv, capsys) -> tuple[int, str, str]:
    code = data_main(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


# ---------------------------------------------------------------- (a) the writer

def test_writer_writes_no_null_row_and_a_validity_column(new_store):
    st = open_store(new_store)
    assert st.meta["store_format"] == STORE_FORMAT == 2 and "migrated_from_format" not in st.meta
    files = [new_store / "requests.parquet", *position_parts(new_store)]
    assert len(files) == 4
    for f in files:
        table = pq.read_table(f)
        cols = _fixed_size_columns(f)
        assert len(cols) == 2
        for c in cols:
            assert table.column(c).null_count == 0, (f.name, c)
    pos = pa.concat_tables([pq.read_table(f) for f in position_parts(new_store)])
    valid = pos.column("hidden_valid").to_numpy()
    assert pos.schema.field("hidden_valid").type == pa.bool_() and not pos.schema.field("hidden_valid").nullable
    np.testing.assert_array_equal(valid, st.hidden_valid)
    assert (~valid).sum() == 5  # every request's last token
    hidden = np.stack(pos.column("hidden").to_numpy(zero_copy_only=False))
    assert not hidden[~valid].any() and hidden[valid].any()  # zeros where there is no state, not the junk
    req = pq.read_table(new_store / "requests.parquet")
    assert req.column("prompt_last_valid").to_pylist() == [True] * 5
    assert verify_store(new_store).startswith("OK")


def test_in_memory_api_is_unchanged(new_store):
    st = open_store(new_store)
    recs = golden_records()
    assert st.hidden.dtype == np.float16 and st.hidden.shape == (15, D)
    assert st.topk.dtype == np.int32 and st.topk.shape == (15, TOPK)
    assert st.hidden_valid.dtype == bool and st.prompt_last_hidden.shape == (5, D)
    assert "prompt_last_valid" not in st.requests.columns and "hidden_valid" not in st.positions.columns
    for r, rec in enumerate(recs):
        rows = slice(st.offsets[r], st.offsets[r + 1])
        np.testing.assert_array_equal(st.hidden_valid[rows], rec.hidden_valid)
        np.testing.assert_array_equal(st.hidden[rows][:-1], rec.hidden[:-1])
        assert not st.hidden[rows][-1].any() and not st.topk[rows][-1].any()
        np.testing.assert_array_equal(st.prompt_last_topk[r], rec.prompt_last_topk)


# ---------------------------------------------------------------- (b) format-1 stores open

def test_format1_store_opens_with_the_same_arrays(new_store, old_store):
    assert "store_format" not in json.loads((old_store / "meta.json").read_text())
    for f in [old_store / "requests.parquet", *position_parts(old_store)]:
        schema = pq.read_schema(f)
        assert "hidden_valid" not in schema.names and "prompt_last_valid" not in schema.names
    old = open_store(old_store)
    assert old.verified
    assert_same_store(old, open_store(new_store))
    assert verify_store(old_store).startswith("OK")


@needs_null_writer
def test_format1_files_hold_null_rows(old_store):
    if not _pyarrow_reads_null_rows():
        pytest.skip(f"pyarrow {pa.__version__} cannot read null rows (apache/arrow#35692)")
    parts = position_parts(old_store)
    assert sum(pq.read_table(f).column("hidden").null_count for f in parts) == 5


def test_golden_format1_store_is_format1_and_matches_its_records(tmp_path, new_store):
    """The committed format-1 store: written from golden_records() by to_format1, and read here by
    whatever pyarrow runs the tests (pyarrow < 26 through a fallback)."""
    path = tmp_path / "golden" / "traces"
    shutil.copytree(GOLDEN, path)
    meta = json.loads((path / "meta.json").read_text())
    assert "store_format" not in meta and meta["d_model"] == D
    for f in position_parts(path):
        assert "hidden_valid" not in pq.read_schema(f).names
    assert_same_store(open_store(path), open_store(new_store))


@needs_null_writer
def test_golden_format1_store_is_what_to_format1_writes(tmp_path):
    """Guards the golden copy against drift: to_format1 of today's writer gives the same tables."""
    path = to_format1_store(tmp_path)
    for f in ["requests.parquet", *[p.name for p in position_parts(path)]]:
        read = storefile_mod._read_table  # pyarrow's reader, or the fallback where pyarrow cannot read null rows
        assert read(path / f, None).equals(read(GOLDEN / f, None)), f


def to_format1_store(root: Path) -> Path:
    path = write_store(root / "fresh" / "traces", golden_records())
    to_format1(path)
    return path


# ---------------------------------------------------------------- the pyarrow < 26 path

def _break_pyarrow(monkeypatch, version_known: bool = False):
    """What pyarrow < 26 does with a file holding null rows of a fixed-size-list column; with
    `version_known`, the reader also knows it runs on such a pyarrow (it then sends a format-1 file
    to the fallbacks without trying)."""
    if version_known:
        monkeypatch.setattr(storefile_mod, "PYARROW_READS_NULL_ROWS", False)
    real = storefile_mod._read_arrow

    def read(source):
        table = real(source)
        if any(table.column(f.name).null_count for f in table.schema if pa.types.is_fixed_size_list(f.type)):
            # knowing the version, the reader must not try: pyarrow 25 can abort at exit after the failed read
            assert not version_known, "a format-1 file was read natively under pyarrow < 26"
            raise pa.ArrowInvalid(f"{NULL_ROW_ERROR}{D} but index 1 had size=0")
        return table

    monkeypatch.setattr(storefile_mod, "_read_arrow", read)


@pytest.mark.parametrize("version_known", [False, True], ids=["after-a-failed-read", "without-a-try"])
@pytest.mark.parametrize("fallback", legacy_mod.FALLBACKS, ids=lambda f: f.__name__)
def test_each_fallback_reads_a_format1_store(fallback, version_known, monkeypatch, old_store, new_store):
    if fallback is legacy_mod._read_with_polars and not hasattr(pl, "Float16"):
        pytest.skip(f"polars {pl.__version__} cannot read float16 Parquet columns")
    _break_pyarrow(monkeypatch, version_known)
    monkeypatch.setattr(legacy_mod, "FALLBACKS", (fallback,))
    assert_same_store(open_store(old_store), open_store(new_store))


@pytest.mark.parametrize("version_known", [False, True], ids=["after-a-failed-read", "without-a-try"])
def test_unreadable_format1_store_is_one_line_naming_migrate(version_known, monkeypatch, old_store, capsys):
    _break_pyarrow(monkeypatch, version_known)

    def fails(data):
        raise ValueError("cannot")

    monkeypatch.setattr(legacy_mod, "FALLBACKS", (fails, fails))
    with pytest.raises(OilbirdError) as e:
        open_store(old_store)
    msg = str(e.value)
    assert "\n" not in msg and "null state rows" in msg and "apache/arrow#35692" in msg
    assert f"python -m data migrate {old_store}" in msg and "pyarrow>=26" in msg
    code, out, err = _cli(["verify", str(old_store)], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "python -m data migrate" in err


def test_format2_store_never_needs_a_fallback(monkeypatch, new_store):
    _break_pyarrow(monkeypatch, version_known=True)
    monkeypatch.setattr(legacy_mod, "FALLBACKS", ())
    assert verify_store(new_store).startswith("OK")


def test_a_format2_store_requires_its_validity_column(new_store):
    part = position_parts(new_store)[0]
    pq.write_table(pq.read_table(part).drop_columns(["hidden_valid"]), part, compression="zstd")
    record_checksums(new_store)
    with pytest.raises(OilbirdError, match="hidden_valid: missing"):
        open_store(new_store)


# ---------------------------------------------------------------- (c) migrate

def test_migrate_rewrites_a_format1_store(old_store, new_store, capsys):
    before = open_store(old_store)
    code, out, err = _cli(["migrate", str(old_store)], capsys)
    assert code == 0 and err == "" and out.count("\n") == 1
    assert out.startswith(f"migrated {old_store}: store format 1 -> 2")
    meta = json.loads((old_store / "meta.json").read_text())
    assert meta["store_format"] == 2 and meta["migrated_from_format"] == 1 and "migrating" not in meta
    files = [old_store / "requests.parquet", *position_parts(old_store)]
    assert meta["checksums"] == {f.name: _sha(f) for f in files}  # recomputed over the new bytes
    for f in files:
        for c in _fixed_size_columns(f):
            assert pq.read_table(f).column(c).null_count == 0
    assert verify_store(old_store).startswith("OK") and "4 files match their checksums" in verify_store(old_store)
    after = open_store(old_store)
    assert after.verified
    assert_same_store(after, before)
    assert_same_store(after, open_store(new_store))
    # idempotent: one line, nothing touched
    stamp = {f.name: _sha(f) for f in [old_store / "meta.json", *files]}
    code, out, err = _cli(["migrate", str(old_store)], capsys)
    assert code == 0 and out == f"{old_store}: already in store format 2; nothing to migrate\n"
    assert stamp == {f.name: _sha(f) for f in [old_store / "meta.json", *files]}


def test_migrate_of_a_format2_store_is_a_no_op(new_store, capsys):
    stamp = {f.name: _sha(f) for f in new_store.iterdir()}
    code, out, _ = _cli(["migrate", str(new_store)], capsys)
    assert code == 0 and "already in store format 2" in out and out.count("\n") == 1
    assert stamp == {f.name: _sha(f) for f in new_store.iterdir()}


def test_migrate_refuses_bad_input_and_damage(tmp_path, old_store, capsys):
    for target in (tmp_path / "nope", tmp_path):
        code, out, err = _cli(["migrate", str(target)], capsys)
        assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    part = position_parts(old_store)[1]
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    part.write_bytes(bytes(blob))
    stamp = {f.name: _sha(f) for f in old_store.iterdir()}
    code, out, err = _cli(["migrate", str(old_store)], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "damaged" in err or "corrupt" in err
    assert stamp == {f.name: _sha(f) for f in old_store.iterdir()}  # refused, not migrated


def test_migrate_refuses_an_incomplete_store(old_store, capsys):
    meta = json.loads((old_store / "meta.json").read_text())
    (old_store / "meta.json").write_text(json.dumps(dict(meta, complete=False)))
    stamp = {f.name: _sha(f) for f in old_store.iterdir()}
    code, out, err = _cli(["migrate", str(old_store)], capsys)
    assert code == 2 and "incomplete" in err and err.count("\n") == 1
    assert stamp == {f.name: _sha(f) for f in old_store.iterdir()}


def test_rows_without_a_state_read_as_zeros_whatever_the_file_holds(new_store):
    """The in-memory contract (zeros where hidden_valid is false) holds for a format-2 file that
    keeps values there (another writer's, or a hand edit)."""
    part = position_parts(new_store)[0]
    table = pq.read_table(part)
    col = table.column("hidden").combine_chunks()
    values = pa.array(np.ones(len(col) * D, np.float16))
    table = table.set_column(3, table.schema.field("hidden"), pa.FixedSizeListArray.from_arrays(values, D))
    pq.write_table(table, part, compression="zstd")
    record_checksums(new_store)
    st = open_store(new_store)
    assert not st.hidden[~st.hidden_valid].any() and st.hidden[st.hidden_valid].all()


def test_interrupted_migration_opens_and_finishes(monkeypatch, old_store, new_store, capsys):
    real, calls = migrate_mod.atomic_write_bytes, {"n": 0}

    def crashing(path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # a kill after two of the four files were renamed into place
        return real(path, data)

    monkeypatch.setattr(migrate_mod, "atomic_write_bytes", crashing)
    with pytest.raises(KeyboardInterrupt):
        migrate_mod.migrate_store(old_store)
    monkeypatch.setattr(migrate_mod, "atomic_write_bytes", real)
    meta = json.loads((old_store / "meta.json").read_text())
    assert "migrating" in meta and "store_format" not in meta
    half = open_store(old_store)  # two files match their new checksums, two their old ones
    assert half.verified
    assert_same_store(half, open_store(new_store))
    code, out, _ = _cli(["migrate", str(old_store)], capsys)
    assert code == 0 and out.startswith("migrated")
    meta = json.loads((old_store / "meta.json").read_text())
    assert meta["store_format"] == 2 and "migrating" not in meta
    assert verify_store(old_store).startswith("OK")


def test_migration_of_a_store_older_than_checksums(old_store, new_store, capsys):
    meta = json.loads((old_store / "meta.json").read_text())
    legacy = {k: v for k, v in meta.items() if k not in ("checksums", "n_requests")}
    (old_store / "meta.json").write_text(json.dumps(legacy))
    code, out, _ = _cli(["migrate", str(old_store)], capsys)
    assert code == 0 and "no checksums" in out
    st = open_store(old_store)
    assert not st.verified and "checksums" not in st.meta and st.meta["store_format"] == 2
    assert_same_store(st, open_store(new_store))


def test_resuming_a_format1_store_writes_format2_parts(old_store, new_store):
    """A capture resumed (or extended) on a format-1 store appends format-2 parts; the store stays
    format 1 in meta.json until migrated, and reads the same."""
    meta = json.loads((old_store / "meta.json").read_text())
    meta["complete"] = False
    (old_store / "meta.json").write_text(json.dumps(meta))
    recs = golden_records()
    w = StoreWriter(old_store, {k: meta[k] for k in StoreWriter.SETTINGS if k in meta})
    assert w.done == 5
    extra = [TraceRecord(**{**r.__dict__, "request": 5 + i, "id": f"x{i}"}) for i, r in enumerate(recs[:2])]
    w.append(extra)
    w.finish()
    newest = position_parts(old_store)[-1]
    assert "hidden_valid" in pq.read_schema(newest).names
    assert "hidden_valid" not in pq.read_schema(position_parts(old_store)[0]).names
    st = open_store(old_store)
    assert "store_format" not in st.meta and st.n_requests == 7
    np.testing.assert_array_equal(st.hidden[:15], open_store(new_store).hidden)
    assert migrate_mod.migrate_store(old_store).startswith("migrated")
    assert verify_store(old_store).startswith("OK")


def test_prompt_hash_pulls_no_model_code():
    """Drafters take prompt_hash from data.store.schema; importing it must load neither transformers nor torch
    (it once came through data.capture.run, which loads models)."""
    code = ("import sys; from data.store.schema import prompt_hash; "
            "assert 'transformers' not in sys.modules, 'transformers'; assert 'torch' not in sys.modules, 'torch'; "
            "print(prompt_hash([1, 2, 3]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == hashlib.sha256(np.asarray([1, 2, 3], np.int32).tobytes()).hexdigest()[:16]
