"""The tool-calling benchmarks: API-Bank (two layouts), tau-bench retail and ToolAlpaca.

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
"""

from __future__ import annotations

import ast
import json
import re

from data.benchmarks.request import Request
from data.benchmarks.sources import DataFile, _read_json, resolve
from data.errors import OilbirdError

TOOL_STOP = ("</tool_call>",)  # the stop string of the benchmarks whose answer is one <tool_call> block


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

