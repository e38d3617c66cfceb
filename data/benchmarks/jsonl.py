"""`jsonl:PATH`, a user's own traffic: one request per line.

A line is {"id", "messages": [...]} or {"id", "prompt"}, with an optional "reference", "group" and
"tenant" (see `_jsonl_request`). A line without "id" takes its line number as its id.

Lines end with "\n" (JSON Lines). A line longer than `--max-line-bytes` (default 1 MiB, about 250k
tokens: more than any model here has context for) is refused before it is parsed: one 10 MB line took
2.5 GB to tokenize, only for the prompt to be refused as longer than the context (issue 23). A line
nested deeper than Python's recursion limit is refused too, in one line.
"""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from data.benchmarks.request import Request
from data.benchmarks.sources import _one_line
from data.errors import OilbirdError
from data.readfile import regular_file

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
                   messages=messages, reference=reference, tenant=_text(tenant, where, '"tenant"'), line=lineno)


DEFAULT_MAX_LINE_BYTES = 1 << 20
_max_line_bytes = DEFAULT_MAX_LINE_BYTES  # set for one command by `line_bound`

MAX_LINE_HELP = ("jsonl:PATH: refuse a line longer than N bytes before reading it whole, N as 1048576, 512K, 8M "
                 "or 1G (default 1M, about 250k tokens; tokenizing a prompt takes about 200 bytes of memory "
                 "per byte of text)")


def parse_bytes(text: str | int | None, flag: str = "--max-line-bytes") -> int | None:
    """A byte count as written on the command line: 1048576, 512K, 8M, 1G (powers of 1024); None stays None."""
    if text is None or isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
        if not m:
            raise OilbirdError(f"{flag} must be a number of bytes such as 1048576, 512K, 8M or 1G (got {text!r})")
        value = int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")
    if value is not None and value < 1:
        raise OilbirdError(f"{flag} must be at least 1 byte (got {text!r})")
    return value


@contextmanager
def line_bound(max_bytes: int | str | None):
    """Within the block, a JSONL line may be up to `max_bytes` long (None: the default). A context
    rather than a setting, so one command's --max-line-bytes never leaks into the next in a process."""
    global _max_line_bytes
    before = _max_line_bytes
    _max_line_bytes = parse_bytes(max_bytes) or DEFAULT_MAX_LINE_BYTES
    try:
        yield _max_line_bytes
    finally:
        _max_line_bytes = before


def _load_jsonl(path_text: str) -> list[Request]:
    path = Path(path_text).expanduser()
    # stat before open: a FIFO would block the open until a writer comes; a folder or a device is named as such
    regular_file(path, "jsonl file")
    requests: list[Request] = []
    seen: dict[str, int] = {}
    without_id = 0
    bound = _max_line_bytes
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(bound + 1), b""), 1):
            # readline(bound + 1) reads at most that much, so a longer line is refused with only the bound in
            # memory; the line's bytes are counted without its "\n"
            if len(raw) - raw.endswith(b"\n") > bound:
                raise OilbirdError(f"{path} line {lineno} is longer than {bound} bytes; pass --max-line-bytes "
                                   "with a larger bound (e.g. 16M) to read it")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise OilbirdError(f"{path} is not UTF-8 text (line {lineno})") from None
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except ValueError as e:
                raise OilbirdError(f"{where}: not valid JSON ({_one_line(getattr(e, 'msg', e))})") from None
            except RecursionError:  # [[[[...]]]] 100,000 deep: json's decoder recurses per level
                raise OilbirdError(f"{where}: JSON nested too deeply to read") from None
            req = _jsonl_request(row, where, lineno)
            without_id += isinstance(row, dict) and "id" not in row
            if req.id in seen:
                raise OilbirdError(f"{where}: id '{req.id}' already used on line {seen[req.id]}")
            seen[req.id] = lineno
            requests.append(req)
    if not requests:
        raise OilbirdError(f"{path} has no requests")
    if without_id and str(path) not in _NOTED_WITHOUT_ID:  # once per file and process
        _NOTED_WITHOUT_ID.add(str(path))
        print(f"note: {path}: {without_id} line(s) without \"id\" take their line number as id", file=sys.stderr)
    return requests


_NOTED_WITHOUT_ID: set[str] = set()
