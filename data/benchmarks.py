"""Benchmark registry and loaders: every benchmark becomes a list of chat requests in serving order.

A `Request` is one prompt to decode: its id (unique within the benchmark), its group (the
conversation or task it belongs to; successive turns of one dialogue share it), the chat messages,
and the reference output where the benchmark has one (used by `--mode reference`).

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

plus `jsonl:PATH`, a user's own traffic (one request per line, see `_load_jsonl`).

Tenants: a request belongs to one tenant (`Request.tenant`, the trace store's `tenant` column).
Registered benchmarks are one tenant, "". JSONL traffic may say `"tenant": "name"` per line
(a string; absent = ""); no request drafts from, or is censused against, another tenant's traces.

Prompt layouts (one system message where the benchmark has one, then one user message):

* `apibank` (level-1 then level-2 test set, file order): the layout used for API-Bank serving in
  the tool-use RL literature. System: the role, the current year from the benchmark header, the
  available tools (`N. Name: ...` / `Description: ...` / `Parameters: {json of input_parameters}`),
  the output rules and the legend of the dialogue tags. User: `**Dialogue Records History**`, then
  the dialogue in order as blocks separated by a blank line: `<user>\\n...\\n</user>` for `User:`
  lines, `<response>\\n...\\n</response>` for `AI:` lines (the tag that layout uses for the
  assistant's natural-language replies), `<tool_call>\\n{"name": ..., "parameters": {...}}\\n</tool_call>`
  for each earlier `API-Request:` and `<obs>\\n...\\n</obs>` for its `->` result (Python-repr lists
  and dicts rewritten as JSON, anything else verbatim); it ends with a `<user>` block asking for
  one tool call. Reference: the expected call in the same `<tool_call>` form. Argument values
  stay exactly as the benchmark writes them (strings, e.g. `"attendees": "['John', 'Jane']"`).
  A call that cannot be parsed stays as raw text inside its block, never dropped (all 379
  history calls and 534 expected calls of the pinned files parse). Group = the record's `file`;
  id = `L{level}-{index in file:03d}`.
* `apibank-native`: the benchmark's own `instruction` and `input` as one user message; reference
  = `expected_output` verbatim (`API-Request: [Name(k='v')]`).
* `taubench-retail`: one request per task and gold step. System: the retail policy (wiki.md), the
  16 tool schemas (one JSON object per line) and the output rules. User: the task instruction,
  then the task's earlier gold calls as `<tool_call>` blocks under `**Tool calls so far**`
  (inside the user turn, so the prompt is one system + one user message under every chat
  template, and a task's requests share their prefix; the calls' results are not in the data
  and are not shown), then `Make the next tool call.`. Reference: that step's gold call. Group =
  task index; id = `{task}-{step}`. Tasks without gold actions (2) yield no request.
* `toolalpaca` (eval_simulated then eval_real; each API's instructions in order). System: the
  API's name and description, its functions as `N. name: Function_Description` (plus the output
  schemas in `components` when given), a `getDetails` tool for asking the user (the golden
  answers use it), and the output rules. User: the instruction. Reference: the golden actions as
  one `<tool_call>` block with one `{"name", "parameters"}` JSON object per line; an
  `Action_Input` that is not JSON (36 of 297 golden actions hold placeholders such as
  `${animeId from searchAnime}`) is spliced in raw. Group = `{split}:{API name}`.
* `humaneval`: the code-completion prompt as the user message; reference `canonical_solution`.
* `classeval`: the class skeleton as the user message; reference `solution_code`.
* `gsm8k`: the question; reference the full answer (rationale and `#### N`).
* `mtbench`: the first turn; no reference. `specbench`: the first turn of all 480 questions;
  reference = the first turn's reference text where the file has one (278 of 480: none for qa,
  for rag, whose references are lists of answer phrases, nor for most open MT-Bench questions).
  `specbench-math`: its 80 `math_reasoning` questions (GSM8K problems, reference = the answer).

Data location (`data_root`): `$OILBIRD_DATA`, else `../shared/benchmarks` next to the repository
when it exists, else the download cache. A file missing there is looked up in the cache
(`$OILBIRD_CACHE/benchmarks`, default `~/.cache/oilbird/benchmarks`) and otherwise downloaded
from the pinned upstream commit (raw GitHub, 10 s timeout; tau-bench's Python task and tool
files are converted to the JSON layout of the shared copy). Offline with nothing found, loading
stops with one line saying where it looked and to set OILBIRD_DATA.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import re
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from data.errors import OilbirdError

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_BENCHMARKS = REPO_ROOT.parent / "shared" / "benchmarks"
DOWNLOAD_TIMEOUT_S = 10.0
TOOL_STOP = ("</tool_call>",)

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
            f"{GRID_CAPTURE_MINUTES} min of capture on 2 cores; data/benchmarks.py GRID_LIMITS)")


@dataclass(frozen=True)
class Request:
    id: str  # unique within the benchmark
    group: str  # conversation / task id
    messages: tuple  # tuple of {"role": "system"|"user"|"assistant", "content": str} dicts, in order
    reference: str | None
    tenant: str = ""  # whose traffic it is; "" = the one default tenant (every registered benchmark)


@dataclass(frozen=True)
class BenchmarkInfo:
    name: str
    description: str
    source: str  # upstream "owner/repo@commit:path"
    max_new_tokens: int
    stop_strings: tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# Where the files come from


@dataclass(frozen=True)
class DataFile:
    """One file under the data root, built from one or more files of a pinned upstream commit."""

    rel: str  # path under the data root, e.g. "apibank/level-1-api.json"
    repo: str
    commit: str
    paths: tuple[str, ...]  # upstream paths it is built from
    convert: Callable[[list[bytes]], bytes] | None = field(default=None, compare=False)  # None: verbatim

    @property
    def short_commit(self) -> str:  # as the shared README pins it
        return self.commit[:12] if len(self.commit) == 40 else self.commit

    def urls(self) -> list[str]:
        return [f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{p}" for p in self.paths]


def data_root() -> Path:
    """`$OILBIRD_DATA`, else `../shared/benchmarks` next to the repository if it exists, else the cache."""
    env = os.environ.get("OILBIRD_DATA")
    if env:
        return Path(env).expanduser()
    if SHARED_BENCHMARKS.is_dir():
        return SHARED_BENCHMARKS
    return cache_dir()


def cache_dir() -> Path:
    base = os.environ.get("OILBIRD_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "oilbird") / "benchmarks"


_offline_reason: str | None = None  # after one failed download, later ones fail at once (no repeated waits)


def _download(url: str) -> bytes:
    global _offline_reason
    if _offline_reason is not None:
        raise OSError(_offline_reason)
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
            return resp.read()
    except Exception as e:  # urllib raises URLError, HTTPError, socket timeouts, ...
        if not getattr(e, "code", None):  # an HTTP status means the network works; anything else: offline
            _offline_reason = f"{type(e).__name__}: {e}"
        raise


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve(f: DataFile) -> Path:
    """The local path of a data file: the data root, else the cache, else downloaded into the cache."""
    root = data_root()
    local = root / f.rel
    if local.is_file():
        return local
    cached = cache_dir() / f.rel
    if cached.is_file():
        return cached
    try:
        blobs = [_download(url) for url in f.urls()]
        payload = f.convert(blobs) if f.convert else blobs[0]
    except Exception as e:
        raise OilbirdError(
            f"benchmark file {f.rel} is not under {root} nor in the cache {cache_dir()}, and fetching it from "
            f"{f.repo}@{f.short_commit} failed ({_one_line(e)}); set OILBIRD_DATA to a folder holding a copy "
            f"(layout {f.rel})") from None
    cached.parent.mkdir(parents=True, exist_ok=True)
    _clean_partial_downloads(cached)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.part")
    tmp.write_bytes(payload)
    os.replace(tmp, cached)  # atomic: a killed download never leaves a truncated file behind
    return cached


def _clean_partial_downloads(cached: Path) -> None:
    """Remove `<name>.<pid>.part` files of downloads killed midway (their pid no longer runs)."""
    for part in cached.parent.glob(f"{cached.name}.*.part"):
        pid = part.name[len(cached.name) + 1:-len(".part")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            part.unlink(missing_ok=True)
        except OSError:
            pass  # alive, someone else's


def _read_json(f: DataFile):
    path = resolve(f)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise OilbirdError(f"{path} is not valid JSON ({_one_line(e)})") from None


def _read_jsonl(f: DataFile) -> list[dict]:
    path = resolve(f)
    opener = gzip.open if path.name.endswith(".gz") else open
    rows, lineno = [], 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    rows.append(json.loads(line))
    except (ValueError, OSError) as e:
        raise OilbirdError(f"{path} line {max(lineno, 1)}: cannot read ({_one_line(e)})") from None
    return rows


# ---------------------------------------------------------------------------------------------
# Shared pieces of the tool-calling prompts


def tool_call_block(calls: list[str]) -> str:
    """`<tool_call>`, one JSON call per line, `</tool_call>`."""
    return "<tool_call>\n" + "\n".join(calls) + "\n</tool_call>"


def call_json(name: str, params) -> str:
    return json.dumps({"name": name, "parameters": params}, ensure_ascii=False)


TOOL_CALL_RULES = """**Output Format**

