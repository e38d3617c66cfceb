"""Shared fixtures: the real tiny model (stories260k), tiny random Llama / Qwen2 models, jsonl benchmarks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

SHARED = Path(os.environ.get("OILBIRD_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260k"

STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a red ball. He liked to play with it every day.",
    "Once upon a time, there was a little girl named Lily.",  # same prompt as request 0
    "The sun was warm and the sky was blue. A bird",
    "One day, a big dog came to the park.",
    "Lily and Tom went to the park. They saw a",
]


def write_jsonl(path: Path, prompts: list[str], references: list[str] | None = None) -> str:
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            row = {"id": f"r{i}", "prompt": p}
            if references:
                row["reference"] = references[i]
            f.write(json.dumps(row) + "\n")
    return f"jsonl:{path}"


def capture_story_store(tmp_path_factory, lm, name: str, prompts: list[str], max_new_tokens: int) -> tuple[str, str]:
    """A stories260k store of `prompts` (a JSONL benchmark) captured under a fresh folder: (bench, runs root)."""
    from data.capture.run import CaptureConfig, capture

    root = tmp_path_factory.mktemp(name)
    bench = write_jsonl(root / "bench.jsonl", prompts)
    capture(CaptureConfig(bench=bench, model="stories260k", max_new_tokens=max_new_tokens, out=str(root / "runs"),
                          progress=False), lm=lm)
    return bench, str(root / "runs")


@pytest.fixture
def one_thread(request):
    """Tiny models run faster on one thread, and far faster when other jobs share the two cores (two
    threads wait on each other for whole time slices there). Tests marked slow keep the default."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for one test module (data/raycluster.py); a command's `--ray local:2`
    inside it uses it as it is (ray_session)."""
    from data.raycluster import parse_ray, start_ray

    ray = start_ray(parse_ray("local:2"))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def stories():
    if not STORIES.is_dir():
        pytest.skip(f"stories260k not found at {STORIES}")
    from data.capture.models import load_model

    return load_model("stories260k")


def _tiny_random(kind: str, root: Path) -> str:
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    with torch.no_grad():  # sharper logits, so greedy paths are not dominated by near-ties
        model.lm_head.weight.mul_(4.0)
    out = root / f"tiny-{kind}"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    if not STORIES.is_dir():
        pytest.skip(f"stories260k tokenizer not found at {STORIES}")
    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: _tiny_random(kind, root) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama64(tmp_path_factory):
    """A tiny random Llama vLLM's CPU attention accepts (head dim 64; stories260k's is 8), with the
    stories260k tokenizer (vocab 512)."""
    if not STORIES.is_dir():
        pytest.skip(f"stories260k tokenizer not found at {STORIES}")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0))
    with torch.no_grad():  # sharper logits: greedy paths not dominated by near-ties, and repetitive
        model.lm_head.weight.mul_(4.0)
    out = tmp_path_factory.mktemp("tiny_llama64") / "llama64"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(out)
    return str(out)


def crash_on_call(monkeypatch, module, name: str, call: int):
    """Make module.name raise KeyboardInterrupt on its call-th call: a kill in the middle of a capture.
    Returns the real function (to put back for the resumed run)."""
    real, calls = getattr(module, name), {"n": 0}

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(module, name, crashing)
    return real
