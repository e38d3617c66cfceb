"""Oilbird inside vLLM (decoder/vllm/proposer.py), on vLLM's CPU build with a tiny random Llama (head dim 64).

Every arm is served by a real engine, each in its own process (`python -m decoder vllm-run`: vLLM's metric
registry is process-wide), over the same prompts, with prefix caching on and 8 requests through 4 rows (rows
reused, batches compacted); each arm's tokens must equal vLLM's greedy decoding, token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.capture.vllm_rows import RowTracker
from data.errors import OilbirdError
from decoder.draft import Draft, best_chain, subtree

ROOT = Path(__file__).resolve().parents[1]


def _prompts() -> list[list[int]]:
    """Repetitive prompts (lookup fires) in three families (the pool and the key have something to find),
    two requests per family sharing a long prefix (prefix-cache hits)."""
    rng = np.random.default_rng(0)
    frames = [rng.integers(3, 500, 10).tolist() for _ in range(3)]
    prompts = []
    for i in range(8):
        f = frames[i % 3]
        prompts.append(f * 4 + rng.integers(3, 500, 3).tolist())
    return prompts


def _run(model: str, arm: str, tmp: Path, env: dict | None = None, name: str | None = None, *flags: str,
         **kw) -> subprocess.CompletedProcess:
    """`vllm-run` of one arm in its own process (one engine), its result at tmp/<name or arm>.json."""
    prompts = tmp / "prompts.json"
    if not prompts.exists():
        prompts.write_text(json.dumps(_prompts()))
    args = [sys.executable, "-m", "decoder", "vllm-run", "--model", model, "--prompts", str(prompts), "--arm", arm,
            "--out", str(tmp / f"{name or arm}.json"), "--k", "4", "--batch", str(kw.pop("batch", 4)),
            "--max-new", str(kw.pop("max_new", 40)), *flags]
    for key, v in kw.items():
        args += [f"--{key.replace('_', '-')}", str(v)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=None if env is None else {**os.environ, **env})


# Sampled requests (the chi-square test): N requests of the first prompt at temperature 0.1 (the tiny model's
# logits are flat; at 0.1 its first positions have a few likely tokens, so drafts are accepted and rejected)
SAMPLED = ("--sample", "800", "--temperature", "0.1", "--top-p", "0.95", "--sample-max-new", "4")
# Every arm at vLLM's default compilation, batch 4 then batch 1 in one engine; `oilbird-eager` is the same
# proposer in eager mode, writing a store of its own (compiled states against eager ones)
RUNS = {  # name: (arm, extra flags, batch)
    "vllm-greedy": ("vllm-greedy", SAMPLED + ("--seed", "0"), "4,1"),
    "oilbird-no-semantic": ("oilbird-no-semantic", (), "4,1"),
    "oilbird": ("oilbird", SAMPLED + ("--seed", "1000000"), "4,1"),
    "oilbird-eager": ("oilbird", ("--eager",), "4"),
    # vLLM's own suffix method, eager (its mode is vLLM's business; it is here for the sampled requests: the skew
    # test_vllm_cpu_sampled_speculation_is_biased_for_its_own_suffix_too pins; make bench-vllm runs it both ways)
    "vllm-suffix": ("vllm-suffix", SAMPLED + ("--seed", "2000000", "--eager"), "4"),
}
# served with OILBIRD_VLLM_STORE: the first writes (a commit every 2 requests), the second pools the first's
# traces and appends its own (its 800 sampled requests too, 50 a commit)
STORE_ARMS = {"oilbird-no-semantic": "2", "oilbird": "50"}
ARMS = list(RUNS)


@pytest.fixture(scope="module")
def served(tiny_llama64, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    out = {"_tmp": tmp}
    for name, (arm, flags, batch) in RUNS.items():
        env = None
        if name in STORE_ARMS:
            env = {"OILBIRD_VLLM_STORE": str(tmp / "store"), "OILBIRD_VLLM_STORE_FLUSH": STORE_ARMS[name],
                   "OILBIRD_VLLM_LOG": str(tmp / f"{name}.log")}
        elif name == "oilbird-eager":
            env = {"OILBIRD_VLLM_STORE": str(tmp / "store-eager"), "OILBIRD_VLLM_STORE_FLUSH": "4"}
        r = _run(tiny_llama64, arm, tmp, env, name, *flags, batch=batch)
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        out[name] = json.loads((tmp / f"{name}.json").read_text())
        if name in STORE_ARMS:
            out[name]["_store_meta"] = json.loads((tmp / "store" / "meta.json").read_text())
    return out


def test_serving_writes_the_store(served):
    """OILBIRD_VLLM_STORE: served requests land in a store that verifies and loads like a capture's, each one
    a request the engine served with the tokens it returned; a second server on the same store pools its
    traces first and appends under new ids."""
    from data.store.reader import open_store
    from decoder.replay.traces import load_traces

    tmp = served["_tmp"]
    first, second = (served[a]["_store_meta"] for a in STORE_ARMS)
    assert first["engine"] == "vllm-serving" and first["complete"] and first["n_requests"] >= 4
    assert second["n_requests"] > first["n_requests"]
    v = subprocess.run([sys.executable, "-m", "data", "verify", str(tmp / "store")], cwd=ROOT, capture_output=True,
                       text=True)
    assert v.returncode == 0 and "OK" in v.stdout + v.stderr, v.stderr
    store = open_store(tmp / "store")
    traces = load_traces(store, None, None)
    prompts = _prompts()
    outputs = served["oilbird"]["outputs"]
    matched = 0
    for r, t in enumerate(traces):
        if t.prompt in prompts and len(t.tokens) > 8:  # (not the warm-up, nor a sampled request: 4 tokens)
            out = outputs[prompts.index(t.prompt)]
            # the tokens the engine generated: what vLLM returned, and at most the last step's accepted drafts
            # past max_tokens (the front end cuts them; they are greedy tokens all the same)
            assert t.tokens[:len(out)] == out and len(t.tokens) - len(out) <= 4
            matched += 1
            valid = store.hidden_valid[store.offsets[r]:store.offsets[r + 1]]
            assert valid[:-1].all() and not valid[-1]  # every fed token has its state; the last is never fed
    assert matched >= 16  # batch 4 and batch 1, two arms (a request enters the store at the next step)
    ids = store.requests["id"].to_list()
    assert len(set(ids)) == len(ids)
    log = (tmp / "oilbird.log").read_text()
    assert f"{first['n_requests']} traces of the served store" in log


@pytest.mark.parametrize("arm", ARMS[1:])
def test_every_arm_is_vllm_greedy_token_for_token(served, arm):
    """At vLLM's default compilation (and `oilbird-eager` eager), every arm's tokens equal vLLM greedy's, at
    batch 4 and, where it ran, at batch 1 in the same engine."""
    greedy, got = served["vllm-greedy"], served[arm]
    assert got["vllm_mode"] == ("eager" if arm in ("oilbird-eager", "vllm-suffix") else "compiled")
    assert greedy["vllm_mode"] == "compiled"
    assert got["requests"] == greedy["requests"] == 8 and got["generated_tokens"] > 8 * 10
    for b, run in got["by_batch"].items():
        assert run["outputs"] == greedy["by_batch"]["4"]["outputs"] == greedy["by_batch"]["1"]["outputs"], b
        assert run["spec"]["num_drafts"] > 0 and run["spec"]["num_accepted_tokens"] > 0  # it did speculate


def _same_text_slack(run: dict) -> int:
    """Rows a proposer may leave unverified: none, but where requests share their text. The rows carry no request
    id (data/capture/vllm_rows.py recognises a request by its tokens), so two of the 800 sampled requests of one
    prompt that drew the same tokens so far can trade rows; the chain proposed for one is then verified on the
    other, which the proposer sees and counts as unverified (never recorded). Seen once in 800 (one run of two)."""
    return len((run.get("sampled") or {}).get("outputs") or []) // 100  # 1%


@pytest.mark.parametrize("arm", ["oilbird", "oilbird-no-semantic", "oilbird-eager"])
def test_the_proposer_follows_every_row(served, arm):
    """Every row's verification lined up with the taps, compiled or eager (no untapped step); every finished
    request entered the pool; the semantic key was fed states."""
    p = served[arm]["proposer"]
    assert p["arm"] == arm.removesuffix("-eager") and p["k"] == 4
    assert p["unaligned_steps"] == 0 and p["untapped_steps"] == 0
    assert p["unverified_rows"] <= _same_text_slack(served[arm])
    requests = 1 + 8 * len(served[arm]["batches"]) + (800 if served[arm]["sampled"] else 0)  # the warm-up too
    assert p["requests"] == requests and p["finished"] == requests  # (vllm-run's last short request ends them)
    pool = p["drafter"]
    assert pool["pool_tokens"] == p["pooled_tokens"] > 0
    if arm != "oilbird-no-semantic":  # the semantic source is on: states reached the pool and the key was asked
        assert pool["semantic_key"] and pool["pool_states"] > 0 and pool["key_queries"] > 0
    else:
        assert pool["key_queries"] == 0


def test_compiled_states_equal_eager_states(served):
    """The states and top-8 a compiled server writes into its store equal an eager server's for the same
    requests: cosine >= 0.9999 at every position with a state, the top-8 identical (issue 43)."""
    from data.store.reader import open_store
    from decoder.replay.traces import load_traces

    tmp = served["_tmp"]
    compiled = load_traces(open_store(tmp / "store"), None, None)
    eager = load_traces(open_store(tmp / "store-eager"), None, None)
    by_prompt: dict[tuple, list] = {}
    for t in compiled:
        by_prompt.setdefault(tuple(t.prompt), []).append(t)
    compared = positions = 0
    for e in eager:
        if e.prompt not in _prompts() or len(e.tokens) <= 8:  # the warm-up and vllm-run's last short request
            continue
        # Both are greedy, so the same tokens up to max_tokens; past it a trace keeps the last step's accepted
        # drafts, which depend on what each engine drafted (a CI run matched 6 of 8 on the whole token list).
        # Compare over the common prefix: the same context, so the same states.
        def common(c):
            return next((i for i, (x, y) in enumerate(zip(c.tokens, e.tokens)) if x != y),
                        min(len(c.tokens), len(e.tokens)))
        c = max(by_prompt.get(tuple(e.prompt), []), key=common, default=None)
        assert c is not None, e.prompt[:4]
        n = common(c) - 1  # the last common token's row may be the one a trace never computes
        assert n >= 39, (e.prompt[:4], n)  # at least the 40 tokens vllm-run asked for, one not computed
        a, b = c.hidden[:n].astype(np.float64), e.hidden[:n].astype(np.float64)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert cos.min() >= 0.9999, (e.prompt[:4], float(cos.min()))
        assert (c.topk[:n] == e.topk[:n]).all()
        fa, fb = c.first_hidden.astype(np.float64), e.first_hidden.astype(np.float64)
        assert fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb) >= 0.9999 and (c.first_topk == e.first_topk).all()
        compared += 1
        positions += n
    assert compared >= 8 and positions >= 8 * 39


def _chi2_homogeneity(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's chi-square test that two samples of tokens come from one distribution: tokens whose pooled
    expected count is under `min_expected` in either sample are lumped into one category. (stat, dof, p)."""
    import torch

    cats = sorted(set(a) | set(b))
    ca, cb = np.array([a.count(c) for c in cats], float), np.array([b.count(c) for c in cats], float)
    share = len(a) / (len(a) + len(b))
    small = (ca + cb) * min(share, 1 - share) < min_expected
    if small.any():
        ca, cb = np.append(ca[~small], ca[small].sum()), np.append(cb[~small], cb[small].sum())
        keep = (ca + cb) > 0
        ca, cb = ca[keep], cb[keep]
    table = np.stack([ca, cb])
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if dof else 1.0
    return stat, dof, p


