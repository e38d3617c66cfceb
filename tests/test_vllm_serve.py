"""`vllm serve` for real (decoder/vllm/serve.py, `python -m decoder serve`): vLLM's own OpenAI-compatible CLI server,
started on 127.0.0.1 with the tiny random Llama (head dim 64), at vLLM's default compilation, with Oilbird as its
proposer, beside the same server without speculation (`--arm none`, the reference), both started once for the
module (each start compiles the model). Requests go over HTTP with the `openai` client, concurrently (threads),
chat and completion, streaming and not, greedy; `return_token_ids` gives the tokens of each. Only loopback
traffic; every wait is bounded in count and time; every server is killed at teardown.

Checked: the outputs equal the reference's token for token; the served store verifies and holds every finished
request once; the proposer's stats equal `/metrics`' spec-decode counters; SIGTERM while requests are in flight
leaves a store that verifies with no half-written request, and a restarted server on it pools it and serves on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
K = 4
START_S = 420  # one server start (compiling the model) at most, on 2 shared cores
REQUEST_S = 180
# stories260k's tokenizer has no chat template: a plain one (vLLM's --chat-template takes a file)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
WORDS = ["the cat sat on the mat", "a dog ran in the park", "the sun was warm and the sky was blue",
         "lily had a red ball", "tom saw a big tree", "the bird sang a song", "mom made a cake",
         "the boy and the girl went home", "a fish swam in the pond", "the old man had a hat",
         "the little bear found honey", "the car went fast down the road"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `python -m decoder serve` process (exec'd into vLLM's server), its own process group."""

    def __init__(self, name: str, model: str, tmp: Path, template: Path, *flags: str, env: dict | None = None):
        self.name, self.port = name, _free_port()
        self.log_path = tmp / f"{name}.server.log"
        self.cmd = [sys.executable, "-m", "decoder", "serve", "--model", model, "--port", str(self.port),
                    "--max-num-seqs", "4", *flags, "--", "--chat-template", str(template), "--max-model-len", "1024",
                    "--served-model-name", "tiny"]
        full = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=full,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=REQUEST_S, max_retries=0)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"{self.name} not ready after {START_S} s: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """vLLM's spec-decode counters from /metrics (summed over label sets)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_num_") and "_total" in line:
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 60) -> int | None:
        """Signal the server (the process `decoder serve` exec'd into: vLLM's API server, as `kill PID` does);
        SIGKILL its whole process group when it has not exited within wait_s."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group (the engine's child)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode


def _request(server: Server, kind: str, text: str, stream: bool, max_tokens: int, ignore_eos: bool = False,
             client=None) -> dict:
    """One greedy request; its prompt's and its output's token ids (vLLM's return_token_ids) and text."""
    extra = {"return_token_ids": True, **({"ignore_eos": True} if ignore_eos else {})}
    c = client or server.client
    if kind == "chat":
        args = dict(model="tiny", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_tokens,
                    extra_body=extra)
    else:
        args = dict(model="tiny", prompt=text, temperature=0, max_tokens=max_tokens, extra_body=extra)
    call = c.chat.completions.create if kind == "chat" else c.completions.create
    prompt, tokens, out, finish = None, [], [], None
    if not stream:
        r = call(**args)
        ch = r.choices[0]
        prompt = getattr(r, "prompt_token_ids", None) or getattr(ch, "prompt_token_ids", None)
        tokens = list(getattr(ch, "token_ids", None) or [])
        out.append(ch.message.content if kind == "chat" else ch.text)
        finish = ch.finish_reason
    else:
        for chunk in call(**args, stream=True):
            prompt = prompt or getattr(chunk, "prompt_token_ids", None)
            for ch in chunk.choices:
                prompt = prompt or getattr(ch, "prompt_token_ids", None)
                tokens += list(getattr(ch, "token_ids", None) or [])
                piece = ch.delta.content if kind == "chat" else ch.text
                out.append(piece or "")
                finish = ch.finish_reason or finish
    return {"prompt": list(prompt or []), "tokens": tokens, "text": "".join(o or "" for o in out), "finish": finish}


def _specs(n: int, offset: int = 0, max_tokens: int = 40, ignore_eos: bool = False) -> list[tuple]:
    """n distinct repetitive requests: (kind, text, stream, max_tokens, ignore_eos), chat and completion, streaming
    and not."""
    specs = []
    for i in range(n):
        w = WORDS[(i + offset) % len(WORDS)]
        text = f"{i + offset}: " + ". ".join([w] * 6) + "."
        specs.append(("chat" if i % 2 else "completion", text, i % 4 in (1, 2), max_tokens, ignore_eos))
    return specs


def _serve_all(server: Server, specs: list[tuple]) -> list[dict]:
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        return list(pool.map(lambda s: _request(server, *s), specs))


def _verify(store: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data", "verify", str(store)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _stored(store: Path) -> list:
    from data.store.reader import open_store
    from decoder.replay.traces import load_traces

    return load_traces(open_store(store), None, None)


def _is_reference(stored_tokens: list[int], ref: dict) -> bool:
    """A stored request is the whole greedy output the reference served for its prompt: its tokens, and past a
    max_tokens cut at most the last step's accepted drafts (the engine generated them; the front end cut them)."""
    n = len(ref["tokens"])
    if stored_tokens[:n] != ref["tokens"]:
        return False
    return len(stored_tokens) == n or (ref["finish"] == "length" and len(stored_tokens) - n <= K)


@pytest.fixture(scope="module")
def served(tiny_llama64, tmp_path_factory):
    """The reference (plain vLLM) and the Oilbird server, started together, and the module's first wave of
    requests served by both, then one flush request on the Oilbird server."""
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    servers = [Server("reference", tiny_llama64, tmp, template, "--arm", "none"),
               Server("oilbird", tiny_llama64, tmp, template, "--arm", "oilbird", "--k", str(K),
                      "--store", str(tmp / "store"), "--store-flush", "1", "--stats", str(tmp / "stats.json"),
                      "--log", str(tmp / "oilbird.log"))]
    try:
        for s in servers:
            s.wait_ready()
        ref, oil = servers
        specs = _specs(10)
        with ThreadPoolExecutor(max_workers=2) as pool:  # both servers at once: the same requests
            want, got = pool.map(lambda s: _serve_all(s, specs), (ref, oil))
        flush = _request(oil, "completion", "flush", False, 1)  # vLLM drops the finished rows at the next step
        yield {"flush": flush, "tmp": tmp, "ref": ref, "oil": oil, "specs": specs, "want": want, "got": got,
               "template": template, "model": tiny_llama64}
    finally:
        for s in servers:
            s.stop()


def test_served_outputs_equal_vllm_without_speculation(served):
    """Chat and completion, streaming and not, 10 concurrent greedy requests: token for token the reference's."""
    want, got = served["want"], served["got"]
    for spec, w, g in zip(served["specs"], want, got):
        assert w["tokens"] and w["prompt"], f"no token ids returned for {spec}"
        assert g["prompt"] == w["prompt"] and g["tokens"] == w["tokens"] and g["text"] == w["text"], spec
    stats = json.loads((served["tmp"] / "stats.json").read_text())
    assert stats["accepted_tokens"] > 0, stats  # drafts were accepted: the proposer did draft


def test_the_served_store_verifies_and_holds_every_finished_request_once(served):
    store = served["tmp"] / "store"
    v = _verify(store)
    assert v.returncode == 0 and "OK" in v.stdout + v.stderr, v.stdout + v.stderr
    traces = _stored(store)
    by_prompt = {tuple(w["prompt"]): w for w in served["want"]}
    assert len(by_prompt) == len(served["want"])  # distinct prompts
    assert sorted(tuple(t.prompt) for t in traces) == sorted(by_prompt)  # each once, nothing else
    for t in traces:
        assert _is_reference(list(t.tokens), by_prompt[tuple(t.prompt)]), t.prompt


def test_stats_equal_the_metrics_spec_decode_counters(served):
    """The recorder's counts of what vLLM verified equal vLLM's own counters, exactly, after the flush request:
    verified_drafts = vllm:spec_decode_num_drafts_total, verified_draft_tokens = ..._num_draft_tokens_total,
    accepted_tokens = ..._num_accepted_tokens_total."""
    oil = served["oil"]
    stats = json.loads((served["tmp"] / "stats.json").read_text())
    m = {}
    for _ in range(20):  # the front end logs a step's counters when it has its outputs: read until two agree
        m, again = oil.metrics(), (time.sleep(0.5), oil.metrics())[1]
        if m == again:
            break
    assert m["vllm:spec_decode_num_drafts_total"] > 0, m
    assert stats["verified_drafts"] == m["vllm:spec_decode_num_drafts_total"], (stats, m)
    assert stats["verified_draft_tokens"] == m["vllm:spec_decode_num_draft_tokens_total"], (stats, m)
    assert stats["accepted_tokens"] == m["vllm:spec_decode_num_accepted_tokens_total"], (stats, m)
    assert stats["finished"] == len(served["specs"])


def _stored_count(store: Path) -> int:
    """The requests of the store's last commit, once it reads as complete again (-1 while a commit is on)."""
    try:
        meta = json.loads((store / "meta.json").read_text())
    except (OSError, ValueError):
        return -1
    return int(meta.get("n_requests") or 0) if meta.get("complete") else -1


def test_sigterm_in_flight_leaves_a_whole_store_and_a_restart_pools_it(served):
    """SIGTERM to the Oilbird server (the process `decoder serve` exec'd into) while requests are in flight: the
    store verifies, holds every request that finished before the signal, and every request in it is whole (the
    reference's whole greedy output for its prompt); a server restarted on it pools every stored request (its log
    says so) and serves on, equal to the reference."""
    tmp, ref, oil = served["tmp"], served["ref"], served["oil"]
    store = tmp / "store"
    # four rows (--max-num-seqs 4), four requests: none waits. The long ones cannot end early (ignore_eos) and need
    # hundreds of steps after the short ones are committed: no request finishes, so none is committed, at the signal
    short, long = _specs(2, offset=20, max_tokens=12), _specs(2, offset=30, max_tokens=900, ignore_eos=True)
    specs = short + long
    # every request the store may hold: the reference's outputs, and the flush request (stored at a later step)
    want = {tuple(r["prompt"]): r for r in _serve_all(ref, specs) + served["want"] + [served["flush"]]}
    before = _stored_count(store)
    # vLLM's default shutdown (--shutdown-timeout 0) aborts the in-flight requests and stops the engine at once: their
    # clients get an error, or a stream left open that the HTTP server waits for; these give up 20 s after a silence
    inflight = openai.OpenAI(base_url=oil.url + "/v1", api_key="none", timeout=20, max_retries=0)
    pool = ThreadPoolExecutor(max_workers=len(specs))
    futures = [pool.submit(_request, oil, *s, client=inflight) for s in specs]
    expected = before + len(short) + 1  # the shorts, and the flush request (the shorts' first step drops it)
    deadline = time.monotonic() + REQUEST_S
    while time.monotonic() < deadline and _stored_count(store) < expected:
        time.sleep(0.02)
    assert all(f.done() for f in futures[:len(short)]) and _stored_count(store) == expected, _stored_count(store)
    assert not any(f.done() for f in futures[len(short):]), "nothing was in flight at SIGTERM"
    code = oil.stop(signal.SIGTERM, wait_s=120)
    pool.shutdown(wait=True, cancel_futures=True)
    assert code == 0, oil.tail()  # it exited by itself (vLLM aborts the in-flight requests: errors to their clients)
    v = _verify(store)
    assert v.returncode == 0 and "OK" in v.stdout + v.stderr, v.stdout + v.stderr
    traces = _stored(store)
    assert len(traces) == expected, (len(traces), expected)
    for t in traces:
        assert tuple(t.prompt) in want, "a stored request nobody sent"
        assert _is_reference(list(t.tokens), want[tuple(t.prompt)]), "a half-written request in the store"
    # the restart: the same store; it pools what is there and serves on
    # (eager: what this pins is the store's restart; the compiled servers are the fixture's)
    again = Server("restarted", served["model"], tmp, served["template"], "--arm", "oilbird", "--k", str(K),
                   "--store", str(store), "--log", str(tmp / "restarted.log"), "--eager")
    try:
        again.wait_ready()
        log = (tmp / "restarted.log").read_text()
        assert f"{len(traces)} traces of the served store {store} pooled" in log, log
        spec = _specs(1, offset=20, max_tokens=12)[0]
        r = _request(again, *spec)
        assert r["tokens"] == want[tuple(r["prompt"])]["tokens"]
    finally:
        again.stop()


def _launcher(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "decoder", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_the_launcher_checks_every_setting_before_vllm_starts(tiny_llama64, tmp_path):
    """Bad input is one `error:` line and exit 2, before any server; --dry-run prints the exact command."""
    r = _launcher("--model", tiny_llama64, "--dry-run", env={"OILBIRD_VLLM_NODES": "abc"})
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: OILBIRD_VLLM_NODES='abc': text, not a whole number; allowed: the tree's node budget, a whole number "
        "1..256"), r.stderr
    for bad in (["--arm", "sam"], ["--arm", "none", "--store", str(tmp_path / "s")], ["--port", "0"],
                ["--stats", str(tmp_path / "no" / "stats.json")], ["--k", "0"], ["--model", str(tmp_path / "none")]):
        r = _launcher(*([] if bad[0] == "--model" else ["--model", tiny_llama64]), *bad, "--dry-run")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (bad, r.stderr)
    r = _launcher("--model", tiny_llama64, "--k", "5", "--store", str(tmp_path / "store"), "--eager", "--dry-run",
                  "--", "--chat-template", "t.jinja")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert f"OILBIRD_VLLM_STORE={tmp_path / 'store'}" in line and f"PYTHONPATH={ROOT}" in line
    assert "--host 127.0.0.1 --port 8000 --dtype float32 --max-num-seqs 8" in line
    assert ('"model": "decoder.vllm.proposer.OilbirdProposer", "num_speculative_tokens": 5}' in line
            and line.endswith("--enforce-eager --chat-template t.jinja")), line
    r = _launcher("--model", tiny_llama64, "--arm", "none", "--dry-run")
    assert r.returncode == 0 and "--speculative-config" not in r.stdout and "OILBIRD_VLLM" not in r.stdout, r.stdout