Reply with the tool call only: a JSON object with "name" (the tool) and "parameters" (its arguments, {} when it takes none) inside a tool-call block:
<tool_call>
{"name": "tool_name", "parameters": {"argument": "value"}}
</tool_call>
When several calls are needed at once, write one JSON object per line inside the block."""


# ---------------------------------------------------------------------------------------------
# API-Bank

APIBANK_REPO, APIBANK_COMMIT = "AlibabaResearch/DAMO-ConvAI", "5c38bb7d1d78c7a7f12aa415d620d6305dbe2078"
APIBANK_FILES = tuple(
    DataFile(f"apibank/level-{lv}-api.json", APIBANK_REPO, APIBANK_COMMIT, (f"api-bank/json_test_data/level-{lv}-api.json",))
    for lv in (1, 2))

APIBANK_SYSTEM = """You are a helpful assistant in a multi-turn dialogue; you solve the user's requests by calling tools.{year}

**Available Tools**

{tools}

{rules}

**Dialogue Records**

The user's message holds the dialogue so far: the user's turns in <user>, your earlier replies in <response>, your earlier tool calls in <tool_call> and their results in <obs>. A tool described in an <obs> result can be called too."""

APIBANK_ASK = "Based on the dialogue above, make the one tool call my request needs now."

_KWARG_START = re.compile(r"(?:^|(?<=')\s*,\s*)([A-Za-z_]\w*)\s*=\s*'")


def parse_api_call(text: str) -> tuple[str, dict] | None:
    """`[Name(k='v', k2='v2')]` (brackets optional) -> (name, {k: v}); None if it cannot be parsed.

    Well-formed Python goes through `ast`. API-Bank also writes values holding unescaped quotes
    (`attendees='['John', 'Jane']'`), which Python cannot parse; for those each value runs from
    `k='` to the quote that precedes `, k2='` or the closing parenthesis, kept verbatim."""
    s = text.strip()
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1].strip()
    m = re.fullmatch(r"([A-Za-z_][\w.]*)\((.*)\)", s, re.S)
    if not m:
        return None
    name, args = m.group(1), m.group(2).strip()
    try:
        node = ast.parse(s, mode="eval").body
        if isinstance(node, ast.Call) and not node.args and all(k.arg for k in node.keywords):
            params = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            json.dumps(params)  # values must be JSON-able (no bytes, sets, ...) for the <tool_call> form
            return name, params
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        pass
    if not args:
        return name, {}
    starts = list(_KWARG_START.finditer(args))
    if not starts or starts[0].start() != 0:
        return None
    params = {}
    for i, km in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(args)
        value = args[km.end():end]
        if not value.endswith("'"):
            return None
        params[km.group(1)] = value[:-1]
    return name, params


def split_api_request(line: str) -> tuple[str, str | None]:
    """`API-Request: [Name(...)]->result` -> ("[Name(...)]", "result"); no `->`: result None."""
    rest = line.split(":", 1)[1].strip() if ":" in line else line
    cut = rest.find(")]->")
    if cut >= 0:
        return rest[: cut + 2], rest[cut + 4:]
    return rest, None


def render_observation(result: str) -> str:
    """A `->` result: Python-repr lists / dicts as JSON, a quoted string unquoted, anything else verbatim."""
    text = result.strip()
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            return text
    return text


def render_api_call(call_text: str) -> str:
    """A call as a `<tool_call>` block: JSON when it parses, else the raw text (never dropped)."""
    parsed = parse_api_call(call_text)
    return tool_call_block([call_json(*parsed) if parsed else call_text.strip()])


def _apibank_tools(instruction: str) -> tuple[str, str]:
    """(tool list, year sentence) from a record's `instruction`: its header and one JSON API per line."""
    header, _, apis = instruction.partition("API descriptions:")
    year = re.search(r"The current year is \d{4}\.", header)
    blocks = []
    for line in apis.strip().splitlines():
        if not line.strip():
            continue
        try:
            api = json.loads(line)
        except ValueError:
            try:
                api = ast.literal_eval(line.strip())
            except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
                api = None
        n = len(blocks) + 1
        if isinstance(api, dict) and "name" in api:
            params = json.dumps(api.get("input_parameters", {}), ensure_ascii=False, default=str)
            blocks.append(f"{n}. Name: {api['name']}\nDescription: {api.get('description', '')}\nParameters: {params}")
        else:
            blocks.append(f"{n}. {line.strip()}")  # unparsable description: kept as written
    return "\n\n".join(blocks), (" " + year.group(0) if year else "")