POSITIONS = (1, 2, 3)  # position 0 is sampled at the prefill, before any draft
THRESHOLD = 0.001 / len(POSITIONS)  # Bonferroni: a correct engine fails the test with probability about 0.1%
CPU_SAMPLING_BUG = ("vllm-cpu 0.32.0's speculative decoding does not keep the sampled distribution, for vLLM's own "
                    "suffix method as for Oilbird (test_vllm_cpu_sampled_speculation_is_biased_for_its_own_suffix_too; "
                    "docs/vllm.md, 'Sampled requests')")


def _homogeneity(base: dict, other: dict) -> list[tuple[int, float, int, float]]:
    """(position, stat, dof, p) of the chi-square test of homogeneity at each of POSITIONS."""
    out = []
    for pos in POSITIONS:
        a = [o[pos] for o in base["outputs"] if len(o) > pos]
        b = [o[pos] for o in other["outputs"] if len(o) > pos]
        assert len(a) > 700 and len(b) > 700
        out.append((pos, *_chi2_homogeneity(a, b)))
    return out


def test_sampled_requests_are_served_through_oilbird_and_the_test_has_power(served):
    """Sampled requests (temperature 0.1, top_p 0.95, each seeded) are served through Oilbird: 800 requests of one
    prompt, 4 tokens each, Oilbird's drafts verified on them by vLLM's rejection sampler (a draft without
    probabilities is one-hot), some accepted and some rejected, no row lost by the proposer. The statistic of the
    distribution test below (Pearson's chi-square test of homogeneity at positions 1-3, categories under 5
    expected lumped, p < 0.001 / 3 rejects) has the power to see a skew: on vLLM's samples without speculation
    split in halves (400 and 400) it passes, and it rejects at every position the first half biased toward its
    most frequent token (each token replaced by it with probability 0.5: the mode's frequency goes from about 52%
    to 76% at position 1; the skew vllm-cpu shows, below, takes it to about 85%)."""
    base, ours = served["vllm-greedy"]["sampled"], served["oilbird"]["sampled"]
    assert base["requests"] == ours["requests"] == 800 and base["temperature"] == ours["temperature"] == 0.1
    assert ours["spec"]["num_draft_tokens"] > 800 and 0 < ours["spec"]["num_accepted_tokens"] < ours["spec"][
        "num_draft_tokens"]
    assert base["spec"]["num_drafts"] == 0
    p = served["oilbird"]["proposer"]
    assert p["unverified_rows"] <= _same_text_slack(served["oilbird"]) and p["unaligned_steps"] == 0
    assert p["untapped_steps"] == 0
    halves = {"outputs": base["outputs"][::2]}, {"outputs": base["outputs"][1::2]}
    rng = np.random.default_rng(0)
    for pos in POSITIONS:
        a, b = ([o[pos] for o in h["outputs"]] for h in halves)
        assert _chi2_homogeneity(a, b)[2] > THRESHOLD, pos
        mode = max(set(a), key=a.count)
        assert _chi2_homogeneity([mode if rng.random() < 0.5 else t for t in a], b)[2] < THRESHOLD, pos
    assert len(set(o[1] for o in ours["outputs"])) >= 3  # a spread sample, not one token


