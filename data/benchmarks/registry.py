"""Benchmark registry: every benchmark becomes a list of chat requests (data/benchmarks/request.py) in serving order.

The registry, the grid's limits and the loaders of the code, math and chat benchmarks live here;
the tool-calling loaders in data/benchmarks/toolbench.py, `jsonl:PATH` in data/benchmarks/jsonl.py, the files they read
in data/benchmarks/sources.py.

Registered benchmarks and their request counts on the pinned upstream files (`EXPECTED_COUNTS`):

| name              | requests | max_new_tokens | stop_strings       |
| ----------------- | -------- | -------------- | ------------------ |
| `apibank`         | 534      | 1024           | `</tool_call>`     |
| `apibank-native`  | 534      | 1024           |                    |
| `taubench-retail` | 582      | 1024           | `</tool_call>`     |
| `toolalpaca`      | 214      | 1024           | `</tool_call>`     |
| `humaneval`       | 164      | 512            |                    |
| `classeval`       | 100      | 2048           |                    |
| `gsm8k`           | 1319     | 1024           |                    |
| `mtbench`         | 80       | 1024           |                    |
| `specbench`       | 480      | 1024           |                    |
| `specbench-math`  | 80       | 1024           |                    |

plus `jsonl:PATH`, a user's own traffic (one request per line, data/benchmarks/jsonl.py).

Tenants: a request belongs to one tenant (`Request.tenant`, the trace store's `tenant` column).
Registered benchmarks are one tenant, "". JSONL traffic may say `"tenant": "name"` per line
(a string; absent = ""); no request drafts from, or is censused against, another tenant's traces.

Prompt layouts (one system message where the benchmark has one, then one user message):

* `apibank`, `apibank-native`, `taubench-retail`, `toolalpaca`: the tool-calling layouts, data/benchmarks/toolbench.py.
* `humaneval`: the code-completion prompt as the user message; reference `canonical_solution`.
* `classeval`: the class skeleton as the user message; reference `solution_code`.
* `gsm8k`: the question; reference the full answer (rationale and `#### N`).
* `mtbench`: the first turn; no reference. `specbench`: the first turn of all 480 questions;
  reference = the first turn's reference text where the file has one (278 of 480: none for qa,
  for rag, whose references are lists of answer phrases, nor for most open MT-Bench questions).
  `specbench-math`: its 80 `math_reasoning` questions (GSM8K problems, reference = the answer).

Data location: data/benchmarks/sources.py (`$OILBIRD_DATA`, else `../shared/benchmarks`, else the download cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from data.benchmarks.jsonl import _load_jsonl
from data.benchmarks.request import Request
from data.benchmarks.sources import DataFile, _read_json, _read_jsonl, data_root
from data.benchmarks.toolbench import (
    APIBANK_FILES,
    TAU_DIR,
    TAU_TASKS,
    TOOL_STOP,
    TOOLALPACA_FILES,
    load_apibank,
    load_apibank_native,
    load_taubench_retail,
    load_toolalpaca,
)
from data.errors import OilbirdError

EXPECTED_COUNTS = {
    "apibank": 534,  # 399 level-1 + 135 level-2
    "apibank-native": 534,
    "taubench-retail": 582,  # gold steps of 113 of the 115 test tasks
    "toolalpaca": 214,  # 100 simulated + 114 real
    "humaneval": 164,
    "classeval": 100,
    "gsm8k": 1319,
    "mtbench": 80,
    "specbench": 480,
    "specbench-math": 80,
}

# The cross-benchmark grid (`make grid`): the benchmarks it runs, in this order, and the first-N
# limit of each whose whole capture does not fit 20 minutes on 2 CPU cores (SmolLM2-135M, fp32,
# cap 256, 32 rows; about 40-70 generated tokens/s there, less with long prompts). A benchmark not
# in GRID_LIMITS is captured whole. `python -m data capture --limit grid` reads this table.
GRID_BENCHES = ("apibank", "taubench-retail", "toolalpaca", "humaneval", "classeval", "gsm8k",
                "specbench-math", "mtbench")
GRID_CAPTURE_MINUTES = 20
GRID_LIMITS = {
    "taubench-retail": 96,  # 4.7k-token prompts, 32 rows: measured 64 requests in 805 s (12.6 s each)
    "gsm8k": 640,  # short prompts: measured 160 requests in 231 s (1.4 s each, ~100 generated tokens/s)
}


def grid_limit(bench: str) -> int | None:
    """The grid's first-N limit for a benchmark (None: captured whole)."""
    return GRID_LIMITS.get(bench)


