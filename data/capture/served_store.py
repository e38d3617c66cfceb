"""Serving writes the store: with OILBIRD_VLLM_STORE=<folder> set (the one flag), the vLLM recorder and the
Oilbird proposer (data/capture/vllm_capture.py, decoder/vllm/proposer.py) append every finished request to a trace
store there, the same format `python -m data capture` writes (tokens, the capture layer's states, top-8),
so `data verify`, the census and replay read it as any store. The pool the proposer drafts from and the
store are the same data: a proposer that starts on an existing served store puts its traces in its pool
first (a restarted server keeps what it learned).

What it writes:
  - requests in the order they finish, committed `OILBIRD_VLLM_STORE_FLUSH` (default 8) at a time through
    StoreWriter (atomic parts, checksums, the store lock), the store marked complete after each commit so
    that a census can read it while serving goes on; requests not yet committed when the engine is killed
    are lost (at most FLUSH - 1; an engine that exits commits them at exit, but `vllm serve` SIGKILLs its
    worker at SIGTERM, so there they are lost: docs/vllm.md, "Serving");
  - a commit that fails while serving (a full disk, the folder removed) raises to the recorder, which logs
    it once and counts it and never lets it reach vLLM; the requests stay pending and go with the next
    commit, at most MAX_PENDING_COMMITS commits' worth (the oldest beyond are dropped, counted in `dropped`);
  - `finished_at`: when serving finished the request (Unix seconds), so a set of replicas' stores reads as
    one stream in finishing order (data/store/storeset.py);
  - ids `served-<start>-<pid>-<serial>` (unique across restarts), bench OILBIRD_VLLM_BENCH (default
    "served"), group and tenant empty;
  - stop_reason: "eos" when the last token is one of the model's end ids, "length" when the request
    reached the context, else "unknown": the engine's proposer never sees a request's own max_tokens or
    stop strings. The tokens are the ones the engine generated, which can run past what the client got:
    past a stop string, and by up to the last step's accepted drafts past max_tokens (the front end cuts
    both); they are the model's greedy tokens all the same;
  - meta.json as a capture's: the model's fingerprint, tokenizer and chat-template hashes come from loading
    the checkpoint once with the harness's loader (data/capture/models.py, bfloat16 on the CPU: the fingerprint is
    dtype-independent), `engine` "vllm-serving", `max_new_tokens` the engine's context (the only cap it
    knows), `data_fingerprint` "served" (no benchmark file behind it).
  - `sampling` and `off_argmax` (data/store/sampling.py): the proposer cannot see a request's sampling parameters
    (vLLM hands it token ids only), but it sees whether each committed token was the model's top-1 where it was
    chosen (`Trace.off_argmax`): "sampled" when some were not, "argmax" when all were (consistent with greedy).
The store holds what was served: greedy traces when clients asked for greedy decoding. A store with sampled
requests is read as any other; the census, replay and the reports say so in one line (docs/replay.md,
"Sampled traces").
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import errno
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from data.capture.vllm_settings import BY_FIELD, VllmSettings, read_vllm_settings
from data.errors import OilbirdError, os_error_line

STORE_ENV = BY_FIELD["store"].name  # OILBIRD_VLLM_STORE
BENCH_ENV = BY_FIELD["bench"].name  # OILBIRD_VLLM_BENCH
FLUSH_ENV = BY_FIELD["store_flush"].name  # OILBIRD_VLLM_STORE_FLUSH
ENGINE = "vllm-serving"
MAX_PENDING_COMMITS = 8  # requests kept for a store that cannot be written, in commits: each holds its states
LOG = logging.getLogger("oilbird.vllm")


def served_meta(model_path: str, layer: int, max_len: int, dtype: str, device: str, bench: str) -> tuple[dict, frozenset]:
    """meta.json of a served store, and the model's end-of-sequence ids (module docstring)."""
    from data.capture.models import load_model
    from data.capture.store_model import recorded_name
    from data.store.schema import PROMPT_HASH_SCHEME
    from data.versions import library_versions

    lm = load_model(model_path, dtype="bfloat16", device="cpu", layer=layer)
    name = recorded_name(model_path)  # a model folder by its resolved path
    meta = {
        "model": name, "model_path": name, "model_fingerprint": lm.fingerprint, "layer": lm.layer,
        "n_layers": lm.n_layers, "d_model": lm.d_model, "vocab_size": lm.vocab_size, "dtype": dtype, "device": device,
        "tokenizer_hash": lm.tokenizer_hash, "chat_template_hash": lm.chat_template_hash, "bench": bench,
        "data_fingerprint": "served", "requests_total": None, "mode": "generate", "max_new_tokens": int(max_len),
        "stop_strings": [], "truncate": None, "prompt_hash_scheme": PROMPT_HASH_SCHEME, "engine": ENGINE,
        "versions": library_versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    eos = lm.eos_ids
    del lm
    return meta, eos


class ServedStore:
    """Appends finished requests (data.capture.vllm_capture.Trace) to the store at `path` (module docstring)."""

    def __init__(self, path: str | Path, meta: dict, eos_ids: frozenset, flush_every: int = 8) -> None:
        from data.store.writer import StoreWriter

        if flush_every < 1:
            raise OilbirdError(f"{FLUSH_ENV} must be at least 1 (got {flush_every})")
        self.path, self.eos_ids, self.flush_every = Path(path), frozenset(eos_ids), int(flush_every)
        self.max_len = int(meta["max_new_tokens"])
        self.writer = StoreWriter(self.path, meta)  # brings a store a killed server left back to its last commit
        if self.writer.done and not self.writer.meta.get("complete"):
            self.writer.finish(keep_lock=True)  # every committed request is whole: readable again
        self.pending: list = []  # TraceRecords not committed yet; their request index is set at the commit
        self.run = f"served-{int(time.time())}-{os.getpid()}"
        self.serial = 0
        self.written = 0
        self.dropped = 0  # requests dropped while the store could not be written (MAX_PENDING_COMMITS)
        atexit.register(self.close)

    @classmethod
    def from_env(cls, vllm_config: Any, layer: int, settings: VllmSettings | None = None) -> "ServedStore | None":
        """The store OILBIRD_VLLM_STORE names for this engine, or None when the flag is unset (the settings
        checked by data/capture/vllm_settings.py before any model loads)."""
        s = settings if settings is not None else read_vllm_settings(("store", "store_flush", "bench"))
        if not s.store:
            return None
        mc = vllm_config.model_config
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "cpu")
        meta, eos = served_meta(str(mc.model), layer, int(mc.max_model_len), str(mc.dtype).removeprefix("torch."),
                                device, s.bench)
        return cls(s.store, meta, eos, s.store_flush)

    def stop_reason(self, trace) -> str:
        if len(trace.output) and int(trace.output[-1]) in self.eos_ids:
            return "eos"
        if len(trace.prompt) + len(trace.output) >= self.max_len:
            return "length"
        return "unknown"

    def add(self, trace, seconds: float = 0.0) -> None:
        """One finished request; committed with the next `flush_every`."""
        from data.store.sampling import served_sampling
        from data.store.schema import prompt_hash
        from data.store.writer import TraceRecord

        if not len(trace.output):
            return
        off = int(getattr(trace, "off_argmax", 0) or 0)  # tokens off the top-1 in the steps the recorder saw
        self.serial += 1
        prompt = trace.prompt.tolist()
        valid = trace.hidden_valid.copy()
        valid[-1] = False  # the last output token is never fed: its row is invalid in every store
        self.pending.append(TraceRecord(
            request=-1, id=f"{self.run}-{self.serial:06d}", group="",
            prompt_hash=prompt_hash(prompt), prompt_tokens=prompt, output_tokens=trace.output.tolist(),
            stop_reason=self.stop_reason(trace), seconds=float(seconds),
            hidden=trace.hidden.astype(np.float16), hidden_valid=valid, topk=trace.topk.astype(np.int32),
            prompt_last_hidden=trace.prompt_last_hidden.astype(np.float16),
            prompt_last_topk=np.asarray(trace.prompt_last_topk, np.int32), tenant="",
            finished_at=time.time(),  # when serving finished it, not when its commit comes (FLUSH later)
            sampling=served_sampling(off), off_argmax=off))
        keep = MAX_PENDING_COMMITS * self.flush_every
        if len(self.pending) > keep:  # the store has failed to commit for a while: the oldest go
            self.dropped += len(self.pending) - keep
            self.pending = self.pending[-keep:]
        if len(self.pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Commit what is pending; the store reads as complete between commits. A failure raises (an OSError
        naming the path) with the requests the commit did not take still pending."""
        if not self.pending:
            return
        if not (self.path / "meta.json").is_file():  # the writer would make a new folder holding half a store
            raise FileNotFoundError(errno.ENOENT, "the store's folder or meta.json is gone (removed while serving)",
                                    str(self.path))
        base = self.writer.done
        try:
            # indices set here, not when added: requests dropped or a failed commit leave no gap
            self.writer.append([dataclasses.replace(r, request=base + i) for i, r in enumerate(self.pending)])
        finally:
            committed = self.writer.done - base  # all or nothing: 0 unless the commit point was passed
            self.written += committed
            self.pending = self.pending[committed:]
        self.writer.finish(keep_lock=True)

    def close(self) -> None:
        try:
            self.flush()
        except Exception as e:  # at exit: said once, never a traceback from atexit
            why = os_error_line(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            LOG.warning(f"oilbird: the served store {self.path} could not commit its last {len(self.pending)} "
                        f"requests: {why}")
        finally:
            atexit.unregister(self.close)
            self.writer.close()  # the store's write lock