@pytest.mark.xfail(condition=not __import__("torch").cuda.is_available(), strict=True, reason=CPU_SAMPLING_BUG)
def test_sampled_requests_through_oilbird_have_vllm_s_distribution(served):
    """The tokens sampled through Oilbird are distributed as vLLM's without speculation: at each of positions 1-3
    the chi-square test of homogeneity between the two 800-request samples has p > 0.001 / 3. On vllm-cpu 0.32.0
    this fails, as it fails for vLLM's own suffix method (next test): the engine's rejection sampler skews the
    tokens (strict: when a vLLM release keeps the distribution this test passes, and the marker must go)."""
    for pos, stat, dof, p in _homogeneity(served["vllm-greedy"]["sampled"], served["oilbird"]["sampled"]):
        assert dof >= 2 and p > THRESHOLD, (pos, stat, dof, p)


def test_vllm_cpu_sampled_speculation_is_biased_for_its_own_suffix_too(served):
    """What the xfail above rests on: vLLM's own `suffix` method (ArcticInference), served the same 800 sampled
    requests, skews the tokens too on this build (p < 0.001 / 3 at some position), so the skew is the engine's, not
    Oilbird's drafts'. When this fails, vLLM's CPU rejection sampler keeps the distribution: remove the xfail above.
    The skew's direction is not fixed: most runs made the most frequent token more frequent than without
    speculation, and a fresh-clone CI run (2026-12-02) less (388 of 800 against 432), so only the test of
    homogeneity is asserted."""
    base, suffix = (served[a]["sampled"] for a in ("vllm-greedy", "vllm-suffix"))
    assert suffix["spec"]["num_drafts"] > 0
    assert min(p for _, _, _, p in _homogeneity(base, suffix)) < THRESHOLD