def _apibank_dialogue(text: str) -> str:
    """The flattened `input` as `**Dialogue Records History**` blocks."""
    turns: list[list[str]] = []  # [tag, text] pairs; a line without a known prefix continues the last turn
    for line in text.splitlines():
        if line.startswith("Generate API Request:"):
            continue
        if line.startswith("User:"):
            turns.append(["user", line[5:].strip()])
        elif line.startswith("AI:"):
            turns.append(["response", line[3:].strip()])
        elif line.startswith("API-Request:"):
            call, result = split_api_request(line)
            turns.append(["call", call])
            if result is not None:
                turns.append(["obs", result])
        elif turns and line.strip():
            turns[-1][1] += "\n" + line
        elif line.strip():
            turns.append(["user", line.strip()])
    blocks = ["**Dialogue Records History**"]
    for tag, body in turns:
        if tag == "call":
            blocks.append(render_api_call(body))
        elif tag == "obs":
            blocks.append(f"<obs>\n{render_observation(body)}\n</obs>")
        else:
            blocks.append(f"<{tag}>\n{body}\n</{tag}>")
    blocks.append(f"<user>\n{APIBANK_ASK}\n</user>")
    return "\n\n".join(blocks)


def _apibank_records() -> list[tuple[int, int, dict]]:
    out = []
    for lv, f in zip((1, 2), APIBANK_FILES):
        data = _read_json(f)
        if not isinstance(data, list):
            raise OilbirdError(f"{resolve(f)}: expected a JSON list of records")
        out += [(lv, i, r if isinstance(r, dict) else {"input": json.dumps(r)}) for i, r in enumerate(data)]
    return out


