"""The schema of the result files a report or a verdict reads, written once for every writer and reader.

Files (docs/reports.md, "Result files and their schema", lists every field and its range):

  census     runs/<bench>/<model>/census*/summary.json            census/summary.py
  replay     runs/<bench>/<model>/replay*/<arm>/summary.json      decoder/replay/run.py, decoder/verify/passes.py
  live       runs/<bench>/<model>/decode/<arm>/summary.json       decoder/live/harness.py, decoder/verify/passes.py
  ablations  runs/<bench>/<model>/ablations/ablations.json        decoder/replay/ablations.py
  vllm       runs/<bench>/<model>/vllm/summary.json               benchmarks/bench_vllm.py (decoder/vllm/run.py rows)

`read_result(path, kind)` reads one through data.readfile.read_json (size and nesting bounded) and checks it:
a field that is present must have its type and range (a share in [0, 1], tau >= 1, a speedup or ratio > 0, a
count a non-negative integer, every number finite, an interval two numbers with lo <= value <= hi); a required
field must be present. It returns the document with every invalid value replaced by null (so no page shows a
share of 500%) and the list of problems, each one line: "<file> lacks <field>" or "<file> has <field> = <value>
outside [0, 1]". What a problem means is the reader's to decide: the verdict refuses ("cannot decide: ...",
reports/decision.py), never substituting another quantity; the other blocks show the value as not known.

Only data.errors and data.readfile are imported: census/, decoder/ and reports/ all use this module.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable

from data.errors import OilbirdError
from data.readfile import read_json


@dataclass(frozen=True)
class Rule:
    """What a value must be: `ok(value)` for a value that is present and not null, `broken` the words after
    "<field> = <value>" when it is not."""

    name: str
    ok: Callable[[object], bool]
    broken: str


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SHARE = Rule("share", lambda v: _number(v) and 0 <= v <= 1, "outside [0, 1]")
TAU = Rule("tau", lambda v: _number(v) and v >= 1, "below 1 (a pass commits at least one token)")
POSITIVE = Rule("positive", lambda v: _number(v) and v > 0, "not above 0")  # speedups, ratios, sizes
NONNEG = Rule("non-negative", lambda v: _number(v) and v >= 0, "below 0")  # seconds, means
NUMBER = Rule("number", _number, "not a finite number")
COUNT = Rule("count", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
             "not a count (an integer >= 0)")
TEXT = Rule("text", lambda v: isinstance(v, str), "not a string")
FLAG = Rule("flag", lambda v: isinstance(v, bool), "not true or false")
TAU_BLOCK = Rule("tau block", lambda v: isinstance(v, dict), "not an object {value, interval}")


def block(fields: str) -> Rule:
    """An object holding `fields`: a bare number where a replay writes a block (`sole_source_share: 0.5`) would
    otherwise pass unchecked (its fields' rules find nothing to check in a number) and be read as the value."""
    return Rule("block", lambda v: isinstance(v, dict), f"not an object {{{fields}}}")


@dataclass(frozen=True)
class Field:
    """One field: its path ("a.b.c"; "*" stands for every key of an object or every item of a list), its rule,
    the path of its 95% interval (beside it in the same object) if it has one, and whether the file must
    hold it. A null value passes (a writer's "not computed") unless the reader itself needs the value."""

    path: str
    rule: Rule
    interval: str | None = None  # the last path component of the interval, e.g. "interval" or "wilson"
    required: bool = False


def _share_block(prefix: str, total: str) -> tuple[Field, ...]:
    """A sole-source share as decoder/verify/passes.py writes it: {value, interval, sole, <total>, definition}."""
    return (Field(f"{prefix}.value", SHARE, "interval"), Field(f"{prefix}.sole", COUNT),
            Field(f"{prefix}.{total}", COUNT), Field(f"{prefix}.definition", TEXT))


def _proportion(prefix: str) -> tuple[Field, ...]:
    """A census proportion: {value, wilson, bootstrap, k, n} (census/summary.py)."""
    return (Field(f"{prefix}.value", SHARE, "wilson"), Field(f"{prefix}.value", SHARE, "bootstrap"),
            Field(f"{prefix}.k", COUNT), Field(f"{prefix}.n", COUNT))


# What decoder/verify/passes.py adds to both a replay's and a live run's summary.
_PASSES = (
    Field("arm", TEXT), Field("kind", TEXT), Field("bench", TEXT), Field("model", TEXT),
    Field("requests", COUNT), Field("generated_tokens", COUNT), Field("passes", COUNT),
    Field("accepted_draft_tokens", COUNT), Field("accepted_by_source.*", COUNT), Field("drafted_by_source.*", COUNT),
    Field("acceptance_rate_by_source.*", NONNEG),  # a token several sources proposed counts for each
    *_share_block("sole_source_share", "tokens"), *_share_block("sole_source_share_of_draft", "accepted"),
    Field("mean_nodes", NONNEG), Field("accepted_per_node", NONNEG),
    *(Field(f"{d}.{q}", NONNEG) for d in ("nodes_per_pass", "draft_s_per_pass", "update_s_per_pass")
      for q in ("mean", "p50", "p99", "max")),
    Field("seconds", NONNEG), Field("exact", FLAG),
)

# The verdict's inputs at the two ends of the profile's spread (decoder/replay/run.py add_profile_spread), in the
# key-on arm's replay summary.
_SPREAD = (
    Field("profile_spread.reps", COUNT), Field("profile_spread.width", NONNEG), Field("profile_spread.note", TEXT),
    Field("profile_spread.ends.*.sole_source_share.value", SHARE, "interval"),
    Field("profile_spread.ends.*.paired_gain.tau_ratio", POSITIVE, "interval"),
    Field("profile_spread.ends.*.speedup", POSITIVE), Field("profile_spread.ends.*.speedup_versus", POSITIVE),
    Field("profile_spread.ends.*.mean_nodes", NONNEG), Field("profile_spread.ends.*.resized", FLAG),
)

# The store's sampled requests, as the census and replay record them (data/store/sampling.py sampled_requests).
_SAMPLED = tuple(Field(f"sampled_requests.{k}", COUNT) for k in ("count", "of", "unknown"))

SCHEMAS: dict[str, tuple[Field, ...]] = {
    "replay": (
        # decoder/replay/run.py writes these as objects (an older live summary's share may be a number: not here)
        Field("sole_source_share", block("value, interval, sole, tokens, definition")),
        Field("sole_source_share_of_draft", block("value, interval, sole, accepted, definition")),
        Field("estimate", block("speedup, speedup_interval, engine, ...")),
        Field("paired_gain", block("versus, tau_ratio, interval, speedup_ratio, speedup_interval")),
        Field("estimate_by_batch", block("batch size: {speedup, speedup_interval}")),
        Field("estimate_by_batch.*", block("speedup, speedup_interval")), Field("knn_recall", block("value, ...")),
        *_PASSES,
        # a replay gives tau as {value, interval}; a live run as a number beside tau_interval
        Field("tau", TAU_BLOCK, required=True),
        Field("tau.value", TAU, "interval"),
        Field("nodes", COUNT),
        Field("paired_gain.versus", TEXT), Field("paired_gain.tau_ratio", POSITIVE, "interval"),
        Field("paired_gain.speedup_ratio", POSITIVE, "speedup_interval"),
        Field("estimate.speedup", POSITIVE, "speedup_interval"), Field("estimate.engine", TEXT),
        Field("estimate.draft_fraction", SHARE), Field("estimate.overhead_fraction", SHARE),
        Field("estimate_by_batch.*.speedup", POSITIVE, "speedup_interval"),
        Field("knn_recall.value", SHARE),
        *_SPREAD, *_SAMPLED,
    ),
    "live": (
        *_PASSES,
        Field("tau", TAU, "tau_interval", required=True),
        Field("speedup", POSITIVE, "speedup_range"), Field("tokens_per_s", NONNEG),
        Field("overhead_fraction", SHARE), Field("draft_fraction", SHARE),
    ),
    "census": (
        Field("bench", TEXT), Field("model", TEXT), Field("pool", TEXT), Field("layer", COUNT),
        Field("positions", COUNT, required=True), Field("requests", COUNT),
        *(f for key in ("available", "producible", "gap", "recall") for f in _proportion(key)),
        *(f for key in ("coverage.reaches.*", "coverage.only_it.*", "coverage.unions.*",
                        "coverage.semantic_recovers_missed_by.*") for f in _proportion(key)),
        Field("coverage.universe", COUNT), Field("coverage.lift.*.value", NONNEG, "bootstrap"),
        Field("mechanism.*.value", NUMBER, "bootstrap"), Field("mechanism.*.n", COUNT), Field("mechanism.*.k", COUNT),
        Field("index.gap_recall_exact", SHARE), Field("index.gap_recall_index", SHARE),
        Field("index.knn_recall", SHARE),
        Field("index.bytes_per_state", NONNEG), *_SAMPLED,
    ),
    "ablations": tuple(
        f for rows in ("merged", "ablations.*", "headline.*", "ladder.*.rungs.*", "best_lexical")
        for f in (Field(f"{rows}.arm", TEXT), Field(f"{rows}.tau", TAU, "tau_interval"),
                  Field(f"{rows}.vs_merged", POSITIVE, "vs_merged_interval"),
                  Field(f"{rows}.oilbird_over_arm", POSITIVE, "oilbird_over_arm_interval"),
                  Field(f"{rows}.speedup", POSITIVE), Field(f"{rows}.exact", FLAG),
                  *_share_block(f"{rows}.sole_source_share", "tokens"))
    ) + (Field("target_met", FLAG), Field("requests", COUNT), Field("nodes", COUNT)),
    "vllm": (
        Field("complete", FLAG), Field("bench", TEXT), Field("model", TEXT),
        Field("rows.*.arm", TEXT), Field("rows.*.batch", COUNT), Field("rows.*.k", COUNT),
        Field("rows.*.requests", COUNT), Field("rows.*.generated_tokens", COUNT),
        Field("rows.*.speedup_vs_ar", POSITIVE, "speedup_range"), Field("rows.*.tok_s", POSITIVE, "tok_s_range"),
        Field("rows.*.mean_acceptance_length", POSITIVE), Field("rows.*.replay_mean_acceptance_length", POSITIVE),
        Field("rows.*.acceptance_vs_replay", POSITIVE), Field("rows.*.wall_s", NONNEG),
        Field("replay.*.tau", TAU), Field("replay.*.passes", COUNT),
        # the proposer's own counters (decoder/vllm/proposer.py `stats`), as the bench copies them into its rows
        *(Field(f"rows.*.proposer.{k}", COUNT) for k in ("steps", "key_queries", "unaligned_steps", "unverified_rows")),
        Field("rows.*.proposer.draft_s", NONNEG),
    ),
}
KINDS = tuple(SCHEMAS)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a result file, said in one line by `str()`."""

    file: str  # the file as the reader was given it
    field: str  # its concrete path, e.g. "sole_source_share.value" or "rows[2].tok_s"
    why: str  # "lacks", or the words after the value ("outside [0, 1]")
    value: object = None
    keys: tuple = ()  # the path as keys and list indexes, to find the value again (scrub)
    detail: str = ""  # said after a missing field: which definition is missing, what the file gives instead

    def __str__(self) -> str:
        if self.why == "lacks":
            return f"{self.file} lacks {self.field}" + (f" {self.detail}" if self.detail else "")
        return f"{self.file} has {self.field} = {shown(self.value)} {self.why}"


def shown(value) -> str:
    """A value as the problem line shows it: JSON, NaN as NaN, cut at 40 characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _label(keys: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else (f".{k}" if i else str(k)) for i, k in enumerate(keys))


def _walk(obj, parts: list[str], keys: tuple = ()):
    """(concrete keys, the object holding the last key, present) for every match of `parts` in `obj`; a
    missing key yields present=False once (a wildcard over nothing yields nothing)."""
    if len(parts) == 1:
        if parts[0] == "*":
            items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
            for k, _ in items:
                yield keys + (k,), obj, True
        elif isinstance(obj, dict):
            yield keys + (parts[0],), obj, parts[0] in obj
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for k, v in items:
            yield from _walk(v, rest, keys + (k,))
    elif isinstance(obj, dict):
        if head in obj:
            yield from _walk(obj[head], rest, keys + (head,))
        else:
            yield keys + (head,), None, False


def _interval_problem(iv, point) -> str | None:
    if not isinstance(iv, (list, tuple)) or len(iv) != 2 or not all(_number(x) for x in iv):
        return "not an interval (two finite numbers)"
    if iv[0] > iv[1]:
        return "not an ordered interval (lo > hi)"
    slack = 1e-9 * max(1.0, abs(point)) if _number(point) else 0.0  # the draws' sums round apart from the point's
    if _number(point) and not iv[0] - slack <= point <= iv[1] + slack:
        return f"an interval that does not hold its value {shown(point)} (lo <= value <= hi)"
    return None


def validate(doc: dict, kind: str, file: str) -> list[Problem]:
    """Every problem of `doc` (a parsed result file of `kind`) against its schema, without changing it."""
    problems: list[Problem] = []
    seen: set[tuple] = set()  # a value checked by two fields (a proportion's wilson and bootstrap) is said once
    for f in SCHEMAS[kind]:
        for keys, holder, present in _walk(doc, f.path.split(".")):
            if not present:
                if f.required:
                    problems.append(Problem(file, _label(keys), "lacks", None, keys))
                continue
            value = holder[keys[-1]]
            if value is not None and not f.rule.ok(value):
                if keys not in seen:
                    seen.add(keys)
                    problems.append(Problem(file, _label(keys), f.rule.broken, value, keys))
                continue
            if f.interval and isinstance(holder, dict) and holder.get(f.interval) is not None:
                why = _interval_problem(holder[f.interval], value)
                ikeys = keys[:-1] + (f.interval,)
                if why and ikeys not in seen:
                    seen.add(ikeys)
                    problems.append(Problem(file, _label(ikeys), why, holder[f.interval], ikeys))
    return problems


def scrub(doc: dict, problems: list[Problem]) -> dict:
    """`doc` with the value of every problem (an invalid value, an invalid interval) set to null, in place."""
    for p in problems:
        if p.why == "lacks":
            continue
        holder = doc
        for k in p.keys[:-1]:
            holder = holder[k]
        holder[p.keys[-1]] = None
    return doc


@dataclass
class ResultFile:
    """A result file as read: the document (invalid values nulled) and what was wrong with it."""

    doc: dict
    problems: list[Problem]


def read_result(path: str | os.PathLike, kind: str, label: str | None = None) -> ResultFile:
    """Read and check the result file at `path` (`kind`: one of KINDS). A file that is not a bounded JSON
    object is an OilbirdError (nothing can be shown from it); a field of the wrong type or range, or a required
    one missing, is a Problem. `label` names the file in the problem lines (default: the path)."""
    name = label or os.fsdecode(path)
    try:
        doc = read_json(path, "file")
    except OilbirdError as e:  # "cannot read <path>: <why>", the reports' form since before the bounds
        raise OilbirdError(f"cannot read {os.fsdecode(path)}: {str(e).replace(f'file {os.fsdecode(path)} ', '')}") \
            from None
    if not isinstance(doc, dict):
        raise OilbirdError(f"{os.fsdecode(path)} is not a JSON object")
    problems = validate(doc, kind, name)
    return ResultFile(scrub(doc, problems), problems)


def check_written(doc: dict, kind: str, file: str) -> None:
    """For writers: refuse to write a result that breaks its own schema (a bug upstream), in one line."""
    problems = validate(doc, kind, file)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise OilbirdError(f"refusing to write a result that breaks its schema: {problems[0]}{more}; "
                           "this is a bug in Oilbird, please report it")