def grid_limit_note(bench: str) -> str:
    """One line saying what the grid captures of a benchmark, and why."""
    limit, total = grid_limit(bench), EXPECTED_COUNTS.get(bench) or len(load_requests(bench))
    if limit is None:
        return (f"capture {bench}: every request{f' ({total})' if total else ''} (the whole benchmark fits "
                f"{GRID_CAPTURE_MINUTES} min of capture on 2 cores)")
    return (f"capture {bench}: the first {limit} of {total} requests (the whole benchmark does not fit "
            f"{GRID_CAPTURE_MINUTES} min of capture on 2 cores; data/benchmarks/registry.py GRID_LIMITS)")


@dataclass(frozen=True)
class BenchmarkInfo:
    name: str
    description: str
    source: str  # upstream "owner/repo@commit:path"
    max_new_tokens: int
    stop_strings: tuple[str, ...]



# ---------------------------------------------------------------------------------------------
# Code, math and chat benchmarks

HUMANEVAL = DataFile("humaneval/HumanEval.jsonl.gz", "openai/human-eval", "6d43fb980f9f", ("data/HumanEval.jsonl.gz",))
CLASSEVAL = DataFile("classeval/ClassEval_data.json", "FudanSELab/ClassEval", "eaeac44d0d5d", ("data/ClassEval_data.json",))
GSM8K = DataFile("gsm8k/test.jsonl", "openai/grade-school-math", "3101c7d5072418", ("grade_school_math/data/test.jsonl",))
MTBENCH = DataFile("mtbench/question.jsonl", "lm-sys/FastChat", "0e6d3e4beaab",
                   ("fastchat/llm_judge/data/mt_bench/question.jsonl",))
SPECBENCH = DataFile("specbench/question.jsonl", "hemingkx/Spec-Bench", "fd2c1cd7d220", ("data/spec_bench/question.jsonl",))


def _single(id_: str, prompt: str, reference: str | None) -> Request:
    return Request(id=id_, group=id_, messages=({"role": "user", "content": prompt},), reference=reference)


def load_humaneval() -> list[Request]:
    return [_single(r["task_id"], r["prompt"], r.get("canonical_solution")) for r in _read_jsonl(HUMANEVAL)]


def load_classeval() -> list[Request]:
    return [_single(r["task_id"], r["skeleton"], r.get("solution_code")) for r in _read_json(CLASSEVAL)]


def load_gsm8k() -> list[Request]:
    return [_single(str(i), r["question"], r.get("answer")) for i, r in enumerate(_read_jsonl(GSM8K))]


def load_mtbench() -> list[Request]:
    return [_single(str(r["question_id"]), r["turns"][0], None) for r in _read_jsonl(MTBENCH)]


def _specbench(category: str | None) -> list[Request]:
    out = []
    for r in _read_jsonl(SPECBENCH):
        if category is None or r.get("category") == category:
            refs = r.get("reference") or [None]
            ref = refs[0] if isinstance(refs[0], str) and refs[0] else None  # rag answers are lists: no text
            out.append(_single(str(r["question_id"]), r["turns"][0], ref))
    return out


# ---------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class _Entry:
    info: BenchmarkInfo
    load: Callable[[], list[Request]]


