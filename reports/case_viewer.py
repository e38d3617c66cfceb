"""The case viewer: a request's generated text, each token coloured by what covers it.

Categories (one per generated position, first match wins):
  producible      the exact-match oracle has the token among its candidates
  recovered       a gap position (available, not producible) where the semantic key has it
  gap             a gap position the semantic key misses
  unavailable     neither producible nor available (the continuation is not in the pool)
Each token's tooltip (title attribute) gives its position, category, the oracle's suffix length,
the longest matched context, the semantic key's best cosine, and the token id and raw piece.

Token text comes from the model's tokenizer only (never the model): each id is decoded after a
fixed one-token anchor so that a leading space survives (SentencePiece drops it on a lone token);
byte tokens that are not valid UTF-8 on their own show as U+FFFD with the raw piece in the tooltip.
Without a tokenizer the viewer shows ids as ⟨id⟩ and says so. Everything is escaped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import polars as pl

from reports.htmlkit import esc

CATEGORIES = {  # class -> (legend label, description)
    "p": ("producible", "the exact-match oracle has this token among its 8 candidates"),
    "r": ("gap, recovered by the semantic key", "available, not producible, and the semantic key has it"),
    "g": ("gap, not recovered", "available, not producible, and the semantic key misses it"),
    "u": ("not available", "the next two tokens occur in no pooled trace"),
}
MAX_TOKENS = 1500  # tokens shown per request; the rest is summarised in one line
MIN_CASE_POSITIONS = 20  # requests shorter than this are not picked as cases (unless all are)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str | bytes) -> str:
    """Display form of a token: bytes decoded with replacement, control characters spelled out."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclass
class TokenText:
    """Token ids -> display text (and raw pieces for tooltips). `note` says what is shown if not text."""

    texts: Callable[[list[int]], list[str | bytes]]
    pieces: Callable[[list[int]], list[str | bytes]] | None = None
    note: str | None = None

    def display(self, ids: list[int]) -> tuple[list[str], list[str]]:
        shown = [visible(t) for t in self.texts(ids)]
        raw = [visible(p) for p in self.pieces(ids)] if self.pieces else [""] * len(ids)
        return shown, raw


def id_text(note: str) -> TokenText:
    return TokenText(texts=lambda ids: [f"⟨{i}⟩" for i in ids], note=note)


