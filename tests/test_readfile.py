"""data/readfile.py: JSON and small files read with bounds (issue 35): a device, a FIFO, a folder, an
oversized file or a deeply nested document is one OilbirdError, never a hang or a RecursionError."""

from __future__ import annotations

import json
import os

import pytest

from data.errors import OilbirdError
from data.readfile import MAX_JSON_DEPTH, json_depth, read_json, read_text


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_depth_matches_a_recursive_count():
    def rec(v):
        if isinstance(v, dict):
            return 1 + max((rec(c) for c in v.values()), default=0)
        if isinstance(v, list):
            return 1 + max((rec(c) for c in v), default=0)
        return 0
    for doc in (1, [], {}, [[1], {"a": [{}]}], {"a": {"b": {"c": [1, [2]]}}}, json.loads(_nested(30))):
        assert json_depth(doc) == rec(doc)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_json_is_one_error(tmp_path, depth):
    p = tmp_path / "summary.json"
    p.write_text(_nested(depth))
    with pytest.raises(OilbirdError, match="nested deeper"):
        read_json(p, "summary")
    (tmp_path / "ok.json").write_text(_nested(MAX_JSON_DEPTH))
    assert json_depth(read_json(tmp_path / "ok.json")) == MAX_JSON_DEPTH


def test_special_files_are_refused_before_opening(tmp_path):
    fifo = tmp_path / "meta.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    with pytest.raises(OilbirdError, match="FIFO"):
        read_json(fifo, "store meta")
    with pytest.raises(OilbirdError, match="device"):
        read_json("/dev/zero", "store meta")
    with pytest.raises(OilbirdError, match="folder"):
        read_text(tmp_path, "prompts file")
    with pytest.raises(OilbirdError, match="not found"):
        read_json(tmp_path / "none.json", "profile")


def test_size_bound_and_bad_json(tmp_path):
    p = tmp_path / "big.json"
    p.write_text(json.dumps(list(range(1000))))
    with pytest.raises(OilbirdError, match="more than the 100"):
        read_json(p, "profile", max_bytes=100)
    p.write_text("{not json")
    with pytest.raises(OilbirdError, match="not valid JSON"):
        read_json(p, "profile")
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(OilbirdError, match="cannot be read"):
        read_text(p, "template")