def _source(files: tuple[DataFile, ...], paths: str | None = None) -> str:
    f = files[0]
    return f"{f.repo}@{f.short_commit}:{paths or f.paths[0]}"


_REGISTRY: dict[str, _Entry] = {}


def _register(name: str, description: str, source: str, load: Callable[[], list[Request]],
              max_new_tokens: int = 1024, stop_strings: tuple[str, ...] = ()) -> None:
    _REGISTRY[name] = _Entry(BenchmarkInfo(name, description, source, max_new_tokens, stop_strings), load)


_register("apibank", "API-Bank level-1 + level-2 API calls, tool-call chat layout (<tool_call> JSON)",
          _source(APIBANK_FILES, "api-bank/json_test_data/level-{1,2}-api.json"), load_apibank, stop_strings=TOOL_STOP)
_register("apibank-native", "API-Bank level-1 + level-2 API calls, the benchmark's own instruction + input",
          _source(APIBANK_FILES, "api-bank/json_test_data/level-{1,2}-api.json"), load_apibank_native)
_register("taubench-retail", "tau-bench retail: next gold tool call of each task step, policy + tool schemas",
          _source((TAU_TASKS,), f"{TAU_DIR}/{{tasks_test.py,tools/*.py,wiki.md}}"), load_taubench_retail,
          stop_strings=TOOL_STOP)
_register("toolalpaca", "ToolAlpaca eval (simulated + real APIs): one tool-call request per instruction",
          _source(TOOLALPACA_FILES, "data/eval_{simulated,real}.json"), load_toolalpaca, stop_strings=TOOL_STOP)
_register("humaneval", "HumanEval code completion (reference: canonical solution)", _source((HUMANEVAL,)),
          load_humaneval, max_new_tokens=512)
_register("classeval", "ClassEval class-level code generation from skeletons (reference: solution code)",
          _source((CLASSEVAL,)), load_classeval, max_new_tokens=2048)
_register("gsm8k", "GSM8K grade-school math test questions (reference: worked answer)", _source((GSM8K,)), load_gsm8k)
_register("mtbench", "MT-Bench first turns (no reference)", _source((MTBENCH,)), load_mtbench)
_register("specbench", "Spec-Bench first turns, all 480 questions in 13 categories", _source((SPECBENCH,)),
          lambda: _specbench(None))
_register("specbench-math", "Spec-Bench math_reasoning category (80 GSM8K questions)", _source((SPECBENCH,)),
          lambda: _specbench("math_reasoning"))


def list_benchmarks() -> list[BenchmarkInfo]:
    """The registered benchmarks in a stable order (`jsonl:PATH` is not listed)."""
    return [e.info for e in _REGISTRY.values()]


def get_benchmark(name: str) -> BenchmarkInfo:
    if name.startswith("jsonl:"):
        path = name[len("jsonl:"):]
        if not path:
            raise OilbirdError("jsonl: needs a path, e.g. jsonl:my_traffic.jsonl")
        return BenchmarkInfo(name=name, description=f"your own requests from {path}", source=path,
                             max_new_tokens=1024, stop_strings=())
    entry = _REGISTRY.get(name)
    if entry is None:
        raise OilbirdError(f"unknown benchmark '{name}'; known: {', '.join(_REGISTRY)} or jsonl:PATH")
    return entry.info


def load_requests(name: str, limit: int | None = None) -> list[Request]:
    """The benchmark's requests in serving order (the first `limit` of them when given)."""
    info = get_benchmark(name)
    if limit is not None and limit < 1:
        raise OilbirdError(f"--limit must be at least 1 (got {limit})")
    if name.startswith("jsonl:"):
        requests = _load_jsonl(info.source)
    else:
        requests = _REGISTRY[name].load()
        if not requests:
            raise OilbirdError(f"benchmark {name} has no requests (data under {data_root()})")
    return requests[:limit] if limit is not None else requests