def test_the_cost_aware_chain_in_vllm_is_greedy_token_for_token(served, tiny_llama64):
    """With a profile (a step that grows 50% with every draft token, batch 4's grid for `oilbird@batch=4`) the
    proposer cuts each row's chain where expected tokens per second stop growing: lengths vary from 0 to k,
    and the output is still vLLM's greedy, token for token."""
    tmp = served["_tmp"]
    nodes = [0, 4, 64]
    grid = [[0.01 * (1 + 0.5 * n) for n in nodes] for _ in range(2)]
    profile = tmp / "steep.json"
    profile.write_text(json.dumps({"format": 1, "model": "tiny", "model_fingerprint": "any", "engine": "vllm",
                                   "nodes": nodes, "contexts": [1, 4096], "verify_s": grid,
                                   "prefill_lengths": [1, 4096], "prefill_s": [0.01, 0.01],
                                   "verify_s_by_batch": {"4": grid}}))
    # eager: what this pins is the sizing (the mode is test_every_arm_is_vllm_greedy_token_for_token's)
    r = _run(tiny_llama64, "oilbird@batch=4", tmp, None, None, "--eager", profile=str(profile))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp / "oilbird@batch=4.json").read_text())
    assert got["outputs"] == served["vllm-greedy"]["outputs"]
    d = got["proposer"]["drafter"]
    assert d["size"] == "auto" and d["step_cost"] == "vllm profile, batch 4"
    assert 0 < d["kept_nodes"] < 4 * d["passes"]  # shorter chains than k on average, but some
    assert d["calibration"]["node"]["labels"] > 0
    bad = _run(tiny_llama64, "oilbird@batch=2", tmp, profile=str(profile))
    assert bad.returncode == 2 and "measured batch sizes 1, 4, not 2" in bad.stderr.strip().splitlines()[-1]


