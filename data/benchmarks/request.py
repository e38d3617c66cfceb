"""A request: one prompt to decode, as every benchmark loader makes it and capture and the decoder read it.

A `Request` is one prompt to decode: its id (unique within the benchmark), its group (the
conversation or task it belongs to; successive turns of one dialogue share it), the chat messages,
the reference output where the benchmark has one (used by `--mode reference`), and its tenant
(whose traffic it is; "" = the one default tenant).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    id: str  # unique within the benchmark
    group: str  # conversation / task id
    messages: tuple  # tuple of {"role": "system"|"user"|"assistant", "content": str} dicts, in order
    reference: str | None
    tenant: str = ""  # whose traffic it is; "" = the one default tenant (every registered benchmark)
    # the JSONL line it was read from (1-based), to name it in errors; not part of the request (nor its fingerprint)
    line: int | None = field(default=None, compare=False)



def data_fingerprint(requests: list[Request]) -> str:
    """sha256 (first 16 hex digits) of a canonical JSON of the requests: ids, groups, messages, references,
    and tenants where not the default "" (so traffic without tenants keeps the fingerprint it always had)."""
    rows = [{"id": r.id, "group": r.group, "messages": [dict(m) for m in r.messages], "reference": r.reference,
             **({"tenant": r.tenant} if r.tenant else {})}
            for r in requests]
    blob = json.dumps(rows, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def render_plain(messages) -> str:
    """Prompt text for a tokenizer without a chat template.

    The system text (if any), a blank line, then each turn as `User: ...` / `Assistant: ...`
    separated by blank lines, ending with `Assistant:` for the model to continue:

        You are helpful.

        User: Hi

        Assistant:
    """
    parts = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            parts.append(content)
        else:
            parts.append(f"{'Assistant' if role == 'assistant' else 'User'}: {content}")
    parts.append("Assistant:")
    return "\n\n".join(parts)

