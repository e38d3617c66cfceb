"""ToolSpec (Xia et al. 2026, arXiv 2604.13519): schema-aware, retrieval-augmented speculative decoding.

What the paper says (its abstract; the method as its released code, github.com/hemingkx/ToolSpec,
`model/toolspec/schema_fsm.py` and `evaluation/inference_toolspec.py`, implements it): tool-calling
traces are structured, follow the tools' schemas and recur. ToolSpec drafts from the predefined tool
schemas with a finite-state machine that alternates between deterministic schema token filling and
speculative generation for the variable fields, and it retrieves similar past tool invocations and
reuses them as drafts; training-free and lossless. The released code, which this module follows:

  schema   tool name -> parameter names, parsed from the system prompt: `N. Name: Tool\\nDescription:
           ...\\nParameters: {...}` (API-Bank; our `apibank` layout writes exactly this) or `N. Tool:
           description\\nParameters: {...}` (its level-3 / ToolAlpaca form); the Parameters dict's
           top-level keys are the parameter names.
  FSM      init: the frame `{"name": "` (four variants, `init_prefixes`) + each tool's name, one
           candidate per (frame, tool); first_param: after the verified tool name, `", "parameters":
           {"` + each of that tool's parameters + `": "`; remaining_param: after a `",` separator in
           the last 4 tokens, ` "` + each parameter whose tokens extend what follows the separator +
           `": "`. The tool is "verified" when its name's tokens have been committed.
  n-gram   (the speculative phase) the context's last n tokens, n = 7 down to 5, searched in the
           retrieved past outputs and then the context itself, earliest occurrence first; up to 4
           distinct continuations of 32, 16, 8 and 8 tokens (a continuation equal to, or a prefix
           of, or extended by one already taken is skipped).
  fallback Token Recycling's tree (the adjacency table of the model's top-8, updated after every
           verification) when neither the n-gram nor the separator rule proposes anything.
  memory   (retrieval) every finished request's output, keyed by the state at the question's last
           token; a request retrieves the 10 most similar outputs by cosine, searched first.
  per pass one source: init/first_param candidates in the FSM's schema states; otherwise the n-gram
           candidates, else the separator rule's parameter names, else the recycling tree. Every
           candidate is its own branch from the anchor.

Choices this module makes where the text leaves them open or our harness differs (each named):
  1. The FSM's clock. The released code advances the FSM by pass count (pass 1 = init, pass 2 =
     first_param, then remaining_param for good), which assumes the response opens with the call and
     that pass 1's draft was accepted whole. Here the state is read off the committed tokens: init
     candidates when the response is empty (the code's pass 1) or when the context ends with at least
     `init_min_match` (2) tokens of a frame+tool candidate inside the response (a call opening later,
     or a second call); first_param when the response ends with the verified tool's name followed by a
     proper prefix of a first_param candidate; the remaining_param rule as in the code. The verified
     tool is the one whose `name": "<tool>` tokens occur last in the response (the code keeps the first
     tool verified for the whole response). Same candidate strings, same priority.
  2. Tokens. The schema is parsed from the prompt's text, so the drafter needs the model's tokenizer:
     `tokenizer` names it (a model alias, directory or hub id); `auto` (default) takes the project's
     model whose tokenizer has exactly `vocab_size` entries (smollm2-135m: 49,152; stories260k: 512)
     and checks that the prompt decodes and re-encodes to the same ids; with none the schema phase is
     off (counter `schema_off`) and the drafter is n-gram + recycling. Candidate strings are encoded in
     context (a frame with its tool name as one string; the text after a tool name re-encoded with it),
     so their ids are the ones the model emits.
  3. Schema formats: beside the two above, one JSON object per line with `name` and `parameters`
     (tau-bench's OpenAI function form: the parameter names are `parameters.properties`' keys); a
     Parameters dict is read as JSON, then as a Python literal, then with the code's key regex; pattern
     2's tool name must sit on one line (the code's `[^:]+` can swallow a line ending in a number).
  4. The tree. Candidates are merged from the anchor (shared prefixes share nodes: the same accepted
     length, fewer nodes) and cut at the node budget in the code's order (frames in order, tools in
     schema order; n-gram candidates in the order found). A stage with no candidate falls through to the
     next (the code drafts an empty template, one token 0, in that case).
  5. n-gram continuations stop at the end of their segment (a retrieved output, or the context) and are
     kept when non-empty; the code takes only continuations of the full target length and lets one run
     from a retrieved output into the prompt. The self-match at the context's end is excluded.
  6. Token Recycling's tree is decoder/drafters/recycling.py's (its static template at the budget, the
     table updated from each verification, rows the replay store lacks skipped), not the code's template.
  7. Memory (`memory`, arm `toolspec-memory`; off in `toolspec`, the base rung). The code keys it by the
     last layer's state at the prompt's last token, taken from the prefill before the first pass. Our
     drafters receive states only with a verification, so the key is row 0 of the request's first
     verification (replay: the store's state at the prompt's last token, at its capture layer), and
     retrieval happens once, at the second pass. Pooled traces of the request's prompt hash are never
     retrieved (the contract's same-prompt exclusion); a trace added without a served request (warm)
     is keyed by its first state row. `evict_traces` forgets the oldest traces (--store-budget).

Arms: `toolspec` (schema FSM + the request's own n-gram + Token Recycling, no cross-request pool: the
transplant ladder's base rung) and `toolspec-memory` (plus the published retrieval memory). The host for
the Oilbird transplant rungs is `ToolSpecHost` (`begin_request`, `draft(context, budget, segments)` ->
(Draft, matched), `observe`, `suspend_request` / `resume_request`); `ToolSpecMemory` is its own key over a
pool of traces.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from data.errors import OilbirdError
from data.store.schema import prompt_hash as hash_prompt
from decoder.draft import Draft, Drafter
from decoder.drafters.recycling import AdjacencyTable, default_template

NAME = "toolspec"
STAGES = ("schema", "ngram", "param", "recycling")  # schema: init / first_param; param: the separator rule
INIT_PREFIXES = ('{"name": "', '<tool_call>\n{"name": "', '<tool_call>\n  {"name": "', '```<tool_call>\n{"name": "')
PARAM_PREFIX = '", "parameters": {"'  # after the tool name (the code drops its first token: the bonus)
PARAM_SUFFIX = '": "'
REMAINING_PREFIX = ' "'
SEPARATOR = '",'
AUTO_MODELS = ("smollm2-135m", "stories260k")  # the project's models `tokenizer=auto` may pick


# ---------------------------------------------------------------- the schema from the prompt text

_PATTERN1 = re.compile(r"\d+\.\s*Name:\s*([^\n]+)\nDescription:[^\n]*?(?:\nParameters:\s*|Parameters:\s*)")
_PATTERN2 = re.compile(r"\d+\.\s*([^:\n]+):\s*[^\n]*\nParameters:\s*")
_KEY = re.compile(r"['\"]([^'\"]+)['\"]\s*:")


def balanced_object(text: str) -> str:
    """The first `{...}` of `text` with balanced braces ('' if none)."""
    start = text.find("{")
    if start < 0:
        return ""
    depth = 0
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start:j + 1]
    return text[start:]


def parameter_names(params: str) -> list[str]:
    """The top-level keys of a Parameters dict written as JSON or a Python literal; else the code's key regex."""
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(params)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, dict):
            return [str(k) for k in value]
    return _KEY.findall(params)