BREAK_STATS = """
import json, shutil, sys
from pathlib import Path

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from data.capture.vllm_engine import EngineConfig, make_llm
from decoder.vllm.proposer import speculative_config


def main(model, tmp):
    prompts = json.loads((tmp / "prompts.json").read_text())
    folder = tmp / "stats"
    folder.mkdir()
    stats = folder / "proposer.json"
    spec = speculative_config("oilbird", k=4, stats=str(stats), log=str(tmp / "break.log"))
    # eager: what this pins is the write failures (the mode is test_every_arm_is_vllm_greedy_token_for_token's)
    llm = make_llm(EngineConfig(model, max_num_seqs=4, enforce_eager=True), spec)
    greedy = SamplingParams(temperature=0.0, max_tokens=40)

    def wave(ps):
        got = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], greedy, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in got]

    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:8])], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    outputs = wave(prompts[:4])
    written = stats.exists()
    shutil.rmtree(folder)
    folder.write_text("a file where the stats folder was")  # unwritable after start-up
    outputs += wave(prompts[4:8])
    folder.unlink()
    folder.mkdir()
    wave(prompts[:1])  # its first step finishes the last wave's requests: the stats are written again
    (tmp / "break.json").write_text(json.dumps({"outputs": outputs, "written_before": written,
                                                "stats": json.loads(stats.read_text())}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
"""