def tokenizer_text(tokenizer) -> TokenText:
    """TokenText of a Hugging Face tokenizer (decode after an anchor, see the module docstring).
    An id the tokenizer cannot decode (outside its vocabulary) shows as ⟨id⟩."""
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1:] or [0]
    prefix = tokenizer.decode(anchor, clean_up_tokenization_spaces=False)

    def text(i: int) -> str:
        try:
            if tokenizer.convert_ids_to_tokens(i) is None:
                return f"⟨{i}⟩"
            both = tokenizer.decode(anchor + [i], clean_up_tokenization_spaces=False)
            return both[len(prefix):] if both.startswith(prefix) else tokenizer.decode(
                [i], clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 (an id outside the vocabulary raises, with various types)
            return f"⟨{i}⟩"

    def piece(i: int) -> str:
        try:
            p = tokenizer.convert_ids_to_tokens(i)
            return "" if p is None else str(p)
        except Exception:  # noqa: BLE001
            return ""

    def cached(fn, cache):
        return lambda ids: [cache[i] if i in cache else cache.setdefault(i, fn(i)) for i in map(int, ids)]

    return TokenText(texts=cached(text, {}), pieces=cached(piece, {}))


def load_token_text(model: str | None) -> TokenText:
    """The tokenizer of `model` (alias, directory or hub id), loaded alone; ids if it cannot be."""
    if not model:
        return id_text("token ids are shown: the run does not name its model (no traces/meta.json)")
    try:
        from transformers import AutoTokenizer

        from data.capture.models import resolve_model

        return tokenizer_text(AutoTokenizer.from_pretrained(resolve_model(model)))
    except Exception as e:  # any failure costs only the token text
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return id_text(f"token ids are shown: the tokenizer of '{model}' could not be loaded ({why[:200]})")


def categories(df: pl.DataFrame) -> np.ndarray:
    """One class letter per row (see CATEGORIES); missing flags count as false."""
    def flag(c: str) -> np.ndarray:
        return df[c].fill_null(False).to_numpy().astype(bool) if c in df.columns else np.zeros(df.height, bool)

    producible, available, sem = flag("producible"), flag("available"), flag("sem_hit")
    gap = flag("gap") if "gap" in df.columns else available & ~producible
    return np.where(producible, "p", np.where(gap & sem, "r", np.where(gap, "g", "u")))


def pick_cases(df: pl.DataFrame) -> list[tuple[str, int, float, int]]:
    """(label, request, gap rate, positions) for the highest-gap, median and lowest-gap requests.

    Ranked by gap rate (gap positions / positions) over the requests with at least
    MIN_CASE_POSITIONS positions and at least one available one (a request whose pool holds none of
    its continuations, like the first one served, says nothing about the gap); when no request
    qualifies, over all of them. Ties go to the lower request number; a request appears once."""
    per = (df.group_by("request")
           .agg(pl.len().alias("n"), pl.col("gap").fill_null(False).mean().alias("rate"),
                pl.col("available").fill_null(False).any().alias("any_available"))
           .sort(["rate", "request"]))
    if per.height == 0:
        return []
    qualified = per.filter((pl.col("n") >= MIN_CASE_POSITIONS) & pl.col("any_available"))
    rows = (qualified if qualified.height else per).rows(named=True)
    picks = [("highest gap rate", rows[-1]), ("median gap rate", rows[(len(rows) - 1) // 2]),
             ("lowest gap rate", rows[0])]
    seen, out = set(), []
    for label, row in picks:
        if row["request"] not in seen:
            seen.add(row["request"])
            out.append((label, int(row["request"]), float(row["rate"]), int(row["n"])))
    return out


def _num(v, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, fmt)


def render_request(df: pl.DataFrame, token_text: TokenText) -> str:
    """The coloured token stream of one request's rows (sorted by position)."""
    shown_df = df.head(MAX_TOKENS)
    ids = shown_df["target"].to_list() if "target" in shown_df.columns else [None] * shown_df.height
    known = [i for i in ids if i is not None]
    texts, raw = token_text.display(known) if known else ([], [])
    text_of = iter(texts)
    raw_of = iter(raw)
    cats = categories(shown_df)
    cols = {c: shown_df[c].to_list() if c in shown_df.columns else [None] * shown_df.height
            for c in ("position", "oracle_suffix_len", "longest_match_len", "sem_best_cos")}
    spans = []
    for k, tid in enumerate(ids):
        text, piece = (next(text_of), next(raw_of)) if tid is not None else ("⟨?⟩", "")
        tip = (f"position {cols['position'][k]} · {CATEGORIES[cats[k]][0]} · oracle suffix "
               f"{_num(cols['oracle_suffix_len'][k], 'd')} · longest match {_num(cols['longest_match_len'][k], 'd')}"
               f" · best cos {_num(cols['sem_best_cos'][k], '.3f')} · id {tid}" + (f" {piece!r}" if piece else ""))
        spans.append(f'<span class="{cats[k]}" title="{esc(tip)}">{esc(text) if text else "&#8203;"}</span>')
    more = ""
    if df.height > MAX_TOKENS:
        rest = categories(df.slice(MAX_TOKENS))
        counts = ", ".join(f"{int((rest == c).sum())} {CATEGORIES[c][0]}" for c in CATEGORIES)
        more = f'<p class="more">… {df.height - MAX_TOKENS} more tokens not shown ({esc(counts)}).</p>'
    return f'<div class="tokens">{"".join(spans)}</div>{more}'


def legend() -> str:
    items = "".join(f'<li><span class="{c} swatch" title="{esc(desc)}">{esc(label)}</span></li>'
                    for c, (label, desc) in CATEGORIES.items())
    return f'<ul class="legend">{items}</ul>'


def render_cases(df: pl.DataFrame, token_text: TokenText, request_ids: dict[int, str] | None = None) -> str:
    """Legend, the tokenizer note, and one viewer per picked request."""
    parts = [legend()]
    if token_text.note:
        parts.append(f'<p class="note">{esc(token_text.note)}</p>')
    for label, r, rate, n in pick_cases(df):
        rows = df.filter(pl.col("request") == r)
        name = f" (id {request_ids[r]})" if request_ids and r in request_ids else ""
        cats = categories(rows)
        counts = " · ".join(f"{int((cats == c).sum())} {CATEGORIES[c][0]}" for c in CATEGORIES)
        parts.append(f'<figure class="case"><figcaption><strong>{esc(label)}</strong>: request {r}{esc(name)}, '
                     f'{n} generated tokens, gap rate {100 * rate:.1f}% <span class="counts">({esc(counts)})</span>'
                     f'</figcaption>{render_request(rows, token_text)}</figure>')
    return "\n".join(parts)
