"""Tenants on the data side: the optional JSONL "tenant" field, the store's `tenant` column (generate
and reference capture), stores written before the column, a resumed capture against other tenants,
and `data show`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.__main__ import main as data_main
from data.benchmarks.registry import load_requests
from data.benchmarks.request import Request, data_fingerprint
from data.capture.run import CaptureConfig, capture
from data.errors import OilbirdError
from data.store.parquetfile import _schema_difference
from data.store.reader import open_store
from data.store.schema import request_schema
from data.store.verify import verify_store
from data.store.writer import TraceRecord, record_checksums, records_to_tables
from tests.conftest import STORY_PROMPTS

TENANTS = ["acme", None, "globex", "acme"]  # None: the line has no "tenant"


def _traffic(path, tenants=TENANTS, refs=False):
    with open(path, "w") as f:
        for i, t in enumerate(tenants):
            row = {"id": f"r{i}", "prompt": STORY_PROMPTS[i]}
            if refs:
                row["reference"] = STORY_PROMPTS[i + 1]
            if t is not None:
                row["tenant"] = t
            f.write(json.dumps(row) + "\n")
    return f"jsonl:{path}"


def _cfg(bench, out, **kw):
    return CaptureConfig(bench=bench, model="stories260k", out=str(out), max_new_tokens=kw.pop("max_new_tokens", 6),
                         progress=False, flush_every=kw.pop("flush_every", 2), **kw)


def test_jsonl_tenant_field(tmp_path):
    reqs = load_requests(_traffic(tmp_path / "t.jsonl"))
    assert [r.tenant for r in reqs] == ["acme", "", "globex", "acme"]
    assert Request("a", "a", ({"role": "user", "content": "x"},), None).tenant == ""  # positional: unchanged
    # a tenant-less file keeps the fingerprint it always had; naming tenants changes it
    plain = load_requests(_traffic(tmp_path / "p.jsonl", [None] * 4))
    assert data_fingerprint(plain) != data_fingerprint(reqs)
    legacy = [{"id": r.id, "group": r.group, "messages": [dict(m) for m in r.messages], "reference": r.reference}
              for r in plain]
    blob = json.dumps(legacy, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert data_fingerprint(plain) == hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.mark.parametrize("value", [3, ["a"], {"a": 1}, True])
def test_bad_tenant_is_one_line_naming_the_line(tmp_path, value):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps({"id": "b", "prompt": "y", "tenant": value}) + "\n")
    with pytest.raises(OilbirdError) as e:
        load_requests(f"jsonl:{path}")
    msg = str(e.value)
    assert "line 2" in msg and '"tenant" must be a string' in msg and "\n" not in msg


def test_generate_capture_stores_tenants_and_show_counts_them(stories, tmp_path, capsys, one_thread):
    path = capture(_cfg(_traffic(tmp_path / "t.jsonl"), tmp_path / "runs"), lm=stories)
    st = open_store(path)
    assert st.requests["tenant"].to_list() == ["acme", "", "globex", "acme"]
    assert pq.read_table(f"{path}/requests.parquet").column("tenant").to_pylist() == ["acme", "", "globex", "acme"]
    assert verify_store(path).startswith("OK")
    capsys.readouterr()
    assert data_main(["show", path]) == 0
    assert "tenants 3: 'acme' 2, '' 1, 'globex' 1" in capsys.readouterr().out
    # a null tenant is damage, not the default tenant
    req = f"{path}/requests.parquet"
    table = pq.read_table(req)
    table = table.set_column(table.schema.get_field_index("tenant"), "tenant", pa.array([None] * 4, pa.string()))
    pq.write_table(table, req)
    record_checksums(path)
    with pytest.raises(OilbirdError, match="tenant is null"):
        open_store(path)


def test_reference_capture_stores_tenants(stories, tmp_path, one_thread):
    bench = _traffic(tmp_path / "r.jsonl", ["x", "y", None], refs=True)
    st = open_store(capture(_cfg(bench, tmp_path / "runs", mode="reference"), lm=stories))
    assert st.requests["tenant"].to_list() == ["x", "y", ""]


def test_resume_refuses_other_tenants(stories, tmp_path, one_thread):
    bench = _traffic(tmp_path / "t.jsonl")
    out = tmp_path / "runs"
    capture(_cfg(bench, out, limit=2), lm=stories)
    _traffic(tmp_path / "t.jsonl", ["acme", "other", "globex", "acme"])  # request 1 changed tenant
    with pytest.raises(OilbirdError) as e:
        capture(_cfg(bench, out, limit=4), lm=stories)
    assert "\n" not in str(e.value) and "--force" in str(e.value)
    _traffic(tmp_path / "t.jsonl")  # the traffic as it was: the capture resumes
    st = open_store(capture(_cfg(bench, out, limit=4), lm=stories))
    assert st.requests["tenant"].to_list() == ["acme", "", "globex", "acme"]


def _drop_tenant(path):
    """Rewrite requests.parquet as code before tenants wrote it (no `tenant` column)."""
    req = path / "requests.parquet"
    table = pq.read_table(req)
    pq.write_table(table.drop_columns(["tenant"]), req, compression="zstd")


def test_store_without_tenant_column_opens_resumes_and_verifies(stories, tmp_path, capsys, one_thread):
    bench = _traffic(tmp_path / "plain.jsonl", [None] * 4)
    out = tmp_path / "runs"
    path = capture(_cfg(bench, out, limit=2), lm=stories)
    path = Path(path)
    _drop_tenant(path)
    with pytest.raises(OilbirdError, match="checksum"):  # the bytes changed under a recorded checksum
        open_store(path)
    record_checksums(path)  # as the older code would have recorded them
    assert "tenant" not in pq.read_table(path / "requests.parquet").column_names
    st = open_store(path)
    assert st.verified and st.requests["tenant"].to_list() == ["", ""]
    assert verify_store(path).startswith("OK")
    capsys.readouterr()
    assert data_main(["show", str(path)]) == 0
    assert "tenants 1 (the default tenant)" in capsys.readouterr().out
    # a store older than checksums too
    meta = json.loads((path / "meta.json").read_text())
    legacy = {k: v for k, v in meta.items() if k not in ("checksums", "n_requests", "store_format", "prompt_hash_scheme", "meta_sha256")}
    (path / "meta.json").write_text(json.dumps(legacy))
    st = open_store(path)
    assert not st.verified and st.requests["tenant"].to_list() == ["", ""]
    (path / "meta.json").write_text(json.dumps(meta))
    # resuming it writes the column from then on
    st = open_store(capture(_cfg(bench, out, limit=4), lm=stories))
    assert st.verified and st.requests["tenant"].to_list() == [""] * 4
    assert "tenant" in pq.read_table(path / "requests.parquet").column_names


def test_schema_check_accepts_a_missing_tenant_only():
    want = request_schema(4)
    old = pa.schema([f for f in want if f.name != "tenant"])
    assert _schema_difference(old, want) == ""
    wrong = pa.schema([pa.field("tenant", pa.int32()) if f.name == "tenant" else f for f in want])
    assert _schema_difference(wrong, want).startswith("tenant: int32")


def test_records_default_to_the_default_tenant():
    import numpy as np

    rec = TraceRecord(request=0, id="a", group="a", prompt_hash="0" * 16, prompt_tokens=[1], output_tokens=[2],
                      stop_reason="eos", seconds=0.0, hidden=np.zeros((1, 4)), hidden_valid=np.ones(1, bool),
                      topk=np.zeros((1, 8)), prompt_last_hidden=np.zeros(4), prompt_last_topk=np.zeros(8))
    req, _ = records_to_tables([rec], 4)
    assert req.column("tenant").to_pylist() == [""] and req.schema == request_schema(4)