def test_an_unwritable_stats_file_mid_run_keeps_serving(served, tiny_llama64):
    """The stats folder replaced by a file while the engine serves: the failed writes are logged once and
    counted, never raised into vLLM (which would end the engine: EngineDeadError); every request is still
    served, identical to vLLM greedy, and the stats, writable again, carry the count (issue 35)."""
    tmp = served["_tmp"]
    script = tmp / "break_stats.py"
    script.write_text(BREAK_STATS)
    r = subprocess.run([sys.executable, str(script), tiny_llama64, str(tmp)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp / "break.json").read_text())
    assert got["outputs"] == served["vllm-greedy"]["outputs"]
    assert got["written_before"] and got["stats"]["stats_write_failures"] >= 1
    assert got["stats"]["finished"] >= 9 and got["stats"]["unverified_rows"] == 0
    assert r.stderr.count("cannot write the stats") == 1, r.stderr[-3000:]
    assert (tmp / "break.log").read_text().count("cannot write the stats") == 1


def test_bad_input_is_one_line(tiny_llama64, tmp_path):
    r = _run(tiny_llama64, "no-such-arm", tmp_path)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    r = _run(tiny_llama64, "lexical", tmp_path)  # a drafter that cannot interleave requests
    assert r.returncode == 2 and "suspend_request" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _run(tiny_llama64, "vllm-greedy", tmp_path, max_new=2000)  # past the model's 1024 positions
    assert r.returncode == 2 and "max_model_len" in r.stderr


def test_a_model_vllm_cannot_run_is_one_line(tmp_path):
    """stories260k: head dim 8, which vLLM's CPU attention refuses."""
    from tests.conftest import STORIES

    if not STORIES.is_dir():
        pytest.skip("stories260k missing")
    r = _run(str(STORIES), "vllm-greedy", tmp_path, max_new=4)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines == ["error: vLLM's CPU attention cannot run " + str(STORIES) + ": head dim 8 "
                                           "(it takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"], r.stderr[-2000:]


def test_vllm_missing_is_one_line(monkeypatch):
    import importlib.util

    from data.capture import vllm_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(OilbirdError, match="vLLM is not installed"):
        vllm_engine.require_vllm()


# ------------------------------------------------------------------ pure parts: exact arrays

def test_best_chain_takes_the_most_proposed_child_ties_to_the_spine():
    d = Draft()
    a = d.add_node(-1, 10, "spine")  # 0
    d.add_node(a, 11, "spine")  # 1
    b = d.add_node(-1, 20, "key")  # 2: a second root child
    d.sources[b].add("branch")  # two sources propose it
    d.add_node(b, 21, "key")  # 3
    d.add_node(b, 22, "key")  # 4
    d.sources[4].add("rollout")
    assert best_chain(d, 8) == [2, 4]
    assert best_chain(d, 1) == [2]
    assert best_chain(Draft(), 4) == []
    e = Draft()
    e.add_node(-1, 1, "spine")
    e.add_node(-1, 2, "key")
    assert best_chain(e, 4) == [0]  # a tie: the earlier child (the host's spine)
    c = subtree(d, [2, 4])
    assert (c.tokens, c.parents, c.sources) == ([20, 22], [-1, 0], [{"key", "branch"}, {"key", "rollout"}])


def _rows(texts, sampled):
    n = max(map(len, texts))
    arr = np.zeros((len(texts) + 2, n + 5), np.int32)
    for i, t in enumerate(texts):
        arr[i, :len(t)] = t
    return sampled, np.array([len(t) for t in texts] + [0, 0]), arr


def test_row_tracker_new_continuing_moved_finished_and_a_later_turn():
    tr = RowTracker()
    held, done = tr.step(*_rows([[1, 2, 3, 9], [5, 6, 7]], [[9], [7]]))
    assert [h.serial for h in held] == [1, 2] and done == []
    assert held[0].prompt_len == 3 and held[1].prompt_len == 2
    a, b = held
    # a continues (2 tokens appended); b finished; a new request takes row 1 (its prompt is a's text + more:
    # a later chat turn is new, never a's continuation)
    held, done = tr.step(*_rows([[1, 2, 3, 9, 4, 4], [1, 2, 3, 9, 4, 4, 8, 8, 5]], [[4, 4], [5]]))
    assert held[0] is a and a.sampled == 2 and done == [b]
    c = held[1]
    assert c.serial == 3 and c.prompt_len == 8
    # compaction moves c to row 0 while a finishes; a prompt still prefilling in chunks holds no request
    held, done = tr.step(*_rows([[1, 2, 3, 9, 4, 4, 8, 8, 5, 6], [7, 7]], [[6], []]))
    assert held[0] is c and c.output.tolist() == [5, 6] and held[1] is None and done == [a]
    # the same text appended by other than the sampled count is not a continuation
    held, done = tr.step(*_rows([[1, 2, 3, 9, 4, 4, 8, 8, 5, 6, 1, 1]], [[1]]))
    assert held[0] is not c and done == [c]