def extract_schema(text: str) -> dict[str, list[str]]:
    """Tool name -> parameter names from a prompt's text (module docstring: patterns 1, 2, JSON lines)."""
    schema: dict[str, list[str]] = {}
    matches = list(_PATTERN1.finditer(text)) or list(_PATTERN2.finditer(text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        schema.setdefault(m.group(1).strip(), parameter_names(balanced_object(text[m.end():end])))
    if schema:
        return schema
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"name"' in line):
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # model or prompt text: tolerated, never an error
            continue
        fn = obj.get("function", obj) if isinstance(obj, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("parameters"), dict):
            props = fn["parameters"].get("properties", fn["parameters"])
            schema.setdefault(fn["name"], [str(k) for k in props] if isinstance(props, dict) else [])
    return schema


# ---------------------------------------------------------------- the tokenizer

_TOKENIZERS: dict[str, object] = {}


def _load(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))
    return _TOKENIZERS[path]


def resolve_tokenizer(spec: str, vocab_size: int) -> tuple[object | None, str]:
    """(tokenizer, its name) for `tokenizer=spec`; `auto`: the project's model whose tokenizer has exactly
    `vocab_size` entries, looked up without downloading or dequantizing anything, else (None, why)."""
    from data.capture.models import model_identity, resolve_model

    if spec == "auto":
        for alias in AUTO_MODELS:
            path = model_identity(alias)
            if not os.path.isfile(os.path.join(path, "tokenizer.json")) and \
                    not os.path.isfile(os.path.join(path, "tokenizer.model")):
                continue
            try:
                tok = _load(path)
            except Exception:  # an unreadable cache entry: not this one
                continue
            if len(tok) == vocab_size:
                return tok, alias
        return None, f"no tokenizer among {', '.join(AUTO_MODELS)} has {vocab_size} entries"
    try:
        tok = _load(resolve_model(spec))
    except OilbirdError:
        raise
    except Exception as e:
        raise OilbirdError(f"toolspec: cannot load the tokenizer {spec!r} ({type(e).__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    if len(tok) > vocab_size:
        raise OilbirdError(f"toolspec: tokenizer {spec!r} has {len(tok)} entries, more than the model's "
                           f"vocabulary ({vocab_size}); name the model's own with toolspec@tokenizer=<model>")
    return tok, spec


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def encode_after(tok, before: str, text: str) -> list[int]:
    """The ids of `text` as the model emits them after `before` (re-encoded together, `before`'s ids cut off)."""
    head, full = encode(tok, before), encode(tok, before + text)
    return full[len(head):] if full[:len(head)] == head else encode(tok, text)


@dataclass
class SchemaTokens:
    """One prompt's schema as token sequences (module docstring, FSM)."""

    tools: list[str]
    init: list[tuple[int, list[int]]]  # (tool, frame + tool name), frames in order, tools in schema order
    name_keys: list[list[int]]  # per tool: `name": "<tool>` as emitted inside `{"name": "<tool>`
    first: list[list[list[int]]]  # per tool: what follows its name: `", "parameters": {"<p>": "` per parameter
    remaining: list[list[list[int]]]  # per tool: ` "<p>": "` per parameter (after a separator)
    separator: int  # the first id of `",`


def schema_tokens(tok, schema: dict[str, list[str]], init_prefixes: Sequence[str]) -> SchemaTokens:
    tools = [t for t in schema if t]
    init = [(i, encode(tok, p + t)) for p in init_prefixes for i, t in enumerate(tools)]
    name_keys = [encode_after(tok, '{"', 'name": "' + t) for t in tools]
    first, remaining = [], []
    for t in tools:
        params = [p for p in schema[t] if p]
        first.append([encode_after(tok, t, PARAM_PREFIX + p + PARAM_SUFFIX) for p in params]
                     or [encode_after(tok, t, PARAM_PREFIX)])  # no parameters: the prefix alone, as the code
        remaining.append([encode_after(tok, SEPARATOR, REMAINING_PREFIX + p + PARAM_SUFFIX) for p in params])
    return SchemaTokens(tools, init, name_keys, first, remaining, encode(tok, SEPARATOR)[0])


# ---------------------------------------------------------------- pure parts of one pass

def find_last(seq: Sequence[int], key: Sequence[int], start: int = 0) -> int:
    """The end (exclusive) of the last occurrence of `key` in seq[start:] (-1 if none)."""
    n = len(key)
    if n == 0:
        return -1
    first = key[0]
    for i in range(len(seq) - n, start - 1, -1):
        if seq[i] == first and list(seq[i:i + n]) == list(key):
            return i + n
    return -1


def init_candidates(context: Sequence[int], response_start: int, init: Sequence[tuple[int, list[int]]],
                    min_match: int) -> list[list[int]]:
    """The init state: every frame+tool candidate when the response is empty; else the remainders of the
    candidates whose proper prefix the context ends with, at the longest such prefix, if it has at least
    `min_match` tokens and lies inside the response."""
    n_resp = len(context) - response_start
    if n_resp <= 0:
        return [list(s) for _, s in init]
    best, out, last = 0, [], context[-1]
    for _, s in init:
        for k in range(min(len(s) - 1, n_resp), max(min_match, best) - 1, -1):
            if k > 0 and s[k - 1] == last and list(context[len(context) - k:]) == s[:k]:
                if k > best:
                    best, out = k, []
                out.append(s[k:])
                break
    return out if best >= max(1, min_match) else []


def verified_tool(context: Sequence[int], response_start: int, name_keys: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(tool, end of its name) for the tool whose `name": "<tool>` tokens occur last in the response, the
    longer name on a tie; (-1, -1) if none."""
    best_tool, best_end = -1, -1
    for i, key in enumerate(name_keys):
        end = find_last(context, key, response_start)
        if end > best_end or (end == best_end >= 0 and len(key) > len(name_keys[best_tool])):
            best_tool, best_end = i, end
    return best_tool, best_end


def first_param_candidates(context: Sequence[int], name_end: int, seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """first_param: the remainders of the candidates whose proper prefix follows the tool name to the end."""
    if name_end < 0:
        return []
    tail = list(context[name_end:])
    k = len(tail)
    return [list(s[k:]) for s in seqs if k < len(s) and list(s[:k]) == tail]


def param_candidates(context: Sequence[int], separator: int, seqs: Sequence[Sequence[int]],
                     window: int = 4) -> list[list[int]]:
    """remaining_param (the code's rule): the last separator among the context's last `window` tokens; the
    remainders of the parameter candidates that extend what follows it (none without a separator)."""
    span = list(context[-window:])
    if separator not in span:
        return []
    after = span[len(span) - 1 - span[::-1].index(separator) + 1:]
    k = len(after)
    return [list(s[k:]) for s in seqs if k < len(s) and list(s[:k]) == after]


def ngram_candidates(context: Sequence[int], segments: Sequence[Sequence[int]] = (), max_n: int = 7,
                     min_n: int = 5, lengths: Sequence[int] = (32, 16, 8, 8),
                     search_context: bool = True) -> list[list[int]]:
    """The n-gram phase: the context's last n tokens (n = max_n .. min_n) searched in `segments` (in order)
    and then in the context (unless `search_context` is off: the segments alone, e.g. a pool's chain),
    earliest occurrence first; the i-th candidate kept is what followed, up to lengths[i] tokens, cut at
    its segment's end; the self-match at the context's end is excluded, and a candidate equal to, a
    prefix of, or extended by one already kept is skipped."""
    ctx = np.asarray(context, dtype=np.int64)
    segs = [np.asarray(s, dtype=np.int64) for s in segments if len(s)] + ([ctx] if search_context else [])
    out: list[list[int]] = []
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        if len(out) >= len(lengths):
            break
        key = ctx[len(ctx) - n:]
        for seg in segs:
            if len(seg) <= n or len(out) >= len(lengths):
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seg[:-1], n)  # a match needs a next token
            for start in np.flatnonzero((windows == key).all(axis=1)):
                if len(out) >= len(lengths):
                    break
                lo = int(start) + n
                cand = seg[lo:lo + lengths[len(out)]].tolist()
                if not cand or any(c[:len(cand)] == cand or cand[:len(c)] == c for c in out):
                    continue
                out.append(cand)
    return out


def candidate_tree(candidates: Sequence[Sequence[int]], budget: int, source: str) -> Draft:
    draft = Draft()
    for c in candidates:
        if len(draft) >= budget:
            break
        draft.add_chain(c, source, budget)
    return draft


# ---------------------------------------------------------------- the host and the memory

@dataclass
class ToolSpecConfig:
    tokenizer: str = "auto"  # the model's tokenizer (alias, directory or hub id); auto: module docstring, choice 2
    init_prefixes: tuple[str, ...] = INIT_PREFIXES  # the code's default frames (its Qwen2.5 / Llama-3.2 list)
    init_min_match: int = 2  # choice 1: frame tokens a mid-response init match needs
    separator_window: int = 4  # the code's param_span: the separator is looked for in the last 4 tokens
    max_ngram: int = 7  # the code's n-gram sizes, 7 down to 5
    min_ngram: int = 5
    ngram_lengths: tuple[int, ...] = (32, 16, 8, 8)  # the code's target lengths (64 nodes; cut at the budget)
    recycling: bool = True  # the Token Recycling fallback
    memory: bool = False  # the retrieval memory (choice 7): off = the base rung
    memory_k: int = 10  # outputs retrieved per request (the code's top_k)


class ToolSpecHost:
    """ToolSpec's draft for one request at a time: the schema FSM, the n-gram phase and the recycling fallback.

    `begin_request(prompt)`, then per pass `draft(context, budget, segments)` -> (Draft, matched) and
    `observe(context, result)`; `segments` are token sequences searched before the context in the n-gram
    phase (ToolSpec's retrieved outputs). `matched`: the schema FSM or the n-gram phase proposed
    something, or the fallback's anchor has adjacency successors (Token Recycling's own test), decided
    before the budget cut. `last_stage` names the stage that drafted (STAGES, or "" for nothing)."""

    def __init__(self, vocab_size: int, config: ToolSpecConfig | None = None, source: str = NAME) -> None:
        self.vocab_size, self.source = vocab_size, source
        self.config = c = config or ToolSpecConfig()
        if c.min_ngram < 1 or c.max_ngram < c.min_ngram or any(n < 0 for n in c.ngram_lengths):
            raise ValueError("ToolSpec needs 1 <= min_ngram <= max_ngram and ngram_lengths >= 0")
        self.table = AdjacencyTable(vocab_size) if c.recycling else None
        self._tokenizer: object | None = None
        self._tokenizer_name: str | None = None
        self._tokenizer_note = ""
        self._schemas: dict[tuple, SchemaTokens] = {}
        self.schema: SchemaTokens | None = None  # this request's
        self.response_start = 0
        self.last_stage = ""
        self.tally = {"schema_requests": 0, "schema_off": 0, "schema_tools": 0,
                      **{f"{s}_passes": 0 for s in STAGES}, **{f"{s}_nodes": 0 for s in STAGES}}

    # ------------------------------------------------------------ tokens
    def tokenizer(self):
        if self._tokenizer_name is None:
            tok, name = resolve_tokenizer(self.config.tokenizer, self.vocab_size)
            self._tokenizer, self._tokenizer_name = tok, (name if tok is not None else "")
            if tok is None:
                self._tokenizer_note = name
                print(f"note: toolspec drafts without the schema: {name} (set toolspec@tokenizer=<model>)",
                      file=sys.stderr)
        return self._tokenizer

    def request_schema(self, prompt: Sequence[int]) -> SchemaTokens | None:
        """The prompt's schema as token sequences (None: no tokenizer, an unreadable prompt, or no tools)."""
        tok = self.tokenizer()
        if tok is None:
            return None
        ids = [int(t) for t in prompt]
        text = tok.decode(ids)
        if self.config.tokenizer == "auto" and encode(tok, text) != ids:
            return None  # auto picked a tokenizer by size only: the prompt is not its text
        schema = extract_schema(text)
        if not schema:
            return None
        key = tuple((t, tuple(ps)) for t, ps in schema.items())
        if key not in self._schemas:
            if len(self._schemas) > 256:
                self._schemas.clear()
            self._schemas[key] = schema_tokens(tok, schema, self.config.init_prefixes)
        return self._schemas[key]

    # ------------------------------------------------------------ one request
    def begin_request(self, prompt: Sequence[int]) -> None:
        self.schema = self.request_schema(prompt)
        self.response_start = len(prompt)
        self.tally["schema_requests" if self.schema is not None else "schema_off"] += 1
        if self.schema is not None:
            self.tally["schema_tools"] += len(self.schema.tools)

    def suspend_request(self) -> tuple:
        return (self.schema, self.response_start)

    def resume_request(self, state: tuple) -> None:
        self.schema, self.response_start = state

    def candidates(self, context: Sequence[int], segments: Sequence[Sequence[int]] = ()) -> tuple[str, list[list[int]]]:
        """(stage, candidates) of this pass, in the code's priority (module docstring)."""
        c, s = self.config, self.schema
        if s is not None:
            cands = init_candidates(context, self.response_start, s.init, c.init_min_match)
            tool, end = verified_tool(context, self.response_start, s.name_keys)
            if tool >= 0:
                cands += first_param_candidates(context, end, s.first[tool])
            if cands:
                return "schema", cands
        cands = ngram_candidates(context, segments, c.max_ngram, c.min_ngram, c.ngram_lengths)
        if cands:
            return "ngram", cands
        if s is not None and tool >= 0:
            cands = param_candidates(context, s.separator, s.remaining[tool], c.separator_window)
            cands = [x for x in cands if x]
            if cands:
                return "param", cands
        return "", []

    def draft(self, context: Sequence[int], budget: int, segments: Sequence[Sequence[int]] = ()) -> tuple[Draft, bool]:
        """This pass's draft within `budget` and whether it matched (class docstring)."""
        stage, cands = self.candidates(context, segments)
        if stage:
            draft = candidate_tree(cands, budget, self.source)
            matched = True
        elif self.table is not None:
            anchor = int(context[-1])
            matched = self.table.knows(anchor)
            parents, ranks = default_template(budget) if budget > 0 else ((), ())
            draft = self.table.expand(anchor, parents, ranks, budget, self.source)
            stage = "recycling" if len(draft) else ""
        else:
            draft, matched = Draft(), False
        self.last_stage = stage
        if stage:
            self.tally[f"{stage}_passes"] += 1
            self.tally[f"{stage}_nodes"] += len(draft)
        return draft, matched

    def observe(self, context: Sequence[int], result) -> None:
        if self.table is not None:
            self.table.observe(int(context[-1]), result.draft.tokens, result.topk)

    def counters(self) -> dict:
        return {**self.tally, "tokenizer": self._tokenizer_name, "tokenizer_note": self._tokenizer_note or None}


@dataclass
class ToolSpecMemory:
    """ToolSpec's retrieval memory: finished outputs keyed by a request state; `retrieve` returns the k most
    similar outputs by cosine (most similar first), skipping one prompt hash and traces without a key."""

    entries: list[tuple[Hashable | None, np.ndarray | None, list[int]]] = field(default_factory=list)

    def add_trace(self, tokens: Sequence[int], group: Hashable | None, key: np.ndarray | None) -> None:
        if key is not None:
            key = np.asarray(key, dtype=np.float32).ravel()
            norm = float(np.linalg.norm(key))
            key = key / norm if norm > 0 else None
        self.entries.append((group, key, [int(t) for t in tokens]))

    def evict_traces(self, count: int) -> None:
        del self.entries[:max(0, count)]

    def retrieve(self, key: np.ndarray | None, k: int, excluded: Hashable | None = None) -> list[list[int]]:
        if key is None or k <= 0:
            return []
        q = np.asarray(key, dtype=np.float32).ravel()
        norm = float(np.linalg.norm(q))
        rows = [(g, v, t) for g, v, t in self.entries
                if v is not None and t and (excluded is None or g != excluded) and v.shape == q.shape]
        if norm == 0 or not rows:
            return []
        scores = np.stack([v for _, v, _ in rows]) @ (q / norm)
        order = np.argsort(-scores, kind="stable")[:k]
        return [rows[i][2] for i in order]


# arm name -> ToolSpecConfig options (registered in decoder/drafters/__init__.py PRESETS)
TOOLSPEC_PRESETS: dict[str, dict] = {"toolspec-memory": {"memory": True}}


class ToolSpecDrafter(Drafter):
    """Arms `toolspec` (base: no cross-request pool) and `toolspec-memory` (the retrieval memory on)."""

    name = NAME
    Config = ToolSpecConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: ToolSpecConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        self.config = config or ToolSpecConfig()
        self.host = ToolSpecHost(vocab_size, self.config, NAME)
        self.memory = ToolSpecMemory() if self.config.memory else None
        self._hash: Hashable | None = None
        self._key: np.ndarray | None = None
        self._segments: list[list[int]] | None = None
        self._pending = ""
        self.tally = {**{f"{s}_accepted": 0 for s in STAGES}, "memory_retrievals": 0, "memory_segments": 0}

    @property
    def table(self):  # replay's exactness note reads it (decoder/replay/traces.py)
        return self.host.table

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        self._hash = hash_prompt(list(prompt)) if prompt_hash is None else prompt_hash
        self._key, self._segments, self._pending = None, None, ""
        self.host.begin_request(prompt)

    def _retrieved(self) -> list[list[int]]:
        if self.memory is None or self._key is None:
            return []
        if self._segments is None:
            self._segments = self.memory.retrieve(self._key, self.config.memory_k, self._hash)
            self.tally["memory_retrievals"] += 1
            self.tally["memory_segments"] += len(self._segments)
        return self._segments

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        draft, _ = self.host.draft(context, budget, self._retrieved())
        self._pending = self.host.last_stage if len(draft) else ""
        return draft

    def observe(self, context: Sequence[int], result) -> None:
        if self._pending:
            self.tally[f"{self._pending}_accepted"] += len(result.accepted_nodes)
            self._pending = ""
        self.host.observe(context, result)
        if self.memory is not None and self._key is None and result.hidden is not None:
            self._key = np.array(result.hidden[0], dtype=np.float32)

    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None, hidden=None) -> None:
        if self.memory is None:
            return
        if prompt_hash is not None and prompt_hash == self._hash:
            key, self._hash, self._key = self._key, None, None
        else:
            key = np.asarray(hidden[0], np.float32) if hidden is not None and len(hidden) else None
        self.memory.add_trace(output, prompt_hash, key)

    def evict_traces(self, count: int) -> None:
        if self.memory is not None:
            self.memory.evict_traces(count)

    def counters(self) -> dict:
        return {**self.host.counters(), **self.tally,
                "memory_traces": len(self.memory.entries) if self.memory is not None else 0}