def _apibank_reference(expected: str) -> str:
    call = expected.split(":", 1)[1].strip() if expected.startswith("API-Request:") else expected
    return render_api_call(call)


def load_apibank() -> list[Request]:
    requests = []
    for lv, i, r in _apibank_records():
        tools, year = _apibank_tools(str(r.get("instruction", "")))
        system = APIBANK_SYSTEM.format(year=year, tools=tools, rules=TOOL_CALL_RULES)
        user = _apibank_dialogue(str(r.get("input", "")))
        requests.append(Request(
            id=f"L{lv}-{i:03d}", group=str(r.get("file", f"L{lv}-{i:03d}")),
            messages=({"role": "system", "content": system}, {"role": "user", "content": user}),
            reference=_apibank_reference(str(r.get("expected_output", "")))))
    return requests


def load_apibank_native() -> list[Request]:
    requests = []
    for lv, i, r in _apibank_records():
        prompt = str(r.get("instruction", "")).strip() + "\n\n" + str(r.get("input", "")).strip()
        requests.append(Request(id=f"L{lv}-{i:03d}", group=str(r.get("file", f"L{lv}-{i:03d}")),
                                messages=({"role": "user", "content": prompt},),
                                reference=r.get("expected_output")))
    return requests


# ---------------------------------------------------------------------------------------------
# tau-bench retail