# ------------------------------------------------------------------ capture by serving

def _capture(model: str, bench: str, out: Path, engine: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "data", "capture", "--bench", bench, "--model", model, "--out", str(out),
            "--max-new-tokens", "24", "--batch-size", "4", "--flush-every", "2", "--engine", engine, "--quiet", *extra]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_capture_by_serving_round_trips_and_agrees_with_the_harness(tiny_llama64, tmp_path):
    """--engine vllm (vLLM's default compilation) writes the store format (verified, censused, replayed), equal to
    the same capture in eager mode; its tokens equal the harness's capture of the same requests and its states
    agree to float32 rounding; the engines do not mix."""
    from data.store.reader import open_store
    from decoder.replay.traces import load_traces
    from tests.conftest import STORY_PROMPTS, write_jsonl

    bench = write_jsonl(tmp_path / "b.jsonl", STORY_PROMPTS * 2)
    served, harness = tmp_path / "served", tmp_path / "harness"
    r = _capture(tiny_llama64, bench, served, "vllm")
    assert r.returncode == 0, r.stderr[-3000:]
    path = Path(r.stdout.strip().splitlines()[-1])
    meta = json.loads((path / "meta.json").read_text())
    assert meta["engine"] == "vllm" and meta["complete"] and meta["n_requests"] == 12
    v = subprocess.run([sys.executable, "-m", "data", "verify", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert v.returncode == 0 and "OK" in v.stdout + v.stderr, v.stderr
    assert [run["vllm_mode"] for run in meta["runs"]] == ["compiled"]
    # the same capture in vLLM's eager mode: the same tokens, states at cosine >= 0.9999, the top-8 identical
    r1 = _capture(tiny_llama64, bench, tmp_path / "eager", "vllm", "--vllm-eager")
    assert r1.returncode == 0, r1.stderr[-3000:]
    eager_path = Path(r1.stdout.strip().splitlines()[-1])
    assert [run["vllm_mode"] for run in json.loads((eager_path / "meta.json").read_text())["runs"]] == ["eager"]
    for tc, te in zip(load_traces(open_store(path), None, None), load_traces(open_store(eager_path), None, None)):
        assert tc.tokens == te.tokens
        n = len(tc.tokens) - 1
        x, y = tc.hidden[:n].astype(np.float64), te.hidden[:n].astype(np.float64)
        assert ((x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)).min() >= 0.9999
        assert (tc.topk[:n] == te.topk[:n]).all() and (tc.first_topk == te.first_topk).all()
    r2 = _capture(tiny_llama64, bench, harness, "harness", "--agree-with", str(path))
    assert r2.returncode == 0, r2.stderr[-3000:]
    agree = json.loads((Path(r2.stdout.strip().splitlines()[-1]) / "meta.json").read_text())["agreement"]
    assert (agree["with"], agree["with_engine"], agree["requests"], agree["identical"]) == (str(path), "vllm", 12, 12)
    assert agree["first_divergence"] is None and agree["state_cosine_min"] > 0.999 and agree["topk_agree"] > 0.9
    assert "12 of 12 common requests identical" in r2.stderr
    a = load_traces(open_store(path), None, None)
    b = load_traces(open_store(Path(r2.stdout.strip().splitlines()[-1])), None, None)
    assert [t.tokens for t in a] == [t.tokens for t in b] and sum(len(t.tokens) for t in a) > 12 * 5
    for ta, tb in zip(a, b):
        n = len(ta.tokens) - 1  # the last token's row is never computed
        np.testing.assert_allclose(ta.hidden[:n].astype(np.float32), tb.hidden[:n].astype(np.float32),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(ta.first_hidden.astype(np.float32), tb.first_hidden.astype(np.float32),
                                   rtol=2e-2, atol=2e-2)
        assert (ta.topk[:n, 0] == tb.topk[:n, 0]).all() and (ta.first_topk[0] == tb.first_topk[0])
    c = subprocess.run([sys.executable, "-m", "census", "--bench", bench, "--model", tiny_llama64, "--out", str(served)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stderr[-2000:]
    # the harness does not extend a store vLLM wrote (nor the reverse): one line
    r3 = _capture(tiny_llama64, bench, served, "harness")
    assert r3.returncode == 2 and "engine" in r3.stderr and len(r3.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_smollm2_in_vllm_is_greedy_token_for_token(tmp_path):
    """The same on SmolLM2-135M: oilbird and oilbird-no-semantic through vLLM equal vLLM's greedy decoding over
    four API-Bank requests (two concurrent), and vLLM's greedy equals the harness's store where one exists."""
    from data.benchmarks.registry import load_requests
    from data.capture.models import encode_prompt, load_model

    lm = load_model("smollm2-135m")
    prompts = [encode_prompt(lm, r.messages) for r in load_requests("apibank", 4)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    got = {}
    for arm in ("vllm-greedy", "oilbird", "oilbird-no-semantic"):
        r = _run(lm.path, arm, tmp_path, max_new=64, batch=2)
        assert r.returncode == 0, r.stderr[-3000:]
        got[arm] = json.loads((tmp_path / f"{arm}.json").read_text())
    assert got["oilbird"]["outputs"] == got["vllm-greedy"]["outputs"] == got["oilbird-no-semantic"]["outputs"]
    assert got["oilbird"]["proposer"]["unaligned_steps"] == 0 and got["oilbird"]["spec"]["num_accepted_tokens"] > 0


def test_the_verification_profile_measured_in_vllm(tiny_llama64, tmp_path):
    """`python -m decoder profile --engine vllm`: the harness profile's format and grid, priced on vLLM steps
    (the file says so), readable by replay's cost model."""
    from decoder.cost.profile import CostModel

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "decoder", "profile", "--engine", "vllm", "--model", tiny_llama64,
                        "--contexts", "64,160", "--nodes", "0,2,8", "--reps", "2", "--batch-sizes", "1,3",
                        "--file", str(out), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["engine"] == "vllm" and d["nodes"] == [0, 2, 8] and d["contexts"] == [64, 160]
    assert np.array(d["verify_s"]).shape == (2, 3) and min(min(row) for row in d["verify_s"]) > 0
    # the batch dimension: steps of 3 requests, each verifying its own draft of 0, 2 or 8 tokens
    assert d["batch_sizes"] == [1, 3] and list(d["verify_s_by_batch"]) == ["3"]
    assert np.array(d["verify_s_by_batch"]["3"]).shape == (2, 3) and min(min(r) for r in d["verify_s_by_batch"]["3"]) > 0
    assert "a step of 3 requests" in r.stdout
    assert d["prefill_lengths"] == [64, 160] and min(d["prefill_s"]) > 0
    cost = CostModel.load(out, model_fingerprint=d["model_fingerprint"])
    assert cost.verify_s(2, 100) > 0 and cost.meta["engine"] == "vllm"


def test_batch_sizes_need_the_vllm_engine():
    r = subprocess.run([sys.executable, "-m", "decoder", "profile", "--model", "stories260k", "--batch-sizes", "1,4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --batch-sizes above 1 needs")


def test_a_bad_store_flush_is_one_line_before_any_model_loads(monkeypatch, tmp_path):
    from data.capture.served_store import FLUSH_ENV, STORE_ENV, ServedStore

    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    monkeypatch.setenv(FLUSH_ENV, "eight")
    with pytest.raises(OilbirdError, match="OILBIRD_VLLM_STORE_FLUSH='eight'"):
        ServedStore.from_env(object(), layer=1)  # no vllm_config is read before the check
    assert not (tmp_path / "store").exists()
