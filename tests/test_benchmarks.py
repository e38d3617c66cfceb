"""Benchmark registry and loaders: counts on the shared copies, the API-Bank template, jsonl, offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from data.benchmarks import sources as benchfiles
from data.benchmarks import toolbench
from data.benchmarks.registry import (
    EXPECTED_COUNTS,
    get_benchmark,
    list_benchmarks,
    load_requests,
)
from data.benchmarks.request import Request, data_fingerprint, render_plain
from data.benchmarks.toolbench import parse_api_call
from data.errors import OilbirdError

GOLDEN = Path(__file__).resolve().parent / "golden"
TOOL_CALL = re.compile(r"<tool_call>\n(.+)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def shared():
    """The shared benchmark copies through data_root(); skip when they are not there."""
    root = benchfiles.data_root()
    missing = [name for name in ("apibank", "taubench-retail", "toolalpaca", "humaneval", "classeval", "gsm8k",
                                 "mtbench", "specbench") if not (root / name).is_dir()]
    if missing:
        pytest.skip(f"shared benchmark copies not found under {root} (missing {', '.join(missing)})")
    return root


@pytest.fixture(scope="module")
def apibank(shared):
    return load_requests("apibank")


def as_dict(r: Request) -> dict:
    return {"id": r.id, "group": r.group, "messages": [dict(m) for m in r.messages], "reference": r.reference}


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


# --- registry -------------------------------------------------------------------------------------


def test_registry_names_defaults_and_sources():
    infos = list_benchmarks()
    assert [i.name for i in infos] == list(EXPECTED_COUNTS)
    by = {i.name: i for i in infos}
    assert by["humaneval"].max_new_tokens == 512 and by["classeval"].max_new_tokens == 2048
    assert {i.name for i in infos if i.max_new_tokens == 1024} == set(EXPECTED_COUNTS) - {"humaneval", "classeval"}
    for name in ("apibank", "taubench-retail", "toolalpaca"):
        assert by[name].stop_strings == ("</tool_call>",)
    for name in set(by) - {"apibank", "taubench-retail", "toolalpaca"}:
        assert by[name].stop_strings == ()
    for i in infos:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{12,14}:\S+", i.source), i.source
        assert i.description and "\n" not in i.description
    assert get_benchmark("gsm8k") is by["gsm8k"]


def test_unknown_benchmark_is_one_line():
    with pytest.raises(OilbirdError) as e:
        get_benchmark("nope")
    msg = one_line_error(e)
    assert msg.startswith("unknown benchmark 'nope'; known: apibank, apibank-native,") and msg.endswith("or jsonl:PATH")
    with pytest.raises(OilbirdError):
        load_requests("nope")


# --- every loader on the shared copies ------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_counts_and_shape(shared, name):
    reqs = load_requests(name)
    assert len(reqs) == EXPECTED_COUNTS[name]
    assert len({r.id for r in reqs}) == len(reqs)  # ids unique within the benchmark
    for r in reqs:
        assert isinstance(r.messages, tuple) and r.messages
        assert all(set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant")
                   and isinstance(m["content"], str) and m["content"] for m in r.messages)
        assert r.messages[-1]["role"] == "user"
        assert isinstance(r.group, str) and r.group
        assert r.reference is None or isinstance(r.reference, str)
    assert load_requests(name, limit=3) == reqs[:3]


def test_references_present_where_documented(shared):
    for name in ("apibank", "apibank-native", "taubench-retail", "toolalpaca", "humaneval", "classeval", "gsm8k",
                 "specbench-math"):
        assert all(r.reference for r in load_requests(name)), name
    assert all(r.reference is None for r in load_requests("mtbench"))
    spec = load_requests("specbench")
    assert sum(r.reference is not None for r in spec) == 278  # none for qa, rag (answer lists), open MT-Bench


def test_apibank_matches_golden(apibank):
    by_id = {r.id: r for r in apibank}
    for fname in ("apibank_first_request.json", "apibank_level2_obs_request.json"):
        golden = json.loads((GOLDEN / fname).read_text(encoding="utf-8"))
        assert as_dict(by_id[golden["id"]]) == golden, fname
    assert apibank[0].id == "L1-000"  # serving order: level-1 first, in file order
    assert apibank[399].id == "L2-000" and apibank[-1].id == "L2-134"


def test_apibank_references_are_tool_calls(apibank):
    for r in apibank:
        m = TOOL_CALL.fullmatch(r.reference)
        assert m, r.reference
        call = json.loads(m.group(1))
        assert set(call) == {"name", "parameters"} and isinstance(call["name"], str)
        assert isinstance(call["parameters"], dict)


def test_apibank_every_record_parses(shared, apibank):
    records = toolbench._apibank_records()
    assert len(records) == len(apibank)
    n_calls = 0
    for (lv, i, rec), req in zip(records, apibank):
        assert parse_api_call(rec["expected_output"].split(":", 1)[1]) is not None
        user = req.messages[1]["content"]
        history_calls = [line for line in rec["input"].splitlines() if line.startswith("API-Request:")]
        for line in history_calls:
            call, result = toolbench.split_api_request(line)
            assert parse_api_call(call) is not None and result is not None, line
        # every earlier call and its result made it into the prompt, as JSON
        calls = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", user, re.S)
        assert len(calls) == user.count("<obs>") == len(history_calls)
        assert all(json.loads(c).keys() == {"name", "parameters"} for c in calls)
        assert user.count("<user>") == sum(line.startswith("User:") for line in rec["input"].splitlines()) + 1
        assert user.count("<response>") == sum(line.startswith("AI:") for line in rec["input"].splitlines())
        n_calls += len(history_calls)
    assert n_calls == 379


def test_apibank_groups_are_dialogues(apibank):
    # successive turns of one dialogue are contiguous and share the group (the record's file)
    runs = [g for k, g in enumerate(r.group for r in apibank) if k == 0 or apibank[k - 1].group != g]
    assert len(runs) == len(set(runs)) == 212 + 49


def test_apibank_nested_quote_values_kept_verbatim(apibank):
    ref = json.loads(TOOL_CALL.fullmatch({r.id: r for r in apibank}["L2-070"].reference).group(1))
    assert ref["parameters"]["attendees"] == "['John']"


def test_apibank_native(shared, apibank):
    native = load_requests("apibank-native")
    assert [r.id for r in native] == [r.id for r in apibank] and [r.group for r in native] == [r.group for r in apibank]
    first = native[0]
    assert len(first.messages) == 1 and first.messages[0]["role"] == "user"
    text = first.messages[0]["content"]
    assert text.startswith("Generate an API request in the format of [ApiName(") and text.endswith("Generate API Request:")
    assert first.reference == ("API-Request: [ModifyRegistration(appointment_id='34567890', "
                               "new_appointment_date='2023-03-26', new_appointment_doctor='Dr. Lee')]")


def test_taubench_steps(shared):
    reqs = load_requests("taubench-retail")
    tasks = json.loads((shared / "taubench-retail" / "retail_tasks_test.json").read_text())
    assert len(reqs) == sum(len(t["actions"]) for t in tasks)
    first_task = [r for r in reqs if r.group == "0"]
    assert [r.id for r in first_task] == [f"0-{k}" for k in range(len(tasks[0]["actions"]))]
    system = first_task[0].messages[0]["content"]
    assert system.startswith("# Retail agent policy")
    assert all(f'\n{{"name": "{t}", "description": ' in system for t in toolbench.TAU_TOOLS)
    for k, r in enumerate(first_task):
        call = json.loads(TOOL_CALL.fullmatch(r.reference).group(1))
        assert call == {"name": tasks[0]["actions"][k]["name"], "parameters": tasks[0]["actions"][k]["kwargs"]}
        user = r.messages[1]["content"]
        assert user.startswith(tasks[0]["instruction"]) and user.endswith("Make the next tool call.")
        assert user.count("<tool_call>") == k  # the earlier gold calls, in order
        for earlier in first_task[:k]:
            assert earlier.reference in user
        assert r.messages[0]["content"] == system


def test_toolalpaca_references(shared):
    reqs = load_requests("toolalpaca")
    assert reqs[0].id == "simulated:Axolotl:0" and reqs[100].id.startswith("real:")
    assert all("getDetails" in r.messages[0]["content"] for r in reqs)
    n_json = n_raw = 0
    for r in reqs:
        for line in TOOL_CALL.fullmatch(r.reference).group(1).splitlines():
            try:
                call = json.loads(line)
                assert set(call) == {"name", "parameters"}
                n_json += 1
            except ValueError:
                assert line.startswith('{"name": "') and '"parameters": ' in line  # placeholder kept raw
                n_raw += 1
    assert (n_json, n_raw) == (261, 36)


def test_simple_benchmarks_content(shared):
    he = load_requests("humaneval")[0]
    assert he.id == "HumanEval/0" and he.messages[0]["content"].startswith("from typing import List")
    assert he.reference.startswith("    for idx, elem in enumerate(numbers):")
    ce = load_requests("classeval")[0]
    assert ce.id == "ClassEval_0" and "class AccessGatewayFilter" in ce.messages[0]["content"]
    assert "class AccessGatewayFilter" in ce.reference
    gs = load_requests("gsm8k")[0]
    assert gs.messages[0]["content"].startswith("Janet") and gs.reference.endswith("#### 18")
    mt = load_requests("mtbench")[0]
    assert mt.id == "81" and mt.messages[0]["content"].startswith("Compose an engaging travel blog post")
    sm = load_requests("specbench-math")
    assert all(400 < int(r.id) <= 480 for r in sm) and sm[0].reference.endswith("#### 1000")


# --- fingerprint and plain rendering --------------------------------------------------------------


def test_data_fingerprint():
    a = [Request("1", "1", ({"role": "user", "content": "hi"},), None)]
    b = [Request("1", "1", ({"role": "user", "content": "hi!"},), None)]
    fa = data_fingerprint(a)
    assert re.fullmatch(r"[0-9a-f]{16}", fa)
    assert fa == data_fingerprint(list(a)) and fa != data_fingerprint(b)
    assert fa != data_fingerprint([Request("1", "1", a[0].messages, "ref")])


def test_render_plain():
    msgs = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"})
    assert render_plain(msgs) == "Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"
    assert render_plain([{"role": "user", "content": "Q"}]) == "User: Q\n\nAssistant:"


# --- the API-Bank call parser ---------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("[GetUserToken(username='user4', password='user4pass')]", ("GetUserToken", {"username": "user4", "password": "user4pass"})),
    ("[ToolSearcher()]", ("ToolSearcher", {})),
    ("Calc(formula='(1+2)*3, then 4')", ("Calc", {"formula": "(1+2)*3, then 4"})),
    ("[AddReminder(token='t', content=\"Mom's birthday\", time='2023-01-01')]",
     ("AddReminder", {"token": "t", "content": "Mom's birthday", "time": "2023-01-01"})),
    ("[AddMeeting(topic='A, B', attendees='['John', 'Jane']', location='Room (5)')]",
     ("AddMeeting", {"topic": "A, B", "attendees": "['John', 'Jane']", "location": "Room (5)"})),
    ("[RecordHealthData(user_id='1', health_data='[{'name': 'bp', 'value': '120/80'}]')]",
     ("RecordHealthData", {"user_id": "1", "health_data": "[{'name': 'bp', 'value': '120/80'}]"})),
    ("[Note(text='it's fine')]", ("Note", {"text": "it's fine"})),
    ("[Switch(on=True, n=3)]", ("Switch", {"on": True, "n": 3})),
])
def test_parse_api_call(text, expected):
    assert parse_api_call(text) == expected


@pytest.mark.parametrize("text", ["", "no call here", "[Broken(k='v']", "[X(k=v w)]", "[X('positional')]",
                                  "[X(k=b'bytes')]"])
def test_parse_api_call_gives_up_gracefully(text):
    assert parse_api_call(text) is None


def test_split_and_observation():
    call, result = toolbench.split_api_request("API-Request: [F(a='x->y')]->{'k': 'v', 'n': [1, None]}")
    assert (call, result) == ("[F(a='x->y')]", "{'k': 'v', 'n': [1, None]}")
    assert toolbench.render_observation(result) == '{"k": "v", "n": [1, null]}'
    assert toolbench.render_observation("success") == "success"
    assert toolbench.render_observation("3.5") == "3.5"
    assert toolbench.render_observation("'quoted'") == "quoted"
    assert toolbench.split_api_request("API-Request: [F()]") == ("[F()]", None)


def test_apibank_odd_records_never_crash(tmp_path, monkeypatch):
    """Unparsable calls and descriptions are kept as raw text, not dropped and not fatal."""
    header = "\nGenerate an API request ...\nThe current year is 2023.\n\nAPI descriptions:\n"
    rows = [
        {"file": "odd.jsonl", "id": 0, "instruction": header + '{"name": "F", "description": "d", "input_parameters": {}}\nnot json',
         "input": "User: hi\nsecond line of the same turn\nAPI-Request: [F(oops]->?\nAI: ok\nGenerate API Request:\n",
         "expected_output": "API-Request: [G(x='1', broken)]"},
        {"file": "odd.jsonl", "id": 1, "instruction": "", "input": "", "expected_output": ""},
    ]
    (tmp_path / "apibank").mkdir()
    (tmp_path / "apibank" / "level-1-api.json").write_text(json.dumps(rows))
    (tmp_path / "apibank" / "level-2-api.json").write_text("[]")
    monkeypatch.setenv("OILBIRD_DATA", str(tmp_path))
    reqs = load_requests("apibank")
    assert [r.id for r in reqs] == ["L1-000", "L1-001"]
    system, user = (m["content"] for m in reqs[0].messages)
    assert "1. Name: F" in system and "2. not json" in system
    assert "<user>\nhi\nsecond line of the same turn\n</user>" in user
    assert "<tool_call>\n[F(oops]->?\n</tool_call>" in user  # no `)]->`: the whole text stays the call
    assert reqs[0].reference == "<tool_call>\n[G(x='1', broken)]\n</tool_call>"
    assert load_requests("apibank-native")[1].reference == ""


# --- jsonl:PATH -----------------------------------------------------------------------------------


def write_lines(path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return f"jsonl:{path}"


def test_jsonl_both_forms(tmp_path):
    name = write_lines(tmp_path / "t.jsonl", [
        {"id": "a", "prompt": "Hello"},
        "",
        {"id": 7, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
         "reference": "R", "group": "conv1"},
        {"prompt": "no id"},
    ])
    info = get_benchmark(name)
    assert info.name == name and info.max_new_tokens == 1024 and info.stop_strings == ()
    reqs = load_requests(name)
    assert reqs[0] == Request("a", "a", ({"role": "user", "content": "Hello"},), None)
    assert reqs[1] == Request("7", "conv1", ({"role": "system", "content": "S"}, {"role": "user", "content": "U"}), "R")
    assert reqs[2].id == "4"  # no id: the line number
    assert load_requests(name, limit=1) == reqs[:1]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"id": "x"}', 'exactly one of "messages"'),
    ('{"id": "x", "prompt": "p", "messages": []}', 'exactly one of "messages"'),
    ('{"id": "x", "prompt": 3}', '"prompt" must be a string'),
    ('{"id": "x", "messages": []}', "non-empty list"),
    ('{"id": "x", "messages": [{"role": "tool", "content": "c"}]}', "message 0 must be"),
    ('{"id": "x", "prompt": "p", "reference": 5}', '"reference" must be'),
    ('{"id": "a", "prompt": "dup"}', "id 'a' already used on line 1"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    name = write_lines(path, [{"id": "a", "prompt": "fine"}, line])
    with pytest.raises(OilbirdError) as e:
        load_requests(name)
    msg = one_line_error(e)
    assert f"{path} line 2" in msg and needle in msg


def test_jsonl_empty_and_missing(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(OilbirdError) as e:
        load_requests(f"jsonl:{tmp_path / 'empty.jsonl'}")
    assert one_line_error(e).endswith("has no requests")
    with pytest.raises(OilbirdError) as e:
        load_requests(f"jsonl:{tmp_path / 'missing.jsonl'}")
    assert "not found" in one_line_error(e)
    with pytest.raises(OilbirdError):
        get_benchmark("jsonl:")


def test_limit_must_be_positive(tmp_path):
    name = write_lines(tmp_path / "t.jsonl", [{"id": "a", "prompt": "p"}])
    with pytest.raises(OilbirdError):
        load_requests(name, limit=0)


# --- data location, download, offline -------------------------------------------------------------


def test_offline_with_nothing_found_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("OILBIRD_DATA", str(tmp_path / "empty"))
    monkeypatch.setenv("OILBIRD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    calls = []

    def offline(url):
        calls.append(url)
        raise OSError("[Errno 101] Network is unreachable\nsecond line")

    monkeypatch.setattr(benchfiles, "_download", offline)
    for name in ("gsm8k", "apibank", "taubench-retail"):
        with pytest.raises(OilbirdError) as e:
            load_requests(name)
        msg = one_line_error(e)
        assert "OILBIRD_DATA" in msg and str(tmp_path / "empty") in msg and "Network is unreachable" in msg
    assert calls and all(u.startswith("https://raw.githubusercontent.com/") for u in calls)
    assert not list((tmp_path / "cache").rglob("*.json*"))  # nothing half-written


def test_download_fails_fast_once_offline(monkeypatch):
    """After one network failure, later downloads in the process fail at once (no 10 s wait per file)."""
    import urllib.error
    import urllib.request

    tries = []

    def unreachable(url, timeout):
        tries.append(timeout)
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(benchfiles, "_offline_reason", None)
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    for _ in range(3):
        with pytest.raises(OSError):
            benchfiles._download("https://raw.githubusercontent.com/o/r/c/f")
    assert tries == [benchfiles.DOWNLOAD_TIMEOUT_S]


def test_data_root_order(tmp_path, monkeypatch):
    monkeypatch.setenv("OILBIRD_DATA", str(tmp_path))
    assert benchfiles.data_root() == tmp_path
    monkeypatch.delenv("OILBIRD_DATA")
    monkeypatch.setattr(benchfiles, "SHARED_BENCHMARKS", tmp_path / "nowhere")
    monkeypatch.setenv("OILBIRD_CACHE", str(tmp_path / "c"))
    assert benchfiles.data_root() == tmp_path / "c" / "benchmarks" == benchfiles.cache_dir()


def test_download_into_cache_then_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("OILBIRD_DATA", str(tmp_path / "empty"))
    monkeypatch.setenv("OILBIRD_CACHE", str(tmp_path / "cache"))
    rows = [{"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]}]
    urls = []

    def fake(url):
        urls.append(url)
        return "".join(json.dumps(r) + "\n" for r in rows).encode()

    monkeypatch.setattr(benchfiles, "_download", fake)
    reqs = load_requests("mtbench")
    assert urls == ["https://raw.githubusercontent.com/lm-sys/FastChat/0e6d3e4beaab/"
                    "fastchat/llm_judge/data/mt_bench/question.jsonl"]
    assert (tmp_path / "cache" / "benchmarks" / "mtbench" / "question.jsonl").is_file()
    assert reqs == [Request("81", "81", ({"role": "user", "content": "Write."},), None)]
    load_requests("mtbench")
    assert len(urls) == 1  # served from the cache the second time


def test_taubench_conversion_from_upstream_python(tmp_path, monkeypatch):
    """tau-bench ships tasks and tools as Python; the download path converts them to the shared JSON layout."""
    tasks_py = '''from tau_bench.types import Task, Action

TASKS_TEST = [
    Task(
        annotator="0",
        user_id="u1",
        instruction="You are U1.",
        actions=[
            Action(name="find_user_id_by_email", kwargs={"email": "u@x.com"}),
            Action(name="get_order_details", kwargs={"order_id": "#W1"}),
        ],
        outputs=[],
    ),
]
'''
    tool_py = '''from typing import Any, Dict
from tau_bench.envs.tool import Tool


class T(Tool):
    @staticmethod
    def invoke(data: Dict[str, Any], x: str) -> str:
        return x

    @staticmethod
    def get_info() -> Dict[str, Any]:
        return {"type": "function", "function": {"name": "%s", "description": "d", "parameters": {}}}
'''
    monkeypatch.setenv("OILBIRD_DATA", str(tmp_path / "empty"))
    monkeypatch.setenv("OILBIRD_CACHE", str(tmp_path / "cache"))

    def fake(url):
        if url.endswith("tasks_test.py"):
            return tasks_py.encode()
        if url.endswith("wiki.md"):
            return b"# Retail agent policy\n"
        return (tool_py % url.rsplit("/", 1)[1][:-3]).encode()

    monkeypatch.setattr(benchfiles, "_download", fake)
    reqs = load_requests("taubench-retail")
    assert [r.id for r in reqs] == ["0-0", "0-1"]
    assert reqs[1].reference == '<tool_call>\n{"name": "get_order_details", "parameters": {"order_id": "#W1"}}\n</tool_call>'
    tools = json.loads((tmp_path / "cache" / "benchmarks" / "taubench-retail" / "retail_tools.json").read_text())
    assert [t["function"]["name"] for t in tools] == list(toolbench.TAU_TOOLS)