TAU_REPO, TAU_COMMIT = "sierra-research/tau-bench", "59a200c6d575"
TAU_DIR = "tau_bench/envs/retail"
TAU_TOOLS = ("calculate", "cancel_pending_order", "exchange_delivered_order_items", "find_user_id_by_email",
             "find_user_id_by_name_zip", "get_order_details", "get_product_details", "get_user_details",
             "list_all_product_types", "modify_pending_order_address", "modify_pending_order_items",
             "modify_pending_order_payment", "modify_user_address", "return_delivered_order_items", "think",
             "transfer_to_human_agents")  # upstream ALL_TOOLS order


def _ast_data(node):
    """A literal Python expression where `Task(...)` / `Action(...)` calls become dicts of their keywords."""
    if isinstance(node, ast.Call):
        return {k.arg: _ast_data(k.value) for k in node.keywords if k.arg}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_ast_data(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {ast.literal_eval(k): _ast_data(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def tau_tasks_to_json(blobs: list[bytes]) -> bytes:
    """Upstream `tasks_test.py` (`TASKS_TEST = [Task(...), ...]`) -> the JSON list of the shared copy."""
    tree = ast.parse(blobs[0].decode("utf-8"))
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List):
            return json.dumps(_ast_data(stmt.value), ensure_ascii=False, indent=1).encode("utf-8")
    raise ValueError("no task list found in tasks_test.py")


def tau_tools_to_json(blobs: list[bytes]) -> bytes:
    """Upstream `tools/*.py` -> the JSON list of what each tool's `get_info()` returns."""
    tools = []
    for blob in blobs:
        tree = ast.parse(blob.decode("utf-8"))
        info = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "get_info"), None)
        ret = next((n for n in ast.walk(info) if isinstance(n, ast.Return)), None) if info else None
        if ret is None:
            raise ValueError("a tool file has no get_info() return")
        tools.append(ast.literal_eval(ret.value))
    return json.dumps(tools, ensure_ascii=False, indent=1).encode("utf-8")


TAU_TASKS = DataFile("taubench-retail/retail_tasks_test.json", TAU_REPO, TAU_COMMIT, (f"{TAU_DIR}/tasks_test.py",),
                     tau_tasks_to_json)
TAU_TOOL_FILE = DataFile("taubench-retail/retail_tools.json", TAU_REPO, TAU_COMMIT,
                         tuple(f"{TAU_DIR}/tools/{t}.py" for t in TAU_TOOLS), tau_tools_to_json)
