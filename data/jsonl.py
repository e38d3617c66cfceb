"""`jsonl:PATH`, a user's own traffic: one request per line.

A line is {"id", "messages": [...]} or {"id", "prompt"}, with an optional "reference", "group" and
"tenant" (see `_jsonl_request`). A line without "id" takes its line number as its id.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from data.benchfiles import _one_line
from data.errors import OilbirdError
from data.request import Request

ROLES = ("system", "user", "assistant")


def _text(value: str, where: str, field: str) -> str:
    """JSON lets a line carry a lone surrogate ("\\ud800"), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OilbirdError(f"{where}: {field} is not valid Unicode text (lone surrogate "
                           f"{value[e.start:e.end]!a} at character {e.start})") from None
    return value


def _jsonl_request(row, where: str, lineno: int) -> Request:
    """One line: {"id", "messages": [...]} or {"id", "prompt"}, optional "reference", "group" and
    "tenant" (a string; absent or null: the default tenant "").

    A line without "id" takes its line number (1-based, blank lines counted) as its id; the loader
    prints one note per file saying how many lines did."""
    if not isinstance(row, dict):
        raise OilbirdError(f"{where}: expected a JSON object with \"messages\" or \"prompt\"")
    rid = row.get("id", str(lineno))  # no id: the line number
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise OilbirdError(f"{where}: \"id\" must be a string or an integer")
    has_messages, has_prompt = "messages" in row, "prompt" in row
    if has_messages == has_prompt:
        raise OilbirdError(f"{where}: give exactly one of \"messages\" (a list of chat turns) or \"prompt\" (a string)")
    if has_prompt:
        if not isinstance(row["prompt"], str):
            raise OilbirdError(f"{where}: \"prompt\" must be a string")
        messages = ({"role": "user", "content": _text(row["prompt"], where, '"prompt"')},)
    else:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw:
            raise OilbirdError(f"{where}: \"messages\" must be a non-empty list")
        msgs = []
        for k, m in enumerate(raw):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise OilbirdError(f"{where}: message {k} must be {{\"role\": system|user|assistant, \"content\": string}}")
            msgs.append({"role": m["role"], "content": _text(m["content"], where, f"message {k}'s content")})
        messages = tuple(msgs)
    reference = row.get("reference")
    if reference is not None and not isinstance(reference, str):
        raise OilbirdError(f"{where}: \"reference\" must be a string or null")
    if reference is not None:
        _text(reference, where, '"reference"')
    group = row.get("group", rid)
    if isinstance(group, bool) or not isinstance(group, (str, int)):
        raise OilbirdError(f"{where}: \"group\" must be a string or an integer")
    tenant = row.get("tenant")
    if tenant is None:
        tenant = ""
    elif not isinstance(tenant, str):
        raise OilbirdError(f"{where}: \"tenant\" must be a string (got {type(tenant).__name__})")
    return Request(id=_text(str(rid), where, '"id"'), group=_text(str(group), where, '"group"'),
                   messages=messages, reference=reference, tenant=_text(tenant, where, '"tenant"'))


def _load_jsonl(path_text: str) -> list[Request]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise OilbirdError(f"jsonl file {path} not found")
    requests: list[Request] = []
    seen: dict[str, int] = {}
    without_id = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise OilbirdError(f"{where}: not valid JSON ({_one_line(getattr(e, 'msg', e))})") from None
                req = _jsonl_request(row, where, lineno)
                without_id += isinstance(row, dict) and "id" not in row
                if req.id in seen:
                    raise OilbirdError(f"{where}: id '{req.id}' already used on line {seen[req.id]}")
                seen[req.id] = lineno
                requests.append(req)
    except UnicodeDecodeError:
        raise OilbirdError(f"{path} is not UTF-8 text") from None
    if not requests:
        raise OilbirdError(f"{path} has no requests")
    if without_id and str(path) not in _NOTED_WITHOUT_ID:  # once per file and process
        _NOTED_WITHOUT_ID.add(str(path))
        print(f"note: {path}: {without_id} line(s) without \"id\" take their line number as id", file=sys.stderr)
    return requests


_NOTED_WITHOUT_ID: set[str] = set()