TAU_WIKI = DataFile("taubench-retail/retail_wiki.md", TAU_REPO, TAU_COMMIT, (f"{TAU_DIR}/wiki.md",))

TAU_ASK = "Make the next tool call."


def load_taubench_retail() -> list[Request]:
    tasks, tools = _read_json(TAU_TASKS), _read_json(TAU_TOOL_FILE)
    wiki = resolve(TAU_WIKI).read_text(encoding="utf-8").strip()
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    system = f"{wiki}\n\n**Available Tools**\n\n{schemas}\n\n{TOOL_CALL_RULES}"
    requests = []
    for ti, task in enumerate(tasks):
        calls = [tool_call_block([call_json(a.get("name", ""), a.get("kwargs", {}))]) for a in task.get("actions", [])]
        for step, call in enumerate(calls):
            parts = [str(task.get("instruction", "")).strip()]
            if step:
                parts.append("**Tool calls so far**\n\n" + "\n\n".join(calls[:step]))
            parts.append(TAU_ASK)
            requests.append(Request(id=f"{ti}-{step}", group=str(ti),
                                    messages=({"role": "system", "content": system},
                                              {"role": "user", "content": "\n\n".join(parts)}),
                                    reference=call))
    return requests


# ---------------------------------------------------------------------------------------------
# ToolAlpaca

TOOLALPACA_REPO, TOOLALPACA_COMMIT = "tangqiaoyu/ToolAlpaca", "189069998d64a7baf1b4a1c3c4b2e75eb9d05532"
TOOLALPACA_FILES = tuple(
    DataFile(f"toolalpaca/eval_{split}.json", TOOLALPACA_REPO, TOOLALPACA_COMMIT, (f"data/eval_{split}.json",))
    for split in ("simulated", "real"))

# The golden answers ask the user for missing values through this tool.
GET_DETAILS = ('getDetails: Ask the user for details the request is missing.\n'
               'Parameters: {"Question": "Required. string. The question to ask the user."}')


def _toolalpaca_system(api: dict) -> str:
    funcs = dict(api.get("Function_Description") or {})
    components = str(funcs.pop("components", "") or "").strip()
    lines = [f"{i}. {name}: {desc}" for i, (name, desc) in enumerate(funcs.items(), 1)]
    lines.append(f"{len(lines) + 1}. {GET_DETAILS}")
    tools = "\n\n".join(lines) + (f"\n\n{components}" if components else "")
    return (f"You are a helpful assistant; you answer the user's request by calling the tools of the "
            f"{api.get('Name', '')} API ({api.get('Description', '')}).\n\n**Available Tools**\n\n{tools}\n\n{TOOL_CALL_RULES}")


def _toolalpaca_reference(actions) -> str | None:
    if not actions:
        return None
    calls = []
    for a in actions:
        raw = str(a.get("Action_Input", "") or "{}")
        try:
            calls.append(call_json(str(a.get("Action", "")), json.loads(raw)))
        except ValueError:  # placeholders like ${id from search}: keep the text as written
            calls.append('{"name": ' + json.dumps(str(a.get("Action", "")), ensure_ascii=False) + ', "parameters": ' + raw + "}")
    return tool_call_block(calls)


def load_toolalpaca() -> list[Request]:
    requests = []
    for split, f in zip(("simulated", "real"), TOOLALPACA_FILES):
        for api in _read_json(f):
            system = _toolalpaca_system(api)
            group = f"{split}:{api.get('Name', '')}"
            golden = api.get("Golden_Answers") or []
            for k, instruction in enumerate(api.get("Instructions", [])):
                requests.append(Request(id=f"{group}:{k}", group=group,
                                        messages=({"role": "system", "content": system},
                                                  {"role": "user", "content": str(instruction)}),
                                        reference=_toolalpaca_reference(golden[k] if k < len(golden) else None)))
    return requests


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


# ---------------------------------------------------------------------------------------------
# jsonl:PATH, a user's own traffic

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
